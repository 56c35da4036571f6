"""Building one variant: every tensor streamed from the source checkpoint through its quantizer
into the variant's files and, when it is to be evaluated, into its in-memory weights.

One tensor is in flight at a time; the writers lay out their headers from a plan made before the
first tensor is read, so a model larger than RAM converts in bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import Progress

from formats.awq import AWQWriter
from formats.bitsandbytes import BitsAndBytesWriter
from formats.compressed_tensors import CompressedTensorsWriter
from formats.gguf import GGUFFileWriter
from formats.gptq import GPTQWriter
from formats.hf import DenseSafetensorsWriter, HFCheckpoint
from formats.modelfile import modelfile_name, write_modelfile
from formats.outputs import Outputs
from quant.error import OUTPUT_ERROR, WEIGHT_ERROR, relative_error
from quant.ggml import FILE_TYPES
from quant.smoothquant import smoothquant_model
from quant.types import InputError, TensorPayload, dequantized
from recipes.methods import Imatrix, Plan, chosen_modules, method_of
from recipes.schema import GGUFWeights, GPTQWeights, Variant

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


def plan_variant(ckpt: HFCheckpoint, variant: Variant, imatrix: bool = False) -> Plan:
    """Check a variant against the model's shapes and fix the tensor order and types; reads no data."""
    return method_of(variant.weights).plan(ckpt, variant, imatrix)


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
    checkpoint: Path | None = None,
) -> BuiltVariant:
    """Quantize ``variant`` tensor by tensor into its exports under ``out_dir/<variant name>``.

    ``gguf_path`` overrides where the GGUF export goes. With ``keep_weights`` the dequantized
    weights are also kept for evaluation (the whole model in float32). Variants fitted on
    calibration text (GPTQ, AWQ) take the token windows in ``calibration``; they are fitted first,
    layer by layer as the layers stream from the checkpoint, and their tensors then stream into
    the exports like any others; a fit that trains (QAT) keeps its progress in the ``checkpoint``
    folder, if given. The files are staged in ``outputs`` and reach their final names when the
    caller commits it (after scoring the variant, say); without ``outputs`` they are committed
    here, once all are written.
    """
    if outputs is None:
        with Outputs() as own:
            built = build_variant(ckpt, variant, out_dir, progress, imatrix, keep_weights, gguf_path, calibration, own,
                                  checkpoint)
            own.commit()
        return built
    method = method_of(variant.weights)
    plan = method.plan(ckpt, variant, imatrix is not None)
    progress = progress or Progress(disable=True)
    fitted, statistics, errors = _fit(ckpt, variant, calibration, progress, checkpoint)
    compares = method.compares_weights and variant.activations is None
    measure = OUTPUT_ERROR if errors else WEIGHT_ERROR if compares and keep_weights else None
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
            payload = fitted.pop(name) if source is None else method.quantize(ckpt, variant, plan, name, source, imatrix)
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
        return GGUFFileWriter(path, ckpt, FILE_TYPES[method_of(weights).gguf_type(weights)].id, gguf_plan)
    write_modelfile(path, files["gguf"].name, ckpt)
    return None


def export_paths(ckpt: HFCheckpoint, variant: Variant, out_dir: Path, gguf_path: Path | None = None) -> dict[str, Path]:
    """Where each of a variant's exports goes, by export name (the GGUF file's Ollama Modelfile as
    'modelfile'), so a job can check every output path before it starts."""
    vdir = out_dir / variant.name
    paths = {export: vdir / export for export in FOLDER_EXPORTS if export in variant.exports}
    if "gguf" in variant.exports:
        gguf = gguf_path or vdir / f"{ckpt.path.name}-{method_of(variant.weights).gguf_type(variant.weights)}.gguf"
        paths["gguf"] = gguf
        paths["modelfile"] = gguf.with_name(modelfile_name(gguf.name))
    return paths


def _fit(ckpt: HFCheckpoint, variant: Variant, windows: torch.Tensor | None, progress: Progress,
         checkpoint: Path | None) -> tuple[dict[str, TensorPayload], dict[str, dict], dict[str, float]]:
    """The variant's calibrated pass (its method's, or SmoothQuant's before W8A8 with the method's
    weight pass), streamed from the checkpoint one decoder layer at a time (the float model is
    never loaded whole): every tensor of the decoder layers it produced, by name (quantized
    weights, and the norms and biases that absorbed AWQ's or SmoothQuant's scales), and by module
    name the per-Linear input statistics of the outlier-aware passes and the output errors the
    pass measured (quant/error.py). Empty for variants without one. The payloads are kept until
    the export loop writes them in the checkpoint's tensor order, which is not the layers' order:
    for a 4-bit variant that is the uint8 codes, a quarter of the float32 weights, plus scales."""
    weights = variant.weights
    method = method_of(weights)
    if variant.activations is None and not method.fits(weights):
        return {}, {}, {}
    if windows is None:
        raise InputError(f"variant '{variant.name}': {weights.method} needs calibration text (add 'calibration: {{text: ...}}')")
    if variant.activations is not None:
        layers = smoothquant_model(ckpt, windows, variant.activations.smoothquant, method.layer_quantizer(ckpt, weights))
        label = "SmoothQuant" if variant.activations.smoothquant is not None else "W8A8"
    else:
        label = method.pass_label(weights)
        layers = method.fit(ckpt, variant, windows,
                            lambda where: progress.update(task, description=f"{variant.name}: {label} {where}"),
                            checkpoint)
    fitted: dict[str, TensorPayload] = {}
    statistics: dict[str, dict] = {}
    errors: dict[str, float] = {}
    task = progress.add_task(f"{variant.name}: {label} layers", total=ckpt.arch.layers)
    try:
        for layer in layers:
            fitted.update(layer.tensors)
            statistics.update(layer.statistics)
            errors.update(layer.errors)
            progress.advance(task)
    finally:
        progress.remove_task(task)
    return fitted, statistics, errors


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


def gguf_variant(file_type: str, imatrix: bool = False) -> Variant:
    """The variant behind ``quantize export --gguf TYPE``."""
    return Variant(name=file_type, weights=GGUFWeights(method="gguf", type=file_type, imatrix=imatrix), exports=["gguf"])
