"""The batch job behind ``quantize RECIPE.yaml``: quantize each variant, export it, score it, report.

Per variant, tensors stream from the source checkpoint one at a time through the quantizer into
every export writer and into the variant's in-memory weights, so the files and the evaluated model
are the same numbers by construction. Everything a user could get wrong is checked before the
first tensor is touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from calib.text import token_windows
from evalsuite.metrics import Scores, causal_lm_logprobs, score
from evalsuite.report import Report, VariantRow, write_report
from formats.gguf import GGUFFileWriter, architecture_of, gguf_name, gguf_order
from formats.hf import DenseSafetensorsWriter, HFCheckpoint, is_linear_weight
from quant.ggml import FILE_TYPES, encode, tensor_type
from quant.rtn import quantize_rtn
from quant.types import InputError, TensorPayload, dequantized
from recipes.schema import GGUFWeights, Recipe, RTNWeights, Variant


@dataclass
class BuiltVariant:
    """A variant's weights as evaluated (float32, by HF name), the files written, and its size."""

    state: dict[str, torch.Tensor]
    files: list[Path]
    bits_per_weight: float


@dataclass
class _Plan:
    """What one variant will write: tensors in order, with each tensor's ggml type for GGUF."""

    names: list[str]
    ggml_types: dict[str, str] = field(default_factory=dict)


def run_recipe(recipe: Recipe, out_dir: Path, console: Console) -> Report:
    ckpt = HFCheckpoint.open(recipe.model)
    plans = {v.name: _plan(ckpt, v) for v in recipe.variants}  # fails fast on any mismatch
    tokenizer = _load_tokenizer(ckpt)
    windows = token_windows(tokenizer, recipe.evaluation.text, recipe.evaluation.window, recipe.evaluation.max_windows)
    out_dir.mkdir(parents=True, exist_ok=True)

    with _progress(console) as progress:
        loading = progress.add_task("original: load for evaluation", total=None)
        reference_model = _load_reference(ckpt)
        progress.remove_task(loading)
        reference = causal_lm_logprobs(reference_model)
        start = time.perf_counter()
        original = _scored(progress, "original: evaluate", lambda tick: score(reference, windows, on_window=tick), len(windows))
        bits = _bits_of_source(ckpt)
        rows = [VariantRow("original", f"source ({_dtype_label(ckpt)})", bits, _size_mb(ckpt, bits), original,
                           seconds=time.perf_counter() - start)]
        for variant in recipe.variants:
            start = time.perf_counter()
            built = build_variant(ckpt, variant, out_dir, progress, plans[variant.name])
            model = model_from_state(reference_model.config, built.state)
            bits, files = built.bits_per_weight, built.files
            del built
            scores = _scored(
                progress, f"{variant.name}: evaluate",
                lambda tick: score(causal_lm_logprobs(model), windows, reference, on_window=tick), len(windows),
            )
            del model
            rows.append(VariantRow(
                variant.name, _describe(variant), bits, _size_mb(ckpt, bits), scores,
                ppl_delta=scores.ppl - original.ppl, seconds=time.perf_counter() - start,
                files=[_file_entry(f, out_dir) for f in files],
            ))

    report = Report(model=str(recipe.model), eval_text=str(recipe.evaluation.text), windows=windows.shape[0],
                    window=windows.shape[1], rows=rows)
    write_report(report, out_dir)
    return report


def _plan(ckpt: HFCheckpoint, variant: Variant) -> _Plan:
    names = ckpt.names
    weights = variant.weights
    if isinstance(weights, RTNWeights):
        spec = weights.spec
        targets = [n for n in names if is_linear_weight(n, ckpt.shape(n))]
        if not targets:
            raise InputError(f"{ckpt.path}: no Linear weights to quantize")
        if spec.granularity == "group":
            for n in targets:
                if ckpt.shape(n)[1] % spec.group_size:
                    raise InputError(
                        f"variant '{variant.name}': group_size {spec.group_size} does not divide "
                        f"the input size {ckpt.shape(n)[1]} of tensor '{n}'"
                    )
    plan = _Plan(names)
    if isinstance(weights, GGUFWeights):
        if "gguf" in variant.exports:
            architecture_of(ckpt)
            names = [n for n in names if gguf_name(n) is not None]
            names.sort(key=lambda n: gguf_order(gguf_name(n)))
        plan = _Plan(names, {n: tensor_type(weights.type, n, ckpt.shape(n)) for n in names})
    return plan


def _quantize(ckpt: HFCheckpoint, variant: Variant, plan: _Plan, name: str) -> TensorPayload:
    tensor = ckpt.tensor(name)
    if not torch.isfinite(tensor).all():
        raise InputError(f"{ckpt.path}: tensor '{name}' contains NaN or Inf")
    weights = variant.weights
    if isinstance(weights, RTNWeights):
        if is_linear_weight(name, tuple(tensor.shape)):
            return quantize_rtn(tensor, weights.spec, name)
        return tensor
    return encode(tensor, plan.ggml_types[name], name)


def build_variant(
    ckpt: HFCheckpoint, variant: Variant, out_dir: Path, progress: Progress | None = None, plan: _Plan | None = None
) -> BuiltVariant:
    """Stream every tensor through the quantizer into the exports and the in-memory state dict."""
    plan = plan or _plan(ckpt, variant)
    progress = progress or Progress(disable=True)
    vdir = out_dir / variant.name
    writers = []
    if "safetensors" in variant.exports:
        shapes = [(n, ckpt.shape(n)) for n in plan.names]
        writers.append(DenseSafetensorsWriter(vdir / "safetensors", shapes, torch.float32, ckpt))
    if "gguf" in variant.exports:
        file_type = variant.weights.type
        stem = f"{ckpt.path.name}-{file_type}.gguf"
        gguf_plan = [(n, ckpt.shape(n), plan.ggml_types[n]) for n in plan.names]
        writers.append(GGUFFileWriter(vdir / stem, ckpt, FILE_TYPES[file_type][0], gguf_plan))

    state: dict[str, torch.Tensor] = {}
    bits = 0.0
    task = progress.add_task(f"{variant.name}: quantize + export", total=len(plan.names))
    try:
        for name in plan.names:
            payload = _quantize(ckpt, variant, plan, name)
            weights = dequantized(payload)
            for w in writers:
                w.add(name, weights if isinstance(w, DenseSafetensorsWriter) else payload)
            state[name] = weights
            bits += _bits(payload) * weights.numel()
            progress.advance(task)
        files = [w.finish() for w in writers]
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        progress.remove_task(task)
    params = sum(t.numel() for t in state.values())
    return BuiltVariant(state, files, bits / params)


def _describe(variant: Variant) -> str:
    w = variant.weights
    return f"rtn {w.spec.label}" if isinstance(w, RTNWeights) else f"gguf {w.type}"


def _bits_of_source(ckpt: HFCheckpoint) -> float:
    total = sum(_numel(ckpt.shape(n)) for n in ckpt.names)
    return sum(_numel(ckpt.shape(n)) * ckpt.dtype(n).itemsize * 8 for n in ckpt.names) / total


def _dtype_label(ckpt: HFCheckpoint) -> str:
    return "/".join(sorted({str(ckpt.dtype(n)).removeprefix("torch.") for n in ckpt.names}))


def _size_mb(ckpt: HFCheckpoint, bits_per_weight: float) -> float:
    return sum(_numel(ckpt.shape(n)) for n in ckpt.names) * bits_per_weight / 8e6


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _file_entry(path: Path, out_dir: Path) -> dict:
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    return {"path": str(path.relative_to(out_dir)), "bytes": size}


def _bits(payload: TensorPayload) -> float:
    if isinstance(payload, torch.Tensor):
        return payload.element_size() * 8.0
    return payload.bits_per_weight


def model_from_state(config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"variant weights do not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def _load_reference(ckpt: HFCheckpoint) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # our own progress bars cover the long steps
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise InputError(f"{ckpt.path}: transformers cannot load this model ({str(e).splitlines()[0]})") from None
    return model.eval()


def _load_tokenizer(ckpt: HFCheckpoint):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ckpt.path)
    except (ValueError, KeyError, OSError) as e:
        raise InputError(f"{ckpt.path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )


def _scored(progress: Progress, label: str, run: Callable[[Callable[[], None]], Scores], total: int) -> Scores:
    task = progress.add_task(label, total=total)
    try:
        return run(lambda: progress.advance(task))
    finally:
        progress.remove_task(task)
