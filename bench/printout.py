"""How the engine and server benchmarks print: a row per side measured, then the ratios against
the baselines, then the checks; or all of it as one JSON object."""

from __future__ import annotations

import json


def print_result(rows: dict, ratios: dict[str, float], checks: dict[str, bool] | None = None, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps({"rows": rows, "ratios": ratios, **({"checks": checks} if checks is not None else {})}, indent=2))
        return
    for name, row in rows.items():
        print(f"{name}: {json.dumps(row) if isinstance(row, dict) else row}")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}")
    for name, ok in (checks or {}).items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
