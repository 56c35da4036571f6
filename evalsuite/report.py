"""The comparison report: one row per variant against the original, as JSON, Markdown and a table."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from evalsuite.metrics import Scores


@dataclass
class VariantRow:
    name: str
    method: str
    bits_per_weight: float  # whole model, every tensor counted at the bits it is stored with
    size_mb: float  # parameters x bits per weight, in 10^6 bytes
    scores: Scores
    ppl_delta: float = 0.0  # variant minus original
    seconds: float = 0.0
    files: list[dict] = field(default_factory=list)  # {"path": relative to the report, "bytes": int}
    # outlier-aware passes: per Linear module, {"outlier_channels", "max_abs", "max_over_median"}
    input_statistics: dict[str, dict] = field(default_factory=dict)

    def as_dict(self) -> dict:
        row = asdict(self)
        row.update(row.pop("scores"))
        return row


@dataclass
class Report:
    model: str
    eval_text: str
    windows: int
    window: int
    rows: list[VariantRow]

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "evaluation": {"text": self.eval_text, "windows": self.windows, "window": self.window},
            "variants": [r.as_dict() for r in self.rows],
        }


_COLUMNS = ("variant", "method", "bpw", "size MB", "PPL", "ΔPPL", "KLD", "top-1", "time s")


def _cells(row: VariantRow) -> list[str]:
    s = row.scores
    return [
        row.name,
        row.method,
        f"{row.bits_per_weight:.2f}",
        f"{row.size_mb:.2f}",
        f"{s.ppl:.3f}",
        f"{round(row.ppl_delta, 3) + 0.0:+.3f}",  # no "-0.000"
        "—" if s.kld is None else f"{s.kld:.5f}",
        "—" if s.top1 is None else f"{100 * s.top1:.2f}%",
        f"{row.seconds:.1f}",
    ]


def markdown(report: Report) -> str:
    lines = [
        "# quantbench report",
        "",
        f"Model: `{report.model}`  ",
        f"Evaluation: `{report.eval_text}`, {report.windows} windows of {report.window} tokens",
        "",
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in report.rows]
    lines += [
        "",
        "PPL: perplexity on the evaluation text. KLD: mean KL divergence from the original model's "
        "next-token distribution (nats per token). top-1: share of positions where the variant's most "
        "likely next token is the original's. bpw: bits per weight over all tensors.",
        "",
        "## Files",
        "",
    ]
    for r in report.rows:
        for f in r.files:
            lines.append(f"- `{f['path']}` ({f['bytes'] / 1e6:.2f} MB)")
    for r in report.rows:
        if r.input_statistics:
            lines += ["", *_outlier_section(r)]
    return "\n".join(lines) + "\n"


_WORST = 5


def _outlier_section(row: VariantRow) -> list[str]:
    """The Linears whose calibration inputs are least flat: where activation quantization hurts
    most, and where 16-bit outlier columns were kept. The full list is in report.json."""
    stats = row.input_statistics
    total = sum(s["outlier_channels"] for s in stats.values())
    worst = sorted(stats.items(), key=lambda kv: -kv[1]["max_over_median"])[:_WORST]
    lines = [
        f"## Activation outliers: {row.name}",
        "",
        f"{total} outlier input channels over {len(stats)} Linear modules; the {len(worst)} with the "
        "largest ratio of the largest per-channel |x| to the median one:",
        "",
        "| module | outlier channels | max abs | max/median |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{name}` | {s['outlier_channels']} | {s['max_abs']:.2f} | {s['max_over_median']:.1f} |" for name, s in worst]
    return lines


def table(report: Report) -> Table:
    t = Table(title=f"{report.model}: {report.windows} x {report.window} tokens of {Path(report.eval_text).name}")
    for i, c in enumerate(_COLUMNS):
        t.add_column(c, justify="left" if i < 2 else "right")
    for r in report.rows:
        t.add_row(*_cells(r))
    return t


def write_report(report: Report, out_dir: Path) -> None:
    """Write report.json and report.md, each under a temporary name first."""
    _write_atomic(out_dir / "report.json", json.dumps(report.as_dict(), indent=2) + "\n")
    _write_atomic(out_dir / "report.md", markdown(report))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
