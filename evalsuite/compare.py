"""Two runs' reports side by side (``quantize compare RUN_A RUN_B``): the same variant names on one
line, so a change of recipe, calibration text, model or machine shows as a difference per variant.
Reads only report.json (plain JSON, never a pickle)."""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import InputError

# (heading, report.json field, format): what a reader compares first
FIELDS = (("size MB", "size_mb", "{:.2f}"), ("PPL", "ppl", "{:.3f}"), ("KLD", "kld", "{:.5f}"), ("top-1", "top1", "{:.2%}"))


def load_report(run: Path) -> dict:
    """A run's report.json, from the run folder or the file itself."""
    path = run / "report.json" if run.is_dir() else run
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"{path}: cannot read the report ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{path}: not a quantbench report.json (not JSON)") from None
    if not isinstance(report, dict) or not isinstance(report.get("variants"), list) or \
            not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in report["variants"]):
        raise InputError(f"{path}: not a quantbench report.json (no 'variants' list)")
    return report


def side_by_side(a: dict, b: dict) -> tuple[list[str], list[list[str]]]:
    """One row per variant name in either report, in A's order then B's new ones: each field in A,
    in B, and each task's accuracy in both."""
    rows_a = {v["name"]: v for v in a["variants"]}
    rows_b = {v["name"]: v for v in b["variants"]}
    names = list(rows_a) + [n for n in rows_b if n not in rows_a]
    tasks = list(dict.fromkeys(t for v in a["variants"] + b["variants"] for t in (v.get("tasks") or {})))
    head = ["variant"] + [f"{h} {side}" for h, _, _ in FIELDS for side in ("A", "B")] + \
           [f"{t} {side}" for t in tasks for side in ("A", "B")]
    rows = []
    for name in names:
        cells = [name]
        for _, key, fmt in FIELDS:
            cells += [_cell(rows_a.get(name, {}).get(key), fmt), _cell(rows_b.get(name, {}).get(key), fmt)]
        for t in tasks:
            cells += [_cell(((r.get(name) or {}).get("tasks") or {}).get(t, {}).get("accuracy"), "{:.1%}")
                      for r in (rows_a, rows_b)]
        rows.append(cells)
    return head, rows


def _cell(value: object, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "—"


def markdown(a_path: Path, b_path: Path, head: list[str], rows: list[list[str]]) -> str:
    lines = ["# quantbench: two runs side by side", "", f"A: `{a_path}`  ", f"B: `{b_path}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
