"""Hugging Face checkpoints: a lazy reader over safetensors files, and a streaming dense writer.

The reader validates the folder up front (config, weights, every safetensors header against its
file size) so a bad input fails with one clear line before any work starts, then reads one tensor
at a time. The writer lays out the header first and then
streams tensor bytes, so neither side ever holds the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Iterable

import torch
from quant.types import InputError

_ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
)


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header without loading data; raise InputError if damaged.

    Each tensor's entry gains ``file_offset``, where its bytes start in the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise InputError(f"{path}: truncated or not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InputError(f"{path}: corrupted safetensors header") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupted safetensors header")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], info["shape"]
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: corrupted safetensors header entry for tensor '{name}'") from None
        if end > data_size:
            raise InputError(
                f"{path}: truncated: tensor '{name}' ends at byte {end} of the data section, "
                f"but the file holds only {data_size}"
            )
        if dtype not in _ST_DTYPES:
            raise InputError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        expected = _ST_DTYPES[dtype].itemsize * _numel(shape)
        if end - begin != expected:
            raise InputError(f"{path}: tensor '{name}' has {end - begin} bytes, its shape {shape} needs {expected}")
        info["file_offset"] = 8 + n + begin
    return header


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class HFCheckpoint:
    """A validated Hugging Face model folder whose tensors are read one at a time."""

    def __init__(self, path: Path, config: dict, headers: dict[Path, dict[str, dict]]):
        self.path = path
        self.config = config
        self._file_of = {name: file for file, header in headers.items() for name in header}
        self._info = {name: info for header in headers.values() for name, info in header.items()}

    @classmethod
    def open(cls, path: str | os.PathLike) -> "HFCheckpoint":
        path = Path(path)
        if not path.exists():
            raise InputError(f"{path}: model folder not found")
        if not path.is_dir():
            raise InputError(f"{path}: expected a model folder (with config.json and *.safetensors)")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise InputError(f"{path}: no config.json in the model folder")
        try:
            config = json.loads(config_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"{config_path}: invalid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
        if not isinstance(config, dict):
            raise InputError(f"{config_path}: expected a JSON object")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            extra = f" ({', '.join(pickles)} are pickle files, which quantbench never loads)" if pickles else ""
            raise InputError(f"{path}: no *.safetensors weights in the model folder{extra}")
        headers = {f: read_safetensors_header(f) for f in files}
        return cls(path, config, headers)

    @property
    def names(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _ST_DTYPES[self._info[name]["dtype"]]

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor with a plain file read rather than a memory map: pages of a mapped file
        stay resident, so mapping a model larger than RAM would grow the process to its size."""
        info = self._info[name]
        begin, end = info["data_offsets"]
        with open(self._file_of[name], "rb") as f:
            f.seek(info["file_offset"])
            data = bytearray(f.read(end - begin))
        dtype = _ST_DTYPES[info["dtype"]]
        if not data:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(info["shape"])

    @property
    def linear_modules(self) -> list[str]:
        """The decoder's Linear modules (``is_linear_weight``), by module name, in checkpoint order."""
        return [n.removesuffix(".weight") for n in self.names if is_linear_weight(n, self.shape(n))]

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or ["?"]
        return archs[0]

    def copy_side_files(self, dest: Path) -> None:
        """Copy the tokenizer and generation files that travel with any export of this model."""
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, dest / name)


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``name`` is a decoder Linear weight: what weight quantization targets by default.

    Embeddings and the output head are not Linear layers of the decoder; quantizers conventionally
    leave them alone (they hurt accuracy most and cost little memory in the models that matter).
    """
    return (
        len(shape) == 2
        and name.endswith(".weight")
        and "norm" not in name
        and "embed" not in name
        and not name.startswith("lm_head")
    )


class SafetensorsFolderWriter:
    """Streams tensors into ``model.safetensors`` of a checkpoint folder transformers can load.

    The header is written from the planned names, dtypes and shapes before any data, then each
    tensor is appended as it arrives, in plan order. The folder is built under a temporary name
    and renamed when complete, so a failed run never leaves a half-written checkpoint. ``config``
    is the folder's config.json; the source's tokenizer and generation files are copied beside it.
    """

    def __init__(self, dest: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], config: dict, source: HFCheckpoint):
        self.dest = dest
        self.tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self._plan = plan
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in plan:
            nbytes = dtype.itemsize * _numel(shape)
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data section 8-byte aligned
        self._file = open(self.tmp / "model.safetensors", "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        (self.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self.source = source
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next == len(self._plan) or self._plan[self._next][0] != name:
            expected = self._plan[self._next][0] if self._next < len(self._plan) else "nothing more"
            raise RuntimeError(f"tensor '{name}' arrived out of plan order (expected '{expected}')")
        _, dtype, shape = self._plan[self._next]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(f"tensor '{name}' is {tensor.dtype} {tuple(tensor.shape)}, planned {dtype} {tuple(shape)}")
        self._next += 1
        self._file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def finish(self) -> Path:
        self._file.close()
        if self._next != len(self._plan):
            raise RuntimeError(f"{self.dest.name} export incomplete: {self._next} of {len(self._plan)} tensors written")
        self.source.copy_side_files(self.tmp)
        shutil.rmtree(self.dest, ignore_errors=True)
        self.tmp.rename(self.dest)
        return self.dest

    def abort(self) -> None:
        self._file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def export_config(source: HFCheckpoint, dtype: torch.dtype) -> dict:
    """The source's config.json for an export stored in ``dtype``, without any quantization_config."""
    config = dict(source.config)
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


class DenseSafetensorsWriter:
    """A float checkpoint: every tensor as given, cast to ``dtype``."""

    def __init__(self, dest: Path, plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, source: HFCheckpoint):
        self.dtype = dtype
        self._folder = SafetensorsFolderWriter(dest, [(n, dtype, tuple(s)) for n, s in plan], export_config(source, dtype), source)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._folder.write(name, tensor.to(self.dtype))

    def finish(self) -> Path:
        return self._folder.finish()

    def abort(self) -> None:
        self._folder.abort()


def load_causal_lm(ckpt: HFCheckpoint) -> torch.nn.Module:
    """The whole model in transformers, float32, for evaluation and calibration."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # our own progress bars cover the long steps
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise InputError(f"{ckpt.path}: transformers cannot load this model ({str(e).splitlines()[0]})") from None
    return model.eval()


def load_tokenizer(ckpt: HFCheckpoint):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ckpt.path)
    except (ValueError, KeyError, OSError) as e:
        raise InputError(f"{ckpt.path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None


def model_from_state(config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A transformers model with exactly these weights (tied output head included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"variant weights do not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval()
