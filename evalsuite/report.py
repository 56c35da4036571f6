"""The comparison report: one row per variant against the original, as JSON, Markdown, an HTML page
with a chart, and a table on the terminal."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path

from rich.table import Table
from rich.text import Text

from evalsuite.chart import heatmap_svg, size_fidelity_svg, speed_fidelity_svg, task_accuracy_svg
from evalsuite.metrics import Scores
from evalsuite.paired import accuracy_interval, score_intervals, spans_zero, task_comparison
from formats.outputs import Outputs


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
    # measured on the recipe's speed workload (recipes/speed.py): {"runner", "concurrency",
    # "output_tokens_per_s", "ttft_ms", "tpot_ms"}, or {"runner": None, "note": why not}
    speed: dict | None = None
    # per task: "correct" (each example right or wrong), "chance" (what guessing scores), "accuracy"
    # and its 95% "interval"; for lm-eval's tasks the "metric" that decided and, where the task
    # generates text, what it was "generated_by"; for a variant also "delta" from the original's
    # accuracy, its paired "delta_interval", and the examples that went "right_to_wrong" and
    # "wrong_to_right" (evalsuite/paired.py)
    tasks: dict[str, dict] = field(default_factory=dict)
    # per decoder Linear, how much quantization changed it, measured as ``error_measure`` says
    # (quant/error.py); empty where no weight was quantized
    linear_errors: dict[str, float] = field(default_factory=dict)
    error_measure: str | None = None
    # paired 95% intervals over the evaluation windows: "ppl_delta", "kld", "top1"
    intervals: dict[str, list[float]] = field(default_factory=dict)
    # False where every interval of a difference from the original spans zero: the evaluation
    # cannot tell this variant from the original (None for the original itself)
    distinguishable: bool | None = None

    def as_dict(self) -> dict:
        row = asdict(self)
        row.update(row.pop("scores"))
        return row


def compare_with_original(rows: list[VariantRow]) -> None:
    """Fill in every row's task accuracies and intervals, and each variant's flips, paired
    intervals and verdict, against ``rows[0]``, the original."""
    original = rows[0]
    for row in rows:
        for name, result in row.tasks.items():
            correct = result["correct"]
            result.update(accuracy=sum(correct) / len(correct), interval=accuracy_interval(correct))
            if row is not original and name in original.tasks:
                result.update(task_comparison(original.tasks[name]["correct"], correct))
        if row is original:
            continue
        row.intervals = score_intervals(original.scores, row.scores)
        differences = [row.intervals.get("ppl_delta", [])] + [t["delta_interval"] for t in row.tasks.values() if "delta_interval" in t]
        row.distinguishable = None if not row.intervals else not all(spans_zero(i) for i in differences)


@dataclass
class Report:
    model: str
    eval_text: str
    windows: int
    window: int
    rows: list[VariantRow]
    recommendation: dict | None = None  # evalsuite/recommend.py: recommend()
    deployment: dict | None = None  # the recipe's deploy: load planned (recipes/deploy.py)

    def as_dict(self) -> dict:
        out = {
            "model": self.model,
            "evaluation": {"text": self.eval_text, "windows": self.windows, "window": self.window},
            "recommendation": self.recommendation,
            "variants": [r.as_dict() for r in self.rows],
        }
        return out | ({"deployment": self.deployment} if self.deployment is not None else {})


COLUMNS = ("variant", "method", "bpw", "size MB", "PPL", "ΔPPL", "KLD", "top-1", "time s")
SPEED_COLUMNS = ("tok/s", "TTFT ms", "TPOT ms", "runner")


def columns(report: Report) -> tuple[str, ...]:
    return COLUMNS + (SPEED_COLUMNS if _timed(report) else ())


def _timed(report: Report) -> bool:
    return any(r.speed is not None for r in report.rows)


def cells(row: VariantRow, timed: bool = False) -> list[str]:
    s = row.scores
    out = [
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
    if timed:
        v = row.speed or {}
        out += [f"{v['output_tokens_per_s']:,.0f}", f"{v['ttft_ms']:,.1f}", f"{v['tpot_ms']:,.2f}",
                f"{v['runner']} x{v['concurrency']}"] if v.get("runner") else ["—", "—", "—", "—"]
    return out


def verdict(row: VariantRow) -> str:
    if row.distinguishable is None:
        return "—"
    return "differs" if row.distinguishable else "not distinguishable from the original"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _span(interval: list[float], fmt) -> str:
    return f"[{fmt(interval[0])}, {fmt(interval[1])}]" if interval else "—"


def significance_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """Each variant's paired 95% intervals against the original, and what they say."""
    head = ["variant", "ΔPPL", "ΔPPL 95% interval", "KLD 95% interval", "top-1 95% interval", "verdict"]
    rows = [[r.name, f"{r.ppl_delta:+.3f}", _span(r.intervals.get("ppl_delta", []), lambda x: f"{x:+.3f}"),
             _span(r.intervals.get("kld", []), lambda x: f"{x:.5f}"), _span(r.intervals.get("top1", []), _pct), verdict(r)]
            for r in report.rows[1:]]
    return head, rows


def task_names(report: Report) -> list[str]:
    return list(report.rows[0].tasks) if report.rows else []


def task_table(report: Report, task: str) -> tuple[list[str], list[list[str]]]:
    """One task: every model's accuracy with its 95% interval, each variant's change with its
    paired interval, and the answers it flipped."""
    head = ["variant", "accuracy", "95% interval", "Δ accuracy", "Δ 95% interval", "right→wrong", "wrong→right"]
    generates = any("generated_by" in r.tasks.get(task, {}) for r in report.rows)
    rows = []
    for r in report.rows:
        t = r.tasks.get(task)
        if t is None:
            continue
        rows.append([r.name, _pct(t["accuracy"]), _span(t["interval"], _pct),
                     f"{100 * t['delta']:+.1f}" if "delta" in t else "—",
                     _span(t.get("delta_interval", []), lambda x: f"{100 * x:+.1f}"),
                     str(len(t["right_to_wrong"])) if "right_to_wrong" in t else "—",
                     str(len(t["wrong_to_right"])) if "wrong_to_right" in t else "—"]
                    + ([t.get("generated_by", "—")] if generates else []))
    return head + (["text generated by"] if generates else []), rows


def _task_caption(report: Report, task: str) -> str:
    t = report.rows[0].tasks[task]
    chance = f", chance {_pct(t['chance'])}" if t.get("chance") else ""
    metric = f", scored by lm-eval's {t['metric']}" if "metric" in t else ""
    return f"{task}: {len(t['correct'])} examples{chance}{metric}"


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    cells = "\n".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return ("<table>\n<thead><tr>" + "".join(f"<th>{escape(c)}</th>" for c in head) + "</tr></thead>\n<tbody>\n"
            + cells + "\n</tbody>\n</table>")


_SIGNIFICANCE_NOTE = ("Intervals: 95% paired bootstrap over the evaluation windows (tasks: over the examples), "
                      "2,000 resamples, seed 0. A variant is not distinguishable from the original when the "
                      "intervals of its perplexity change and of every task's accuracy change all include zero. "
                      "right→wrong / wrong→right: answers the original got right and the variant wrong, and the "
                      "reverse; accuracy can stay flat while many answers flip.")


def recommendation_lines(report: Report) -> list[str]:
    """The answer first: which variant to ship and why, or what each variant misses."""
    rec = report.recommendation
    if not rec:
        return []
    lines = [(f"Ship {rec['variant']}. " if rec["variant"] else "") + rec["reason"]]
    if rec["budget"] is not None and rec["misses"]:
        lines += [f"{name} misses: {'; '.join(m)}." for name, m in rec["misses"].items()]
    if rec["pareto"]:
        lines.append("Pareto front of size against KLD (no other variant is both smaller and closer to the "
                     f"original): {', '.join(rec['pareto'])}.")
    return lines


def deployment_lines(report: Report) -> list[str]:
    """The recipe's deploy: load, and what it takes for the recommended variant: GPUs, layout,
    predicted TTFT and TPOT (p50 and p99), cost, and the command to start it; or the planner's
    one line naming what to relax."""
    d = report.deployment
    if not d:
        return []
    q = d["query"]
    targets = ", ".join(f"{k} ≤ {_ms(q[f'{k.lower()}_s'])}" for k in ("TTFT", "TPOT") if q[f"{k.lower()}_s"] is not None)
    share = f" ({q['prefix_share']:.0%} from the prefix cache)" if q["prefix_share"] else ""
    lines = [f"Load: {q['users']} users at once, {q['prompt_tokens']:,}-token prompts{share}, {q['output_tokens']:,}-token "
             f"answers; {targets} at {q['percentile']}; GPUs: {', '.join(q['gpus']) if q['gpus'] else 'any in the catalogue'}."]
    if d["error"]:
        return lines + [f"No deployment of {d['variant'] or 'any variant'} meets it: {d['error']}"]
    r, p, engine = d["recommendation"], d["recommendation"]["prediction"], d["engine"]
    layout = (f"{r['prefill_instances']} prefill + {r['decode_instances']} decode instance(s)" if r["layout"] == "disaggregated"
              else f"{r['copies']} cop{'y' if r['copies'] == 1 else 'ies'}")
    tp = f" of {r['tensor_parallel']} GPUs each" if r["tensor_parallel"] > 1 else ""
    which = "the report's recommended variant" if d["recommended_by"] == "report" else "the cheapest variant that meets it"
    lines += [
        f"Deploy {r['variant']} ({which}) on {r['gpus']} x {r['gpu']}: {layout}{tp}, KV cache {r['kv_cache']}"
        + (f", prefill chunk {r['chunk']} tokens." if r["chunk"] else "."),
        f"Predicted TTFT {_ms(p['ttft_p50'])} p50, {_ms(p['ttft_p99'])} p99; TPOT {_ms(p['tpot_p50'])} p50, "
        f"{_ms(p['tpot_p99'])} p99; {r['tokens_per_s']:,.0f} output tokens/s.",
        f"Cost: {_money(r['cost_per_hour'])}/hour, {_money(r['cost_per_million_tokens'])} per million output tokens.",
        f"Engine: {engine['engine']}: {engine['why']}.",
        *(f"Run: `{c}`" for c in engine["commands"]),
    ]
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _money(value: float | None) -> str:
    return "n/a (no price in the catalogue)" if value is None else f"${value:,.2f}" if value >= 0.1 else f"${value:,.4f}"


_WORST_LINEARS = 5


def worst_linears_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """Per variant, the Linears quantization changed most: where a mixed-precision fix would go."""
    head = ["variant", "measure", f"worst {_WORST_LINEARS} Linears", "median"]
    rows = []
    for r in report.rows:
        if not r.linear_errors:
            continue
        ranked = sorted(r.linear_errors.items(), key=lambda kv: -kv[1])
        median = sorted(r.linear_errors.values())[len(ranked) // 2]
        rows.append([r.name, r.error_measure or "", ", ".join(f"{n.removeprefix('model.')} {e:.3f}" for n, e in ranked[:_WORST_LINEARS]),
                     f"{median:.3f}"])
    return head, rows


def markdown(report: Report) -> str:
    lines = [
        "# quantbench report",
        "",
        f"Model: `{report.model}`  ",
        f"Evaluation: `{report.eval_text}`, {report.windows} windows of {report.window} tokens",
        "",
        *(["## Recommendation", "", *(f"- {line}" for line in recommendation_lines(report)), ""]
          if report.recommendation else []),
        *(["## Deployment", "", *(f"- {line}" for line in deployment_lines(report)), ""] if report.deployment else []),
        *_md_table(list(columns(report)), [cells(r, _timed(report)) for r in report.rows]),
    ]
    lines += [
        "",
        "PPL: perplexity on the evaluation text. KLD: mean KL divergence from the original model's "
        "next-token distribution (nats per token). top-1: share of positions where the variant's most "
        "likely next token is the original's. bpw: bits per weight over all tensors.",
        *(_speed_notes(report) if _timed(report) else []),
        *(["", "## Against the original", "", *_md_table(*significance_table(report))] if len(report.rows) > 1 else []),
    ]
    for task in task_names(report):
        lines += ["", f"## Task: {_task_caption(report, task)}", "", *_md_table(*task_table(report, task))]
    if len(report.rows) > 1:
        lines += ["", _SIGNIFICANCE_NOTE]
    hurts = worst_linears_table(report)
    if hurts[1]:
        lines += ["", "## Where it hurts", "", *_md_table(*hurts)]
    lines += [
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


def _speed_notes(report: Report) -> list[str]:
    """What the speed columns measured, and why a variant has none."""
    lines = ["", "tok/s, TTFT, TPOT: the recipe's speed workload (greedy, EOS ignored), mean time to first "
             "token and per later token; runner: what ran it (quantbench's engine, or llama.cpp for a GGUF "
             "file) and how many requests at a time."]
    lines += [f"- {r.name}: no speed: {r.speed['note']}" for r in report.rows if r.speed and not r.speed.get("runner")]
    return lines


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
        *_md_table(["module", "outlier channels", "max abs", "max/median"],
                   [[f"`{name}`", str(s["outlier_channels"]), f"{s['max_abs']:.2f}", f"{s['max_over_median']:.1f}"]
                    for name, s in worst]),
    ]
    return lines


def html(report: Report) -> str:
    """One self-contained page: the table, the size/fidelity chart and the files. Well-formed XML,
    so tools (and tests) can parse it; it opens offline and survives being mailed."""
    main_table = _html_table(list(columns(report)), [cells(r, _timed(report)) for r in report.rows])
    files = "\n".join(f"<li><code>{escape(f['path'])}</code> ({f['bytes'] / 1e6:.2f} MB)</li>" for r in report.rows for f in r.files)
    against = (f"<h2>Against the original</h2>\n{_html_table(*significance_table(report))}\n" if len(report.rows) > 1 else "")
    against += "".join(f"<h2>Task: {escape(_task_caption(report, t))}</h2>\n{_html_table(*task_table(report, t))}\n"
                       f"{_task_chart(report, t)}\n" for t in task_names(report))
    against += f"<p>{escape(_SIGNIFICANCE_NOTE)}</p>\n" if len(report.rows) > 1 else ""
    hurts = worst_linears_table(report)
    if hurts[1]:
        maps = "\n".join(heatmap_svg(r.name, r.linear_errors, r.error_measure or "") for r in report.rows if r.linear_errors)
        against += f"<h2>Where it hurts</h2>\n{_html_table(*hurts)}\n<div class=\"heatmaps\">\n{maps}\n</div>\n"
    advice = "".join(f"<li>{escape(line)}</li>" for line in recommendation_lines(report))
    advice = f'<h2>Recommendation</h2>\n<ul class="recommendation">{advice}</ul>\n' if advice else ""
    plan = "".join(f"<li>{_code(line)}</li>" for line in deployment_lines(report))
    advice += f'<h2>Deployment</h2>\n<ul class="deployment">{plan}</ul>\n' if plan else ""
    return f"""<!DOCTYPE html>
<html xmlns="http://www.w3.org/1999/xhtml" lang="en">
<head>
<meta charset="utf-8" />
<title>quantbench report: {escape(report.model)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th:nth-child(-n+2), td:nth-child(-n+2) {{ text-align: left; }}
svg text {{ font-size: 12px; fill: #222; }}
.heatmaps {{ display: flex; flex-wrap: wrap; gap: 1em; }}
</style>
</head>
<body>
<h1>quantbench report</h1>
<p>Model: <code>{escape(report.model)}</code>. Evaluation: <code>{escape(report.eval_text)}</code>,
{report.windows} windows of {report.window} tokens.</p>
{advice}{main_table}
<p>PPL: perplexity on the evaluation text. KLD: mean KL divergence from the original model's
next-token distribution (nats per token). top-1: share of positions where the variant's most likely
next token is the original's. bpw: bits per weight over all tensors.</p>
<h2>Size against fidelity</h2>
{size_fidelity_svg(report.rows, _pareto(report))}
{_speed_chart(report)}{against}<h2>Files</h2>
<ul>
{files}
</ul>
</body>
</html>
"""


def _code(line: str) -> str:
    """A line with its `command` in <code>, the rest escaped."""
    parts = line.split("`")
    return "".join(escape(p) if i % 2 == 0 else f"<code>{escape(p)}</code>" for i, p in enumerate(parts))


def _speed_chart(report: Report) -> str:
    if not _timed(report):
        return ""
    return f"<h2>Speed against fidelity</h2>\n{speed_fidelity_svg(report.rows, _pareto(report))}\n"


def _pareto(report: Report) -> frozenset[str]:
    return frozenset(report.recommendation["pareto"]) if report.recommendation else frozenset()


def _task_chart(report: Report, task: str) -> str:
    points = [(r.name, t["accuracy"], *t["interval"]) for r in report.rows if (t := r.tasks.get(task))]
    return task_accuracy_svg(task, points, report.rows[0].tasks[task].get("chance") or None)


def table(report: Report) -> Table:
    t = Table(title=Text(f"{report.model}: {report.windows} x {report.window} tokens of {Path(report.eval_text).name}"))
    for i, c in enumerate(columns(report)):
        t.add_column(c, justify="left" if i < 2 or c == "runner" else "right")
    for r in report.rows:
        t.add_row(*cells(r, _timed(report)))
    return t


def write_report(report: Report, out_dir: Path) -> None:
    """Write report.json, report.md and report.html, under temporary names until all three are written."""
    with Outputs() as outputs:
        for name, text in (("report.json", json.dumps(report.as_dict(), indent=2) + "\n"),
                           ("report.md", markdown(report)), ("report.html", html(report))):
            outputs.stage(out_dir / name).write_text(text, encoding="utf-8")
        outputs.commit()
