"""The GPU catalog (``runner/fit/presets/gpus.json``): memory, memory bandwidth and dense BF16 compute,
the three numbers that decide what fits and how fast it can go; and for planning a deployment
(``quantize plan``) what a GPU-hour costs and how fast GPUs talk to each other (inside a node and
between nodes). ``custom:MEM,BANDWIDTH[,TFLOPS]`` (GiB, GB/s, dense TFLOP/s) describes any other
device, a laptop's CPU included."""

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
    price_per_hour: float | None = None  # US dollars per GPU-hour; None where unknown
    interconnect: float | None = None  # bytes per second one way between GPUs of a node; None: one device
    network: float | None = None  # bytes per second per GPU between nodes
    gpus_per_node: int = 1


@cache
def catalog() -> dict[str, GPU]:
    entries = json.loads((PRESETS / "gpus.json").read_text(encoding="utf-8"))
    return {
        name: GPU(name, int(e["memory_gib"] * GIB), e["bandwidth_gbs"] * 1e9, e["bf16_tflops"] * 1e12 if e.get("bf16_tflops") else None,
                  e["vendor"], e.get("price_per_hour"), _gbs(e.get("interconnect_gbs")), _gbs(e.get("network_gbs")),
                  e.get("gpus_per_node", 1))
        for name, e in entries.items() if not name.startswith("_")
    }


def _gbs(value: float | None) -> float | None:
    return value * 1e9 if value else None


_CUSTOM = re.compile(r"^custom:([0-9.]+),([0-9.]+)(?:,([0-9.]+))?$")


_LISTED = re.compile(r"\s*(custom:[^,]*(?:,\s*[0-9.]+){0,2}|[^,]+)\s*(?:,|$)")


def split_gpus(text: str) -> list[str]:
    """``l4,a10`` as ``["l4", "a10"]``, a ``custom:MEM,BANDWIDTH[,TFLOPS]`` entry kept whole
    (its commas are its own): ``custom:48,960,100,l4`` is two devices."""
    return [m.group(1).replace(" ", "") for m in _LISTED.finditer(text) if m.group(1).strip()]


def resolve_gpu(name: str) -> GPU:
    """A catalog GPU by name, or ``custom:MEM_GIB,BANDWIDTH_GBS[,TFLOPS]``."""
    m = _CUSTOM.match(name)
    if m:
        memory, bandwidth = float(m.group(1)), float(m.group(2))
        tflops = float(m.group(3)) if m.group(3) else None
        if not (0 < memory <= 100_000 and 0 < bandwidth <= 1_000_000) or (tflops is not None and not 0 < tflops <= 1_000_000):
            raise InputError(f"--gpu {name}: memory (GiB), bandwidth (GB/s) and TFLOPS must be positive and plausible")
        return GPU(name, int(memory * GIB), bandwidth * 1e9, tflops * 1e12 if tflops else None)
    if name.startswith("custom:"):
        raise InputError(f"--gpu {name}: expected custom:MEM_GIB,BANDWIDTH_GBS[,TFLOPS], e.g. custom:48,960")
    known = catalog()
    key = name.lower().replace(" ", "-")
    starting = sorted(k for k in known if k.startswith(key))
    if key in known or len(starting) == 1:  # H200 is h200-141gb, the one catalog GPU it can mean
        return known[key if key in known else starting[0]]
    if starting:
        raise InputError(f"--gpu {name}: {len(starting)} GPUs of the catalog: {', '.join(starting)}; name one")
    raise InputError(f"--gpu {name}: unknown GPU{suggest_names(key, sorted(known))}")
