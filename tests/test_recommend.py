"""The recommendation: the budget picks what a person would pick from the table."""

import pytest

from conftest import write_recipe
from core.errors import InputError
from evalsuite.metrics import Scores
from evalsuite.recommend import Budget, pareto_front, recommend
from evalsuite.report import VariantRow
from recipes.schema import load_recipe

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


def row(name, size, ppl, kld, top1, acc, tok_s=None):
    speed = {"runner": "engine", "output_tokens_per_s": tok_s} if tok_s else None
    return VariantRow(name, "m", 16 * size / 100, size, Scores(ppl, kld, top1), tasks={"cloze": {"accuracy": acc}},
                      speed=speed)


# name, size MB, perplexity, KLD, top-1, task accuracy, tokens/s: read down the table
TABLE = [
    row("original", 100, 10.0, None, None, 0.50, 100),
    row("int8", 53, 10.01, 0.001, 0.99, 0.50, 130),
    row("int6-big", 60, 10.05, 0.004, 0.97, 0.50, 120),  # larger and worse than int8: off the front
    row("int4", 28, 10.3, 0.03, 0.92, 0.49, 160),
    row("int3", 22, 11.5, 0.12, 0.80, 0.44, 150),
]


@pytest.mark.parametrize("budget, goal, chosen", [
    (Budget(kld=0.01), "smallest", "int8"),  # only the 8-bit one is this close
    (Budget(kld=0.05, top1=0.9, ppl_increase=0.05, task_drop=0.02), "smallest", "int4"),
    (Budget(ppl_increase=0.2, task_drop=0.1), "smallest", "int3"),  # a loose budget takes the smallest
    (Budget(ppl_increase=0.2, task_drop=0.1), "fastest", "int4"),  # int4 runs faster than int3
])
def test_the_budget_picks_the_variant_a_person_would(budget, goal, chosen):
    rec = recommend(TABLE, budget, goal)
    assert rec["variant"] == chosen
    assert chosen not in rec["misses"] and rec["reason"].startswith(f"{chosen} is the {goal} variant")


def test_no_variant_meets_a_tight_budget_and_each_says_what_it_misses():
    rec = recommend(TABLE, Budget(kld=0.0005, task_drop=0.005), "smallest")
    assert rec["variant"] is None and rec["reason"].startswith("No variant meets the budget")
    assert rec["misses"]["int8"] == ["KLD 0.0010 > 0.0005"]
    assert rec["misses"]["int3"] == ["KLD 0.1200 > 0.0005", "cloze −6.0 points > −0.5"]
    assert set(rec["misses"]) == {"int8", "int6-big", "int4", "int3"}


def test_a_limit_met_exactly_is_met():
    """One answer in a hundred lost is a drop of one point, whatever the floats make of 0.23 - 0.22."""
    table = [row("original", 100, 10.0, None, None, 0.23), row("int4", 28, 10.2, 0.02, 0.9, 0.22)]
    assert 0.23 - 0.22 > 0.01
    rec = recommend(table, Budget(kld=0.02, top1=0.9, ppl_increase=0.02, task_drop=0.01))
    assert rec["variant"] == "int4" and rec["misses"] == {}


def test_the_pareto_front_leaves_out_what_another_variant_beats_on_both():
    assert pareto_front(TABLE) == ["int8", "int4", "int3"]
    assert recommend(TABLE, None)["variant"] is None and recommend(TABLE, None)["pareto"] == ["int8", "int4", "int3"]


def test_a_budget_reads_percentages_and_refuses_what_cannot_be_met(tmp_path):
    base = {"model": "m", "evaluation": {"text": "t.txt"}, "variants": [{"name": "a", "weights": {"method": "none"}}]}
    recipe = load_recipe(write_recipe(tmp_path, dict(base, budget={"ppl_increase": "2%", "top1": 0.9})))
    assert recipe.budget.ppl_increase == pytest.approx(0.02) and recipe.budget.top1 == 0.9
    for bad, message in [({"budget": {"kld": "a lot"}}, "budget.kld"),
                         ({"budget": {"top1": "150%"}}, "budget.top1"),
                         ({"budget": {"task_drop": "1%"}}, "task_drop needs tasks"),
                         ({"goal": "fastest"}, "goal 'fastest' needs measured speed"),
                         ({"goal": "cheapest"}, "goal")]:
        with pytest.raises(InputError, match=message):
            load_recipe(write_recipe(tmp_path, dict(base, **bad)))
