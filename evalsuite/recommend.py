"""Which variant to ship: the smallest (or fastest) one inside the customer's quality budget, and
the size-against-KLD Pareto front every choice should come from.

The budget is read the way a person reads the table: the point estimates against the limits,
every limit at once. A variant outside it is listed with each limit it misses and by how much, so
"none fits" still says what to relax.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from evalsuite.report import VariantRow

Goal = Literal["smallest", "fastest"]
# a limit met but for float rounding is met: 23% - 22% of 100 answers is 0.010000000000000009
_ROUNDING = 1e-9


@dataclass(frozen=True)
class Budget:
    kld: float | None = None  # most mean KLD from the original, nats per token
    top1: float | None = None  # least top-1 agreement with the original, a fraction
    ppl_increase: float | None = None  # most perplexity increase, a fraction of the original's
    task_drop: float | None = None  # most accuracy lost on any task, in accuracy (0.01: one point)

    def describe(self) -> str:
        parts = [f"KLD ≤ {self.kld:g}" if self.kld is not None else "",
                 f"top-1 ≥ {100 * self.top1:g}%" if self.top1 is not None else "",
                 f"perplexity +{100 * self.ppl_increase:g}% at most" if self.ppl_increase is not None else "",
                 f"task accuracy −{100 * self.task_drop:g} points at most" if self.task_drop is not None else ""]
        return ", ".join(p for p in parts if p)


def misses(row: VariantRow, original: VariantRow, budget: Budget) -> list[str]:
    """Each limit of ``budget`` that ``row`` misses, with its value: empty when it fits."""
    s, out = row.scores, []
    if budget.kld is not None and (s.kld is None or s.kld > budget.kld + _ROUNDING):
        out.append(f"KLD {s.kld:.4f} > {budget.kld:g}" if s.kld is not None else "no KLD")
    if budget.top1 is not None and (s.top1 is None or s.top1 < budget.top1 - _ROUNDING):
        out.append(f"top-1 {100 * s.top1:.1f}% < {100 * budget.top1:g}%" if s.top1 is not None else "no top-1")
    if budget.ppl_increase is not None:
        increase = s.ppl / original.scores.ppl - 1
        if increase > budget.ppl_increase + _ROUNDING:
            out.append(f"perplexity +{100 * increase:.1f}% > +{100 * budget.ppl_increase:g}%")
    if budget.task_drop is not None:
        for name, t in row.tasks.items():
            drop = original.tasks[name]["accuracy"] - t["accuracy"]
            if drop > budget.task_drop + _ROUNDING:
                out.append(f"{name} −{100 * drop:.1f} points > −{100 * budget.task_drop:g}")
    return out


def pareto_front(rows: list[VariantRow]) -> list[str]:
    """The variants no other is both smaller than and closer to the original (KLD) than."""
    scored = [r for r in rows if r.scores.kld is not None]
    return [r.name for r in scored
            if not any(o.size_mb <= r.size_mb and o.scores.kld <= r.scores.kld
                       and (o.size_mb, o.scores.kld) != (r.size_mb, r.scores.kld) for o in scored)]


def _speed(row: VariantRow) -> float | None:
    return row.speed["output_tokens_per_s"] if row.speed and row.speed.get("runner") else None


def recommend(rows: list[VariantRow], budget: Budget | None, goal: Goal = "smallest") -> dict:
    """The report's recommendation (``rows[0]`` is the original): the chosen variant or None,
    why, what each other variant misses, and the Pareto front."""
    front = pareto_front(rows)
    if budget is None:
        return {"goal": goal, "budget": None, "variant": None, "misses": {}, "pareto": front,
                "reason": "No quality budget was given; the Pareto front lists the variants worth choosing from."}
    original, variants = rows[0], rows[1:]
    missed = {r.name: misses(r, original, budget) for r in variants}
    if goal == "fastest":
        missed.update({r.name: missed[r.name] + ["no measured speed"] for r in variants if _speed(r) is None})
    fits = [r for r in variants if not missed[r.name]]
    key = (lambda r: (-_speed(r), r.size_mb)) if goal == "fastest" else (lambda r: (r.size_mb, r.scores.kld))
    chosen = min(fits, key=key) if fits else None
    if chosen is None:
        reason = f"No variant meets the budget ({budget.describe()}); ship the original or relax a limit."
    else:
        measure = f"{_speed(chosen):,.0f} output tokens/s" if goal == "fastest" else f"{chosen.size_mb:.2f} MB"
        reason = (f"{chosen.name} is the {goal} variant within the budget ({budget.describe()}): {measure}, "
                  f"{100 * chosen.size_mb / original.size_mb:.0f}% of the original's size.")
    return {"goal": goal, "budget": asdict(budget), "variant": chosen.name if chosen else None,
            "misses": {n: m for n, m in missed.items() if m}, "pareto": front, "reason": reason}
