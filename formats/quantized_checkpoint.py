"""Quantized checkpoint folders read back: each quantized Linear as the codes, scales and zero-points
it holds (a ``QuantizedTensor``), every other tensor as it is.

The layouts our writers make (formats/compressed_tensors.py, gptq.py, awq.py, bitsandbytes.py),
read back: compressed-tensors (``pack-quantized`` integer weights by group or channel,
``int-quantized`` int8 channels, ``float-quantized`` fp8 by tensor, channel or block), GPTQ (the
AutoGPTQ layout, v1 and v2, with ``g_idx``), AWQ (AutoAWQ's GEMM layout), and bitsandbytes as
transformers saves it (nf4/fp4, with or without double quantization, and LLM.int8). The folder is
checked as a float one is: its config's model must have every tensor, each quantized Linear
stored in its format's tensors of the shapes the config implies, and nothing else. So the engine
can run a variant on its real low-bit weights, and what it runs is exactly what was written; and
a customer's quantized checkpoint is a source like a float one (``tensor`` dequantizes it one
weight at a time), for a GGUF file or a report.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from core.errors import InputError
from core.schemes import FOUR_BIT_CODES, QuantSpec
from core.tensors import QuantizedTensor, TensorPayload
from formats.architecture import expected_tensors, from_transformers, transformers_config
from formats.awq import deinterleaved
from formats.hf import HFCheckpoint, is_linear_weight, read_json, read_safetensors_header
from formats.packing import unpack_codes


class QuantizedCheckpoint:
    """A checked GPTQ or compressed-tensors folder. ``names`` are the model's tensors, as a float
    checkpoint of it would name them; ``payload(name)`` gives a quantized weight's codes, and
    ``tensor(name)`` any tensor in float32 (dequantized where quantized)."""

    def __init__(self, files: HFCheckpoint, spec: QuantSpec, method: str, layout: str, stored: set[str], names: list[str],
                 fused: dict[str, list[str]] | None = None):
        self.path, self.config, self.arch = files.path, files.config, files.arch
        self.spec, self.method, self.names = spec, method, names
        self.layout = layout  # compressed-tensors' format (pack-quantized, ...); the method's name otherwise
        self._fused = fused or {}  # a fused weight -> the stored parts it is made of, by rows
        self._stored_quantized = stored  # the quantized weights as stored (the parts, not the fused weight)
        self.quantized = stored - {p for parts in self._fused.values() for p in parts} | set(self._fused)
        self._files = files

    @property
    def architecture(self) -> str:
        return self._files.architecture

    @property
    def label(self) -> str:
        """What the checkpoint is, for a report: its method and weights, e.g. ``gptq int4-g128-asym``."""
        return f"{self.method} {self.spec.label}"

    @property
    def bits_per_weight(self) -> float:
        """The bits the folder stores per weight, codes, scales, zero-points and indices included."""
        raw = self._files
        stored = sum(math.prod(raw.shape(n)) * raw.dtype(n).itemsize * 8 for n in raw.names)
        return stored / sum(math.prod(self.shape(n)) for n in self.names)

    # What a source checkpoint offers besides its tensors, as the float folder it was made from.
    @property
    def linear_modules(self) -> list[str]:
        return [n.removesuffix(".weight") for n in self.names if is_linear_weight(n, self.shape(n))]

    @property
    def tokenizer_dir(self) -> Path:
        return self._files.tokenizer_dir

    @property
    def tokenizer_config(self) -> dict:
        return self._files.tokenizer_config

    def side_file(self, name: str) -> dict:
        return self._files.side_file(name)

    def copy_side_files(self, dest: Path) -> None:
        self._files.copy_side_files(dest)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "QuantizedCheckpoint":
        path = Path(path)
        config = read_json(path / "config.json") if (path / "config.json").is_file() else None
        if not isinstance(config, dict) or not isinstance(config.get("quantization_config"), dict):
            raise InputError(f"{path}: not a quantized checkpoint (no quantization_config in config.json)")
        q = config["quantization_config"]
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError(f"{path}: no *.safetensors weights in the checkpoint folder")
        headers = {f: read_safetensors_header(f).tensors for f in files}
        where = str(path / "config.json")
        hf = transformers_config(config, where)
        raw = HFCheckpoint(path, config, from_transformers(hf, config, where), headers)
        spec, method, layout = _scheme(q, where, raw)
        expected, optional = expected_tensors(hf, where)
        stored = set(raw.names)
        marker = {"gptq": ".qweight", "awq": ".qweight", "pack-quantized": ".weight_packed", "bnb-4bit": ".weight.absmax",
                  "bnb-int8": ".SCB"}.get(layout, ".weight_scale")
        quantized = {f"{n.removesuffix(marker)}.weight" for n in stored if n.endswith(marker)}
        needed, fused = set(), {}
        for name, shape in expected.items():
            parts = [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
            if name.endswith("mlp.gate_up_proj.weight") and name not in stored and set(parts) <= quantized:
                # Phi-3's GPTQ and AWQ folders split it as GPTQModel quantizes it: fused back here
                for part in parts:
                    needed |= _check_stored(raw, layout, spec, part, (shape[0] // 2, shape[1]))
                fused[name] = parts
            elif name in quantized:
                needed |= _check_stored(raw, layout, spec, name, shape)
            elif name in stored:
                if raw.shape(name) != shape:
                    raise InputError(f"{path}: tensor '{name}' has shape {list(raw.shape(name))}, the config gives {list(shape)}")
                needed.add(name)
            elif name not in optional:
                raise InputError(f"{path}: no tensor '{name}' in the checkpoint ({raw.architecture} needs it)")
        extra = sorted(stored - needed)
        if extra:
            raise InputError(f"{path}: tensor '{extra[0]}' is not part of the {method} checkpoint of the "
                             f"{raw.architecture} that config.json describes")
        return cls(raw, spec, method, layout, quantized, [n for n in expected if n in quantized or n in stored or n in fused], fused)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._fused:
            shapes = [self.shape(p) for p in self._fused[name]]
            return sum(s[0] for s in shapes), shapes[0][1]
        if name in self._stored_quantized:
            module = name.removesuffix(".weight")
            if self.layout in ("int-quantized", "float-quantized", "bnb-int8"):
                return self._files.shape(name)
            if self.layout == "bnb-4bit":
                return tuple(_bnb_state(self._files, name)["shape"])
            if self.method == "compressed-tensors":
                return tuple(self._files.tensor(f"{module}.weight_shape").tolist())
            n_in = self._files.shape(f"{module}.qweight")[0] if self.method == "awq" else self._files.shape(f"{module}.g_idx")[0]
            return self._files.shape(f"{module}.scales")[1], n_in
        return self._files.shape(name)

    def payload(self, name: str) -> TensorPayload:
        if name in self._fused:
            parts = [self.payload(p) for p in self._fused[name]]
            if any(p.group_index is not None for p in parts):  # act-order parts keep their own column groups
                return torch.cat([p.dequantize() for p in parts])
            return QuantizedTensor(self.spec, *(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))
        if name not in self._stored_quantized:
            return self._files.tensor(name)
        module = name.removesuffix(".weight")
        read = self._files.tensor
        bits, out, n_in = self.spec.bits, *self.shape(name)
        if self.layout == "bnb-4bit":
            return self._bnb_4bit(name, out, n_in)
        if self.layout == "bnb-int8":  # LLM.int8's rows: int8 times the row's absmax / 127
            codes = (read(name).to(torch.int16) + 128).to(torch.uint8)
            scales = (read(f"{module}.SCB").float() / 127).reshape(out, 1)
            return QuantizedTensor(self.spec, codes, scales, torch.full_like(scales, 128.0))
        if self.layout == "int-quantized":  # int8 levels minus 128, one scale per row
            codes = (read(name).to(torch.int16) + 128).to(torch.uint8)
            scales = read(f"{module}.weight_scale").float().reshape(out, 1)
            return QuantizedTensor(self.spec, codes, scales, torch.full_like(scales, 128.0))
        if self.layout == "float-quantized":  # fp8 bit patterns; a scale per tensor, row or block
            scales = read(f"{module}.weight_scale").float()
            scales = scales.reshape(1, 1).expand(out, 1).contiguous() if self.spec.granularity == "tensor" else scales.reshape(-1, scales.shape[-1])
            return QuantizedTensor(self.spec, read(name).view(torch.uint8), scales, torch.zeros_like(scales))
        if self.method == "compressed-tensors":
            codes = unpack_codes(read(f"{module}.weight_packed"), bits, n_in)
            scales = read(f"{module}.weight_scale").float()
            zeros = torch.full_like(scales, 2 ** (bits - 1)) if self.spec.symmetric else \
                unpack_codes(read(f"{module}.weight_zero_point").T.contiguous(), bits, out).T.float()
            return QuantizedTensor(self.spec, codes, scales, zeros)
        if self.method == "awq":
            codes = deinterleaved(unpack_codes(read(f"{module}.qweight"), 4, out)).T.contiguous()
            zeros = deinterleaved(unpack_codes(read(f"{module}.qzeros"), 4, out)).T.float().contiguous()
            return QuantizedTensor(self.spec, codes, read(f"{module}.scales").T.float().contiguous(), zeros)
        codes = unpack_codes(read(f"{module}.qweight").T.contiguous(), bits, n_in)
        scales = read(f"{module}.scales").T.float().contiguous()
        zeros = unpack_codes(read(f"{module}.qzeros"), bits, out).T.to(torch.int16)
        if self.spec.symmetric:  # v1 stores each zero-point minus one
            zeros = (zeros + 1) % 2**bits
        g_idx = read(f"{module}.g_idx").to(torch.int32)
        groups = scales.shape[1]
        plain = torch.arange(n_in, dtype=torch.int32) // (n_in // groups)
        return QuantizedTensor(self.spec, codes, scales, zeros.float().contiguous(), None if torch.equal(g_idx, plain) else g_idx)

    def _bnb_4bit(self, name: str, out: int, n_in: int) -> TensorPayload:
        """bitsandbytes' 4-bit weight: two codes a byte (high nibble first) over the flattened
        weight, a scale per block, itself 8-bit quantized in blocks of its own under double
        quantization (bitsandbytes' ``dequantize_blockwise`` plus the stored offset)."""
        read, state = self._files.tensor, _bnb_state(self._files, name)
        packed = read(name).reshape(-1)
        codes = torch.stack([packed >> 4, packed & 15], 1).reshape(-1)
        absmax = read(f"{name}.absmax")
        if "nested_blocksize" in state:
            nested = read(f"{name}.nested_absmax").float().repeat_interleave(state["nested_blocksize"])[: absmax.numel()]
            absmax = read(f"{name}.nested_quant_map").float()[absmax.long()] * nested + float(state["nested_offset"])
        table, block = read(f"{name}.quant_map").float(), state["blocksize"]
        if n_in % block == 0 and torch.equal(table, FOUR_BIT_CODES[self.spec.format]):
            return QuantizedTensor(self.spec, codes.reshape(out, n_in), absmax.float().reshape(out, n_in // block),
                                   torch.zeros(out, n_in // block))
        return (table[codes.long()].reshape(-1, block) * absmax.float()[:, None]).reshape(out, n_in)

    def tensor(self, name: str) -> torch.Tensor:
        payload = self.payload(name)
        return payload.dequantize() if isinstance(payload, QuantizedTensor) else payload.float()

    def dtype(self, name: str) -> torch.dtype:
        """float32 for a quantized weight (what ``tensor`` gives), the stored dtype otherwise."""
        return torch.float32 if name in self.quantized else self._files.dtype(name)


def _bnb_state(raw: HFCheckpoint, name: str) -> dict:
    """The JSON record bitsandbytes keeps beside a 4-bit weight (quant type, blocksize, shape,
    and the nested blocksize and offset under double quantization)."""
    stored = [n for n in raw.names if n.startswith(f"{name}.quant_state.bitsandbytes__")]
    if len(stored) != 1:
        raise InputError(f"{raw.path}: no tensor '{name}.quant_state.bitsandbytes__nf4' (or __fp4) for the 4-bit weight")
    try:
        state = json.loads(bytes(raw.tensor(stored[0]).to(torch.uint8).tolist()))
        int(state["blocksize"])
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{raw.path}: tensor '{stored[0]}' is not bitsandbytes' record of a 4-bit weight ({e})") from None
    return state


def _scheme(q: dict, where: str, raw: HFCheckpoint) -> tuple[QuantSpec, str, str]:
    """The weights' spec, the method and its layout, from the quantization_config (and, for
    bitsandbytes, whose blocksize it does not say, the first weight's record)."""
    method = q.get("quant_method")
    try:
        if method == "bitsandbytes":
            if q.get("load_in_8bit"):
                return QuantSpec(8, True, "channel"), method, "bnb-int8"
            if not q.get("load_in_4bit"):
                raise ValueError("neither load_in_4bit nor load_in_8bit")
            fmt = q.get("bnb_4bit_quant_type", "fp4")
            if fmt not in FOUR_BIT_CODES:
                raise ValueError(f"bnb_4bit_quant_type {fmt!r}")
            first = next((n.removesuffix(".absmax") for n in raw.names if n.endswith(".weight.absmax")), None)
            block = _bnb_state(raw, first)["blocksize"] if first else 64
            return QuantSpec(4, True, "group", int(block), format=fmt), method, "bnb-4bit"
        if method == "gptq":
            if q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
                raise ValueError(f"checkpoint_format {q.get('checkpoint_format')!r}")
            group = q.get("group_size", -1)
            spec = QuantSpec(q["bits"], bool(q.get("sym", True)), "channel" if group in (-1, None) else "group",
                             None if group in (-1, None) else group)
            if q.get("checkpoint_format", "gptq") == "gptq" and not spec.symmetric:
                raise ValueError("asymmetric weights in checkpoint_format gptq (v1 cannot hold them)")
            return spec, "gptq", "gptq"
        if method == "compressed-tensors":
            layout = q.get("format")
            groups = q.get("config_groups") or {}
            if len(groups) != 1:
                raise ValueError("more than one config group")
            w = next(iter(groups.values()))["weights"]
            strategy = w.get("strategy")
            if layout == "pack-quantized" and w.get("type") == "int" and strategy in ("group", "channel"):
                return QuantSpec(w["num_bits"], bool(w.get("symmetric", True)), strategy, w.get("group_size")), method, layout
            if layout == "int-quantized" and w.get("type") == "int" and w.get("num_bits") == 8 and strategy == "channel" \
                    and w.get("symmetric", True):
                return QuantSpec(8, True, "channel"), method, layout
            if layout == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8 \
                    and strategy in ("tensor", "channel", "block"):
                block = w.get("block_structure") if strategy == "block" else None
                if block is not None and (len(block) != 2 or block[0] != block[1]):
                    raise ValueError(f"block_structure {block} (square blocks only)")
                return QuantSpec(8, True, strategy, block[0] if block else None, format="fp8_e4m3"), method, layout
            raise ValueError(f"format {layout!r} with {w.get('num_bits')}-bit {w.get('type')} weights by {strategy}")
        if method == "awq":
            if str(q.get("version", "gemm")).lower() != "gemm" or q.get("bits", 4) != 4:
                raise ValueError(f"version {q.get('version')!r}, {q.get('bits')} bits (the GEMM layout holds int4)")
            # zero-points are always stored; a symmetric spec would only fix them at 8
            return QuantSpec(4, False, "group", int(q["group_size"])), "awq", "awq"
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{where}: a {method} quantization_config this reader does not take ({e})") from None
    raise InputError(f"{where}: quant_method {method!r}: the readable quantized checkpoints are gptq, awq (gemm), "
                     "compressed-tensors (pack-quantized, int-quantized, float-quantized) and bitsandbytes (4-bit, int8)")


def _check_stored(raw: HFCheckpoint, layout: str, spec: QuantSpec, name: str, shape: tuple[int, ...]) -> set[str]:
    """The stored tensors of one quantized weight ``[out, in]``, checked to be of the shapes and
    dtypes its layout gives; returns their names."""
    module, (out, n_in), bits = name.removesuffix(".weight"), shape, spec.bits
    groups = n_in // spec.group_size if spec.granularity == "group" else 1
    if spec.granularity in ("group", "block") and (n_in % spec.group_size or (spec.granularity == "block" and out % spec.group_size)):
        raise InputError(f"{raw.path}: {spec.granularity} size {spec.group_size} does not divide the {list(shape)} weight of '{module}'")
    if layout == "bnb-4bit":
        state, n = _bnb_state(raw, name), out * n_in
        if list(state.get("shape", [])) != [out, n_in] or n % 2 or n % state["blocksize"]:
            raise InputError(f"{raw.path}: '{name}' is recorded as {state.get('shape')} in blocks of "
                             f"{state['blocksize']}; the config gives {list(shape)}")
        blocks = n // state["blocksize"]
        record = next(n for n in raw.names if n.startswith(f"{name}.quant_state.bitsandbytes__"))
        tensors = {name: (torch.uint8, (n // 2, 1)), f"{name}.quant_map": (torch.float32, (16,)),
                   record: (torch.uint8, raw.shape(record))}
        if "nested_blocksize" in state:
            tensors.update({f"{name}.absmax": (torch.uint8, (blocks,)), f"{name}.nested_quant_map": (torch.float32, (256,)),
                            f"{name}.nested_absmax": (torch.float32, (math.ceil(blocks / state["nested_blocksize"]),))})
        else:
            tensors[f"{name}.absmax"] = (torch.float32, (blocks,))
    elif layout == "bnb-int8":
        tensors = {name: (torch.int8, shape), f"{module}.SCB": (torch.float32, (out,))}
        if f"{module}.weight_format" in raw.names:  # what older transformers saved beside (the row layout)
            tensors[f"{module}.weight_format"] = (raw.dtype(f"{module}.weight_format"), raw.shape(f"{module}.weight_format"))
    elif layout in ("int-quantized", "float-quantized"):
        scales = {"tensor": None, "channel": (out, 1), "block": (out // (spec.group_size or 1), n_in // (spec.group_size or 1))}[spec.granularity]
        tensors = {name: (torch.int8 if layout == "int-quantized" else torch.float8_e4m3fn, shape)}
        if scales is not None:
            tensors[f"{module}.weight_scale"] = (None, scales)
        elif f"{module}.weight_scale" not in raw.names or math.prod(raw.shape(f"{module}.weight_scale")) != 1:
            raise InputError(f"{raw.path}: no one-value tensor '{module}.weight_scale' for the per-tensor fp8 weight '{name}'")
        else:
            tensors[f"{module}.weight_scale"] = (None, raw.shape(f"{module}.weight_scale"))
    elif layout == "pack-quantized":
        tensors = {f"{module}.weight_packed": (torch.int32, (out, math.ceil(n_in * bits / 32))),
                  f"{module}.weight_scale": (None, (out, groups)), f"{module}.weight_shape": (torch.int64, (2,))}
        if not spec.symmetric:
            tensors[f"{module}.weight_zero_point"] = (torch.int32, (math.ceil(out * bits / 32), groups))
    elif layout == "awq":
        if out % 8:
            raise InputError(f"{raw.path}: '{module}' has {out} outputs; AWQ packs them eight to a word")
        tensors = {f"{module}.qweight": (torch.int32, (n_in, out // 8)), f"{module}.qzeros": (torch.int32, (groups, out // 8)),
                  f"{module}.scales": (None, (groups, out))}
    else:
        tensors = {f"{module}.qweight": (torch.int32, (math.ceil(n_in * bits / 32), out)),
                  f"{module}.qzeros": (torch.int32, (groups, math.ceil(out * bits / 32))),
                  f"{module}.scales": (None, (groups, out)), f"{module}.g_idx": (torch.int32, (n_in,))}
    for stored, (dtype, expected) in tensors.items():
        if stored not in raw.names:
            raise InputError(f"{raw.path}: no tensor '{stored}' for the quantized weight '{name}'")
        if raw.shape(stored) != expected or (dtype is not None and raw.dtype(stored) != dtype) or \
                (dtype is None and not raw.dtype(stored).is_floating_point):
            raise InputError(f"{raw.path}: tensor '{stored}' is {raw.dtype(stored)} {list(raw.shape(stored))}; "
                             f"its {layout} layout needs {dtype or 'a float'} {list(expected)}")
    if f"{module}.weight_shape" in tensors and tuple(raw.tensor(f"{module}.weight_shape").tolist()) != shape:
        raise InputError(f"{raw.path}: tensor '{module}.weight_shape' says {raw.tensor(f'{module}.weight_shape').tolist()}, "
                         f"the config gives {list(shape)}")
    return set(tensors)
