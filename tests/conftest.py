"""Shared fixtures: the bundled model and one small recipe run that several tests inspect."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

# Triton decides when it is imported whether its kernels run interpreted; transformers imports it
# (through torch._dynamo) long before a test asks. Without a GPU, the engine's Triton kernels are
# tested in the interpreter (tests/test_paged_attention.py), so it is switched on here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "recipes" / "bundled"
TINY = BUNDLED / "tiny"
EVAL_TEXT = BUNDLED / "eval.txt"

SMALL_RECIPE = {
    "model": str(TINY),
    "evaluation": {"text": str(EVAL_TEXT), "window": 512, "max_windows": 2},
    "calibration": {"text": str(BUNDLED / "calib.txt"), "max_windows": 16},
    "variants": [
        {"name": "int8", "weights": {"method": "rtn", "bits": 8}, "exports": ["safetensors", "compressed-tensors", "gptq"]},
        {"name": "int4-g64-asym",
         "weights": {"method": "rtn", "bits": 4, "symmetric": False, "granularity": "group", "group_size": 64},
         "exports": ["safetensors", "compressed-tensors"]},
        {"name": "gptq-int4-g64-asym",
         "weights": {"method": "gptq", "bits": 4, "symmetric": False, "group_size": 64, "act_order": True},
         "exports": ["safetensors", "gptq"]},
        {"name": "awq-int4-g64", "weights": {"method": "awq", "bits": 4, "group_size": 64},
         "exports": ["safetensors", "compressed-tensors", "awq"]},
        {"name": "int4-g64-outliers",
         "weights": {"method": "rtn", "bits": 4, "symmetric": False, "granularity": "group", "group_size": 64,
                     "outliers": {"relative": 2.0}}},
        {"name": "w8a8-smoothquant", "weights": {"method": "rtn", "bits": 8}, "activations": {"format": "int8"},
         "exports": ["safetensors", "compressed-tensors"]},
        {"name": "kv-int4", "weights": {"method": "none"}, "kv_cache": {"format": "int4"}},
        {"name": "f16", "weights": {"method": "gguf", "type": "F16"}, "exports": ["gguf"]},
        {"name": "q8_0", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"]},
        {"name": "q4_k_m-imatrix", "weights": {"method": "gguf", "type": "Q4_K_M", "imatrix": True}, "exports": ["gguf"]},
    ],
}


def tiny_with(folder: Path, changes: dict) -> Path:
    """A copy of the bundled model in ``folder`` with some tensors replaced (name -> tensor, stored
    in its own dtype)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    state = load_file(TINY / "model.safetensors")
    state.update({n: t.contiguous() for n, t in changes.items()})
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def output_change(original, quantized, module: str, windows) -> float:
    """‖y' - y‖ / ‖y‖ of one Linear's outputs over ``windows``, each model fed its own inputs: what
    a quantizer's recorded relative output error claims, measured by running both models."""
    import torch

    outputs = []
    for model in (original, quantized):
        seen = []
        handle = model.get_submodule(module).register_forward_hook(lambda m, args, out: seen.append(out.detach()))
        with torch.inference_mode():
            model(input_ids=windows)
        handle.remove()
        outputs.append(torch.cat(seen).double())
    return ((outputs[1] - outputs[0]).norm() / outputs[0].norm()).item()


def write_recipe(folder: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def small_run() -> tuple[Path, dict]:
    """Run SMALL_RECIPE once through the real pipeline; return (output folder, report.json). Its
    folder lies outside pytest's base folder, whose module folders are removed as each module ends
    (below), and is removed when the session ends."""
    import shutil
    import tempfile

    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    folder = Path(tempfile.mkdtemp(prefix="quantbench-small-run-"))
    recipe = load_recipe(write_recipe(folder, SMALL_RECIPE))
    out = folder / "out"
    run_recipe(recipe, out, Console(quiet=True))
    yield out, json.loads((out / "report.json").read_text())
    shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- disk
# CI's machine shares its disk and has had under 10 GB free; the suite's module fixtures write
# models, GGUF files and checkpoints worth over 10 GB in all. So what a module's tests wrote under
# pytest's base folder is removed when the module ends, unless one of its tests failed (then it
# is kept to look at). Each test's own tmp_path goes when it passes (pyproject.toml's
# tmp_path_retention_policy).
_module_started: dict[str, tuple[set[str], int]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    module = item.nodeid.split("::")[0]
    if module not in _module_started:
        base = item.config._tmp_path_factory.getbasetemp()
        _module_started[module] = ({p.name for p in base.iterdir()}, item.session.testsfailed)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's fixtures are torn down by now when nextitem lies in another module
    module = item.nodeid.split("::")[0]
    if (nextitem is not None and nextitem.nodeid.split("::")[0] == module) or module not in _module_started:
        return
    before, failed = _module_started.pop(module)
    if item.session.testsfailed == failed:
        import shutil

        for path in item.config._tmp_path_factory.getbasetemp().iterdir():
            if path.name not in before:  # a folder, or pytest's "<name>current" link to the newest
                path.unlink() if path.is_symlink() else shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- tiers (docs/testing.md)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    """A module puts single parametrized cases in the fast tier by id, where a mark on a parameter
    would take in every case sharing it: ``CHECK_CASES = {"test_x[tiny-Q4_K_M-imatrix]"}``. A test
    both in the fast tier and needing an anchor is an error (the fast tier runs without them)."""
    for item in items:
        if item.name in getattr(getattr(item, "module", None), "CHECK_CASES", ()):
            item.add_marker(pytest.mark.check)
    both = [item.nodeid for item in items if item.get_closest_marker("check") and item.get_closest_marker("anchor")]
    if both:
        raise pytest.UsageError(f"marked both check and anchor (the fast tier runs without anchors): {both}")
    # small_run builds ten variants (about 6 minutes on a loaded 2-core machine): the fast tier never pays for it
    heavy = [item.nodeid for item in items if item.get_closest_marker("check") and "small_run" in getattr(item, "fixturenames", ())]
    if heavy:
        raise pytest.UsageError(f"in the fast tier but using the small_run fixture (minutes to build): {heavy}")
