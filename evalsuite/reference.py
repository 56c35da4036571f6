"""The original's next-token distributions on the evaluation windows, kept in a folder so that
each variant is compared with them without the original loaded or recomputed: one safetensors
file per window holding its ``calib.distributions.TopK``, and ``reference.json`` with the top ``k``,
a fingerprint of the windows and the key of the model they came from (recipes/resume.py), so a
store is never read against other text or another original.

``k`` is the whole vocabulary wherever that fits in ``EXACT_BYTES`` (then every score equals the
in-memory one); beyond, the top ``TOP_K`` tokens and the rest, as llama.cpp's KL-divergence base
file keeps the original (it keeps every token, as uint16).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from calib.distributions import TopK
from core.errors import InputError
from formats.outputs import Outputs

EXACT_BYTES = 2**30
TOP_K = 1024
_META = "reference.json"


class ReferenceStore:
    """A store's distributions, window by window, in the order of the windows it was made on."""

    def __init__(self, folder: Path, windows: torch.Tensor, key: str | None = None):
        meta_path = folder / _META
        if not meta_path.is_file():
            raise InputError(f"{folder}: not a reference store (no {_META})")
        self.folder = folder
        self.meta = json.loads(meta_path.read_text())
        if self.meta["windows"] != _fingerprint(windows):
            raise InputError(f"{folder}: its reference distributions were computed on other evaluation windows")
        if key is not None and self.meta["key"] != key:
            raise InputError(f"{folder}: its reference distributions are another model's")

    @classmethod
    def find(cls, folder: Path, windows: torch.Tensor, key: str) -> "ReferenceStore | None":
        """The store in ``folder`` if it was made on these windows by the model ``key`` names."""
        try:
            return cls(folder, windows, key)
        except InputError:
            return None

    def window(self, index: int) -> TopK:
        return TopK.from_tensors(load_file(self.folder / _window_file(index)))

    @property
    def top_k(self) -> int:
        return self.meta["top_k"]


class ReferenceWriter:
    """Writes a store under a temporary name, which ``outputs.commit`` makes its own once ``finish``
    has marked every window in."""

    def __init__(self, outputs: Outputs, folder: Path, windows: torch.Tensor, vocab: int, top_k: int | None = None,
                 key: str = ""):
        self.staged = outputs.stage(folder)
        self.staged.mkdir(parents=True)
        positions = windows.shape[0] * (windows.shape[1] - 1)
        exact = positions * vocab * 8 <= EXACT_BYTES  # an int32 id and a float32 log-probability each
        self.top_k = top_k or (vocab if exact else TOP_K)
        self.meta = {"windows": _fingerprint(windows), "top_k": self.top_k, "key": key}

    def add(self, index: int, logp: torch.Tensor) -> None:
        """Window ``index``'s full log-probabilities ``[positions, vocab]``."""
        save_file(TopK.of(logp, self.top_k).to("cpu").tensors(), self.staged / _window_file(index))

    def finish(self) -> None:
        (self.staged / _META).write_text(json.dumps(self.meta) + "\n")


def _fingerprint(windows: torch.Tensor) -> str:
    ids = windows.to(torch.int64).contiguous()
    return f"{tuple(ids.shape)} " + hashlib.sha256(ids.numpy().tobytes()).hexdigest()


def _window_file(index: int) -> str:
    return f"window-{index:06d}.safetensors"
