"""The trade-offs a quantization report is about, drawn as SVGs a web page can hold inline (no
scripts, no external files, well-formed XML): size, and measured speed, against KL divergence from
the original, one point per variant; one task's accuracy per variant with its interval; and one
variant's per-Linear quantization error as a layer-by-module heat map.

Every chart follows the same conventions, so a test (or a browser) can find and count what it
drew: the root is ``<svg class="chart" data-chart="KIND">``; each per-variant mark has
``class="mark" data-variant="NAME"``; each point label is ``<text class="label" data-variant="NAME">``;
each heat-map cell is ``<rect class="cell" data-module="NAME">``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evalsuite.report import VariantRow

_W, _H = 640, 360  # chart size in px
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 150, 20, 50  # margins: axis labels on the left/bottom, point labels on the right
_R = 4  # mark radius, px
_BLUE = "#3366cc"

# Label boxes, for a 12px sans-serif font: a text's box runs from 11 px above its baseline to 3 px
# below it (measured in Chromium with DejaVu Sans; other sans fonts are within a pixel).
_LABEL_H, _ASCENT = 14.0, 11.0
_PAD = 2.0  # kept free around every label, for fonts a little wider than the estimate
_GAP = 7.0  # from a point's centre to its label, when the label sits beside it


def size_fidelity_svg(rows: list[VariantRow], pareto: frozenset[str] = frozenset()) -> str:
    """An SVG scatter of size (MB) against KLD (log scale): lower left is smaller and closer to the
    original. Variants whose KLD rounds to nothing sit on the bottom edge, marked "≈0". Variants
    named in ``pareto`` (the size-against-quality front, evalsuite/recommend.py) are filled and
    joined by a step line, the rest hollow; with no front given every mark is filled."""
    return _fidelity_svg([(r.name, r.size_mb, r.scores.kld) for r in rows if r.scores.kld is not None],
                         "size (MB)", "MB", "size against KL divergence", "size-kld", pareto)


def speed_fidelity_svg(rows: list[VariantRow], pareto: frozenset[str] = frozenset()) -> str:
    """The same against measured output tokens/s: lower right is faster and closer to the original.
    ``pareto`` is still the size-against-quality front, so a reader sees what the small, faithful
    variants cost in speed."""
    return _fidelity_svg([(r.name, r.speed["output_tokens_per_s"], r.scores.kld) for r in rows
                          if r.scores.kld is not None and r.speed and r.speed.get("runner")],
                         "output tokens/s", "tokens/s", "speed against KL divergence", "speed-kld", pareto)


# --- label placement ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Box:
    """A rectangle in the chart's px (y down): a label, a mark or a line, for the overlap checks."""
    x0: float
    y0: float
    x1: float
    y1: float

    def hits(self, other: _Box) -> bool:
        return self.x0 < other.x1 and other.x0 < self.x1 and self.y0 < other.y1 and other.y0 < self.y1

    def grown(self, by: float) -> _Box:
        return _Box(self.x0 - by, self.y0 - by, self.x1 + by, self.y1 + by)

    def inside(self, area: _Box) -> bool:
        return area.x0 <= self.x0 and self.x1 <= area.x1 and area.y0 <= self.y0 and self.y1 <= area.y1


@dataclass(frozen=True)
class _Placed:
    box: _Box
    leader: bool  # set apart from its point: drawn with a thin line back to it


_NARROW, _WIDE, _SYMBOL = set("ijlI.,:;'|!()[] -frt"), set("mwMW@%"), set("<>=+~&#")


def _text_width(text: str) -> float:
    """An estimate of ``text``'s width at 12px, from the kind of each character (about 7 px on
    average; narrow and wide letters differ by 3x, which a flat 7 px would miss on names like
    "mmm"). Only ever used with a few pixels of padding around it."""
    return sum(4.5 if c in _NARROW else 12.0 if c in _WIDE else 10.0 if c in _SYMBOL else 8.5 if c.isupper()
               else 7.7 if c.isdigit() else 7.0 if c.isascii() else 10.0 for c in text)


def _beside(px: float, py: float, w: float) -> list[_Box]:
    """Boxes of width ``w`` right next to a point: right (the usual place), left, above, below,
    then the four corners."""
    h, g, d = _LABEL_H, _GAP, _GAP - 1
    corners = [(px + d, py - d - h), (px + d, py + d), (px - d - w, py - d - h), (px - d - w, py + d)]
    spots = [(px + g, py - h / 2), (px - g - w, py - h / 2), (px - w / 2, py - g - h), (px - w / 2, py + g), *corners]
    return [_Box(x, y, x + w, y + h) for x, y in spots]


def _nudged(px: float, py: float, w: float, reach: float) -> list[_Box]:
    """Boxes further from a point, on its right or left, moved up or down in 6 px steps (nearest
    first): where a label goes when every spot beside its point is taken."""
    h, out = _LABEL_H, []
    for k in range(1, int(reach / 6) + 1):
        for dy in (6 * k, -6 * k):
            for dx in (_GAP + 6, _GAP + 30):
                out += [_Box(px + dx, py - h / 2 + dy, px + dx + w, py + h / 2 + dy),
                        _Box(px - dx - w, py - h / 2 + dy, px - dx, py + h / 2 + dy)]
    return out


def _place_labels(points: list[tuple[float, float, float]], area: _Box, obstacles: list[_Box],
                  column_x: float) -> list[_Placed]:
    """A box for each point's label (``(x, y, label width)``), in the points' order, that overlaps
    no other label, no mark and no obstacle, and stays in ``area``: first a spot beside the point,
    then one nudged away from it (with a leader line), and if even that fails, the first free slot
    of a column at ``column_x`` (new columns to the right when one fills; the caller widens the
    chart to fit). Greedy and deterministic: the same points always get the same layout."""
    marks = [_Box(x - _R, y - _R, x + _R, y + _R) for x, y, _ in points]
    taken = [*marks, *obstacles]
    placed: dict[int, _Placed] = {}
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))

    def free(box: _Box) -> bool:
        grown = box.grown(_PAD)
        return box.inside(area) and not any(grown.hits(t) for t in taken)

    for i in order:
        px, py, w = points[i]
        spot = next((_Placed(b, False) for b in _beside(px, py, w) if free(b)), None)
        spot = spot or next((_Placed(b, True) for b in _nudged(px, py, w, area.y1 - area.y0) if free(b)), None)
        spot = spot or _Placed(_column_slot(w, area, column_x, taken), True)
        placed[i] = spot
        taken.append(spot.box)
    return [placed[i] for i in range(len(points))]


def _column_slot(w: float, area: _Box, column_x: float, taken: list[_Box]) -> _Box:
    """The first free slot, top to bottom, of label columns 160 px apart from ``column_x`` on:
    always found, because a column far enough right is empty."""
    for col in range(len(taken) + 1):
        x = column_x + 160 * col
        for y in range(int(area.y0), int(area.y1 - _LABEL_H) + 1, 4):
            box = _Box(x, y, x + w, y + _LABEL_H)
            if not any(box.grown(_PAD).hits(t) for t in taken):
                return box
    raise AssertionError("unreachable: the last column is empty")


def _anchor(box: _Box, px: float) -> tuple[str, float]:
    """Where a label's text is tied to its box: the edge nearest its point (the middle for a label
    above or below it), so a text wider than estimated grows away from the point, never onto it."""
    if box.x1 <= px:
        return "end", box.x1
    if box.x0 >= px:
        return "start", box.x0
    return "middle", (box.x0 + box.x1) / 2


def _leader(px: float, py: float, box: _Box) -> str:
    """A thin line from a mark's edge to the nearest point of its label's box."""
    nx, ny = min(max(px, box.x0), box.x1), min(max(py, box.y0), box.y1)
    d = math.hypot(nx - px, ny - py) or 1.0
    sx, sy = px + (nx - px) * (_R + 1) / d, py + (ny - py) * (_R + 1) / d
    return (f'<line class="leader" x1="{sx:.1f}" y1="{sy:.1f}" x2="{nx:.1f}" y2="{ny:.1f}" '
            'stroke="#888" stroke-width="0.75" />')


# --- size / speed against KLD -------------------------------------------------------------------

def _fidelity_svg(points: list[tuple[str, float, float]], x_label: str, unit: str, aria: str, kind: str,
                  pareto: frozenset[str]) -> str:
    """The scatter both charts share: ``(name, x value, KLD)`` points on a linear x axis from 0 and
    a log KLD axis, each labelled where its label collides with nothing (``_place_labels``)."""
    if not points:
        return "<p>No variant to compare with the original.</p>"
    positive = [k for _, _, k in points if k > 0]
    floor = min(positive) / 10 if positive else 1e-6
    y_lo, y_hi = math.floor(math.log10(floor)), math.ceil(math.log10(max(positive, default=floor * 10)))
    y_hi = max(y_hi, y_lo + 1)
    step = _nice_step(max(size for _, size, _ in points) * 1.05 / 4)
    x_hi = max(step * math.ceil(max(size for _, size, _ in points) * 1.05 / step), step)  # all at 0: no 0/0
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def x(size: float) -> float:
        return _LEFT + plot_w * size / x_hi

    def y(kld: float) -> float:
        return _TOP + plot_h * (y_hi - math.log10(max(kld, floor))) / (y_hi - y_lo)

    texts = [name + (" (≈0)" if kld <= 0 or kld < floor else "") for name, _, kld in points]
    xy = [(round(x(size), 1), round(y(kld), 1)) for _, size, kld in points]
    # labels may use the plot and the right margin, from the top edge down to just above the x ticks
    area = _Box(_LEFT + 2, 2, _W - 2, _H - _BOTTOM + 4)
    front = [(px, py) for (name, size, kld), (px, py) in sorted(zip(points, xy), key=lambda p: (p[0][1], p[0][2]))
             if name in pareto]
    spots = _place_labels([(px, py, _text_width(t)) for (px, py), t in zip(xy, texts)], area,
                          _step_boxes(front), _W - _RIGHT + 10)
    width = max(_W, math.ceil(max(s.box.x1 for s in spots)) + 4)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="{kind}" width="{width}" '
             f'height="{_H}" font-size="12" role="img" aria-label="{aria}">',
             f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999" />']
    for e in range(y_lo, y_hi + 1):
        parts.append(f'<text x="{_LEFT - 6}" y="{y(10.0 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    for i in range(round(x_hi / step) + 1):
        size = step * i
        parts.append(f'<text x="{x(size):.1f}" y="{_H - _BOTTOM + 18}" text-anchor="middle">{size:g}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_H - 8}" text-anchor="middle">{x_label}</text>')
    parts.append(f'<text x="14" y="{_TOP + plot_h / 2}" transform="rotate(-90 14 {_TOP + plot_h / 2})" '
                 'text-anchor="middle">KLD (nats/token)</text>')
    if front:
        parts.append(_step_line(front))
    if pareto:
        parts.append(_front_legend(width))
    for (name, size, kld), (px, py), text, spot in zip(points, xy, texts, spots):
        filled = not pareto or name in pareto
        style = f'fill="{_BLUE}"' if filled else f'fill="white" stroke="{_BLUE}" stroke-width="1.5"'
        parts.append(f'<circle class="mark" data-variant="{escape(name)}" cx="{px:.1f}" cy="{py:.1f}" r="{_R}" '
                     f'{style}><title>{escape(name)}: {size:,.2f} {unit}, KLD {kld:.5f}</title></circle>')
        if spot.leader:
            parts.append(_leader(px, py, spot.box))
        anchor, tx = _anchor(spot.box, px)
        parts.append(f'<text class="label" data-variant="{escape(name)}" x="{tx:.1f}" y="{spot.box.y0 + _ASCENT:.1f}" '
                     f'text-anchor="{anchor}">{escape(text)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _step_line(xy: list[tuple[float, float]]) -> str:
    """The front as a staircase, left to right: across to the next point's x, then up or down to
    it; everything above and right of it is beaten by a point on it."""
    d = f"M{xy[0][0]:.1f} {xy[0][1]:.1f}" + "".join(f" H{px:.1f} V{py:.1f}" for px, py in xy[1:])
    return f'<path class="front" d="{d}" fill="none" stroke="{_BLUE}" stroke-width="1" stroke-opacity="0.6" />'


def _step_boxes(xy: list[tuple[float, float]]) -> list[_Box]:
    """The step line's segments as thin boxes, for labels to keep clear of."""
    out = []
    for (ax, ay), (bx, by) in zip(xy, xy[1:]):
        out += [_Box(min(ax, bx), ay - 0.5, max(ax, bx), ay + 0.5), _Box(bx - 0.5, min(ay, by), bx + 0.5, max(ay, by))]
    return out


def _front_legend(width: float) -> str:
    """Which marks are on the size/KLD front, bottom right, on the x axis title's line (no label
    goes that low)."""
    on, off = "Pareto front (size, KLD)", "other"
    x0 = width - 4 - (12 + _text_width(on) + 16 + 12 + _text_width(off))
    x1 = x0 + 12 + _text_width(on) + 16
    yb = _H - 8
    return (f'<g class="legend"><circle cx="{x0 + 4:.1f}" cy="{yb - 4}" r="{_R}" fill="{_BLUE}" />'
            f'<text x="{x0 + 12:.1f}" y="{yb}">{on}</text>'
            f'<circle cx="{x1 + 4:.1f}" cy="{yb - 4}" r="{_R}" fill="white" stroke="{_BLUE}" stroke-width="1.5" />'
            f'<text x="{x1 + 12:.1f}" y="{yb}">{off}</text></g>')


def _nice_step(raw: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``raw``: round axis ticks."""
    if raw <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


# --- one task's accuracy --------------------------------------------------------------------------

_ROW, _ACC_W = 22, 360  # task chart: px per variant row, px of the 0-100% axis


def task_accuracy_svg(task: str, points: list[tuple[str, float, float, float]], chance: float | None = None) -> str:
    """One task's accuracy per variant, ``(name, accuracy, low, high)`` as fractions with a 95%
    interval, as dots with whiskers on a 0-100% axis, one row per variant: whether two variants
    differ beyond sampling noise is whether their whiskers overlap, and a dashed line at
    ``chance`` shows which scores mean nothing."""
    if not points:
        return f"<p>No variant was scored on {escape(task)}.</p>"
    left = max(60.0, max(_text_width(name) for name, *_ in points)) + 16
    top, rows = 24, len(points)
    bottom_y = top + rows * _ROW
    width, height = math.ceil(left + _ACC_W + 24), bottom_y + 44

    def x(frac: float) -> float:
        return left + _ACC_W * _unit(frac)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="task-accuracy" '
             f'data-task="{escape(task)}" width="{width}" height="{height}" font-size="12" role="img" '
             f'aria-label="{escape(task)}: accuracy per variant">']
    for pct in range(0, 101, 20):
        parts.append(f'<line x1="{x(pct / 100):.1f}" y1="{top}" x2="{x(pct / 100):.1f}" y2="{bottom_y}" '
                     'stroke="#e4e4e4" />')
        parts.append(f'<text x="{x(pct / 100):.1f}" y="{bottom_y + 16}" text-anchor="middle">{pct}%</text>')
    parts.append(f'<line x1="{left}" y1="{bottom_y}" x2="{left + _ACC_W}" y2="{bottom_y}" stroke="#999" />')
    parts.append(f'<text x="{left + _ACC_W / 2}" y="{bottom_y + 36}" text-anchor="middle">'
                 f'{escape(task)}: accuracy (95% interval)</text>')
    if chance is not None and math.isfinite(chance):
        cx = x(chance)
        parts.append(f'<line class="chance" x1="{cx:.1f}" y1="{top - 4}" x2="{cx:.1f}" y2="{bottom_y}" '
                     'stroke="#b33" stroke-dasharray="4 3" />')
        parts.append(f'<text x="{cx:.1f}" y="{top - 8}" text-anchor="middle" fill="#b33">chance</text>')
    for i, (name, acc, low, high) in enumerate(points):
        parts += _accuracy_row(name, acc, low, high, top + (i + 0.5) * _ROW, left, x)
    parts.append("</svg>")
    return "\n".join(parts)


def _unit(frac: float) -> float:
    """``frac`` clamped to [0, 1] (NaN to 0), so a bad number cannot draw outside the axis."""
    return min(max(frac, 0.0), 1.0) if math.isfinite(frac) else 0.0


def _accuracy_row(name: str, acc: float, low: float, high: float, yc: float, left: float,
                  x: Callable[[float], float]) -> list[str]:
    """One variant's row: its name right-aligned in the left column, the whisker, the dot."""
    n = escape(name)
    xl, xh = x(min(low, high)), x(max(low, high))
    return [f'<text class="label" data-variant="{n}" x="{left - 10:.1f}" y="{yc + 4:.1f}" text-anchor="end">{n}</text>',
            f'<path class="whisker" data-variant="{n}" d="M{xl:.1f} {yc - 4:.1f} V{yc + 4:.1f} M{xl:.1f} {yc:.1f} '
            f'H{xh:.1f} M{xh:.1f} {yc - 4:.1f} V{yc + 4:.1f}" fill="none" stroke="#555" />',
            f'<circle class="mark" data-variant="{n}" cx="{x(acc):.1f}" cy="{yc:.1f}" r="{_R + 0.5}" fill="{_BLUE}">'
            f'<title>{n}: {100 * acc:.1f}% (95% interval {100 * low:.1f}–{100 * high:.1f}%)</title></circle>']


# --- per-Linear error heat map ---------------------------------------------------------------------

_CELL_H, _HEAT_LEFT, _HEAT_TOP = 13, 44, 24  # heat map: px per layer row, row-label column, header
# viridis at 0, 1/4, 1/2, 3/4, 1, read from light (small error) to dark (large): perceptually even
# and readable with every common colour-vision deficiency, and in greyscale
_RAMP = ((0xfd, 0xe7, 0x25), (0x5e, 0xc9, 0x62), (0x21, 0x91, 0x8c), (0x3b, 0x52, 0x8b), (0x44, 0x01, 0x54))
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def heatmap_svg(variant: str, errors: dict[str, float], measure: str) -> str:
    """One variant's per-Linear error (``errors``: module name to a value of ``measure``, such as
    relative output error) as a grid, a row per layer and a column per module kind (q_proj, ...,
    down_proj, in their first order in ``errors``), light for small errors and dark for the
    largest: which layers and which projections a method hurts shows at a glance. Names without
    a "layers.N." part are left out."""
    grid = _parse_modules(errors)
    if not grid:
        return f"<p>No per-layer errors for {escape(variant)}.</p>"
    layers = sorted({layer for layer, _ in grid.values()})
    columns = list(dict.fromkeys(col for _, col in grid.values()))
    heads = [c.removesuffix("_proj") for c in columns]
    col_w = max(30, math.ceil(max(_text_width(h) for h in heads)) + 8)
    finite = [errors[name] for name in grid if math.isfinite(errors[name])]  # the cells drawn, only
    top_value = max(max(finite, default=0.0), 0.0)
    legend_y = _HEAT_TOP + len(layers) * _CELL_H + 12
    width = math.ceil(max(_HEAT_LEFT + len(columns) * col_w, _HEAT_LEFT + _text_width(measure), _HEAT_LEFT + 150) + 8)
    height = legend_y + 46
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="heatmap" '
             f'data-variant="{escape(variant)}" width="{width}" height="{height}" font-size="12" role="img" '
             f'aria-label="{escape(variant)}: {escape(measure)} per Linear module">',
             f'<text x="{_HEAT_LEFT - 6}" y="{_HEAT_TOP - 8}" text-anchor="end">layer</text>']
    parts += [f'<text x="{_HEAT_LEFT + (j + 0.5) * col_w:.1f}" y="{_HEAT_TOP - 8}" text-anchor="middle">'
              f'<title>{escape(c)}</title>{escape(h)}</text>' for j, (c, h) in enumerate(zip(columns, heads))]
    parts += [f'<text x="{_HEAT_LEFT - 6}" y="{_HEAT_TOP + i * _CELL_H + 10}" text-anchor="end" '
              f'style="font-size: 10px">{layer}</text>' for i, layer in enumerate(layers)]
    row_of, col_of = {layer: i for i, layer in enumerate(layers)}, {c: j for j, c in enumerate(columns)}
    for name, (layer, col) in grid.items():
        value = errors[name]
        fill = _ramp(value / top_value if top_value > 0 else 0.0) if math.isfinite(value) else "#bbbbbb"
        parts.append(f'<rect class="cell" data-module="{escape(name)}" x="{_HEAT_LEFT + col_of[col] * col_w}" '
                     f'y="{_HEAT_TOP + row_of[layer] * _CELL_H}" width="{col_w - 1}" height="{_CELL_H - 1}" '
                     f'fill="{fill}"><title>{escape(name)}: {value:.4g} ({escape(measure)})</title></rect>')
    parts.append(_heat_legend(top_value, measure, legend_y))
    parts.append("</svg>")
    return "\n".join(parts)


def _parse_modules(errors: dict[str, float]) -> dict[str, tuple[int, str]]:
    """Module name to (layer index, last name component), for the names that have a layer."""
    out = {}
    for name in errors:
        m = _LAYER.search(name)
        if m:
            out[name] = (int(m.group(1)), name.rsplit(".", 1)[1])
    return out


def _ramp(t: float) -> str:
    """The colour at ``t`` in [0, 1] along ``_RAMP``, interpolated linearly between its stops."""
    t = min(max(t, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(t), len(_RAMP) - 2)
    f = t - i
    a, b = _RAMP[i], _RAMP[i + 1]
    return "#" + "".join(f"{round(p + (q - p) * f):02x}" for p, q in zip(a, b))


def _heat_legend(top_value: float, measure: str, y: float) -> str:
    """Ten swatches from 0 to the largest value, their two ends labelled, and what is measured."""
    n, sw = 10, 14
    swatches = "".join(f'<rect class="swatch" x="{_HEAT_LEFT + k * sw}" y="{y}" width="{sw}" height="10" '
                       f'fill="{_ramp(k / (n - 1))}" />' for k in range(n))
    return (f'<g class="legend">{swatches}'
            f'<text x="{_HEAT_LEFT}" y="{y + 24}">0</text>'
            f'<text x="{_HEAT_LEFT + n * sw}" y="{y + 24}" text-anchor="end">{top_value:.3g}</text>'
            f'<text x="{_HEAT_LEFT}" y="{y + 40}">{escape(measure)}</text></g>')
