"""A GGUF file as a source: the model llama.cpp runs from it, read tensor by tensor as transformers
names and computes it, so a customer who has only a GGUF file can convert it to another type, score
it in a report or export it for transformers and vLLM (llama.cpp's users are told to find the
original weights: llama.cpp issues 10965, 12923, 11024).

The file's metadata gives the architecture (formats/architecture.py ``from_gguf``); the config.json
transformers needs is made from it with what llama.cpp assumes and does not store (Gemma's attention
scale and layer pattern, Llama 3's rope scaling recovered from ``rope_freqs``), and checked to
describe the same model. Each tensor is dequantized on read and put back in transformers' layout
(llama's q/k rows un-interleaved, Gemma's norms minus one); ``stored`` gives it exactly as the file
holds it, so a GGUF file written from this one keeps each tensor whose type does not change byte
for byte. The tokenizer is transformers' reading of the file's own.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from core.architecture import FAMILIES, FROM_GGUF, Architecture, Rope
from core.errors import InputError
from core.rope import from_pairs_side_by_side
from core.tensors import StoredGGMLTensor
from formats.architecture import expected_tensors, from_gguf, from_transformers, transformers_config
from formats.gguf import gguf_name, llama3_divisors
from formats.gguf_file import GGUFHeader, GGUFTensorInfo, read_gguf_header
from formats.hf import TOKENIZER_FILES, is_linear_weight, read_json

# What the two descriptions of the model must agree on.
_SAME = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "windows", "tied_embeddings",
         "qkv_bias", "post_norms", "qk_norm", "attn_softcap", "final_softcap", "fused_projections")


class GGUFCheckpoint:
    """A checked GGUF file. ``names`` are its tensors as a transformers checkpoint names them;
    ``tensor(name)`` gives one in float32, ``stored(name)`` as the file holds it."""

    def __init__(self, path: Path, header: GGUFHeader, config: dict, arch: Architecture,
                 tensors: dict[str, GGUFTensorInfo]):
        self.path, self.header, self.config, self.arch = path, header, config, arch
        self._tensors = tensors  # HF name -> the file's tensor
        self._tokenizer: tempfile.TemporaryDirectory | None = None

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFCheckpoint":
        path = Path(path)
        header = read_gguf_header(path)
        by_name = {t.name: t for t in header.tensors}
        kind = header.fields.get("general.architecture")
        if kind not in FROM_GGUF:
            raise InputError(f"{path}: GGUF architecture '{kind}' is not one quantbench reads "
                             f"(it reads {', '.join(FROM_GGUF)})")
        where = str(path)
        stored = from_gguf(header.fields, {t.name: t.shape for t in header.tensors}, where)
        config = _hf_config(header.fields, stored, by_name, path)
        hf = transformers_config(config, where)
        arch = from_transformers(hf, config, where)
        for field in _SAME:
            if getattr(arch, field) != getattr(stored, field):
                raise InputError(f"{path}: its metadata and tensors are not a {config['model_type']} transformers "
                                 f"can run ({field}: {getattr(stored, field)} in the file, {getattr(arch, field)} "
                                 "in the model made of it)")
        expected, optional = expected_tensors(hf, where)
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape in expected.items():
            info = by_name.get(gguf_name(name, arch))
            if info is None:
                if name in optional:
                    continue
                raise InputError(f"{path}: no tensor '{gguf_name(name, arch)}' (the {kind} model's {name})")
            if info.shape != shape:
                raise InputError(f"{path}: tensor '{info.name}' has shape {list(info.shape)}; the metadata gives {list(shape)}")
            tensors[name] = info
        for qtype in {t.type for t in tensors.values()}:
            _check_readable(qtype, path)
        extra = sorted(set(by_name) - {t.name for t in tensors.values()} - {"rope_freqs.weight"})
        if extra:
            raise InputError(f"{path}: tensor '{extra[0]}' is not part of the {kind} model its metadata describes")
        return cls(path, header, config, arch, tensors)

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32  # what ``tensor`` gives

    def ggml_type(self, name: str) -> str:
        return self._tensors[name].type.name

    def stored(self, name: str) -> StoredGGMLTensor:
        info = self._tensors[name]
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            data = np.frombuffer(bytearray(f.read(info.n_bytes)), dtype=np.uint8)
        if info.type == GGMLQuantizationType.F32:
            raw = data.view(np.float32).reshape(info.shape)
        elif info.type == GGMLQuantizationType.F16:
            raw = data.view(np.float16).reshape(info.shape)
        else:
            raw = data.reshape(*info.shape[:-1], -1)
        values = np.asarray(dequantize(raw, info.type), dtype=np.float32).reshape(info.shape)
        if self.arch.rope_pairs_adjacent_in_gguf and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            values = from_pairs_side_by_side(values, self.arch.kv_heads[0] if ".k_proj." in name else self.arch.heads)
        if self.arch.norm_offset and name.endswith("norm.weight"):
            values = (values.astype(np.float64) - self.arch.norm_offset).astype(np.float32)
        return StoredGGMLTensor(info.type.name, raw, info.shape, torch.from_numpy(np.ascontiguousarray(values)))

    def payload(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.stored(name).values

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]

    @property
    def label(self) -> str:
        """The file type llama.cpp names the file by, e.g. ``gguf Q4_K_M``."""
        from core.file_types import FILE_TYPES

        ftype = self.header.fields.get("general.file_type")
        name = next((n for n, t in FILE_TYPES.items() if t.id == ftype), None)
        return f"gguf {name or ','.join(sorted({self.ggml_type(n) for n in self.names}))}"

    @property
    def bits_per_weight(self) -> float:
        return sum(8 * t.n_bytes for t in self._tensors.values()) / sum(math.prod(t.shape) for t in self._tensors.values())

    @property
    def linear_modules(self) -> list[str]:
        return [n.removesuffix(".weight") for n in self.names if is_linear_weight(n, self.shape(n))]

    @property
    def tokenizer_dir(self) -> Path:
        """transformers' tokenizer of the file, saved once as tokenizer files in a folder of its own."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            folder = tempfile.TemporaryDirectory(prefix="quantbench-gguf-tokenizer-")
            try:
                AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name, local_files_only=True).save_pretrained(folder.name)
            except Exception as e:  # transformers raises what its converter hits on a tokenizer it does not take
                folder.cleanup()
                raise InputError(f"{self.path}: transformers cannot read the file's tokenizer "
                                 f"({str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__})") from None
            self._tokenizer = folder
        return Path(self._tokenizer.name)

    @property
    def tokenizer_config(self) -> dict:
        return self.side_file("tokenizer_config.json")

    def side_file(self, name: str) -> dict:
        path = self.tokenizer_dir / name
        data = read_json(path) if path.is_file() else {}
        return data if isinstance(data, dict) else {}

    def copy_side_files(self, dest: Path) -> None:
        import shutil

        for name in TOKENIZER_FILES:
            if (self.tokenizer_dir / name).is_file():
                shutil.copyfile(self.tokenizer_dir / name, dest / name)

    def carried_fields(self) -> dict[str, tuple[object, tuple]]:
        """What a GGUF file written from this one carries over as it is, value and type: the
        model's name and the tokenizer's metadata."""
        return {k: (v, self.header.types[k]) for k, v in self.header.fields.items()
                if k.startswith("tokenizer.") or k == "general.name"}


def _check_readable(qtype: GGMLQuantizationType, path: Path) -> None:
    """Refuse a ggml type gguf-py cannot dequantize, before any tensor is read."""
    block, size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, size), np.uint8) if qtype not in _FLOATS else np.zeros(block, _FLOATS[qtype]), qtype)
    except NotImplementedError:
        raise InputError(f"{path}: tensors of type {qtype.name}, which gguf-py cannot dequantize") from None


_FLOATS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


def _hf_config(fields: dict, stored: Architecture, tensors: dict[str, GGUFTensorInfo], path: Path) -> dict:
    """The config.json of the model llama.cpp runs from the file: its metadata, and what llama.cpp
    assumes for the architecture where the file says nothing."""
    kind = fields["general.architecture"]
    model_type = FROM_GGUF[kind]
    cls = FAMILIES[model_type].causal_lm
    if len(set(stored.kv_heads)) > 1:
        raise InputError(f"{path}: KV heads differ between layers ({sorted(set(stored.kv_heads))}); "
                         f"transformers' {model_type} has one count")
    rope = _rope_parameters(fields, stored, tensors, path)
    config = dict(architectures=[cls], model_type=model_type, hidden_size=stored.hidden,
                  intermediate_size=stored.intermediate, num_hidden_layers=stored.layers,
                  num_attention_heads=stored.heads, num_key_value_heads=stored.kv_heads[0],
                  vocab_size=stored.vocab, max_position_embeddings=stored.max_context or 4096,
                  rms_norm_eps=float(str(np.float32(stored.norm_eps))),  # the float32 the file holds, as written
                  tie_word_embeddings=stored.tied_embeddings, rope_parameters=rope)
    if f"{kind}.attention.key_length" in fields:  # as the converter wrote it: where config.json gave head_dim
        config["head_dim"] = stored.head_dim
    for key, stored_as in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):  # None, not a class default
        token = fields.get(f"tokenizer.ggml.{stored_as}_token_id")
        config[f"{key}_token_id"] = token if isinstance(token, int) and 0 <= token < stored.vocab else None
    if kind in ("llama", "qwen3"):
        config["attention_bias"] = stored.qkv_bias
    if kind == "phi3":
        config.update(sliding_window=None, original_max_position_embeddings=config["max_position_embeddings"])
        if stored.rope.dims != stored.head_dim:
            rope["partial_rotary_factor"] = stored.rope.dims / stored.head_dim
    if kind in ("gemma2", "gemma3"):
        # llama.cpp scales queries by head_dim ** -0.5, but for the 27B by (hidden / heads) ** -0.5
        large = {"gemma2": 46, "gemma3": 62}[kind]
        window = next((w for w in stored.windows if w is not None), None)
        config.update(query_pre_attn_scalar=stored.hidden // stored.heads if stored.layers == large else stored.head_dim,
                      sliding_window=window, hidden_activation="gelu_pytorch_tanh",
                      layer_types=["sliding_attention" if w else "full_attention" for w in stored.windows],
                      final_logit_softcapping=stored.final_softcap)
        if kind == "gemma2":  # llama.cpp soft-caps Gemma 2 by 50 and 30 where the file says nothing
            config.update(attn_logit_softcapping=stored.attn_softcap or 50.0,
                          final_logit_softcapping=stored.final_softcap or 30.0)
        else:  # the sliding layers rotate by a theta of 10000, unscaled
            config["rope_parameters"] = {"full_attention": rope,
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return config


def _rope_parameters(fields: dict, stored: Architecture, tensors: dict[str, GGUFTensorInfo], path: Path) -> dict:
    """transformers' rope parameters of the file: linear scaling from its metadata, Llama 3's from
    the per-frequency divisors of ``rope_freqs``."""
    kind, theta = fields["general.architecture"], stored.rope.theta
    scaling = fields.get(f"{kind}.rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        if kind != "llama":
            raise InputError(f"{path}: a {kind} file with rope_freqs; quantbench reads Llama 3's rope scaling only")
        return _llama3_rope(tensors["rope_freqs.weight"], path, theta, stored.rope.dims)
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    factor = fields.get(f"{kind}.rope.scaling.factor")
    if scaling != "linear" or not isinstance(factor, (int, float)) or not factor > 0:
        raise InputError(f"{path}: rope scaling '{scaling}' (factor {factor}); quantbench reads linear and Llama 3's")
    return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}


def _llama3_rope(info: GGUFTensorInfo, path: Path, theta: float, dims: int) -> dict:
    """Llama 3's rope parameters from the divisors llama.cpp reads. Between the wavelengths it
    leaves alone and those it divides by ``factor``, a divisor's inverse is linear in the inverse
    wavelength; only the ratios of the three parameters matter, so low_freq_factor is taken as 1
    (as every Llama 3 has it) and the others follow from that line."""
    if info.type != GGMLQuantizationType.F32 or info.shape != (dims // 2,):
        raise InputError(f"{path}: tensor 'rope_freqs.weight' is {info.type.name} {list(info.shape)}; "
                         f"llama.cpp reads {dims // 2} F32 divisors")
    with open(path, "rb") as f:
        f.seek(info.offset)
        divisors = np.frombuffer(f.read(info.n_bytes), dtype=np.float32).astype(np.float64)
    factor = float(divisors.max())
    inverse_wavelength = 1.0 / (2 * np.pi * theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    between = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    fitted = None
    if factor > 1 and between.sum() >= 2:
        smooth = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inverse_wavelength[between], smooth, 1)
        if intercept < 0:
            high = 1 - 1 / intercept
            fitted = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": float(f"{high:.6g}"), "original_max_position_embeddings": int(round(-slope / intercept))}
    if fitted is None or not np.allclose(llama3_divisors(Rope(theta, "llama3", factor, 1.0, fitted["high_freq_factor"],
                                                               fitted["original_max_position_embeddings"], dims)),
                                         divisors, rtol=1e-5):
        raise InputError(f"{path}: tensor 'rope_freqs.weight' is not Llama 3's rope scaling of theta {theta:g}")
    return fitted
