"""Building one variant: every tensor streamed from the source checkpoint through its quantizer
into the variant's files and, when it is to be evaluated, into its in-memory weights.

One tensor is in flight at a time; the writers lay out their headers from a plan made before the
first tensor is read, so a model larger than RAM converts in bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from rich.progress import Progress

from formats.awq import AWQWriter
from formats.bitsandbytes import BitsAndBytesWriter
from formats.compressed_tensors import CompressedTensorsWriter
from formats.gguf import GGUFFileWriter, architecture_of, gguf_name, gguf_order
from formats.gptq import GPTQWriter
from formats.hf import DenseSafetensorsWriter, HFCheckpoint
from formats.modelfile import modelfile_name, write_modelfile
from formats.outputs import Outputs
from quant.awq import awq_model
from quant.error import OUTPUT_ERROR, WEIGHT_ERROR, relative_error
from quant.ggml import FILE_TYPES, encode, tensor_types
from quant.gptq_model import gptq_layer, gptq_model, select_modules
from quant.outliers import mixed_precision_model
from quant.rtn import quantize_rtn
from quant.smoothquant import LayerQuantizer, rtn_layer, smoothquant_model
from quant.types import InputError, LayerResult, TensorPayload, dequantized
from recipes.schema import AWQWeights, GGUFWeights, GPTQWeights, RTNWeights, SourceWeights, Variant

Imatrix = dict[str, np.ndarray]  # HF weight name -> importance per input column
FOLDER_EXPORTS = ("safetensors", "compressed-tensors", "gptq", "awq", "bitsandbytes")  # each a checkpoint folder


@dataclass
class BuiltVariant:
    """A variant's weights as evaluated (float32, by HF name; empty unless kept), its files, its
    size, and for outlier-aware passes the statistics of each Linear's calibration inputs."""

    state: dict[str, torch.Tensor]
    files: list[Path]
    bits_per_weight: float
    input_statistics: dict[str, dict] = field(default_factory=dict)  # quant.outliers.channel_statistics
    # per decoder Linear (module name), how much quantization changed it (quant/error.py), and how
    # that was measured; empty where the weights were kept
    linear_errors: dict[str, float] = field(default_factory=dict)
    error_measure: str | None = None


@dataclass
class Plan:
    """What one variant will write: tensors in order, with each tensor's ggml type for GGUF."""

    names: list[str]
    ggml_types: dict[str, str] = field(default_factory=dict)
    quantized: set[str] = field(default_factory=set)  # RTN/GPTQ/AWQ: the weights they quantize


def plan_variant(ckpt: HFCheckpoint, variant: Variant, imatrix: bool = False) -> Plan:
    """Check a variant against the model's shapes and fix the tensor order and types; reads no data."""
    names = ckpt.names
    weights = variant.weights
    if isinstance(weights, (RTNWeights, GPTQWeights, AWQWeights)):
        spec = weights.spec
        if not ckpt.linear_modules:
            raise InputError(f"{ckpt.path}: no Linear weights to quantize")
        try:
            chosen = chosen_modules(ckpt, weights)
        except InputError as e:
            raise InputError(f"variant '{variant.name}': {e}") from None
        targets = [f"{m}.weight" for m in chosen]
        for n in targets:
            rows, cols = ckpt.shape(n)
            if spec.granularity == "group" and cols % spec.group_size:
                raise InputError(
                    f"variant '{variant.name}': group_size {spec.group_size} does not divide the input size {cols} of tensor '{n}'"
                )
            if spec.granularity == "block" and (rows % spec.group_size or cols % spec.group_size):
                raise InputError(
                    f"variant '{variant.name}': block size {spec.group_size} does not divide the shape {rows}x{cols} of tensor '{n}'"
                )
        return Plan(names, quantized=set(targets))
    if isinstance(weights, SourceWeights):
        return Plan(names)
    if "gguf" in variant.exports:
        architecture_of(ckpt)
        names = [n for n in names if gguf_name(n) is not None]
        names.sort(key=lambda n: gguf_order(gguf_name(n)))
    return Plan(names, tensor_types(weights.type, [(n, ckpt.shape(n)) for n in names], ckpt.arch, imatrix))


def build_variant(
    ckpt: HFCheckpoint,
    variant: Variant,
    out_dir: Path,
    progress: Progress | None = None,
    imatrix: Imatrix | None = None,
    keep_weights: bool = True,
    gguf_path: Path | None = None,
    calibration: torch.Tensor | None = None,
    outputs: Outputs | None = None,
) -> BuiltVariant:
    """Quantize ``variant`` tensor by tensor into its exports under ``out_dir/<variant name>``.

    ``gguf_path`` overrides where the GGUF export goes. With ``keep_weights`` the dequantized
    weights are also kept for evaluation (the whole model in float32). Variants fitted on
    calibration text (GPTQ, AWQ) take the token windows in ``calibration``; they are fitted first,
    layer by layer as the layers stream from the checkpoint, and their tensors then stream into
    the exports like any others. The files are staged in ``outputs`` and reach their final names
    when the caller commits it (after scoring the variant, say); without ``outputs`` they are
    committed here, once all are written.
    """
    if outputs is None:
        with Outputs() as own:
            built = build_variant(ckpt, variant, out_dir, progress, imatrix, keep_weights, gguf_path, calibration, own)
            own.commit()
        return built
    plan = plan_variant(ckpt, variant, imatrix is not None)
    progress = progress or Progress(disable=True)
    calibrated = variant.needs_calibration and not isinstance(variant.weights, GGUFWeights)
    fitted, statistics, errors = _fit(ckpt, variant, calibration, progress) if calibrated else ({}, {}, {})
    measure = OUTPUT_ERROR if errors else WEIGHT_ERROR if _compares_weights(variant) and keep_weights else None
    linears = set(ckpt.linear_modules)
    files = export_paths(ckpt, variant, out_dir, gguf_path)
    writers: list = []
    state: dict[str, torch.Tensor] = {}
    bits = params = 0.0
    task = progress.add_task(f"{variant.name}: quantize + export", total=len(plan.names))
    try:
        for export, final in files.items():
            writer = _writer(export, outputs.stage(final), ckpt, variant, plan, files)
            if writer is not None:
                writers.append(writer)
        for name in plan.names:
            source = None if name in fitted else ckpt.tensor(name)
            payload = fitted.pop(name) if source is None else _quantize(ckpt, variant, plan, name, source, imatrix)
            weights = dequantized(payload) if keep_weights or "safetensors" in variant.exports else None
            for w in writers:
                w.add(name, weights if isinstance(w, DenseSafetensorsWriter) else payload)
            if keep_weights:
                state[name] = weights
            if measure == WEIGHT_ERROR and name.removesuffix(".weight") in linears:
                errors[name.removesuffix(".weight")] = relative_error(ckpt.tensor(name) if source is None else source, weights)
            n = _numel(ckpt.shape(name))
            bits += _bits(payload) * n
            params += n
            progress.advance(task)
        for w in writers:
            w.finish()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        progress.remove_task(task)
    return BuiltVariant(state, [p for export, p in files.items() if export != "modelfile"], bits / params, statistics,
                        errors, measure if errors else None)


def _compares_weights(variant: Variant) -> bool:
    """Whether a variant's dequantized weights are comparable with the source's one to one, for
    the weight error where no calibrated pass measured output errors: not where AWQ or
    SmoothQuant rescaled them, nor where nothing was quantized."""
    w = variant.weights
    return variant.activations is None and isinstance(w, (RTNWeights, GPTQWeights, GGUFWeights))


def _writer(export: str, path: Path, ckpt: HFCheckpoint, variant: Variant, plan: Plan, files: dict[str, Path]):
    """The writer of one export at ``path`` (None for the Modelfile, written here at once)."""
    weights = variant.weights
    if export == "safetensors":
        return DenseSafetensorsWriter(path, [(n, ckpt.shape(n)) for n in plan.names], torch.float32, ckpt)
    if export == "compressed-tensors":
        act_order = isinstance(weights, GPTQWeights) and weights.act_order
        activations = variant.activations.spec if variant.activations else None
        return CompressedTensorsWriter(path, ckpt, plan.names, plan.quantized, weights.spec, activations, act_order)
    if export == "gptq":
        act_order = isinstance(weights, GPTQWeights) and weights.act_order and not weights.static_groups
        settings = {"damp_percent": weights.damp, "static_groups": weights.static_groups, "true_sequential": True} \
            if isinstance(weights, GPTQWeights) else {"method": weights.method}
        return GPTQWriter(path, ckpt, plan.names, plan.quantized, weights.spec, act_order, settings)
    if export == "awq":
        return AWQWriter(path, ckpt, plan.names, plan.quantized, weights.spec)
    if export == "bitsandbytes":
        return BitsAndBytesWriter(path, ckpt, plan.names, plan.quantized, weights.spec)
    if export == "gguf":
        gguf_plan = [(n, ckpt.shape(n), plan.ggml_types[n]) for n in plan.names]
        return GGUFFileWriter(path, ckpt, FILE_TYPES[weights.type].id, gguf_plan)
    write_modelfile(path, files["gguf"].name, ckpt)
    return None


def export_paths(ckpt: HFCheckpoint, variant: Variant, out_dir: Path, gguf_path: Path | None = None) -> dict[str, Path]:
    """Where each of a variant's exports goes, by export name (the GGUF file's Ollama Modelfile as
    'modelfile'), so a job can check every output path before it starts."""
    vdir = out_dir / variant.name
    paths = {export: vdir / export for export in FOLDER_EXPORTS if export in variant.exports}
    if "gguf" in variant.exports:
        gguf = gguf_path or vdir / f"{ckpt.path.name}-{variant.weights.type}.gguf"
        paths["gguf"] = gguf
        paths["modelfile"] = gguf.with_name(modelfile_name(gguf.name))
    return paths


def _fit(ckpt: HFCheckpoint, variant: Variant, windows: torch.Tensor | None,
         progress: Progress) -> tuple[dict[str, TensorPayload], dict[str, dict], dict[str, float]]:
    """The calibrated passes (GPTQ, AWQ, outlier columns, SmoothQuant before W8A8), streamed from
    the checkpoint one decoder layer at a time (the float model is never loaded whole): every
    tensor of the decoder layers they produced, by name (quantized weights, and the norms and
    biases that absorbed AWQ's or SmoothQuant's scales), and by module name the per-Linear input
    statistics of the outlier-aware passes and the output errors GPTQ, AWQ and SmoothQuant
    measured (quant/error.py). The payloads are kept until the export loop writes them in the
    checkpoint's tensor order, which is not the layers' order: for a 4-bit variant that is the
    uint8 codes, a quarter of the float32 weights, plus their scales."""
    weights = variant.weights
    if windows is None:
        raise InputError(f"variant '{variant.name}': {weights.method} needs calibration text (add 'calibration: {{text: ...}}')")
    layers: Iterator[LayerResult]
    if variant.activations is not None:
        layers = smoothquant_model(ckpt, windows, variant.activations.smoothquant, _layer_quantizer(ckpt, weights))
    elif isinstance(weights, GPTQWeights):
        gptq = gptq_model(ckpt, windows, weights.spec, weights.settings, weights.targets, weights.ignore)
        layers = (LayerResult({n: r.tensor for n, r in results.items()}, {},
                              {n.removesuffix(".weight"): r.output_error for n, r in results.items()}) for results in gptq)
    elif isinstance(weights, AWQWeights):
        layers = awq_model(ckpt, windows, weights.spec, weights.settings, modules=chosen_modules(ckpt, weights))
    else:
        layers = mixed_precision_model(ckpt, windows, weights.spec, weights.outliers.rule, chosen_modules(ckpt, weights))
    fitted: dict[str, TensorPayload] = {}
    statistics: dict[str, dict] = {}
    errors: dict[str, float] = {}
    task = progress.add_task(f"{variant.name}: {_pass_label(variant)} layers", total=ckpt.arch.layers)
    try:
        for layer in layers:
            fitted.update(layer.tensors)
            statistics.update(layer.statistics)
            errors.update(layer.errors)
            progress.advance(task)
    finally:
        progress.remove_task(task)
    return fitted, statistics, errors


def _layer_quantizer(ckpt: HFCheckpoint, weights: RTNWeights | GPTQWeights) -> LayerQuantizer:
    """The weight pass run on each decoder layer after SmoothQuant smoothed it."""
    chosen = chosen_modules(ckpt, weights)
    if isinstance(weights, RTNWeights):
        return lambda step: rtn_layer(step, weights.spec, chosen)
    return lambda step: {n: r.tensor for n, r in gptq_layer(step, weights.spec, weights.settings, chosen).items()}


def _pass_label(variant: Variant) -> str:
    if variant.activations is not None:
        return "SmoothQuant" if variant.activations.smoothquant is not None else "W8A8"
    return "outliers" if isinstance(variant.weights, RTNWeights) else variant.weights.method.upper()


def chosen_modules(ckpt: HFCheckpoint, weights: RTNWeights | GPTQWeights | AWQWeights) -> list[str]:
    """The decoder Linear modules the weights' ``targets`` and ``ignore`` patterns pick, in
    checkpoint order."""
    linears = ckpt.linear_modules
    chosen = select_modules(linears, weights.targets, weights.ignore)
    return [n for n in linears if n in chosen]


def activation_modules(ckpt: HFCheckpoint, variant: Variant) -> list[str]:
    """The Linear modules whose inputs a variant with ``activations`` quantizes: those whose
    weights it quantizes."""
    return chosen_modules(ckpt, variant.weights)


def _quantize(ckpt: HFCheckpoint, variant: Variant, plan: Plan, name: str, tensor: torch.Tensor,
              imatrix: Imatrix | None) -> TensorPayload:
    """One tensor's payload. The quantizers refuse NaN/Inf themselves (naming the tensor), so the
    explicit scan is only needed for tensors passed through unchanged."""
    weights = variant.weights
    if not isinstance(weights, GGUFWeights):
        if isinstance(weights, RTNWeights) and name in plan.quantized:
            return quantize_rtn(tensor, weights.spec, name)
        if not torch.isfinite(tensor).all():
            raise InputError(f"{ckpt.path}: tensor '{name}' contains NaN or Inf")
        return tensor
    importance = imatrix.get(name) if imatrix else None
    return encode(tensor, plan.ggml_types[name], name, importance)


def _bits(payload: TensorPayload) -> float:
    if isinstance(payload, torch.Tensor):
        return payload.element_size() * 8.0
    return payload.bits_per_weight


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def gguf_variant(file_type: str, imatrix: bool = False) -> Variant:
    """The variant behind ``quantize export --gguf TYPE``."""
    return Variant(name=file_type, weights=GGUFWeights(method="gguf", type=file_type, imatrix=imatrix), exports=["gguf"])
