"""Variants built on the working device (core/device.py): the policy, the build that reads and
quantizes tensors ahead of its writers (core/overlap.py) writing the serial build's bytes, the
quantizers on CUDA choosing the CPU's codes, and bench/recipe_gpu.py's smoke run."""

import importlib.util
import json
import threading
import time

import pytest
import torch

import recipes.variants as variants
from calib.text import sample_windows
from conftest import BUNDLED, REPO, TINY
from core.device import overlap_workers, working_device
from core.overlap import Behind, ordered_map
from core.schemes import QuantSpec
from core.tensors import all_finite
from formats.hf import HFCheckpoint, load_tokenizer
from quant.gptq import GPTQSettings, gptq_quantize
from quant.rtn import quantize_rtn
from recipes.schema import Variant

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.check
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's policy")
def test_without_a_gpu_the_work_stays_on_the_cpu_and_nothing_runs_ahead():
    assert working_device() == torch.device("cpu")
    assert overlap_workers() == 0


@cuda
def test_with_a_gpu_the_work_goes_there_and_the_next_tensors_are_prepared_ahead():
    assert working_device().type == "cuda"
    assert overlap_workers() > 0


@pytest.mark.check
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_all_finite_agrees_with_isfinite(device):
    """The one-read scan that the quantizers and the pass-through check run on whole weights."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = torch.randn(64, 96, generator=gen).to(dtype)
        cases = [w, w[:0], w[:, 5]]
        for bad in (float("nan"), float("inf"), -float("inf")):
            for at in ((0, 0), (63, 95), (17, 40)):
                spoilt = w.clone()
                spoilt[at] = bad
                cases.append(spoilt)
        for x in cases:
            x = x.to(device)
            assert all_finite(x) == bool(torch.isfinite(x).all())
    assert all_finite(torch.arange(10, device=device))


@pytest.mark.check
def test_ordered_map_keeps_the_order_holds_few_at_once_and_raises_where_consumed():
    running, peak, lock = [0], [0], threading.Lock()

    def slow_square(x: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01 * (x % 3))  # later items finish first sometimes
        with lock:
            running[0] -= 1
        return x * x

    assert list(ordered_map(slow_square, range(12), 2)) == [x * x for x in range(12)]
    assert 1 < peak[0] <= 2  # really concurrent, and bounded by ``ahead``
    assert list(ordered_map(slow_square, range(5), 0)) == [0, 1, 4, 9, 16]

    def fails_at_3(x: int) -> int:
        if x == 3:
            raise ValueError("three")
        return x

    got = []
    with pytest.raises(ValueError, match="three"):
        for x in ordered_map(fails_at_3, range(8), 2):
            got.append(x)
    assert got == [0, 1, 2]


@pytest.mark.check
def test_behind_runs_calls_in_order_beside_the_caller_and_raises_their_errors():
    done: list[int] = []
    with Behind(1) as behind:
        for i in range(6):
            behind.submit(lambda i=i: (time.sleep(0.005), done.append(i)))
        assert len(done) >= 4  # each submit waited for all but the newest call
    assert done == list(range(6))
    with Behind(0) as inline:
        inline.submit(lambda: done.append(threading.current_thread() is threading.main_thread()))
    assert done[-1] is True

    def boom() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        with Behind(1) as behind:
            behind.submit(boom)


RTN = {"name": "rtn", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64},
       "exports": ["compressed-tensors"]}
VARIANTS = [
    pytest.param(RTN, id="rtn"),
    pytest.param({"name": "q4km", "weights": {"method": "gguf", "type": "Q4_K_M"}, "exports": ["gguf"]}, id="q4km",
                 marks=pytest.mark.check),
    pytest.param({"name": "gptq", "weights": {"method": "gptq", "bits": 4, "group_size": 64}, "exports": ["gptq"]}, id="gptq",
                 marks=pytest.mark.check),
]


@pytest.mark.parametrize("spec", VARIANTS)
def test_the_build_reading_ahead_writes_the_serial_builds_files(tmp_path, monkeypatch, spec):
    """With a GPU, tensors are read and quantized ahead of the writers, and a fitted layer's
    tensors are written while the next layer is fitted (GPTQ): here, on the CPU, the same threads."""
    ckpt, variant = HFCheckpoint.open(TINY), Variant.model_validate(spec)
    windows = sample_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 64, 4) if variant.needs_calibration else None
    built = {}
    for ahead in (0, 2):
        monkeypatch.setattr(variants, "overlap_workers", lambda: ahead)
        out = tmp_path / f"ahead-{ahead}"
        result = variants.build_variant(ckpt, variant, out, keep=out / "kept", calibration=windows)
        built[ahead] = {p.relative_to(out): p.read_bytes() for f in result.files for p in ([f] if f.is_file() else sorted(f.rglob("*")))
                        if p.is_file()}
        built[ahead, "errors"] = result.linear_errors
    assert built[0] and built[0] == built[2]
    assert built[0, "errors"] == built[2, "errors"]


def _layer(out: int = 256, n_in: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, n_in, generator=gen) * torch.linspace(0.2, 3.0, n_in)  # uneven input energy
    return torch.randn(out, n_in, generator=gen) * 0.02, 2 * x.T @ x / len(x)


@cuda
@pytest.mark.parametrize("spec", [QuantSpec(4, True, "group", 128), QuantSpec(4, False, "group", 64), QuantSpec(8, True, "channel"),
                                  QuantSpec(4, True, "group", 64, format="nf4"), QuantSpec(8, True, "channel", format="fp8_e4m3")])
def test_rtn_on_cuda_chooses_the_cpus_codes(spec):
    weight, _ = _layer()
    cpu, gpu = quantize_rtn(weight, spec), quantize_rtn(weight.cuda(), spec)
    assert torch.equal(gpu.scales.cpu(), cpu.scales)  # the same float32 operations, each rounded once
    assert torch.equal(gpu.codes.cpu(), cpu.codes)


@cuda
@pytest.mark.parametrize("act_order, static_groups", [(False, False), (True, False), (True, True)])
def test_gptq_on_cuda_chooses_the_cpus_codes(act_order, static_groups):
    weight, hessian = _layer()
    spec, settings = QuantSpec(4, True, "group", 128), GPTQSettings(act_order=act_order, static_groups=static_groups)
    cpu = gptq_quantize(weight, hessian, spec, settings)
    gpu = gptq_quantize(weight.cuda(), hessian.cuda(), spec, settings)
    assert gpu.tensor.codes.is_cuda
    assert (gpu.tensor.codes.cpu() == cpu.tensor.codes).float().mean() >= 0.999
    assert gpu.damp == cpu.damp and gpu.loss == pytest.approx(cpu.loss, rel=1e-3)
    if cpu.tensor.group_index is not None:
        assert torch.equal(gpu.tensor.group_index.cpu(), cpu.tensor.group_index)


@cuda
def test_the_rtn_method_quantizes_on_the_gpu_and_hands_back_cpu_codes():
    ckpt, variant = HFCheckpoint.open(TINY), Variant.model_validate(RTN)
    method = variants.method_of(variant.weights)
    plan = method.plan(ckpt, variant, False)
    name = sorted(plan.quantized)[0]
    got = method.quantize(ckpt, variant, plan, name, ckpt.tensor(name), None)
    assert got.codes.device.type == "cpu"
    assert (got.codes == quantize_rtn(ckpt.tensor(name), variant.weights.spec).codes).float().mean() >= 0.999


def test_the_recipe_bench_times_every_stage_and_extrapolates_from_two_cuts(tmp_path):
    spec = importlib.util.spec_from_file_location("recipe_gpu", REPO / "bench" / "recipe_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.jsonl"
    rows = bench.main(["--shape", "small", "--out", str(out), "--keep", str(tmp_path / "models")])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    measured = [r for r in rows if "layers" in r]
    assert {(r["stage"], r["layers"]) for r in measured} == {(s, n) for s in {r["stage"] for r in measured} for n in (1, 2)}
    assert len({r["stage"] for r in measured}) == 5 and all(r["seconds"] > 0 for r in measured)
    estimates = [r for r in rows if "per_layer_s" in r]
    assert len(estimates) == 5
    for r in estimates:
        assert r["at_32_layers_s"] == pytest.approx(r["fixed_s"] + 32 * r["per_layer_s"], abs=0.1)
    assert rows[-1]["at_32_layers_s"] == pytest.approx(sum(r["at_32_layers_s"] for r in estimates), abs=0.3)
    assert bench.extrapolate({1: 3.0, 2: 5.0}, 32) == (2.0, 1.0, 65.0)
