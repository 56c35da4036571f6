"""The GPU catalog (``runner/fit/presets/gpus.json``): memory, memory bandwidth and dense BF16 compute,
the three numbers that decide what fits and how fast it can go. ``custom:MEM,BANDWIDTH`` (GiB,
GB/s) describes any other device."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache

from core.errors import InputError
from runner.fit.model_shape import PRESETS, suggest_names

GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes per second
    flops: float | None  # dense BF16 FLOP/s; None where unknown (custom devices)
    vendor: str = "custom"


@cache
def catalog() -> dict[str, GPU]:
    entries = json.loads((PRESETS / "gpus.json").read_text(encoding="utf-8"))
    return {
        name: GPU(name, int(e["memory_gib"] * GIB), e["bandwidth_gbs"] * 1e9, e["bf16_tflops"] * 1e12 if e.get("bf16_tflops") else None,
                  e["vendor"])
        for name, e in entries.items() if not name.startswith("_")
    }


_CUSTOM = re.compile(r"^custom:([0-9.]+),([0-9.]+)$")


def resolve_gpu(name: str) -> GPU:
    """A catalog GPU by name, or ``custom:MEM_GIB,BANDWIDTH_GBS``."""
    m = _CUSTOM.match(name)
    if m:
        memory, bandwidth = float(m.group(1)), float(m.group(2))
        if not (0 < memory <= 100_000 and 0 < bandwidth <= 1_000_000):
            raise InputError(f"--gpu {name}: memory (GiB) and bandwidth (GB/s) must be positive and plausible")
        return GPU(name, int(memory * GIB), bandwidth * 1e9, None)
    if name.startswith("custom:"):
        raise InputError(f"--gpu {name}: expected custom:MEM_GIB,BANDWIDTH_GBS, e.g. custom:48,960")
    gpu = catalog().get(name.lower())
    if gpu is None:
        raise InputError(f"--gpu {name}: unknown GPU{suggest_names(name, sorted(catalog()))}")
    return gpu
