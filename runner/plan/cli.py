"""``quantize plan``: check the request, size every candidate, print the plan and its reasons."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from core.errors import InputError
from runner.fit.gpus import GPU, catalog, resolve_gpu
from runner.fit.memfit import KV_BITS
from runner.fit.model_shape import ModelShape, load_model_shape
from runner.plan.engines import EngineChoice, choose_engine
from runner.plan.planner import Candidate, Targets, plan_candidates, recommend, size_colocated, size_disaggregated
from runner.plan.serving import Load, Prediction
from runner.plan.variants import PlanVariant, model_variant, read_variants

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")
LOAD_STEPS = (0.125, 0.25, 0.5, 1, 2, 4, 8)  # multiples of the load the disaggregation comparison tries


def parse_duration(flag: str, text: str | None) -> float | None:
    """``500ms``, ``0.5s`` or ``500`` (milliseconds) in seconds."""
    if text is None:
        return None
    try:
        return duration_seconds(text)
    except ValueError as e:
        raise InputError(f"{flag} {text}: {e}") from None


def duration_seconds(text: str) -> float:
    """``500ms``, ``0.5s`` or ``500`` (milliseconds) in seconds; ValueError for anything else (the
    recipe's ``deploy:`` block reads its targets with it)."""
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError("a positive duration, e.g. 500ms or 0.5s")
    return float(m.group(1)) / (1 if m.group(2) == "s" else 1000)


@dataclass
class PlanRequest:
    model: str
    users: int
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None
    gpus: list[str] | None
    variants: Path | None
    prefix_share: float
    kv_cache: list[str]
    percentile: str = "p99"


@dataclass
class SplitPoint:
    users: int
    colocated: Candidate
    split: Candidate | None


@dataclass
class PlanOutput:
    request: PlanRequest
    shape: ModelShape
    load: Load
    targets: Targets
    chosen: Candidate
    engine: EngineChoice
    cheaper: list[Candidate]
    candidates: list[Candidate]
    budget: str | None
    sweep: list[SplitPoint]
    split_pays_from: int | None

    def as_dict(self) -> dict:
        return {
            "model": self.shape.name, "parameters": self.shape.parameters,
            "query": {"users": self.load.users, "prompt_tokens": self.load.prompt, "output_tokens": self.load.output,
                      "prefix_share": self.load.prefix_share, "ttft_s": self.targets.ttft, "tpot_s": self.targets.tpot,
                      "percentile": self.targets.percentile, "gpus": self.request.gpus,
                      "variants": str(self.request.variants) if self.request.variants else None},
            "accuracy_budget": self.budget,
            "recommendation": _candidate(self.chosen, self.load.users),
            "engine": {"engine": self.engine.engine, "weights": self.engine.weights, "why": self.engine.why,
                       "commands": self.engine.commands, "alternative": self.engine.alternative},
            "cheaper_failing": [_candidate(c, self.load.users) for c in self.cheaper],
            "disaggregation": {"split_pays_from_users": self.split_pays_from,
                               "by_load": [{"users": s.users, "colocated": _candidate(s.colocated, s.users),
                                            "disaggregated": _candidate(s.split, s.users) if s.split else None}
                                           for s in self.sweep]},
            "candidates": [_candidate(c, self.load.users) for c in self.candidates],
        }

    def print(self, console: Console) -> None:
        _print_plan(console, self)


def _candidate(c: Candidate, users: int) -> dict:
    p = c.prediction
    return {
        "gpu": c.gpu.name, "variant": c.variant.name, "method": c.variant.method, "kv_cache": c.variant.kv_cache,
        "weights_bytes": c.variant.weights_bytes, "bytes_measured": c.variant.measured,
        "layout": "disaggregated" if c.disaggregated else "colocated", "tensor_parallel": c.tp,
        "copies": c.copies if not c.disaggregated else None,
        "prefill_instances": c.disaggregated[0] if c.disaggregated else None,
        "decode_instances": c.disaggregated[1] if c.disaggregated else None,
        "gpus": c.gpus, "users_per_copy": c.users_per_copy, "users_per_gpu": users / c.gpus if c.gpus else None,
        "chunk": c.chunk or None, "cost_per_hour": c.cost_per_hour, "cost_per_million_tokens": c.cost_per_million(users),
        "tokens_per_s": c.total_tokens_per_s(), "prediction": p.as_dict() if p else None,
        "meets": c.meets, "fails": c.fails,
    }


def plan_command(req: PlanRequest) -> PlanOutput:
    """The plan, or one line naming what to relax."""
    _check(req)
    shape = load_model_shape(req.model)
    check_context(shape, req.prompt_tokens, req.output_tokens, "--prompt-tokens", "--output-tokens")
    gpus = [resolve_gpu(g) for g in req.gpus] if req.gpus else list(catalog().values())
    if req.variants is not None:
        variants, budget = read_variants(req.variants, shape)
    else:
        where = Path(req.model) if Path(req.model).exists() else None
        variants, budget = [model_variant(shape, kv_cache=kv, where=where) for kv in req.kv_cache], None
    return plan_variants(req, shape, variants, budget, gpus)


def check_context(shape: ModelShape, prompt: int, output: int, prompt_name: str, output_name: str) -> None:
    """Refuse, in one line naming the fields, a prompt and answer longer than the model's context."""
    context, limit = prompt + output, shape.arch.max_context
    if limit and context > limit:
        raise InputError(f"{prompt_name} {prompt} + {output_name} {output} = {context:,} tokens exceeds "
                         f"{shape.name}'s context of {limit:,}: shorten the prompt to at most {limit - output:,} tokens")


def plan_variants(req: PlanRequest, shape: ModelShape, variants: list[PlanVariant], budget: str | None, gpus: list[GPU]) -> PlanOutput:
    """The plan for ``variants`` of ``shape`` on ``gpus`` (a recipe job plans its recommended
    variant this way); a request no candidate meets gets one line naming what to relax."""
    context = req.prompt_tokens + req.output_tokens
    load = Load(req.users, req.prompt_tokens, req.output_tokens, req.prefix_share)
    targets = Targets(req.ttft, req.tpot, req.percentile)
    candidates = plan_candidates(shape, variants, gpus, load, targets)
    chosen, cheaper = recommend(candidates)
    if chosen is None:
        raise InputError(_relax(shape, load, targets, candidates, gpus))
    engine = choose_engine(_served_name(req.model), chosen.variant, chosen.gpu, chosen.tp, chosen.copies, chosen.users_per_copy, context,
                           chosen.chunk or 2048, chosen.disaggregated)
    sweep, pays = _split_sweep(shape, chosen, load, targets)
    return PlanOutput(req, shape, load, targets, chosen, engine, cheaper, sorted(candidates, key=_order), budget, sweep, pays)


def _served_name(model: str) -> str:
    """What an engine loads for ``model``: a preset's Hugging Face repository (its ``_source``),
    else the path or id as given."""
    from runner.fit.model_shape import PRESETS, preset_names

    if model in preset_names():
        import json

        return json.loads((PRESETS / f"{model}.json").read_text(encoding="utf-8")).get("_source", model)
    return model


def _order(c: Candidate) -> tuple:
    return (not c.meets, c.cost_per_hour is None, c.cost_per_hour or 0.0, c.gpus)


def _check(req: PlanRequest) -> None:
    for flag, value, low, high in (("--users", req.users, 1, 1_000_000), ("--prompt-tokens", req.prompt_tokens, 1, 10_000_000),
                                   ("--output-tokens", req.output_tokens, 1, 10_000_000)):
        if not low <= value <= high:
            raise InputError(f"{flag} {value}: must be between {low} and {high:,}")
    if not 0 <= req.prefix_share < 1:
        raise InputError(f"--prefix-share {req.prefix_share}: a share of the prompt in [0, 1), e.g. 0.6")
    if req.ttft is None and req.tpot is None:
        raise InputError("no target: give --ttft, --tpot or both (e.g. --ttft 500ms --tpot 30ms)")
    for kv in req.kv_cache:
        if kv not in KV_BITS:
            raise InputError(f"--kv-cache {kv}: unknown (one of {', '.join(KV_BITS)})")
    if req.percentile not in ("p50", "p99"):
        raise InputError(f"--at {req.percentile}: p50 or p99")


def _relax(shape: ModelShape, load: Load, targets: Targets, candidates: list[Candidate], gpus: list[GPU]) -> str:
    """One line: no candidate meets the request; what to relax, by how much."""
    where = f"{shape.name}, {load.users} users, {load.prompt:,}-token prompts" + (
        f" on {', '.join(g.name for g in gpus)}" if len(gpus) < len(catalog()) else " on any GPU in the catalogue")
    timed = [c for c in candidates if c.prediction is not None]
    accurate = [c for c in timed if c.variant.within_budget]
    if not timed:
        reasons = sorted({f for c in candidates for f in c.fails})
        return f"nothing can serve {where}: {'; '.join(reasons[:2])}"
    if not accurate:
        return f"no variant within the accuracy budget can be served for {where}: relax the recipe's budget or add variants"
    if any(not targets.misses(c.prediction) for c in timed if not c.variant.within_budget):
        return f"only variants outside the accuracy budget meet the targets for {where}: relax the recipe's budget"
    best = [c.floor or c.prediction for c in accurate]
    pick = "p99" if targets.percentile == "p99" else "p50"
    ttft = min(getattr(p, f"ttft_{pick}") for p in best)
    tpot = min(getattr(p, f"tpot_{pick}") for p in best)
    parts = []
    if targets.ttft is not None and ttft > targets.ttft:
        parts.append(f"--ttft to at least {_up(ttft)} (or shorten the prompt, or raise --prefix-share)")
    if targets.tpot is not None and tpot > targets.tpot:
        parts.append(f"--tpot to at least {_up(tpot)} (or use a smaller variant)")
    if not parts:
        near = min(accurate, key=lambda c: targets.excess(c.floor or c.prediction))
        p = near.floor or near.prediction
        parts.append(f"--ttft or --tpot: no candidate meets both at once (closest: {near.label()}, TTFT {_up(getattr(p, f'ttft_{pick}'))}, "
                     f"TPOT {_up(getattr(p, f'tpot_{pick}'))})")
    return f"no candidate meets the targets for {where}: relax " + "; ".join(parts)


def _up(seconds: float) -> str:
    return "∞" if math.isinf(seconds) else f"{math.ceil(seconds * 1000):,}ms"


def _split_sweep(shape: ModelShape, chosen: Candidate, load: Load, targets: Targets) -> tuple[list[SplitPoint], int | None]:
    """Co-located against disaggregated for the chosen GPU and variant at multiples of the load:
    the split pays from the least load where it meets the targets for less (or alone meets them)."""
    points, pays = [], None
    for k in LOAD_STEPS:
        users = max(1, round(load.users * k))
        if points and points[-1].users == users:
            continue
        at = replace(load, users=users)
        co = size_colocated(shape, chosen.variant, chosen.gpu, at, targets)
        split = size_disaggregated(shape, chosen.variant, chosen.gpu, max(co.tp, 1), at, targets) if co.copies else None
        points.append(SplitPoint(users, co, split))
        if pays is None and split is not None and split.meets and (
                co.fails or (split.cost_per_hour or 0) < (co.cost_per_hour or 0)):
            pays = users
    return points, pays


def _ms(seconds: float) -> str:
    return "∞" if math.isinf(seconds) else f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _money(value: float | None) -> str:
    return "n/a" if value is None else f"${value:,.2f}" if value >= 0.1 else f"${value:,.4f}"


def _print_plan(console: Console, out: PlanOutput) -> None:
    c, load, t = out.chosen, out.load, out.targets
    goals = ", ".join(x for x in (f"TTFT ≤ {_ms(t.ttft)}" if t.ttft else "", f"TPOT ≤ {_ms(t.tpot)}" if t.tpot else "") if x)
    console.print(f"[bold]{escape(out.shape.name)}[/bold]: {load.users} users at once, {load.prompt:,}-token prompts "
                  f"({100 * load.prefix_share:.0f}% from the prefix cache), {load.output:,}-token answers; {goals} at {t.percentile}"
                  + (f"; accuracy budget: {escape(out.budget)}" if out.budget else ""))
    layout = (f"{c.disaggregated[0]} prefill + {c.disaggregated[1]} decode instance(s)" if c.disaggregated
              else f"{c.copies} cop{'y' if c.copies == 1 else 'ies'}")
    tp = f" of {c.tp} GPUs (tensor parallel)" if c.tp > 1 else ""
    measured = "" if c.variant.measured else " (bytes counted from its method: the run was of another model)"
    console.print(f"[green]recommended[/green]: {c.gpus} x {c.gpu.name}, {layout}{tp}, variant "
                  f"[bold]{escape(c.variant.name)}[/bold] ({escape(c.variant.method)}, {c.variant.weights_bytes / 2**30:.2f} GiB"
                  f"{measured}), KV cache {c.variant.kv_cache}" + (f", chunk {c.chunk} tokens" if c.chunk else ""))
    console.print(f"  cost {_money(c.cost_per_hour)}/hour, {_money(c.cost_per_million(load.users))} per million output tokens, "
                  f"{load.users / c.gpus:,.1f} users per GPU, {c.total_tokens_per_s():,.0f} output tokens/s")
    _print_predictions(console, c.prediction)
    console.print(f"[bold]engine[/bold]: {c and escape(out.engine.engine)}: {escape(out.engine.why)}")
    for line in out.engine.commands:
        console.print(f"  {escape(line)}", soft_wrap=True)
    for line in out.engine.alternative:
        console.print(f"  or: {escape(line)}", soft_wrap=True)
    if out.cheaper:
        console.print("[bold]cheaper, and why not[/bold]:")
        for f in out.cheaper[:12]:
            console.print(f"  {escape(f.label())} ({f.gpus} GPUs, {_money(f.cost_per_hour)}/hour): {escape('; '.join(f.fails))}")
    console.print("[bold]disaggregated prefill/decode[/bold] on the same GPU and variant, by load:")
    table = Table("users", "co-located GPUs", "$/hour", "meets", "split GPUs", "$/hour", "meets")
    for s in out.sweep:
        sp = s.split
        table.add_row(str(s.users), str(s.colocated.gpus), _money(s.colocated.cost_per_hour), "yes" if s.colocated.meets else "no",
                      str(sp.gpus) if sp else "-", _money(sp.cost_per_hour) if sp else "-", ("yes" if sp.meets else "no") if sp else "-")
    console.print(table)
    console.print(f"the split starts to pay at {out.split_pays_from} users" if out.split_pays_from
                  else "the split does not pay within 8x this load: co-located chunked prefill is as cheap or cheaper")


def _print_predictions(console: Console, p: Prediction | None) -> None:
    if p is None:
        return
    table = Table("", "p50", "p99")
    table.add_row("TTFT", _ms(p.ttft_p50), _ms(p.ttft_p99))
    table.add_row("TPOT", _ms(p.tpot_p50), _ms(p.tpot_p99))
    table.add_row("end to end", _ms(p.e2e_p50), _ms(p.e2e_p99))
    console.print(table)
    extra = f", KV transfer {_ms(p.kv_transfer)}" if p.kv_transfer else ""
    console.print(f"  decode step {_ms(p.step_decode)} at a batch of {p.decode_batch:.1f}; step with a prefill chunk "
                  f"{_ms(p.step_mixed)}; prefill busy {100 * p.prefill_busy:.0f}% of the time{extra}")
