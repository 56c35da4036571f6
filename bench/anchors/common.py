"""What every anchor script shares: its one-line errors, the calibration windows file, peak RSS
and the tokenizer files copied beside a dense export.

Standard library at import time (torch and safetensors are imported inside the functions), so the
anchor virtualenvs, whose stacks differ from quantbench's, can all import it. The anchor scripts
run as ``python bench/anchors/SCRIPT.py``, which puts this folder first on ``sys.path``.
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
from pathlib import Path

# Copied from the source model folder beside a dense export (those present), so it loads alone.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def die(tool: str, msg: str, code: int = 2) -> None:
    print(f"{tool}: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def peak_rss_mb() -> float:
    """This process's peak RSS so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def check_model_dir(tool: str, folder: Path) -> None:
    if not folder.is_dir() or not (folder / "config.json").is_file():
        die(tool, f"model folder not found (or has no config.json): {folder}")
    if not any(folder.glob("*.safetensors")):
        die(tool, f"no *.safetensors weights in model folder: {folder}")


def load_windows(tool: str, path: Path, model_dir: Path):
    """The int64 ``input_ids [N, L]`` of a windows file (safetensors: no pickle), checked against
    the model's vocabulary."""
    import torch
    from safetensors.torch import load_file

    if not path.is_file():
        die(tool, f"windows file not found: {path}")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # not a safetensors file, truncated, ...
        die(tool, f"cannot read windows file {path}: {type(e).__name__}: {e}")
    if "input_ids" not in tensors:
        die(tool, f"windows file {path} has no 'input_ids' tensor (has {sorted(tensors)})")
    ids = tensors["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.numel() == 0:
        die(tool, f"windows file {path}: input_ids must be a non-empty int64 [N, L] tensor, got {ids.dtype} {tuple(ids.shape)}")
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        die(tool, f"windows file {path} holds token ids outside [0, {vocab})")
    return ids


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
