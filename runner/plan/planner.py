"""The deployment plan: for every GPU type and variant, the fewest GPUs that meet the targets, its
cost, and the cheapest of all within the accuracy budget, with why each cheaper one fails.

A candidate is a GPU type, a variant (its bytes and KV-cache type) and a tensor-parallel width;
the load is split evenly over copies of the model. More copies mean fewer users per copy, so a
smaller decode batch and fewer prompts queued per copy: latency only falls as copies are added, and
the fewest copies that meet the targets are found by bisection. Each copy is sized from memory
first (``quantize fit``'s calculator: the weights and every user's KV cache at prompt + output
tokens must fit) and capped at 256 users (vLLM's max_num_seqs).

The same search sizes a disaggregated deployment (prefill and decode pools, each of the fewest
instances that meets its own target), and the plan compares the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from runner.fit.gpus import GPU
from runner.fit.memfit import ENGINES, KV_BITS, kv_bytes_per_sequence
from runner.fit.model_shape import ModelShape
from runner.plan.engines import is_local, servable
from runner.plan.roofline import Device, ModelWork, step_seconds
from runner.plan.serving import Load, Prediction, colocated, disaggregated
from runner.plan.variants import PlanVariant

CHUNKS = (256, 512, 1024, 2048, 4096, 8192)  # prefill tokens per step tried (vLLM's max_num_batched_tokens)
TENSOR_PARALLEL = (1, 2, 4, 8)
MAX_SEQS = 256  # vLLM's default max_num_seqs: users one copy runs at once
APPLE_WIRED = 0.75  # macOS lets the GPU wire about 75% of unified memory by default


@dataclass(frozen=True)
class Targets:
    ttft: float | None  # seconds
    tpot: float | None  # seconds
    percentile: str = "p99"  # which prediction must meet them: "p50" or "p99"

    def misses(self, p: Prediction) -> list[str]:
        """Each target ``p`` misses, with its value: empty when it meets them."""
        ttft, tpot = (p.ttft_p99, p.tpot_p99) if self.percentile == "p99" else (p.ttft_p50, p.tpot_p50)
        out = []
        if self.ttft is not None and ttft > self.ttft:
            out.append(f"TTFT {self.percentile} {_ms(ttft)} > {_ms(self.ttft)}")
        if self.tpot is not None and tpot > self.tpot:
            out.append(f"TPOT {self.percentile} {_ms(tpot)} > {_ms(self.tpot)}")
        return out

    def excess(self, p: Prediction) -> float:
        """How far ``p`` is from the targets: the largest ratio of prediction to target."""
        ttft, tpot = (p.ttft_p99, p.tpot_p99) if self.percentile == "p99" else (p.ttft_p50, p.tpot_p50)
        return max(ttft / self.ttft if self.ttft else 0.0, tpot / self.tpot if self.tpot else 0.0)


def _ms(seconds: float) -> str:
    return "∞" if math.isinf(seconds) else f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


@dataclass
class Candidate:
    gpu: GPU
    variant: PlanVariant
    tp: int = 1
    copies: int = 0  # 0: no configuration fits memory
    users_per_copy: int = 0
    chunk: int = 0
    prediction: Prediction | None = None
    fails: list[str] = field(default_factory=list)  # empty: meets targets and accuracy budget
    disaggregated: tuple[int, int] | None = None  # (prefill, decode) instances of tp GPUs each
    floor: Prediction | None = None  # failing: the best it reaches (one user per copy, or the most instances)

    @property
    def gpus(self) -> int:
        return self.tp * (sum(self.disaggregated) if self.disaggregated else self.copies)

    @property
    def cost_per_hour(self) -> float | None:
        return self.gpus * self.gpu.price_per_hour if self.gpu.price_per_hour is not None else None

    @property
    def meets(self) -> bool:
        return self.prediction is not None and not self.fails

    def cost_per_million(self, users: int) -> float | None:
        """Dollars per million output tokens at the load: the deployment's hourly cost over the
        output tokens all copies make in an hour."""
        if self.cost_per_hour is None or self.prediction is None or self.prediction.tokens_per_s <= 0:
            return None
        per_s = self.prediction.tokens_per_s * (self.copies if not self.disaggregated else 1)
        return self.cost_per_hour / (per_s * 3600) * 1e6

    def total_tokens_per_s(self) -> float:
        if self.prediction is None:
            return 0.0
        return self.prediction.tokens_per_s * (self.copies if not self.disaggregated else 1)

    def label(self) -> str:
        layout = (f"{self.disaggregated[0]} prefill + {self.disaggregated[1]} decode x{self.tp}" if self.disaggregated
                  else f"{self.copies} x{self.tp}" if self.tp > 1 else f"{self.copies}")
        return f"{self.gpu.name} {layout} {self.variant.name} kv {self.variant.kv_cache}"


def max_users_per_copy(shape: ModelShape, variant: PlanVariant, gpu: GPU, tp: int, context: int) -> int:
    """Users whose KV cache at ``context`` tokens fits one copy beside its weights (0: not even one)."""
    engine = ENGINES["llamacpp" if is_local(gpu) else "vllm"]
    usable = gpu.memory_bytes * engine.utilisation * (APPLE_WIRED if gpu.vendor == "apple" else 1.0)
    room = usable - variant.weights_bytes / tp - engine.overhead - engine.activations(shape, MAX_SEQS, context, tp)
    per_user = kv_bytes_per_sequence(shape, variant.kv_cache, context, tp)
    return max(0, min(MAX_SEQS, int(room // per_user))) if room > 0 else 0


def best_colocated(work: ModelWork, device: Device, load: Load, targets: Targets) -> tuple[Prediction, list[str]] | None:
    """The chunk size that meets the targets with the lowest p50 latency, else the one closest to
    them; None when no chunk has room beside the decode tokens."""
    found = [(p, targets.misses(p)) for c in CHUNKS if (p := colocated(work, device, load, c)) is not None]
    if not found:
        return None
    meeting = [f for f in found if not f[1]]
    if meeting:
        return min(meeting, key=lambda f: f[0].e2e_p50)
    return min(found, key=lambda f: targets.excess(f[0]))


def size_colocated(shape: ModelShape, variant: PlanVariant, gpu: GPU, load: Load, targets: Targets) -> Candidate:
    """The cheapest co-located configuration of ``variant`` on ``gpu``: fewest GPUs that meet the
    targets, else the closest (its ``fails`` say by how much)."""
    context = load.prompt + load.output
    best: Candidate | None = None
    for tp in TENSOR_PARALLEL:
        if tp > gpu.gpus_per_node or (tp > 1 and not gpu.interconnect):
            break
        capacity = max_users_per_copy(shape, variant, gpu, tp, context)
        if capacity < 1:
            continue
        work = ModelWork(shape, variant.weights_bytes, KV_BITS[variant.kv_cache], tp)
        device = Device(gpu, tp)
        trial = _fewest_copies(work, device, load, targets, math.ceil(load.users / capacity))
        trial = replace(trial, gpu=gpu, variant=variant, tp=tp)
        if best is None or _better(trial, best, targets):
            best = trial
    if best is None:
        return Candidate(gpu, variant, fails=[f"does not fit: weights and one user's KV cache at {context:,} tokens exceed "
                                              f"{max(t for t in TENSOR_PARALLEL if t <= max(gpu.gpus_per_node, 1))} x {gpu.name}"])
    return best


def _better(a: Candidate, b: Candidate, targets: Targets) -> bool:
    """Meets before misses; of two that meet, fewer GPUs; of two that miss, the one whose best
    (one user per copy) comes closer to the targets: what a refusal quotes."""
    if bool(a.fails) != bool(b.fails):
        return not a.fails
    if not a.fails:
        return a.gpus < b.gpus
    def excess(c: Candidate) -> float:
        p = c.floor or c.prediction
        return targets.excess(p) if p is not None else math.inf

    return excess(a) < excess(b)


def _fewest_copies(work: ModelWork, device: Device, load: Load, targets: Targets, least: int) -> Candidate:
    def at(copies: int) -> Candidate:
        users = math.ceil(load.users / copies)
        found = best_colocated(work, device, replace(load, users=users), targets)
        if found is None:
            return Candidate(device.gpu, None, device.tp, copies, users, fails=["no chunk room beside the decode tokens"])  # type: ignore[arg-type]
        p, missed = found
        return Candidate(device.gpu, None, device.tp, copies, users, p.chunk, p, missed)  # type: ignore[arg-type]

    most = max(least, load.users)
    top = at(most)
    if top.fails:
        top.fails = [f + f" even at {top.users_per_copy} user(s) per copy" for f in top.fails]
        out = top if least == most else _with_fails(at(least), top.fails)
        out.floor = top.prediction
        return out
    lo, hi = least, most
    if not at(lo).fails:
        return at(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid).fails else (lo, mid)
    return at(hi)


def _with_fails(c: Candidate, fails: list[str]) -> Candidate:
    c.fails = fails
    return c


def size_disaggregated(shape: ModelShape, variant: PlanVariant, gpu: GPU, tp: int, load: Load, targets: Targets) -> Candidate | None:
    """Prefill and decode pools of ``tp``-wide instances: the fewest decode instances whose pure
    decode steps meet the TPOT target, then the fewest prefill instances that meet TTFT (the KV
    cache crossing the node's links, or the network once the pools span nodes). None where the GPU
    has no link to carry the cache."""
    link_in, link_out = gpu.interconnect, gpu.network
    if not (link_in or link_out) or is_local(gpu):
        return None
    context = load.prompt + load.output
    capacity = max_users_per_copy(shape, variant, gpu, tp, context)
    if capacity < 1:
        return None
    work = ModelWork(shape, variant.weights_bytes, KV_BITS[variant.kv_cache], tp)
    device = Device(gpu, tp)
    decode = math.ceil(load.users / capacity)
    decode_context = load.prompt + load.output / 2
    if targets.tpot is not None:
        while decode < load.users and step_seconds(work, device, math.ceil(load.users / decode), decode_context) > targets.tpot:
            decode += 1

    def predict(prefill: int) -> Prediction:
        instances = (prefill + decode) * tp
        link = link_in if instances <= gpu.gpus_per_node and link_in else (link_out or link_in)
        return disaggregated(work, device, prefill, device, decode, load, link)

    lo, hi = 1, max(1, load.users)
    if targets.misses(predict(hi)) or not targets.misses(predict(lo)):
        hi = lo if not targets.misses(predict(lo)) else hi
    else:
        while hi - lo > 1:  # TTFT falls as prefill instances are added: the fewest that meet it
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if targets.misses(predict(mid)) else (lo, mid)
    prefill, p = hi, predict(hi)
    floor = predict(max(1, load.users)) if targets.misses(p) else None
    return Candidate(gpu, variant, tp, decode, math.ceil(load.users / decode), 0, p, targets.misses(p), (prefill, decode), floor)


def plan_candidates(shape: ModelShape, variants: list[PlanVariant], gpus: list[GPU], load: Load, targets: Targets,
                    with_disaggregated: bool = True) -> list[Candidate]:
    """Every (GPU, variant) sized, co-located and (where it has links) disaggregated; the
    variants outside the accuracy budget or no engine serves carry that as a failure."""
    out = []
    for gpu in gpus:
        if not gpu.flops:
            out.append(Candidate(gpu, variants[0], fails=[f"{gpu.name}: no FLOPs known, so prefill cannot be timed "
                                                          "(give custom:MEM_GIB,BANDWIDTH_GBS,TFLOPS)"]))
            continue
        for variant in variants:
            reason = servable(variant, gpu)
            if reason is not None:
                out.append(Candidate(gpu, variant, fails=[reason]))
                continue
            best = size_colocated(shape, variant, gpu, load, targets)
            found = [best]
            if with_disaggregated and best.copies:
                split = size_disaggregated(shape, variant, gpu, best.tp, load, targets)
                if split is not None:
                    found.append(split)
            for c in found:
                if not variant.within_budget:
                    c.fails = c.fails + [f"outside the accuracy budget: {'; '.join(variant.misses)}"]
                out.append(c)
    return out


def cost_key(c: Candidate) -> tuple:
    """Cheapest first: hourly cost (unknown last), then fewer GPUs, then the faster answer."""
    cost = c.cost_per_hour
    return (cost is None, cost if cost is not None else 0.0, c.gpus, c.prediction.e2e_p50 if c.prediction else math.inf, c.label())


def recommend(candidates: list[Candidate]) -> tuple[Candidate | None, list[Candidate]]:
    """The cheapest candidate that meets everything, and the ones as cheap or cheaper than it (or
    all, if none meets) that fail, each with its reasons."""
    meeting = sorted((c for c in candidates if c.meets), key=cost_key)
    chosen = meeting[0] if meeting else None
    failing = sorted((c for c in candidates if not c.meets), key=cost_key)
    if chosen is not None:
        failing = [c for c in failing if c.copies and cost_key(c)[:3] <= cost_key(chosen)[:3]]
    return chosen, failing
