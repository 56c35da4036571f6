"""The weight methods a variant names (``weights: {method: ...}``): one registry that the recipe
schema (recipes/schema.py: the union of the weights classes), the variant builder
(recipes/variants.py) and the pipeline dispatch through.

A method is one module here, registered under its recipe name, holding its weights class (the
recipe's fields, checked; its bases are in recipes/fields.py): what it writes (``plan``), the
layer-by-layer pass it fits on calibration text if it has one (``fits``, ``fit``), what it makes
of each other tensor (``quantize``), and how the report names it (``describe``). The defaults
suit methods that quantize the chosen decoder Linears. The modules are imported at the end of
this one, in the order a recipe's error lists the methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from pydantic import BaseModel

from core.errors import InputError
from core.file_types import imatrix_required_by, tensor_types
from core.schemes import QuantSpec
from core.tensors import LayerResult, TensorPayload, all_finite
from formats.gguf import architecture_of, gguf_name, gguf_order
from formats.hf import HFCheckpoint
from formats.registry import FORMATS
from quant.ggml import encode
from recipes.bit_search import grid_summary, searched_grids, smallest_grids

Imatrix = dict[str, np.ndarray]  # HF weight name -> importance per input column


@dataclass
class Plan:
    """What one variant will write: tensors in order, with each tensor's ggml type for GGUF."""

    names: list[str]
    ggml_types: dict[str, str] = field(default_factory=dict)
    quantized: set[str] = field(default_factory=set)  # grid methods: the weights they quantize
    specs: dict[str, QuantSpec] = field(default_factory=dict)  # bits auto: each quantized weight's own grid
    summary: str = ""  # what a search chose (gguf's type: auto: "Q4_K: 28 tensors, Q5_K: 7"), for the report

    @property
    def modules(self) -> set[str]:
        """The Linear modules whose weights are quantized."""
        return {n.removesuffix(".weight") for n in self.quantized}

    def spec(self, name: str, weights) -> QuantSpec:
        """The grid of the quantized weight ``name``: its own where a search chose one, else the weights'."""
        return self.specs.get(name) or weights.spec


class WeightMethod:
    """How a method turns the source tensors into a variant's. ``weights`` is the variant's
    weights entry of the recipe: an instance of the method's ``weights`` class."""

    weights: type[BaseModel]  # the recipe's fields of the method, with ``method: Literal[its name]``
    # whether its weights are codes on one grid (``weights.spec``), which quantized checkpoint
    # exports can hold (formats/registry.py: the formats with ``codes``)
    on_grid = True
    # whether the dequantized weights compare one to one with the source's, for the report's
    # weight error where no calibrated pass measured output errors
    compares_weights = True

    def plan(self, ckpt: HFCheckpoint, variant, imatrix: bool) -> Plan:
        """The tensors the variant writes, checked against the model's shapes; reads no data."""
        return grid_plan(ckpt, variant)

    def settle(self, ckpt: HFCheckpoint, variant, plan: Plan, imatrix: Imatrix | None, windows: torch.Tensor | None,
               progress) -> Plan:
        """``plan`` with the choices made that need the weights themselves (gguf's ``type: auto``
        measures each tensor in each candidate type, on the calibration ``windows`` if asked),
        before any tensor is written; the default has none to make."""
        return plan

    def fits(self, weights) -> bool:
        """Whether these weights are fitted layer by layer on calibration text (``fit``)."""
        return False

    def fit(self, ckpt: HFCheckpoint, variant, windows: torch.Tensor, report: Callable[[str], None] | None = None,
            checkpoint: Path | None = None, plan: Plan | None = None) -> Iterator[LayerResult]:
        """The layer-by-layer pass on the calibration ``windows``: each decoder layer's tensors
        as the variant stores them (on the grids the settled ``plan`` gives them, where a search
        chose), as the layers stream from the checkpoint. A long pass may
        ``report`` where it is (a line for the progress bar: a training loss, say), and may keep
        its progress in the ``checkpoint`` folder, to take up again if the job is killed."""
        raise NotImplementedError

    def quantize(self, ckpt: HFCheckpoint, variant, plan: Plan, name: str, tensor: torch.Tensor,
                 imatrix: Imatrix | None) -> TensorPayload:
        """A tensor the fit did not produce: passed through unchanged, checked for NaN and Inf."""
        return finite(ckpt, name, tensor)

    def layer_quantizer(self, ckpt: HFCheckpoint, weights) -> Callable:
        """The weight pass on one smoothed decoder layer, for variants with quantized activations
        (quant/smoothquant.py: ``LayerQuantizer``)."""
        raise InputError(f"activations need rtn or gptq weights, not {weights.method}")

    def gguf_type(self, weights) -> str | None:
        """The GGUF file type the weights are encoded as, for a GGUF export (None: not GGUF)."""
        return None

    def fit_record(self, weights) -> dict:
        """How the weights were fitted, as a quantized checkpoint's config records it (a GPTQ
        config's ``meta``)."""
        return {"method": weights.method}

    def describe(self, weights) -> str:
        return weights.method

    def pass_label(self, weights) -> str:
        return weights.method.upper()


METHODS: dict[str, WeightMethod] = {}


def register(name: str) -> Callable[[type[WeightMethod]], type[WeightMethod]]:
    def add(cls: type[WeightMethod]) -> type[WeightMethod]:
        METHODS[name] = cls()
        return cls
    return add


def method_of(weights) -> WeightMethod:
    return METHODS[weights.method]


def chosen_modules(ckpt: HFCheckpoint, weights) -> list[str]:
    """The decoder Linear modules the weights' ``targets`` and ``ignore`` patterns pick, in
    checkpoint order."""
    linears = ckpt.linear_modules
    chosen = select_modules(linears, weights.targets, weights.ignore)
    return [n for n in linears if n in chosen]


def select_modules(names: list[str], targets: list[str], ignore: list[str]) -> set[str]:
    """The module names a pass applies to: matching a target pattern and no ignore pattern. A
    pattern that matches no module is a mistake worth stopping for."""
    for pattern in [*targets, *ignore]:
        if not any(fnmatchcase(n, pattern) for n in names):
            raise InputError(f"pattern '{pattern}' matches no Linear module of the decoder layers (e.g. '{names[0]}')")
    return {n for n in names if any(fnmatchcase(n, p) for p in targets) and not any(fnmatchcase(n, p) for p in ignore)}


def finite(ckpt: HFCheckpoint, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as it is; the quantizers refuse NaN and Inf themselves (naming the tensor), so
    only tensors passed through need this scan (``all_finite``: no mask of an 8B embedding, 525 MB)."""
    if not all_finite(tensor):
        raise InputError(f"{ckpt.path}: tensor '{name}' contains NaN or Inf")
    return tensor


class SearchesBits:
    """What a grid method (RTN, GPTQ) plans when its weights say ``bits: auto`` (recipes/bit_search.py):
    mixed in before ``WeightMethod``, whose plan and settle it keeps for one grid."""

    def plan(self, ckpt: HFCheckpoint, variant, imatrix: bool) -> Plan:
        if not variant.weights.searches_bits:
            return super().plan(ckpt, variant, imatrix)
        specs = smallest_grids(ckpt, variant, _targeted(ckpt, variant))
        return Plan(ckpt.names, quantized=set(specs), specs=specs)

    def settle(self, ckpt: HFCheckpoint, variant, plan: Plan, imatrix: Imatrix | None, windows: torch.Tensor | None,
               progress) -> Plan:
        if not variant.weights.searches_bits:
            return plan
        modules = _targeted(ckpt, variant)
        specs = searched_grids(ckpt, variant, modules, imatrix, windows, progress)
        return Plan(plan.names, quantized=set(specs), specs=specs, summary=grid_summary(specs, len(modules) - len(specs)))


def _targeted(ckpt: HFCheckpoint, variant) -> list[str]:
    """The variant's chosen decoder Linears, refused in one line naming it where its patterns pick none."""
    if not ckpt.linear_modules:
        raise InputError(f"{ckpt.path}: no Linear weights to quantize")
    try:
        return chosen_modules(ckpt, variant.weights)
    except InputError as e:
        raise InputError(f"variant '{variant.name}': {e}") from None


def grid_plan(ckpt: HFCheckpoint, variant) -> Plan:
    """Every tensor in checkpoint order; the chosen decoder Linears' weights quantized on the
    weights' grid, whose groups or blocks must divide their shapes."""
    spec = variant.weights.spec
    chosen = _targeted(ckpt, variant)
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
    return Plan(ckpt.names, quantized=set(targets))


def gguf_plan(ckpt: HFCheckpoint, variant, file_type: str, imatrix: bool) -> Plan:
    """Every tensor's ggml type for ``file_type`` (llama.cpp's mixture), in the GGUF file's tensor
    order when the variant writes a GGUF file: gguf's plan, and QAT's on a GGUF grid."""
    names = ckpt.names
    if any(FORMATS[e].ggml for e in variant.exports):
        architecture_of(ckpt)
        names = sorted((n for n in names if gguf_name(n, ckpt.arch) is not None), key=lambda n: gguf_order(gguf_name(n, ckpt.arch)))
    types = tensor_types(file_type, [(n, ckpt.shape(n)) for n in names], ckpt.arch, imatrix)
    needy = None if imatrix else imatrix_required_by(file_type, types)
    if needy is not None:
        raise InputError(f"GGUF {file_type} needs an importance matrix (--imatrix, or imatrix: true in a recipe): "
                         f"llama.cpp makes {needy} {types[needy]} only with one")
    return Plan(names, types)


def gguf_encode(plan: Plan, name: str, tensor: torch.Tensor, imatrix: Imatrix | None) -> TensorPayload:
    return encode(tensor, plan.ggml_types[name], name, imatrix.get(name) if imatrix else None)


# each module registers its method on import, in this order
from recipes.methods import rtn, gptq, awq, qat, gguf, source  # noqa: E402,F401,I001
