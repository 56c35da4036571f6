"""A recipe's ``speed``: every variant that can run does the same workload where its files run (the
engine for the original, a KV cache and compressed-tensors exports; llama.cpp for GGUF), and the
report shows tokens/s, TTFT and TPOT, a speed-against-fidelity chart, and why the rest have none."""

import json
import xml.etree.ElementTree as ET

import pytest

from conftest import BUNDLED, TINY, write_recipe

RECIPE = {
    "model": str(TINY),
    "evaluation": {"text": str(BUNDLED / "eval.txt"), "window": 128, "max_windows": 2},
    "speed": {"requests": 4, "concurrency": 2, "prompt_tokens": [16, 32], "output_tokens": [4, 8]},
    "variants": [
        {"name": "int4", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64},
         "exports": ["compressed-tensors"]},
        {"name": "q8_0", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"]},
        {"name": "kv-int8", "weights": {"method": "none"}, "kv_cache": {"format": "int8"}},
        {"name": "dense-only", "weights": {"method": "rtn", "bits": 8}, "exports": ["safetensors"]},
    ],
}


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    folder = tmp_path_factory.mktemp("speed")
    out = folder / "out"
    run_recipe(load_recipe(write_recipe(folder, RECIPE)), out, Console(quiet=True))
    return out, json.loads((out / "report.json").read_text())


def test_every_runnable_variant_is_timed_where_its_files_run(timed_run):
    _, report = timed_run
    speed = {r["name"]: r["speed"] for r in report["variants"]}
    assert speed["original"]["runner"] == "quantbench" and speed["kv-int8"]["runner"] == "quantbench"
    assert speed["int4"]["runner"] == "quantbench" and speed["q8_0"]["runner"] == "llama.cpp"
    for name in ("original", "int4", "q8_0", "kv-int8"):
        s = speed[name]
        assert s["output_tokens_per_s"] > 0 and 0 < s["ttft_ms"] and s["tpot_ms"] > 0, (name, s)
    assert speed["q8_0"]["concurrency"] == 1 and speed["int4"]["concurrency"] == 2
    assert speed["dense-only"] == {"runner": None, "note": "no export that runs as the variant itself (compressed-tensors, GPTQ or GGUF)"}


def test_the_report_shows_speed_beside_quality(timed_run):
    out, _ = timed_run
    md = (out / "report.md").read_text()
    assert "| tok/s | TTFT ms | TPOT ms | runner |" in md and "llama.cpp x1" in md and "quantbench x2" in md
    assert "- dense-only: no speed: no export that runs" in md
    page = ET.fromstring((out / "report.html").read_text().removeprefix("<!DOCTYPE html>\n"))
    svgs = [s for s in page.findall(".//{http://www.w3.org/2000/svg}svg") if s.get("data-chart") != "heatmap"]
    assert [s.get("aria-label") for s in svgs] == ["size against KL divergence", "speed against KL divergence"]
    labels = {t.text for t in svgs[1].iter("{http://www.w3.org/2000/svg}text")}
    assert {"int4", "q8_0", "kv-int8"} <= labels and "dense-only" not in labels


def test_a_rerun_keeps_the_measured_speed(timed_run, tmp_path):
    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    out, report = timed_run
    again = run_recipe(load_recipe(write_recipe(tmp_path, RECIPE)), out, Console(quiet=True))
    assert [r.speed for r in again.rows] == [r["speed"] for r in report["variants"]]
