"""The report's deployment section: the recipe's ``deploy:`` load planned for the variant the
report recommends, as ``quantize plan --variants`` would plan it from the finished run.

With no variant recommended (no budget was given), every variant is a candidate and the plan
picks the cheapest that meets the targets. A plan no hardware meets is a finding of the report,
not a failed job: the section holds the planner's one line naming what to relax.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import InputError
from recipes.schema import Deploy
from runner.fit.gpus import catalog, resolve_gpu
from runner.fit.model_shape import load_model_shape
from runner.plan.cli import PlanRequest, plan_variants
from runner.plan.variants import report_variants


def plan_deployment(deploy: Deploy, model: Path, report: dict, out_dir: Path) -> dict:
    """``deploy``'s plan for ``report``'s recommended variant of ``model`` (its files under
    ``out_dir``): the query, the variant, the recommendation (GPUs, layout, p50/p99 predictions,
    cost), the engine and its commands; or the query and an ``error`` line."""
    query = {"users": deploy.users, "prompt_tokens": deploy.prompt_tokens, "output_tokens": deploy.output_tokens,
             "ttft_s": deploy.ttft, "tpot_s": deploy.tpot, "gpus": deploy.gpu, "prefix_share": deploy.prefix_share,
             "percentile": "p99"}
    chosen = (report.get("recommendation") or {}).get("variant")
    try:
        shape = load_model_shape(str(model))
        variants, budget = report_variants(report, out_dir, shape, "the report")
        if chosen is not None:
            variants = [v for v in variants if v.name == chosen]
        request = PlanRequest(str(model), deploy.users, deploy.prompt_tokens, deploy.output_tokens, deploy.ttft, deploy.tpot,
                              deploy.gpu, None, deploy.prefix_share, ["fp16"])
        gpus = [resolve_gpu(g) for g in deploy.gpu] if deploy.gpu else list(catalog().values())
        plan = plan_variants(request, shape, variants, budget, gpus).as_dict()
    except InputError as e:
        return {"query": query, "variant": chosen, "error": _fields(str(e))}
    return {"query": query, "variant": plan["recommendation"]["variant"], "recommended_by": "report" if chosen else "plan",
            "recommendation": plan["recommendation"], "engine": plan["engine"],
            "split_pays_from_users": plan["disaggregation"]["split_pays_from_users"], "error": None}


_FLAGS = {"--ttft": "deploy.ttft", "--tpot": "deploy.tpot", "--prefix-share": "deploy.prefix_share",
          "--prompt-tokens": "deploy.prompt_tokens", "--output-tokens": "deploy.output_tokens"}


def _fields(message: str) -> str:
    """The planner's line with its command-line flags named as the recipe's fields."""
    for flag, field in _FLAGS.items():
        message = message.replace(flag, field)
    return message
