"""Building one variant: every tensor streamed from the source checkpoint through its quantizer
into the variant's files and, when it is to be evaluated, into its weights kept on disk as the
quantizer made them (formats/variant_weights.py), which the evaluation then streams.

One tensor is in flight at a time; the writers lay out their headers from a plan made before the
first tensor is read, so a model larger than RAM converts in bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import Progress

from core.errors import InputError
from core.file_types import FILE_TYPES
from core.tensors import TensorPayload, dequantized
from formats.awq import AWQWriter
from formats.bitsandbytes import BitsAndBytesWriter
from formats.compressed_tensors import CompressedTensorsWriter
from formats.gguf import GGUFFileWriter
from formats.gptq import GPTQWriter
from formats.hf import DenseSafetensorsWriter, HFCheckpoint
from formats.hub import model_name
from formats.modelfile import modelfile_name, write_modelfile
from formats.outputs import Outputs
from formats.variant_weights import VariantWeights
from quant.error import OUTPUT_ERROR, WEIGHT_ERROR, relative_error
from quant.smoothquant import smoothquant_model
from recipes.methods import Imatrix, Plan, chosen_modules, method_of
from recipes.schema import GGUFWeights, GPTQWeights, Variant

FOLDER_EXPORTS = ("safetensors", "compressed-tensors", "gptq", "awq", "bitsandbytes")  # each a checkpoint folder


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
    plan = method.plan(ckpt, variant, imatrix is not None)
    progress = progress or Progress(disable=True)
    statistics, errors = _fit(ckpt, variant, calibration, progress, checkpoint, fitted)
    compares = method.compares_weights and variant.activations is None
    measure = OUTPUT_ERROR if errors else WEIGHT_ERROR if compares and kept is not None else None
    linears = set(ckpt.linear_modules)
    files = export_paths(ckpt, variant, out_dir, gguf_path)
    writers: list = []
    bits = params = 0.0
    task = progress.add_task(f"{variant.name}: quantize + export", total=len(plan.names))
    try:
        for export, final in files.items():
            writer = _writer(export, outputs.stage(final), ckpt, variant, plan, files)
            if writer is not None:
                writers.append(writer)
        for name in plan.names:
            source = None if name in fitted else ckpt.tensor(name)
            if source is None:
                payload = fitted.payload(name)
            else:
                payload = method.quantize(ckpt, variant, plan, name, source, imatrix)
                if kept is not None:
                    kept.put(name, payload)
            # float32 weights only where a dense export or the weight error takes them: an 8B
            # model's embedding and head (no decoder Linears, so no weight error) are 2 GiB each
            compared = measure == WEIGHT_ERROR and name.removesuffix(".weight") in linears
            weights = dequantized(payload) if compared or "safetensors" in variant.exports else None
            for w in writers:
                w.add(name, weights if isinstance(w, DenseSafetensorsWriter) else payload)
            if compared:
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
    return BuiltVariant(kept, [p for export, p in files.items() if export != "modelfile"], bits / params, statistics,
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
        gguf = gguf_path or vdir / f"{model_name(ckpt.path)}-{method_of(variant.weights).gguf_type(variant.weights)}.gguf"
        paths["gguf"] = gguf
        paths["modelfile"] = gguf.with_name(modelfile_name(gguf.name))
    return paths


def _fit(ckpt: HFCheckpoint, variant: Variant, windows: torch.Tensor | None, progress: Progress,
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
                            checkpoint)
    statistics: dict[str, dict] = {}
    errors: dict[str, float] = {}
    task = progress.add_task(f"{variant.name}: {label} layers", total=ckpt.arch.layers)
    try:
        for layer in layers:
            for name, payload in layer.tensors.items():
                fitted.put(name, payload)
            statistics.update(layer.statistics)
            errors.update(layer.errors)
            progress.advance(task)
            del layer  # on disk now: not held while the next layer is fitted
    finally:
        progress.remove_task(task)
    return statistics, errors


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
