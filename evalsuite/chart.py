"""The trade-offs a quantization report is about, drawn: size, and measured speed, against KL
divergence from the original, one point per variant, as SVGs a web page can hold inline (no
scripts, no external files)."""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evalsuite.report import VariantRow

_W, _H = 640, 360  # chart size in px
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 150, 20, 50  # margins: axis labels on the left/bottom, point labels on the right


def size_fidelity_svg(rows: list[VariantRow]) -> str:
    """An SVG scatter of size (MB) against KLD (log scale): lower left is smaller and closer to the
    original. Variants whose KLD rounds to nothing sit on the bottom edge, marked "≈0"."""
    return _fidelity_svg([(r.name, r.size_mb, r.scores.kld) for r in rows if r.scores.kld is not None],
                         "size (MB)", "MB", "size against KL divergence")


def speed_fidelity_svg(rows: list[VariantRow]) -> str:
    """The same against measured output tokens/s: lower right is faster and closer to the original."""
    return _fidelity_svg([(r.name, r.speed["output_tokens_per_s"], r.scores.kld) for r in rows
                          if r.scores.kld is not None and r.speed and r.speed.get("runner")],
                         "output tokens/s", "tokens/s", "speed against KL divergence")


def _fidelity_svg(points: list[tuple[str, float, float]], x_label: str, unit: str, aria: str) -> str:
    if not points:
        return "<p>No variant to compare with the original.</p>"
    positive = [k for _, _, k in points if k > 0]
    floor = min(positive) / 10 if positive else 1e-6
    y_lo, y_hi = math.floor(math.log10(floor)), math.ceil(math.log10(max(positive, default=floor * 10)))
    y_hi = max(y_hi, y_lo + 1)
    step = _nice_step(max(size for _, size, _ in points) * 1.05 / 4)
    x_hi = step * math.ceil(max(size for _, size, _ in points) * 1.05 / step)
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def x(size: float) -> float:
        return _LEFT + plot_w * size / x_hi

    def y(kld: float) -> float:
        return _TOP + plot_h * (y_hi - math.log10(max(kld, floor))) / (y_hi - y_lo)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img" '
             f'aria-label="{aria}">',
             f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999" />']
    for e in range(y_lo, y_hi + 1):
        parts.append(f'<text x="{_LEFT - 6}" y="{y(10.0 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    for i in range(round(x_hi / step) + 1):
        size = step * i
        parts.append(f'<text x="{x(size):.1f}" y="{_H - _BOTTOM + 18}" text-anchor="middle">{size:g}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_H - 8}" text-anchor="middle">{x_label}</text>')
    parts.append(f'<text x="14" y="{_TOP + plot_h / 2}" transform="rotate(-90 14 {_TOP + plot_h / 2})" '
                 'text-anchor="middle">KLD (nats/token)</text>')
    for name, size, kld in points:
        label = escape(name) + (" (≈0)" if kld <= 0 or kld < floor else "")
        parts.append(f'<circle cx="{x(size):.1f}" cy="{y(kld):.1f}" r="4" fill="#3366cc"><title>{escape(name)}: '
                     f'{size:,.2f} {unit}, KLD {kld:.5f}</title></circle>')
        parts.append(f'<text x="{x(size) + 7:.1f}" y="{y(kld) + 4:.1f}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _nice_step(raw: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``raw``: round axis ticks."""
    if raw <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
