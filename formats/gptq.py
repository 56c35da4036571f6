"""GPTQ checkpoints: the AutoGPTQ layout that GPTQModel, transformers (through GPTQModel), vLLM
and TGI load.

Per quantized Linear ``X`` with ``I`` inputs, ``O`` outputs, ``b`` bits and ``G`` groups:

- ``X.qweight`` int32 ``[ceil(I·b/32), O]``: each output column's codes packed along the input,
  a little-endian bit stream (AutoGPTQ's 3-bit layout is that stream too).
- ``X.qzeros`` int32 ``[G, ceil(O·b/32)]``: zero-points packed along the output.
- ``X.scales`` float16 ``[G, O]`` and ``X.g_idx`` int32 ``[I]``, the group of each input column
  (GPTQ's act-order permutation mapped to groups; ``i // group_size`` otherwise).

Symmetric files are checkpoint format ``gptq`` ("v1"), which stores each zero-point minus one: the
layout every loader reads. v1 cannot hold an asymmetric zero-point of 0 (it wraps, and loaders
that add the one back carry into the next field), so asymmetric files are ``gptq_v2``, with the
zero-points as they are, which GPTQModel reads, and vLLM since its gptq_v2 support (older
releases read every GPTQ file as v1; a compressed-tensors export serves asymmetric weights there). Every float tensor is float16, like
the scales the codes were chosen for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from core.errors import InputError
from core.schemes import ActivationSpec, QuantSpec
from core.tensors import QuantizedTensor
from formats.checkpoint_format import CheckpointFormat, ExportContents, weight_only
from formats.hf import HFCheckpoint
from formats.packing import pack_codes, unpack_codes
from formats.quantized_folder import FUSED, Planned, QuantizedFolderWriter, by_product, unquantized_linears
from formats.quantized_layout import Expected, MixedLayout, QuantizedLayout

BITS = (2, 3, 4, 8)


def check_spec(spec: QuantSpec) -> None:
    """ValueError saying why ``spec`` has no GPTQ layout."""
    if spec.format != "int" or spec.bits not in BITS:
        raise ValueError(f"{spec.label} weights (GPTQ holds int2, int3, int4 and int8)")
    if spec.granularity not in ("group", "channel"):
        raise ValueError(f"granularity '{spec.granularity}' (GPTQ takes group or channel)")


class GPTQWriter(QuantizedFolderWriter):
    """One variant as a GPTQ folder. ``act_order``: the weights carry GPTQ's act-order groups
    (``desc_act``); ``settings``: how they were fitted, kept under the config's ``meta``."""

    export = "gptq"
    splits_gate_up = True
    holds_group_index = True

    def __init__(self, dest: Path, source: HFCheckpoint, names: list[str], quantized: set[str], spec: QuantSpec,
                 act_order: bool = False, settings: dict | None = None, specs: dict[str, QuantSpec] | None = None):
        self._accept(spec, check_spec, source, specs)
        if self.module_specs:  # the grid most Linears share is the config's; the others are overrides
            grids = list(self.module_specs.values())
            self.spec = max(grids, key=grids.count)
        spec = self.spec
        quantization = {
            "quant_method": "gptq", "bits": spec.bits, "group_size": _group_size(spec), "desc_act": act_order,
            "sym": spec.symmetric, "lm_head": False, "checkpoint_format": "gptq" if spec.symmetric else "gptq_v2",
            "pack_dtype": "int32", "meta": {"quantizer": ["quantbench"], **(settings or {})},
        }
        skipped = [part.removesuffix(".weight") for module in unquantized_linears(source, quantized)
                   for part, _ in self._parts(f"{module}.weight", tuple(source.shape(f"{module}.weight")))]
        dynamic = skipped_overrides(skipped) | dynamic_overrides(self.module_specs, spec)
        if dynamic:
            quantization["dynamic"] = dynamic
        self._open(dest, source, names, quantized, quantization)
        (self.folder / "quantize_config.json").write_text(json.dumps(quantization, indent=2) + "\n")

    def stored(self, module: str, shape: tuple[int, int]) -> Planned:
        out, n_in = shape
        spec = self.spec_of(module)
        bits = spec.bits
        groups = n_in // spec.group_size if spec.granularity == "group" else 1
        return [
            (f"{module}.qweight", torch.int32, (-(-n_in * bits // 32), out)),
            (f"{module}.qzeros", torch.int32, (groups, -(-out * bits // 32))),
            (f"{module}.scales", torch.float16, (groups, out)),
            (f"{module}.g_idx", torch.int32, (n_in,)),
        ]

    def encode(self, payload: QuantizedTensor) -> list[torch.Tensor]:
        spec = payload.spec
        bits = spec.bits
        n_in = payload.shape[1]
        zeros = payload.zeros.round().to(torch.int16)
        if spec.symmetric:
            zeros = (zeros - 1) % 2**bits  # v1 stores zero-points minus one
        index = payload.group_index
        if index is None:
            index = torch.arange(n_in, dtype=torch.int32) // (spec.group_size if spec.granularity == "group" else n_in)
        return [
            pack_codes(payload.codes, bits).T.contiguous(),
            pack_codes(zeros.T.to(torch.uint8).contiguous(), bits),
            payload.scales.T.to(torch.float16).contiguous(),
            index.to(torch.int32),
        ]


def _group_size(spec: QuantSpec) -> int:
    """A GPTQ config's group size: -1 for one scale per output channel."""
    return spec.group_size if spec.granularity == "group" else -1


def dynamic_overrides(module_specs: dict[str, QuantSpec], base: QuantSpec) -> dict[str, dict]:
    """GPTQModel's ``dynamic``: for each Linear (or product of Linears vLLM fuses, which share a
    grid) not on the ``base`` grid, a ``+:`` regex over its module name and its own ``bits`` and
    ``group_size``. GPTQModel matches the regex against each Linear's name, vLLM against the
    product's (``qkv_proj``), so the regex takes both."""
    overrides = {}
    for fused, members in by_product(module_specs).items():
        grids = {module_specs[m] for m in members}
        if len(grids) > 1:
            raise InputError(f"gptq export: {', '.join(members)} run as one product in vLLM but are on different grids")
        spec = grids.pop()
        if spec == base:
            continue
        overrides[f"+:{_pattern(fused, members)}"] = {"bits": spec.bits, "group_size": _group_size(spec)}
    return overrides


def skipped_overrides(modules: list[str]) -> dict[str, dict]:
    """GPTQModel's ``-:`` entries for the decoder Linear ``modules`` a variant leaves in 16 bits
    (its ``ignore`` patterns, or ``bits: auto``'s 16-bit choice): without them GPTQModel looks for
    their codes and refuses the folder. A product vLLM fuses is named too where all its Linears
    are left out; where only some are, vLLM cannot load the file (one product, one kernel), and
    GPTQModel and transformers still can."""
    overrides = {}
    for fused, members in by_product(modules).items():
        whole = set(FUSED.get(fused.rpartition(".")[2], ())) <= {m.rpartition(".")[2] for m in members}
        overrides[f"-:{_pattern(fused if whole else None, members)}"] = {}
    return overrides


def _pattern(fused: str | None, members) -> str:
    """A regex matching the Linear ``members`` of one layer by their full names, and the name of
    the product vLLM fuses them into where ``fused`` is given (GPTQModel matches each Linear's
    name, vLLM the product's)."""
    parent = next(iter(members)).rpartition(".")[0]
    leaves = sorted({m.rpartition(".")[2] for m in members} | ({fused.rpartition(".")[2]} if fused else set()))
    return re.escape(parent) + r"\." + (leaves[0] if len(leaves) == 1 else "(?:" + "|".join(leaves) + ")") + "$"


class GPTQLayout(QuantizedLayout):
    """A GPTQ folder read back, v1 or v2, with its ``g_idx`` (kept where it is not the plain
    ``i // group_size``)."""

    name = "gptq"
    marker = ".qweight"

    def expected(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> Expected:
        module, (out, n_in), bits = name.removesuffix(".weight"), shape, self.spec.bits
        groups = self.groups(n_in)
        return {f"{module}.qweight": (torch.int32, (-(-n_in * bits // 32), out)),
                f"{module}.qzeros": (torch.int32, (groups, -(-out * bits // 32))),
                f"{module}.scales": (None, (groups, out)), f"{module}.g_idx": (torch.int32, (n_in,))}

    def shape(self, raw: HFCheckpoint, name: str) -> tuple[int, ...]:
        module = name.removesuffix(".weight")
        return raw.shape(f"{module}.scales")[1], raw.shape(f"{module}.g_idx")[0]

    def payload(self, raw: HFCheckpoint, name: str, shape: tuple[int, int]) -> QuantizedTensor:
        module, read, bits, (out, n_in) = name.removesuffix(".weight"), raw.tensor, self.spec.bits, shape
        codes = unpack_codes(read(f"{module}.qweight").T.contiguous(), bits, n_in)
        scales = read(f"{module}.scales").T.float().contiguous()
        zeros = unpack_codes(read(f"{module}.qzeros"), bits, out).T.to(torch.int16)
        if self.spec.symmetric:  # v1 stores each zero-point minus one
            zeros = (zeros + 1) % 2**bits
        g_idx = read(f"{module}.g_idx").to(torch.int32)
        groups = scales.shape[1]
        plain = torch.arange(n_in, dtype=torch.int32) // (n_in // groups)
        return QuantizedTensor(self.spec, codes, scales, zeros.float().contiguous(), None if torch.equal(g_idx, plain) else g_idx)


class GPTQFormat(CheckpointFormat):
    name = "gptq"
    codes = True
    holds_group_index = GPTQWriter.holds_group_index
    mixes_grids = True
    readable = "gptq"

    def check(self, spec: QuantSpec, activations: ActivationSpec | None) -> None:
        weight_only(check_spec, spec, activations)

    def writer(self, dest: Path, contents: ExportContents) -> GPTQWriter:
        c = contents
        return GPTQWriter(dest, c.source, c.names, c.quantized, c.spec, c.act_order and not c.static_groups, c.settings,
                          c.specs)

    def read(self, config: dict, raw: HFCheckpoint) -> GPTQLayout:
        if config.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format {config.get('checkpoint_format')!r}")
        base = _layout(config)
        rules = [(matches, _layout({**config, **override})) for matches, override in read_dynamic(config)]
        return MixedLayout([*rules, (lambda module: True, base)], f"{raw.path / 'config.json'}") if rules else base


def read_dynamic(config: dict) -> list[tuple[Callable[[str], object], dict]]:
    """GPTQModel's per-module overrides of a config, in the order they are matched against each
    module's name: for each "+:regex" (or bare regex), whether a module matches it and the fields
    that put it on its own grid. "-:regex" ones leave a module unquantized, stored as a float
    weight, which a reader finds by its name alone, so they are left out. ValueError where the
    overrides are not a mapping of regexes that compile to mappings."""
    dynamic = config.get("dynamic") or {}
    if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
        raise ValueError(f"dynamic {dynamic!r}")
    try:
        return [(re.compile(key.removeprefix("+:")).match, override) for key, override in dynamic.items()
                if not key.startswith("-:")]
    except re.error as e:
        raise ValueError(f"dynamic: a regex that does not compile ({e})") from None


def _layout(config: dict) -> GPTQLayout:
    """The grid of a GPTQ config (or of one of its ``dynamic`` overrides laid over it)."""
    group = config.get("group_size", -1)
    spec = QuantSpec(config["bits"], bool(config.get("sym", True)), "channel" if group in (-1, None) else "group",
                     None if group in (-1, None) else group)
    if config.get("checkpoint_format", "gptq") == "gptq" and not spec.symmetric:
        raise ValueError("asymmetric weights in checkpoint_format gptq (v1 cannot hold them)")
    return GPTQLayout(spec)


FORMAT = GPTQFormat()
