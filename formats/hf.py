"""Hugging Face checkpoints: a lazy reader over safetensors files, and a streaming dense writer.

The reader validates the folder up front (config, weights, every safetensors header against its
file size) so a bad input fails with one clear line before any work starts, then reads one tensor
at a time. The writer lays out the header first and then
streams tensor bytes, so neither side ever holds the whole model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from core.architecture import Architecture
from core.errors import InputError
from formats.architecture import expected_tensors, from_transformers, transformers_config
from formats.checkpoint_format import CheckpointFormat, ExportContents

_ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_FLOAT_DTYPES = ("F32", "F16", "BF16")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
)


# Every dtype the safetensors format defines, with its width in bits (sub-byte types pack).
_ST_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
    "C64": 64,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit
_USIZE = 1 << 64


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header: each tensor's entry as the file gives it (``dtype``, ``shape``,
    ``data_offsets`` within the data section) plus ``file_offset``, where its bytes start in the
    file; and the free-form ``__metadata__`` strings."""

    tensors: dict[str, dict]
    metadata: dict[str, str]


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header without reading any tensor data.

    The checks are the safetensors library's own (its ``Metadata::validate``): header length within
    the file and the 100 MB limit, a UTF-8 JSON object, string-to-string ``__metadata__``, known
    dtypes, shapes and offsets of non-negative integers, each tensor's bytes equal to its shape times
    its dtype, and the tensors tiling the data section exactly, in order, without gaps or overlaps.
    So a file the library refuses is refused here, with one line naming the tensor or field.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise InputError(f"{path}: truncated or not a safetensors file (header length {n}, file size {size})")
            text = f.read(n)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(text.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InputError(f"{path}: corrupted safetensors header (not UTF-8 JSON)") from None
    if not isinstance(header, dict) or not text.lstrip().startswith(b"{"):
        raise InputError(f"{path}: corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{path}: corrupted safetensors header: __metadata__ must map names to strings")
    for name, info in header.items():
        _check_entry(path, name, info)
    data_size = size - 8 - n
    end = 0
    for name, info in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, stop = info["data_offsets"]
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap of {begin - end:,} bytes before it"
            raise InputError(f"{path}: corrupted safetensors header: tensor '{name}' starts at byte {begin:,} of the data "
                             f"section and {what}")
        end = stop
        info["file_offset"] = 8 + n + begin
    if end != data_size:
        raise InputError(f"{path}: {'truncated' if end > data_size else 'damaged'}: the header's tensors take "
                         f"{end:,} bytes of data, the file holds {data_size:,}")
    return SafetensorsHeader(header, metadata)


def read_json(path: Path) -> object:
    """A JSON file, or one line saying why it is not one (deep nesting and NaN included)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: invalid JSON (not UTF-8 text)") from None
    except RecursionError:
        raise InputError(f"{path}: invalid JSON (nested too deeply)") from None
    except ValueError as e:
        raise InputError(f"{path}: invalid JSON ({getattr(e, 'msg', e)})") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _check_entry(path: Path, name: str, info: object) -> None:
    """One tensor entry: a dtype the format defines, a shape of non-negative integers, and two
    offsets whose distance is exactly the bytes that shape takes."""
    def fail(what: str) -> InputError:
        return InputError(f"{path}: corrupted safetensors header: tensor '{name}' {what}")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise fail("needs 'dtype', 'shape' and 'data_offsets'")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_BITS:
        raise fail(f"has dtype {json.dumps(dtype)[:40]}, not a safetensors dtype")
    if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
        raise fail(f"has shape {json.dumps(shape)[:60]}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_usize(o) for o in offsets):
        raise fail(f"has data_offsets {json.dumps(offsets)[:60]}, not two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise fail(f"ends (byte {end:,}) before it begins (byte {begin:,})")
    bits = _ST_BITS[dtype] * math.prod(shape)
    if bits >= _USIZE or bits % 8:
        raise fail(f"of shape {shape} in {dtype} is not a whole number of bytes the format can hold")
    if end - begin != bits // 8:
        raise fail(f"has {end - begin:,} bytes, but its shape {shape} in {dtype} needs {bits // 8:,}")


def _is_usize(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _USIZE


class HFCheckpoint:
    """A validated Hugging Face model folder whose tensors are read one at a time."""

    def __init__(self, path: Path, config: dict, arch: Architecture, headers: dict[Path, dict[str, dict]]):
        self.path = path
        self.config = config
        self.arch = arch  # what every stage reads of the model, rather than the raw config
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
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise InputError(f"{config_path}: expected a JSON object")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            extra = f" ({', '.join(pickles)} are pickle files, which quantbench never loads)" if pickles else ""
            raise InputError(f"{path}: no *.safetensors weights in the model folder{extra}")
        if "vision_config" in config:
            raise InputError(f"{config_path}: a {config.get('model_type')} model with a vision tower (vision_config); "
                             "quantbench takes text decoders: save its language model alone (for Gemma 3, as "
                             "Gemma3ForCausalLM, model_type gemma3_text)")
        headers = {f: read_safetensors_header(f).tensors for f in files}
        where = str(config_path)
        hf = transformers_config(config, where)
        ckpt = cls(path, config, from_transformers(hf, config, where), headers)
        ckpt._check_against(hf, headers)
        return ckpt

    def _check_against(self, hf, headers: dict[Path, dict[str, dict]]) -> None:
        """Refuse a folder whose tensors are not the model its config.json describes: every tensor
        the architecture needs, present once, with its shape, in a float dtype, and nothing else
        (but the rotary frequencies old checkpoints carry), so that no conversion or evaluation
        starts on a checkpoint that would fail, or load wrongly, later."""
        quantization = self.config.get("quantization_config")
        if quantization is not None:
            method = quantization.get("quant_method", "quantized") if isinstance(quantization, dict) else "quantized"
            raise InputError(f"{self.path}: a {method} checkpoint (quantization_config in config.json); "
                             "quantbench reads float checkpoints (F32, F16, BF16)")
        seen: dict[str, Path] = {}
        for file, header in headers.items():
            for name in header:
                if name in seen:
                    raise InputError(f"{self.path}: tensor '{name}' is in both {seen[name].name} and {file.name}")
                seen[name] = file
        if not seen:
            raise InputError(f"{self.path}: the safetensors files hold no tensors")
        expected, optional = expected_tensors(hf, str(self.path / "config.json"))
        missing = [n for n in expected if n not in seen and n not in optional]
        if missing:
            more = f"; {len(missing) - 1} more are missing" if len(missing) > 1 else ""
            raise InputError(f"{self.path}: no tensor '{missing[0]}' in the checkpoint ({self.architecture} needs it{more})")
        extra = [n for n in seen if n not in expected and not n.endswith("rotary_emb.inv_freq")]
        if extra:
            more = f"; {len(extra) - 1} more are unexpected" if len(extra) > 1 else ""
            raise InputError(f"{self.path}: tensor '{extra[0]}' in {seen[extra[0]].name} is not part of the "
                             f"{self.architecture} that config.json describes{more}")
        for name in seen:
            dtype = self._info[name]["dtype"]
            if name in expected and self.shape(name) != expected[name]:
                raise InputError(f"{self.path}: tensor '{name}' has shape {list(self.shape(name))}, "
                                 f"the config gives {list(expected[name])}")
            if dtype not in _FLOAT_DTYPES:
                raise InputError(f"{self.path}: tensor '{name}' is {dtype}; a float checkpoint holds F32, F16 or BF16")

    @property
    def names(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        stored = self._info[name]["dtype"]
        if stored not in _ST_DTYPES:
            raise InputError(f"{self._file_of[name]}: tensor '{name}' is {stored}, a dtype quantbench does not read")
        return _ST_DTYPES[stored]

    def payload(self, name: str) -> torch.Tensor:
        """What the tensor holds, for readers that also take quantized checkpoints (there: codes)."""
        return self.tensor(name)

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor with a plain file read rather than a memory map: pages of a mapped file
        stay resident, so mapping a model larger than RAM would grow the process to its size."""
        info = self._info[name]
        begin, end = info["data_offsets"]
        with open(self._file_of[name], "rb") as f:
            f.seek(info["file_offset"])
            data = bytearray(f.read(end - begin))
        dtype = self.dtype(name)
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

    @property
    def label(self) -> str:
        """What the checkpoint stores, for a report: its dtypes, e.g. ``bfloat16``."""
        return "/".join(sorted({str(self.dtype(n)).removeprefix("torch.") for n in self.names}))

    @property
    def bits_per_weight(self) -> float:
        return 8 * sum(math.prod(self.shape(n)) * self.dtype(n).itemsize for n in self.names) / \
            sum(math.prod(self.shape(n)) for n in self.names)

    @property
    def tokenizer_dir(self) -> Path:
        """The folder the tokenizer files are in."""
        return self.path

    @property
    def tokenizer_config(self) -> dict:
        return self.side_file("tokenizer_config.json")

    def side_file(self, name: str) -> dict:
        """A JSON object beside the weights (tokenizer.json, tokenizer_config.json), {} if absent."""
        path = self.path / name
        if not path.is_file():
            return {}
        data = read_json(path)
        if not isinstance(data, dict):
            raise InputError(f"{path}: expected a JSON object")
        return data

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
    tensor is appended as it arrives, in plan order. The folder is made at ``path`` (commands make
    it under a temporary name and rename it when complete: formats/outputs.py). ``config`` is the
    folder's config.json; the source's tokenizer and generation files are copied beside it.
    """

    def __init__(self, path: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], config: dict, source: HFCheckpoint):
        self.path = path
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        self._plan = plan
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in plan:
            nbytes = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data section 8-byte aligned
        self._file = open(path / "model.safetensors", "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self.source = source
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor, cast: bool = False) -> None:
        """Append the next tensor of the plan; with ``cast``, a tensor of another dtype is cast to
        the planned one. Written a slice of rows at a time, each cast alone and handed to the file
        as it is, so an 8B model's embedding costs no second copy (1 GiB in float16)."""
        if self._next == len(self._plan) or self._plan[self._next][0] != name:
            expected = self._plan[self._next][0] if self._next < len(self._plan) else "nothing more"
            raise RuntimeError(f"tensor '{name}' arrived out of plan order (expected '{expected}')")
        _, dtype, shape = self._plan[self._next]
        if (tensor.dtype != dtype and not cast) or tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(f"tensor '{name}' is {tensor.dtype} {tuple(tensor.shape)}, planned {dtype} {tuple(shape)}")
        self._next += 1
        rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.reshape(1, -1)
        step = max(1, _WRITE_SLICE // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            self._file.write(rows[start : start + step].to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy())

    def finish(self) -> Path:
        self._file.close()
        if self._next != len(self._plan):
            raise RuntimeError(f"{self.path.name} export incomplete: {self._next} of {len(self._plan)} tensors written")
        self.source.copy_side_files(self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        shutil.rmtree(self.path, ignore_errors=True)


_WRITE_SLICE = 2**24  # values written at a time by ``SafetensorsFolderWriter.write``


def export_config(source: HFCheckpoint, dtype: torch.dtype) -> dict:
    """The source's config.json for an export stored in ``dtype``, without any quantization_config."""
    config = dict(source.config)
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


class DenseSafetensorsWriter:
    """A float checkpoint: every tensor as given, cast to ``dtype``."""

    def __init__(self, path: Path, plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, source: HFCheckpoint):
        self.dtype = dtype
        self._folder = SafetensorsFolderWriter(path, [(n, dtype, tuple(s)) for n, s in plan], export_config(source, dtype), source)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._folder.write(name, tensor, cast=True)

    def finish(self) -> Path:
        return self._folder.finish()

    def abort(self) -> None:
        self._folder.abort()


class DenseFormat(CheckpointFormat):
    """The ``safetensors`` export: the weights as evaluated, in float32, for any variant."""

    name = "safetensors"
    dense = True

    def writer(self, dest: Path, contents: ExportContents) -> DenseSafetensorsWriter:
        source = contents.source
        return DenseSafetensorsWriter(dest, [(n, source.shape(n)) for n in contents.names], torch.float32, source)


FORMAT = DenseFormat()


def load_causal_lm(ckpt: HFCheckpoint) -> torch.nn.Module:
    """The whole model in transformers, float32, for evaluation and calibration."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # our own progress bars cover the long steps
    if not isinstance(ckpt, HFCheckpoint):  # a quantized source: its weights as it dequantizes them
        from formats.architecture import transformers_config

        config = transformers_config(ckpt.config, str(ckpt.path))
        return model_from_state(config, {name: ckpt.tensor(name) for name in ckpt.names})
    try:  # a folder on disk (formats/hub.py fetched any id): transformers must not ask the Hub about it
        model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise InputError(f"{ckpt.path}: transformers cannot load this model ({str(e).splitlines()[0]})") from None
    return model.eval()


def load_tokenizer(ckpt: HFCheckpoint):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ckpt.tokenizer_dir, local_files_only=True)
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
