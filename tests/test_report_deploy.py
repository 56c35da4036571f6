"""A recipe's ``deploy:`` block: validated with the rest of the recipe (one line naming the field),
and planned in the report for the recommended variant: GPUs, layout, p50/p99 TTFT and TPOT, cost
and the command, as ``quantize plan --variants`` plans the finished run."""

import json
import xml.etree.ElementTree as ET

import pytest

from conftest import BUNDLED, TINY, write_recipe
from core.errors import InputError

DEPLOY = {"users": 40, "prompt_tokens": 400, "output_tokens": 100, "ttft": "2s", "tpot": "50ms", "gpu": "l4"}
RECIPE = {
    "model": str(TINY),
    "evaluation": {"text": str(BUNDLED / "eval.txt"), "window": 128, "max_windows": 2},
    "budget": {"kld": 10.0},
    "variants": [
        {"name": "int8", "weights": {"method": "rtn", "bits": 8}, "exports": ["compressed-tensors"]},
        {"name": "int4", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64},
         "exports": ["compressed-tensors"]},
    ],
    "deploy": DEPLOY,
}


def _load(tmp_path, deploy):
    from recipes.schema import load_recipe

    return load_recipe(write_recipe(tmp_path, RECIPE | {"deploy": deploy}))


@pytest.mark.check
def test_the_deploy_block_reads_durations_and_gpu_lists(tmp_path):
    d = _load(tmp_path, DEPLOY | {"ttft": "0.5s", "tpot": 30, "gpu": "l4, a10", "prefix_share": 0.5}).deploy
    assert (d.ttft, d.tpot, d.gpu, d.prefix_share) == (0.5, 0.030, ["l4", "a10"], 0.5)
    assert _load(tmp_path, DEPLOY | {"gpu": "custom:48,960,100, l4"}).deploy.gpu == ["custom:48,960,100", "l4"]
    assert _load(tmp_path, {k: v for k, v in DEPLOY.items() if k not in ("ttft", "gpu")}).deploy.gpu is None


@pytest.mark.check
@pytest.mark.parametrize("change, fragment", [
    ({"users": 0}, "field 'deploy.users': Input should be greater than or equal to 1"),
    ({"ttft": "soon"}, "field 'deploy.ttft': a positive duration, e.g. 500ms or 0.5s"),
    ({"tpot": True}, "field 'deploy.tpot': a positive duration"),
    ({"gpu": "custom:48"}, "field 'deploy.gpu': custom:48: expected custom:MEM_GIB,BANDWIDTH_GBS[,TFLOPS]"),
    ({"tpot": None, "ttft": None}, "field 'deploy': no target: give ttft, tpot or both"),
    ({"gpu": "h1000"}, "field 'deploy.gpu': h1000: unknown GPU"),
    ({"prefix_share": 1}, "field 'deploy.prefix_share': Input should be less than 1"),
    ({"speed": 3}, "unknown field 'deploy.speed'"),
    ({"output_tokens": None}, "field 'deploy.output_tokens': Input should be a valid integer"),
])
def test_a_bad_deploy_field_is_one_line_naming_it(tmp_path, change, fragment):
    with pytest.raises(InputError) as e:
        _load(tmp_path, DEPLOY | change)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.check
def test_a_deployment_longer_than_the_context_is_refused_before_any_work(tmp_path):
    from formats.sources import open_checkpoint
    from recipes.schema import check_against_model

    recipe = _load(tmp_path, DEPLOY | {"prompt_tokens": 2000})
    with pytest.raises(InputError, match=r"field 'deploy.prompt_tokens': 2000 \+ output_tokens 100 .*at most 1948 tokens"):
        check_against_model(recipe, open_checkpoint(recipe.model).arch)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    folder = tmp_path_factory.mktemp("deploy")
    out = folder / "out"
    run_recipe(load_recipe(write_recipe(folder, RECIPE)), out, Console(quiet=True))
    return out, json.loads((out / "report.json").read_text())


def test_the_report_plans_the_recommended_variant(deployed):
    from runner.fit.gpus import catalog

    out, report = deployed
    d = report["deployment"]
    assert d["error"] is None and d["recommended_by"] == "report"
    assert d["variant"] == report["recommendation"]["variant"] == "int4"  # the smallest within the loose budget
    r, p = d["recommendation"], d["recommendation"]["prediction"]
    assert r["meets"] and r["gpu"] == "l4" and r["bytes_measured"]
    # the plan's own numbers: p99 inside the targets, p50 no worse, cost from the catalogue's price
    assert p["ttft_p50"] <= p["ttft_p99"] <= 2.0 and p["tpot_p50"] <= p["tpot_p99"] <= 0.050
    assert r["cost_per_hour"] == pytest.approx(r["gpus"] * catalog()["l4"].price_per_hour)
    assert d["engine"]["engine"] == "vllm" and str(out / "int4" / "compressed-tensors") in d["engine"]["commands"][0]
    md = (out / "report.md").read_text()
    section = md.split("## Deployment\n", 1)[1].split("\n## ", 1)[0]
    assert "40 users at once, 400-token prompts" in section and f"Deploy int4 (the report's recommended variant) on {r['gpus']} x l4" in section
    assert f"TTFT {p['ttft_p50'] * 1000:,.0f} ms p50" in section and f"`{d['engine']['commands'][0]}`" in section
    page = ET.fromstring((out / "report.html").read_text().removeprefix("<!DOCTYPE html>\n"))
    items = page.findall(".//{http://www.w3.org/1999/xhtml}ul[@class='deployment']/{http://www.w3.org/1999/xhtml}li")
    assert any(i.findtext("{http://www.w3.org/1999/xhtml}code") == d["engine"]["commands"][0] for i in items)


def test_a_deployment_no_gpu_meets_is_reported_not_fatal(deployed):
    from recipes.deploy import plan_deployment
    from recipes.schema import Deploy

    out, report = deployed
    d = plan_deployment(Deploy.model_validate(DEPLOY | {"tpot": "0.01ms"}), TINY, report, out)
    assert d["variant"] == "int4" and "relax deploy.tpot to at least" in d["error"]
