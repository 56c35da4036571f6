"""Building one variant: every tensor streamed from the source checkpoint through its quantizer
into the variant's files and, when it is to be evaluated, into its weights kept on disk as the
quantizer made them (formats/variant_weights.py), which the evaluation then streams.

One tensor is in flight at a time on a CPU, a few with a GPU (read and quantized ahead of the one
being written: core/overlap.py); the writers lay out their headers from a plan made before the
first tensor is read, so a model larger than RAM converts in bounded memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError
from rich.progress import Progress

from core.device import overlap_workers
from core.errors import InputError
from core.file_types import AUTO
from core.overlap import Behind, ordered_map
from core.tensors import TensorPayload, dequantized
from formats.checkpoint_format import CheckpointFormat, ExportContents, Writer
from formats.hf import HFCheckpoint
from formats.hub import model_name
from formats.outputs import Outputs
from formats.registry import FORMATS, in_writing_order
from formats.variant_weights import VariantWeights
from quant.error import OUTPUT_ERROR, WEIGHT_ERROR, relative_error
from quant.smoothquant import smoothquant_model
from recipes.methods import Imatrix, Plan, chosen_modules, method_of
from recipes.methods.gguf import GGUFWeights
from recipes.schema import Variant


@dataclass
class BuiltVariant:
    """A variant's weights as evaluated (None unless kept), its files, its size, and for
    outlier-aware passes the statistics of each Linear's calibration inputs."""

    weights: VariantWeights | None
    files: list[Path]
    bits_per_weight: float
    input_statistics: dict[str, dict] = field(default_factory=dict)  # quant.outliers.channel_statistics
    # per decoder Linear (module name), how much quantization changed it (quant/error.py), and how
    # that was measured; empty where the weights were kept
    linear_errors: dict[str, float] = field(default_factory=dict)
    error_measure: str | None = None
    types_chosen: str = ""  # the per-tensor types a search chose (gguf's type: auto), summed up


def plan_variant(ckpt: HFCheckpoint, variant: Variant, imatrix: bool = False) -> Plan:
    """Check a variant against the model's shapes and fix the tensor order and types; reads no data."""
    return method_of(variant.weights).plan(ckpt, variant, imatrix)


def build_variant(
    ckpt: HFCheckpoint,
    variant: Variant,
    out_dir: Path,
    progress: Progress | None = None,
    imatrix: Imatrix | None = None,
    keep: Path | None = None,
    gguf_path: Path | None = None,
    calibration: torch.Tensor | None = None,
    outputs: Outputs | None = None,
    checkpoint: Path | None = None,
) -> BuiltVariant:
    """Quantize ``variant`` tensor by tensor into its exports under ``out_dir/<variant name>``.

    ``gguf_path`` overrides where the GGUF export goes. With ``keep`` (a folder, which the caller
    stages and discards) the quantized weights are also kept there for evaluation. Variants fitted
    on calibration text (GPTQ, AWQ) take the token windows in ``calibration``; they are fitted
    first, layer by layer as the layers stream from the checkpoint, their tensors waiting on disk
    (in ``keep``, or a scratch folder beside the exports) until they stream into the exports like
    any others, in the checkpoint's tensor order; a fit that trains (QAT) keeps its progress in
    the ``checkpoint`` folder, if given. The files are staged in ``outputs`` and reach their final
    names when the caller commits it (after scoring the variant, say); without ``outputs`` they
    are committed here, once all are written.
    """
    if outputs is None:
        with Outputs() as own:
            built = build_variant(ckpt, variant, out_dir, progress, imatrix, keep, gguf_path, calibration, own, checkpoint)
            own.commit()
        return built
    with Outputs() as scratch:  # the fitted tensors' folder when none is kept
        kept = None if keep is None else VariantWeights(keep, ckpt)
        fitted = kept if kept is not None else VariantWeights(scratch.stage(out_dir / variant.name / ".fitted"), ckpt)
        return _build(ckpt, variant, out_dir, progress, imatrix, kept, fitted, gguf_path, calibration, outputs, checkpoint)


def _build(ckpt: HFCheckpoint, variant: Variant, out_dir: Path, progress: Progress | None, imatrix: Imatrix | None,
           kept: VariantWeights | None, fitted: VariantWeights, gguf_path: Path | None, calibration: torch.Tensor | None,
           outputs: Outputs, checkpoint: Path | None) -> BuiltVariant:
    method = method_of(variant.weights)
    progress = progress or Progress(disable=True)
    plan = method.settle(ckpt, variant, method.plan(ckpt, variant, imatrix is not None), imatrix, calibration,
                         progress)
    statistics, errors = _fit(ckpt, variant, plan, calibration, progress, checkpoint, fitted)
    compares = method.compares_weights and variant.activations is None
    measure = OUTPUT_ERROR if errors else WEIGHT_ERROR if compares and kept is not None else None
    linears = set(ckpt.linear_modules)
    files = export_paths(ckpt, variant, out_dir, gguf_path)
    contents = export_contents(ckpt, variant, plan)
    writers: list[tuple[CheckpointFormat, Writer]] = []
    bits = params = 0.0
    task = progress.add_task(f"{variant.name}: quantize + export", total=len(plan.names))
    try:
        for fmt in in_writing_order(variant.exports):
            writers.append((fmt, fmt.open(outputs, files, contents)))
        dense = any(fmt.dense for fmt, _ in writers)

        def prepare(name: str) -> tuple[str, bool, TensorPayload, torch.Tensor | None, float | None]:
            """The tensor as the writers take it (and whether it was quantized here), its float32
            weights only where a dense export or the weight error takes them (an 8B model's
            embedding and head, no decoder Linears so no weight error, are 2 GiB each), and its
            weight error where measured."""
            source = None if name in fitted else ckpt.tensor(name)
            payload = fitted.payload(name) if source is None else method.quantize(ckpt, variant, plan, name, source, imatrix)
            compared = measure == WEIGHT_ERROR and name.removesuffix(".weight") in linears
            weights = dequantized(payload) if compared or dense else None
            error = relative_error(ckpt.tensor(name) if source is None else source, weights) if compared else None
            return name, source is not None, payload, weights, error

        # with a GPU, the next tensors are read, quantized (or GGUF-encoded) and measured while this one is written
        for name, fresh, payload, weights, error in ordered_map(prepare, plan.names, overlap_workers()):
            if fresh and kept is not None:
                kept.put(name, payload)
            for fmt, w in writers:
                w.add(name, weights if fmt.dense else payload)
            if error is not None:
                errors[name.removesuffix(".weight")] = error
            n = _numel(ckpt.shape(name))
            bits += _bits(payload) * n
            params += n
            progress.advance(task)
        for _, w in writers:
            w.finish()
    except BaseException:
        for _, w in writers:
            w.abort()
        raise
    finally:
        progress.remove_task(task)
    return BuiltVariant(kept, [p for key, p in files.items() if key in FORMATS], bits / params, statistics,
                        errors, measure if errors else None, plan.summary)


def export_contents(ckpt: HFCheckpoint, variant: Variant, plan: Plan) -> ExportContents:
    """What the variant's exports hold, for their writers (formats/checkpoint_format.py): its
    weights' grid only where an export stores codes on it (a gguf grid has none)."""
    w, method = variant.weights, method_of(variant.weights)
    codes = any(FORMATS[e].codes for e in variant.exports)
    return ExportContents(ckpt, plan.names, plan.quantized, plan.ggml_types, spec=w.spec if codes else None, specs=plan.specs,
                          activations=variant.activations.spec if variant.activations else None,
                          act_order=getattr(w, "act_order", False), static_groups=getattr(w, "static_groups", False),
                          settings=method.fit_record(w), file_type=method.gguf_type(w))


def export_paths(ckpt: HFCheckpoint, variant: Variant, out_dir: Path, gguf_path: Path | None = None) -> dict[str, Path]:
    """Where each of a variant's exports goes, by export name (and its side files, such as the
    GGUF file's Ollama Modelfile as 'modelfile'), so a job can check every output path before it
    starts. ``gguf_path`` overrides where a file export (GGUF) goes."""
    vdir = out_dir / variant.name
    file_type = method_of(variant.weights).gguf_type(variant.weights)
    paths: dict[str, Path] = {}
    for fmt in in_writing_order(variant.exports):
        at = gguf_path if gguf_path is not None and not fmt.folder else vdir / fmt.file_name(model_name(ckpt.path), file_type)
        paths |= fmt.files(at, file_type)
    return paths


def _fit(ckpt: HFCheckpoint, variant: Variant, plan: Plan, windows: torch.Tensor | None, progress: Progress,
         checkpoint: Path | None, fitted: VariantWeights) -> tuple[dict[str, dict], dict[str, float]]:
    """The variant's calibrated pass (its method's, or SmoothQuant's before W8A8 with the method's
    weight pass), streamed from the checkpoint one decoder layer at a time (the float model is
    never loaded whole): every tensor of the decoder layers it produced (quantized weights, and
    the norms and biases that absorbed AWQ's or SmoothQuant's scales) goes into ``fitted``, and by
    module name it returns the per-Linear input statistics of the outlier-aware passes and the
    output errors the pass measured (quant/error.py). Nothing for variants without one."""
    weights = variant.weights
    method = method_of(weights)
    if variant.activations is None and not method.fits(weights):
        return {}, {}
    if windows is None:
        raise InputError(f"variant '{variant.name}': {weights.method} needs calibration text (add 'calibration: {{text: ...}}')")
    if variant.activations is not None:
        layers = smoothquant_model(ckpt, windows, variant.activations.smoothquant, method.layer_quantizer(ckpt, weights))
        label = "SmoothQuant" if variant.activations.smoothquant is not None else "W8A8"
    else:
        label = method.pass_label(weights)
        layers = method.fit(ckpt, variant, windows,
                            lambda where: progress.update(task, description=f"{variant.name}: {label} {where}"),
                            checkpoint, plan)
    statistics: dict[str, dict] = {}
    errors: dict[str, float] = {}
    task = progress.add_task(f"{variant.name}: {label} layers", total=ckpt.arch.layers)
    # with a GPU, a fitted layer's tensors are written while the next layer is fitted
    try:
        with Behind(1 if overlap_workers() else 0) as behind:
            for layer in layers:
                behind.submit(functools.partial(_put_all, fitted, layer.tensors))
                statistics.update(layer.statistics)
                errors.update(layer.errors)
                progress.advance(task)
                del layer  # on disk (with a GPU, being written) now: not held once the next layer is fitted
    finally:
        progress.remove_task(task)
    return statistics, errors


def _put_all(fitted: VariantWeights, tensors: dict[str, TensorPayload]) -> None:
    for name, payload in tensors.items():
        fitted.put(name, payload)


def activation_modules(ckpt: HFCheckpoint, variant: Variant) -> list[str]:
    """The Linear modules whose inputs a variant with ``activations`` quantizes: those whose
    weights it quantizes."""
    return chosen_modules(ckpt, variant.weights)


def _bits(payload: TensorPayload) -> float:
    if isinstance(payload, torch.Tensor):
        return payload.element_size() * 8.0
    return payload.bits_per_weight


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def gguf_variant(file_type: str, imatrix: bool = False, bpw: float | None = None, size: str | None = None,
                 measured: bool = False) -> Variant:
    """The variant behind ``quantize export --gguf TYPE`` (``auto``: within ``bpw`` or ``size``,
    each tensor's proxy scaled by its measured KL divergence where ``measured``: with a text to
    measure it on)."""
    try:
        weights = GGUFWeights(method="gguf", type=file_type, imatrix=imatrix, bpw=bpw, size=size,
                              sensitivity=None if file_type != AUTO else "kld" if measured else "proxy")
    except ValidationError as e:
        raise InputError(f"--gguf {file_type}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    return Variant(name=file_type, weights=weights, exports=["gguf"])
