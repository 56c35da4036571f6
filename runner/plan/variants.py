"""The candidates a recipe run offers the planner: each variant of its ``report.json`` with its
bytes, its KV-cache type, the files an engine would load, and whether it is inside the recipe's
accuracy budget (the report's own verdict, ``recommendation.misses``).

Bytes are the run's own when the run quantized the model being planned (the report's size is
every tensor at the bits it is stored with). A run of another model (a recipe tried on the small
model first) lends its *method*: the same format is counted on the planned model's real tensor
list by ``quantize fit``'s calculator, since bits per weight do not carry across models whose
16-bit embeddings are a different share; its accuracy is then the smaller model's, and the plan
says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import InputError
from runner.fit.memfit import weights_bytes
from runner.fit.model_shape import ModelShape

# the report's KV-cache labels (quant/kv_cache.py KVCacheSpec.label) -> quantize fit's KV dtypes
_KV_LABELS = {"kv-fp8e4m3": "fp8", "kv-q8_0": "int8", "kv-q4_0": "int4"}
# the exports an engine loads, by the name of the variant's output
SERVABLE = ("compressed-tensors", "gptq", "awq", "gguf")


@dataclass(frozen=True)
class PlanVariant:
    name: str
    method: str
    weights_bytes: float  # of the planned model
    kv_cache: str  # a runner.fit.memfit.KV_BITS name
    exports: dict[str, Path] = field(default_factory=dict)  # format -> file or folder
    misses: tuple[str, ...] = ()  # the accuracy budget's limits it misses (empty: inside, or no budget)
    kld: float | None = None
    measured: bool = True  # bytes measured on the planned model (False: the method counted on it)
    original: bool = False

    @property
    def within_budget(self) -> bool:
        return not self.misses


def model_variant(shape: ModelShape, weights: str = "bf16", kv_cache: str = "fp16", where: Path | None = None) -> PlanVariant:
    """The model as given, when there is no recipe run: its stored bytes (a GGUF file, a quantized
    folder) or its 16-bit weights. A GGUF file or a folder in a format an engine loads (``where``)
    is the file the engine is given."""
    exports = {}
    if where is not None and shape.stored_as is not None:
        kind = "gguf" if shape.stored_as == "gguf file" else shape.stored_as.removesuffix(" checkpoint")
        if kind in SERVABLE:
            exports[kind] = where.parent if where.name == "config.json" else where
    return PlanVariant(shape.stored_as or weights, shape.stored_as or weights, weights_bytes(shape, weights), kv_cache,
                       exports, original=shape.stored_bytes is None)


def read_variants(run: Path, shape: ModelShape) -> tuple[list[PlanVariant], str | None]:
    """The variants of the recipe run in ``run`` (a folder holding report.json, or the file), the
    original first; and the budget the report checked them against, in words (None: none given)."""
    path = run / "report.json" if run.is_dir() else run
    if not path.is_file():
        raise InputError(f"--variants {run}: no report.json there (give a recipe run's output folder)")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise InputError(f"{path}: not a quantbench report.json (no 'variants' list)") from None
    return report_variants(report, path.parent, shape, str(path))


def report_variants(report: dict, base: Path, shape: ModelShape, where: str) -> tuple[list[PlanVariant], str | None]:
    """``read_variants`` of a report already in memory (``Report.as_dict()``), its files relative
    to ``base``; ``where`` names it in errors. The recipe job plans its own report this way,
    before report.json is written."""
    try:
        rows, recommendation = report["variants"], report.get("recommendation") or {}
        misses = recommendation.get("misses") or {}
        budget = recommendation.get("budget")
    except (KeyError, TypeError, AttributeError):
        raise InputError(f"{where}: not a quantbench report.json (no 'variants' list)") from None
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(_variant(row, shape, base, misses.get(row["name"], []), i == 0))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: variant {i}: unreadable ({e})") from None
    if not out:
        raise InputError(f"{where}: no variants")
    words = ", ".join(f"{k} {v:g}" for k, v in budget.items() if v is not None) if isinstance(budget, dict) else None
    return out, words or None


def _variant(row: dict, shape: ModelShape, base: Path, missed: list[str], original: bool) -> PlanVariant:
    method = str(row["method"])
    kv = next((_KV_LABELS[w] for w in method.split() if w in _KV_LABELS), "fp16")
    exports = {}
    for f in row.get("files") or []:
        rel = Path(f["path"])
        kind = "gguf" if rel.suffix == ".gguf" else rel.name
        exports[kind] = base / rel
    measured_bytes = float(row["size_mb"]) * 1e6
    parameters = measured_bytes * 8 / float(row["bits_per_weight"])
    same_model = abs(parameters / shape.parameters - 1) < 0.005
    if same_model:
        size, measured = measured_bytes, True
    else:
        fmt = _format_of(method, original)
        size = weights_bytes(shape, fmt[0], fmt[1]) if fmt else float(row["bits_per_weight"]) * shape.parameters / 8
        measured = False
    return PlanVariant(str(row["name"]), method, size, kv, exports, tuple(missed), row.get("kld"), measured, original)


def _format_of(method: str, original: bool) -> tuple[str, int] | None:
    """quantize fit's weight format and group size for a report's method, for counting it on
    another model; None where no format says it (the run's bits per weight are used)."""
    if original or method.startswith("source"):
        return "bf16", 128
    words = method.split()
    if words[0] == "gguf" and len(words) > 1:
        return words[1].lower(), 128
    label = words[1] if len(words) > 1 else ""
    m = re.match(r"(?:int|fp)(\d+)(?:-g(\d+))?(?:-channel)?-?(sym|asym)?", label)
    if not m:
        return None
    bits, group = int(m.group(1)), int(m.group(2) or 128)
    if bits == 8:
        return ("fp8" if label.startswith("fp8") else "int8"), group
    if bits == 4:
        if words[0] in ("gptq", "awq"):
            return words[0], group
        return ("awq" if m.group(3) == "asym" else "int4"), group
    return None
