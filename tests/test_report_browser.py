"""The report page as a reader sees it: opened in a real headless browser (Debian's chromium via
Playwright, see tests/helpers/browser.py), with no errors, nothing fetched from outside, one mark per
variant and no label over another label or a mark, even when variants crowd together. The new
charts (one task's accuracy, a per-Linear error heat map) are checked the same way on a page of
their own, and without a browser as XML.

The browser tests fail, not skip, when chromium or playwright is missing: CI installs both
(``bash bench/anchors/setup.sh chromium``; playwright is in the ``dev`` extra)."""

from __future__ import annotations

import math
import random
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers.browser import BrowserMissing, check_page, launch, overlaps
from evalsuite import chart
from evalsuite.chart import heatmap_svg, size_fidelity_svg, speed_fidelity_svg, task_accuracy_svg
from evalsuite.metrics import Scores
from evalsuite.recommend import pareto_front
from evalsuite.report import Report, VariantRow, html

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "test-results"  # screenshots, kept for a person (or CI's artefacts) to look at
SVG = "{http://www.w3.org/2000/svg}"
PNG = b"\x89PNG\r\n\x1a\n"

# Six variants at nearly the same size and KLD (their marks sit within a few pixels of each other),
# a far one, and the original (no KLD: no mark). A label to the right of each point would collide.
CROWD = [  # name, size MB, KLD, tokens/s
    ("int4-g128-asym", 121.0, 0.01040, 410.0),
    ("int4-g128-sym", 120.2, 0.01010, 405.0),
    ("gptq-w4g128", 121.6, 0.00990, 402.0),
    ("awq-w4g128", 120.8, 0.01000, 412.0),
    ("q4_k_m", 122.1, 0.01060, 398.0),
    ("q4_k_m-imatrix", 122.0, 0.00975, 400.0),
    ("int8 <&\"'>", 240.0, 0.00004, 300.0),  # a name that needs escaping
]


def _rows() -> list[VariantRow]:
    rows = [VariantRow("original", "none", 16.0, 480.0, Scores(ppl=10.0), speed=_speed(250.0))]
    rows += [VariantRow(name, "rtn", 4.5, size, Scores(ppl=10.2, kld=kld, top1=0.95, tokens=1024), ppl_delta=0.2,
                        seconds=1.0, speed=_speed(tps)) for name, size, kld, tps in CROWD]
    return rows


def _speed(tps: float) -> dict:
    return {"runner": "quantbench", "concurrency": 2, "output_tokens_per_s": tps, "ttft_ms": 20.0, "tpot_ms": 2.5}


TASK_POINTS = [("original", 0.712, 0.671, 0.750), ("int4-g128-asym", 0.695, 0.653, 0.734),
               ("q4_k_m", 0.701, 0.660, 0.740), ("int8 <&\"'>", 0.709, 0.668, 0.747)]
LAYERS, MODULES = 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _errors() -> dict[str, float]:
    """A per-Linear error map shaped like a real one: 32 layers of 7 Linears, the down projection
    and the last layers worst, plus names the heat map must leave out."""
    errors = {f"model.layers.{i}.{'mlp' if m in MODULES[4:] else 'self_attn'}.{m}":
              0.01 * (1 + i / LAYERS) * (3.0 if m == "down_proj" else 1.0 + j / 10)
              for i in range(LAYERS) for j, m in enumerate(MODULES)}
    errors["lm_head"] = 0.5
    errors["model.embed_tokens"] = 0.2
    errors["model.layers.x.mlp.up_proj"] = 0.3
    return errors


def _page(title: str, body: str) -> str:
    """A page like the report's (same styles, XHTML), holding ``body``."""
    return f"""<!DOCTYPE html>
<html xmlns="http://www.w3.org/1999/xhtml" lang="en">
<head><meta charset="utf-8" /><title>{title}</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 2em; }} svg text {{ font-size: 12px; fill: #222; }}</style>
</head>
<body>
{body}
</body>
</html>
"""


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for the whole module (a launch costs about a second)."""
    missing = None
    try:
        with launch() as b:
            yield b
    except BrowserMissing as e:
        missing = str(e)
    if missing:  # out of the except block, so the failure reads as one line, not a traceback chain
        pytest.fail(f"no browser for the report check: {missing}", pytrace=False)


def _keep(screenshot: Path) -> None:
    """Check the screenshot is a PNG and copy it to test-results/ for a person to look at."""
    assert screenshot.read_bytes()[:8] == PNG
    RESULTS.mkdir(exist_ok=True)
    shutil.copy(screenshot, RESULTS / screenshot.name)


def _assert_clean(check) -> None:
    assert check.console_errors == [] and check.page_errors == [], (check.console_errors, check.page_errors)
    assert check.failed_requests == [], f"the page is not self-contained: {check.failed_requests}"
    assert check.scripts == 0


def _assert_readable(c) -> None:
    """No label over another label or any mark, and every label and mark inside its chart."""
    assert overlaps(c) == [], (c.kind, overlaps(c))
    outside = [b.variant for b in c.labels + c.marks if not b.within(c.box)]
    assert outside == [], (c.kind, outside)


# --- in the browser -------------------------------------------------------------------------------

@pytest.mark.anchor  # Debian's chromium
def test_the_report_page_renders_cleanly_with_crowded_variants(browser, tmp_path):
    rows = _rows()
    report = Report(model="synthetic/crowded", eval_text="eval.txt", windows=2, window=128, rows=rows)
    page = tmp_path / "report.html"
    page.write_text(html(report), encoding="utf-8")
    ET.fromstring(page.read_text(encoding="utf-8").removeprefix("<!DOCTYPE html>\n"))  # still well-formed XML

    check = check_page(page, tmp_path / "report-crowded.png", browser)

    _assert_clean(check)
    compared = sorted(r.name for r in rows if r.scores.kld is not None)
    for kind in ("size-kld", "speed-kld"):
        c = check.chart(kind)
        assert sorted(c.variants) == compared, kind  # exactly one mark per variant with a KLD
        assert sorted(b.variant for b in c.labels) == compared, kind
        _assert_readable(c)
    _keep(check.screenshot)


@pytest.mark.anchor  # Debian's chromium
def test_the_new_charts_render_cleanly(browser, tmp_path):
    rows = _rows()
    errors = _errors()
    body = "\n".join([
        "<h2>Size against fidelity</h2>", size_fidelity_svg(rows, frozenset(pareto_front(rows))),
        "<h2>Speed against fidelity</h2>", speed_fidelity_svg(rows, frozenset(pareto_front(rows))),
        "<h2>hellaswag</h2>", task_accuracy_svg("hellaswag", TASK_POINTS, chance=0.25),
        "<h2>Per-Linear error</h2>", heatmap_svg("int4-g128-asym", errors, "relative output error"),
    ])
    page = tmp_path / "charts.html"
    page.write_text(_page("charts", body), encoding="utf-8")
    ET.fromstring(page.read_text(encoding="utf-8").removeprefix("<!DOCTYPE html>\n"))

    check = check_page(page, tmp_path / "charts.png", browser)

    _assert_clean(check)
    assert [c.kind for c in check.charts] == ["size-kld", "speed-kld", "task-accuracy", "heatmap"]
    task = check.chart("task-accuracy", task="hellaswag")
    assert task.variants == [name for name, *_ in TASK_POINTS]
    heat = check.chart("heatmap", variant="int4-g128-asym")
    assert sorted(heat.cells) == sorted(n for n in errors if n.startswith("model.layers.") and ".x." not in n)
    for c in check.charts:
        _assert_readable(c)
    _keep(check.screenshot)


@pytest.mark.anchor  # Debian's chromium
def test_the_check_itself_sees_errors_and_outside_requests(browser, tmp_path):
    """A page that breaks every rule, so a clean result above means something."""
    page = tmp_path / "bad.html"
    page.write_text(_page("bad", '<img src="http://127.0.0.1:9/x.png" alt="" /><img src="other.png" alt="" />'
                                 '<script>console.error("boom"); undefined_name();</script>'), encoding="utf-8")
    check = check_page(page, tmp_path / "bad.png", browser)
    assert any("boom" in m for m in check.console_errors)
    assert any("undefined_name" in e for e in check.page_errors)
    assert "http://127.0.0.1:9/x.png" in check.failed_requests
    assert (tmp_path / "other.png").as_uri() in check.failed_requests
    assert check.scripts == 1


# --- without a browser ----------------------------------------------------------------------------

@pytest.mark.check
def test_task_accuracy_chart_has_a_dot_and_whisker_per_variant():
    root = ET.fromstring(task_accuracy_svg("arc <easy>", TASK_POINTS, chance=0.25))
    assert (root.get("class"), root.get("data-chart"), root.get("data-task")) == ("chart", "task-accuracy", "arc <easy>")
    marks = root.findall(f".//{SVG}circle[@class='mark']")
    assert [m.get("data-variant") for m in marks] == [name for name, *_ in TASK_POINTS]
    labels = root.findall(f".//{SVG}text[@class='label']")
    assert [t.text for t in labels] == [t.get("data-variant") for t in labels] == [name for name, *_ in TASK_POINTS]
    assert len(root.findall(f".//{SVG}path[@class='whisker']")) == len(TASK_POINTS)
    # accuracy on a 0-100% axis: the dot sits where its fraction says, between the axis ends
    x0, x100 = (float(t.get("x")) for t in root.findall(f"{SVG}text") if t.text in ("0%", "100%"))
    for m, (_, acc, _, _) in zip(marks, TASK_POINTS):
        assert float(m.get("cx")) == pytest.approx(x0 + acc * (x100 - x0), abs=0.1)
    chance = root.find(f"{SVG}line[@class='chance']")
    assert float(chance.get("x1")) == pytest.approx(x0 + 0.25 * (x100 - x0), abs=0.1)
    assert "chance" in {t.text for t in root.iter(f"{SVG}text")}
    assert ET.fromstring(task_accuracy_svg("t", TASK_POINTS)).find(f"{SVG}line[@class='chance']") is None
    assert task_accuracy_svg("t", []).startswith("<p>")


@pytest.mark.check
def test_heatmap_has_a_cell_per_module_coloured_by_its_error():
    errors = _errors()
    root = ET.fromstring(heatmap_svg("int4 <g128>", errors, "relative output error"))
    assert (root.get("data-chart"), root.get("data-variant")) == ("heatmap", "int4 <g128>")
    cells = {c.get("data-module"): c for c in root.iter(f"{SVG}rect") if c.get("class") == "cell"}
    layered = [n for n in errors if n.startswith("model.layers.") and ".x." not in n]
    assert sorted(cells) == sorted(layered)  # lm_head, embeddings and unparsable names left out
    assert all(cells[n].find(f"{SVG}title").text.startswith(f"{n}: ") for n in layered)
    # rows by layer index (numerically: 10 below 9), columns in first-seen order
    pos = {n: (float(c.get("x")), float(c.get("y"))) for n, c in cells.items()}
    assert pos["model.layers.10.mlp.down_proj"][1] > pos["model.layers.9.mlp.down_proj"][1]
    xs = [pos[f"model.layers.0.{'mlp' if m in MODULES[4:] else 'self_attn'}.{m}"][0] for m in MODULES]
    assert xs == sorted(xs) and len(set(xs)) == len(MODULES)
    rows = sorted({y for _, y in pos.values()})
    assert len(rows) == LAYERS and rows[1] - rows[0] <= 14  # 32 layers fit
    lo, hi = min(layered, key=errors.get), max(layered, key=errors.get)
    assert cells[lo].get("fill") != cells[hi].get("fill")
    assert _luminance(cells[lo].get("fill")) > _luminance(cells[hi].get("fill"))  # light to dark
    legend = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "relative output error" in legend and f"{errors[hi]:.3g}" in legend
    assert heatmap_svg("v", {"lm_head": 1.0}, "m").startswith("<p>")


def _luminance(colour: str) -> float:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


@pytest.mark.check
def test_the_front_is_filled_and_the_rest_hollow():
    rows = _rows()
    front = frozenset(pareto_front(rows))
    assert front == {"int4-g128-sym", "awq-w4g128", "gptq-w4g128", "q4_k_m-imatrix", "int8 <&\"'>"}
    root = ET.fromstring(size_fidelity_svg(rows, front))
    assert root.get("data-chart") == "size-kld"
    fills = {c.get("data-variant"): c.get("fill") for c in root.findall(f"{SVG}circle")}  # the marks only
    assert {n for n, f in fills.items() if f != "white"} == front
    assert root.find(f"{SVG}path[@class='front']") is not None
    assert "Pareto front (size, KLD)" in {t.text for t in root.iter(f"{SVG}text")}
    plain = ET.fromstring(size_fidelity_svg(rows))  # no front given: as before, every mark filled, no legend
    assert all(c.get("fill") != "white" for c in plain.findall(f"{SVG}circle"))
    assert plain.find(f"{SVG}g[@class='legend']") is None


@pytest.mark.check
@pytest.mark.parametrize("seed", range(40))
def test_labels_never_overlap_on_estimated_boxes(seed):
    """Random crowds (tight clusters, duplicates, long names, KLDs of zero), checked on the boxes the
    layout assumes: the browser tests above check the real ones on two of them."""
    rng = random.Random(seed)
    n = rng.randint(2, 14)
    centre_size, centre_kld = rng.uniform(10, 1000), 10 ** rng.uniform(-4, -1)
    points = [(f"v{i}-" + "x" * rng.randint(0, 18), centre_size * rng.uniform(0.97, 1.03) if rng.random() < 0.8
               else rng.uniform(1, 1000), 0.0 if rng.random() < 0.1 else centre_kld * rng.uniform(0.9, 1.1))
              for i in range(n)]
    points.append((points[0][0] + "-copy", points[0][1], points[0][2]))  # two marks on one spot
    rows = [VariantRow(name, "rtn", 4.0, size, Scores(ppl=1.0, kld=kld)) for name, size, kld in points]
    root = ET.fromstring(size_fidelity_svg(rows, frozenset(pareto_front(rows))))
    width, height = float(root.get("width")), float(root.get("height"))
    marks = [(float(c.get("cx")) - 4, float(c.get("cy")) - 4, 8.0, 8.0) for c in root.findall(f"{SVG}circle")]
    labels = [_estimated_box(t) for t in root.findall(f"{SVG}text[@class='label']")]
    assert len(marks) == len(labels) == len(rows)
    for i, a in enumerate(labels):
        assert 0 <= a[0] and a[0] + a[2] <= width and 0 <= a[1] and a[1] + a[3] <= height
        assert not any(_hit(a, b) for b in labels[i + 1:] + marks), (seed, i)


def _estimated_box(text: ET.Element) -> tuple[float, float, float, float]:
    """The box the layout assumed for a label: x, y (top), width, height."""
    w = chart._text_width(text.text)
    shift = {"start": 0.0, "middle": w / 2, "end": w}[text.get("text-anchor")]
    return float(text.get("x")) - shift, float(text.get("y")) - 11, w, 14.0


def _hit(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


@pytest.mark.check
def test_names_are_escaped_and_the_charts_stay_free_of_scripts_and_links():
    for svg in (size_fidelity_svg(_rows(), frozenset(pareto_front(_rows()))), speed_fidelity_svg(_rows()),
                task_accuracy_svg("t", TASK_POINTS, 0.5), heatmap_svg("v", _errors(), "m")):
        root = ET.fromstring(svg)
        assert root.get("class") == "chart"
        assert not re.search(r"<script|href=|url\(|@import", svg)
        assert all(math.isfinite(float(v)) for e in root.iter() for k, v in e.attrib.items()
                   if k in ("x", "y", "cx", "cy", "width", "height"))
    marks = ET.fromstring(size_fidelity_svg(_rows())).findall(f"{SVG}circle[@class='mark']")
    assert "int8 <&\"'>" in {m.get("data-variant") for m in marks}
