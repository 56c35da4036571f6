"""``bits: auto``: the recipe fields and their refusals, the grids the knapsack picks within a budget
of bits per weight, and the mixed checkpoints it writes, read back by transformers (compressed-tensors)
and GPTQModel (GPTQ ``dynamic``) as the weights that were quantized."""

import json
import re

import numpy as np
import pytest
import torch
from rich.progress import Progress
from safetensors.torch import load_file

from conftest import BUNDLED, SMALL_RECIPE, TINY, write_recipe
from calib.text import token_windows
from core.errors import InputError
from formats.gptq import dynamic_overrides
from formats.hf import HFCheckpoint, load_tokenizer
from formats.quantized_folder import fused_name
from helpers.gptqmodel import assert_read_back_exactly, needs_gptqmodel, read_back
from quant.rtn import quantize_rtn
from recipes.bit_search import grid_bits, grid_items, rounding_error, searched_grids, smallest_grids
from recipes.importance import model_imatrix
from recipes.schema import Variant, load_recipe
from recipes.variants import build_variant, plan_variant

MIXED_BITS = ["int4-g128", "int8-g128"]


@pytest.mark.check
@pytest.mark.parametrize("weights, exports, message", [
    ({"method": "gptq", "bits": "four"}, [], "field 'variants[0](v).weights.bits': 'four' is not a width from 2 to 8 bits, nor auto"),
    ({"method": "gptq", "bits": 4.5}, [], "field 'variants[0](v).weights.bits': Input should be a valid integer"),
    ({"method": "gptq", "bits": "auto"}, [], "bits auto needs a budget: bpw"),
    ({"method": "gptq", "bits": "auto", "bpw": 4.5, "group_size": 64}, [], "leave out group_size"),
    ({"method": "rtn", "bits": "auto", "bpw": 4.5, "granularity": "group"}, [], "leave out granularity"),
    ({"method": "gptq", "bits": 4, "bpw": 4.5}, [], "bpw, candidates and sensitivity are for bits auto"),
    ({"method": "gptq", "bits": "auto", "bpw": 5, "candidates": ["int4-g128", "int6-g128"]}, [], "weights.candidates"),
    ({"method": "rtn", "bits": "auto", "bpw": 5, "outliers": {}}, [], "outliers (16-bit weight columns) and bits auto"),
    ({"method": "rtn", "bits": "auto", "bpw": 5}, ["awq"], "a awq export holds one grid, not the mix bits auto chooses; "
                                                             "use compressed-tensors or gptq"),
    ({"method": "awq", "bits": "auto", "bpw": 5}, ["awq"], "a awq export holds one grid, not the mix bits auto chooses"),
    ({"method": "awq", "format": "fp8_e4m3"}, [], "AWQ searches its scales for integer grids: format must be int"),
    ({"method": "rtn", "bits": "auto", "bpw": 5, "candidates": ["16-bit"]}, [], "an integer grid among its candidates, not only 16-bit"),
])
def test_recipe_errors_name_the_field(tmp_path, weights, exports, message):
    variant = {"name": "v", "weights": weights, "exports": exports}
    with pytest.raises(InputError) as e:
        load_recipe(write_recipe(tmp_path, dict(SMALL_RECIPE, variants=[variant])))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.check
def test_bits_auto_is_weight_only(tmp_path):
    variant = {"name": "v", "weights": {"method": "gptq", "bits": "auto", "bpw": 5}, "activations": {}}
    with pytest.raises(InputError, match="bits auto chooses weight-only grids"):
        load_recipe(write_recipe(tmp_path, dict(SMALL_RECIPE, variants=[variant])))


def _variant(bpw: float, candidates: list[str] | None = None, method: str = "rtn", exports: tuple[str, ...] = (),
             sensitivity: str = "proxy") -> Variant:
    """Ranked by the proxy alone unless asked: the selection tests check the knapsack on it."""
    weights = {"method": method, "bits": "auto", "bpw": bpw, "sensitivity": sensitivity} | (
        {"candidates": candidates} if candidates else {})
    return Variant.model_validate({"name": f"{method}-auto", "weights": weights, "exports": list(exports)})


@pytest.fixture(scope="module")
def tiny():
    ckpt = HFCheckpoint.open(TINY)
    windows = token_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 256, 4)
    return ckpt, model_imatrix(ckpt, windows), windows


def _searched(ckpt, variant, imatrix, windows=None):
    return searched_grids(ckpt, variant, ckpt.linear_modules, imatrix, windows, Progress(disable=True))


def _bpw(ckpt, specs) -> float:
    return sum(grid_bits(s, ckpt.shape(n)) for n, s in specs.items()) / sum(np.prod(ckpt.shape(n)) for n in specs)


@pytest.mark.check
def test_a_tighter_budget_keeps_fewer_linears_in_8_bits(tiny):
    ckpt = tiny[0]
    eights = []
    for bpw in (6.5, 5.0):
        specs = _searched(ckpt, _variant(bpw, MIXED_BITS), tiny[1])
        assert len(specs) == 7 * ckpt.arch.layers and _bpw(ckpt, specs) <= bpw
        eights.append(sum(s.bits == 8 for s in specs.values()))
        by_product: dict[str, set] = {}
        for name, spec in specs.items():  # vLLM runs q, k and v (gate and up) as one product: one grid
            by_product.setdefault(fused_name(name.removesuffix(".weight")), set()).add(spec)
        assert all(len(grids) == 1 for grids in by_product.values())
    assert eights[0] > eights[1] > 0 and eights[1] < 7 * ckpt.arch.layers


@pytest.mark.check
def test_the_budget_goes_where_the_calibration_inputs_are_large(tiny):
    """One down_proj whose inputs are 1000 times as large as measured is the one the 8-bit grid goes to
    when the budget buys exactly one product's upgrade."""
    ckpt, imatrix, windows = tiny
    loud = "model.layers.2.mlp.down_proj.weight"
    variant, imatrix = _loud_budget(ckpt, imatrix, MIXED_BITS, loud)
    specs = _searched(ckpt, variant, imatrix)
    assert [n for n, s in specs.items() if s.bits == 8] == [loud]


def _loud_budget(ckpt, imatrix, candidates: list[str], loud: str, exports: tuple[str, ...] = ()):
    """A variant whose budget buys exactly ``loud``'s upgrade from the smallest grid to the next
    candidate, and an importance matrix where ``loud``'s inputs are 1000 times as large as measured."""
    variant = _variant(16, candidates)  # any budget: the smallest grids are what the budget below adds to
    base = smallest_grids(ckpt, variant, ckpt.linear_modules)
    count = sum(np.prod(ckpt.shape(n)) for n in base)
    upgrade = grid_bits(None if "16-bit" in candidates else variant.weights.grids[1], ckpt.shape(loud)) \
        - grid_bits(variant.weights.grids[0], ckpt.shape(loud))
    return (_variant((_bpw(ckpt, base) * count + upgrade) / count + 1e-9, candidates, exports=exports),
            imatrix | {loud: imatrix[loud] * 1000.0})


@pytest.mark.check
def test_the_16_bit_candidate_leaves_the_costliest_product_unquantized(tiny):
    """With ``16-bit`` among the candidates, the budget that buys one product's 16 bits goes to the
    product whose inputs are loudest, which the search then leaves out of the quantized grids."""
    from recipes.bit_search import grid_summary

    ckpt, imatrix, _ = tiny
    loud = "model.layers.2.mlp.down_proj.weight"
    variant, imatrix = _loud_budget(ckpt, imatrix, ["int4-g128", "16-bit"], loud)
    specs = _searched(ckpt, variant, imatrix)
    assert set(ckpt.linear_modules) - {n.removesuffix(".weight") for n in specs} == {loud.removesuffix(".weight")}
    assert grid_summary(specs, 1) == "int4-g128-sym: 41 tensors, 16-bit: 1"


@pytest.mark.check
def test_kld_sensitivity_needs_calibration_text(tiny):
    with pytest.raises(InputError, match="^variant 'rtn-auto': sensitivity kld needs calibration text"):
        _searched(tiny[0], _variant(5, MIXED_BITS, sensitivity="kld"), tiny[1])


@pytest.mark.check
def test_fisher_gains_follow_the_measured_ones(tiny):
    """Each product's KL divergence per unit of proxy, estimated from one forward and backward walk
    (``sensitivity: fisher``) against measured one pass per product (``kld``): the same order across
    the 4 x 5 products, within a factor of 1.5 each (docs/formats.md: 0.96 of it in the median)."""
    from scipy.stats import spearmanr

    from recipes.kld_gains import sensitivity_gains

    ckpt, imatrix, windows = tiny
    items = list(grid_items(ckpt.linear_modules).values())
    spec = _variant(5, MIXED_BITS).weights.grids[0]
    proxies = [sum(rounding_error(ckpt.tensor(n).float(), spec, imatrix.get(n), n) for n in item) for item in items]

    def alone(i):
        return {n: quantize_rtn(ckpt.tensor(n), spec, n) for n in items[i]}

    gains = {way: sensitivity_gains(way, ckpt, proxies, alone, windows, imatrix, Progress(disable=True))
             for way in ("kld", "fisher")}
    assert spearmanr(gains["kld"], gains["fisher"]).statistic > 0.9
    assert np.all(np.abs(np.log(gains["fisher"] / gains["kld"])) < np.log(1.5))


@pytest.mark.check
def test_a_budget_below_the_smallest_mix_is_refused_in_one_line(tiny):
    with pytest.raises(InputError) as e:
        plan_variant(tiny[0], _variant(4.0))
    assert str(e.value) == ("variant 'rtn-auto': a budget of 4 bpw is below the smallest mix of its candidates, "
                            "4.052 bpw (2.390 MB)")


@pytest.mark.check
def test_gptq_dynamic_regexes_match_each_linear_and_the_product_vllm_names():
    from core.schemes import QuantSpec

    g128, g32 = QuantSpec(4, True, "group", 128), QuantSpec(4, True, "group", 32)
    modules = {f"model.layers.0.self_attn.{p}_proj": g32 for p in "qkv"} | {"model.layers.0.self_attn.o_proj": g128,
                                                                            "model.layers.0.mlp.down_proj": g32}
    dynamic = dynamic_overrides(modules, g128)
    assert list(dynamic.values()) == [{"bits": 4, "group_size": 32}] * 2

    def override(name):
        return next((v for k, v in dynamic.items() if re.match(k.removeprefix("+:"), name)), None)
    for name in [*modules, "model.layers.0.self_attn.qkv_proj"]:
        assert override(name) == (None if name.endswith("o_proj") else {"bits": 4, "group_size": 32}), name
    assert override("model.layers.10.self_attn.q_proj") is None and override("model.layers.0.mlp.down_proj_x") is None


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """GPTQ bits auto among 4- and 8-bit grids (each Linear's proxy scaled by its measured KL divergence),
    written as compressed-tensors, GPTQ and float safetensors."""
    ckpt, imatrix, windows = tiny
    out = tmp_path_factory.mktemp("bits")
    variant = _variant(4.6, ["int4-g32", "int4-g128", "int8-g128"], "gptq", ("safetensors", "compressed-tensors", "gptq"),
                       sensitivity="kld")
    built = build_variant(ckpt, variant, out, imatrix=imatrix, calibration=windows)
    return out / variant.name, built


def test_compressed_tensors_holds_a_config_group_per_grid_that_transformers_reads_back(mixed):
    from compressed_tensors.compressors.base import decompress_module
    from transformers import AutoModelForCausalLM

    folder, built = mixed
    groups = json.loads((folder / "compressed-tensors" / "config.json").read_text())["quantization_config"]["config_groups"]
    grids = {(g["weights"]["num_bits"], g["weights"]["group_size"]) for g in groups.values()}
    assert len(groups) == len(grids) >= 2 and 8 in {bits for bits, _ in grids}, groups
    ours = load_file(str(folder / "safetensors" / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(folder / "compressed-tensors", dtype=torch.float16)
    read = 0
    for name, module in model.named_modules():
        if hasattr(module, "quantization_scheme"):
            decompress_module(module)
            assert torch.equal(module.weight.float(), ours[f"{name}.weight"].half().float()), name
            read += 1
    assert read == 7 * 6 and "int8-g128-sym" in built.types_chosen


@needs_gptqmodel
def test_gptqmodel_reads_the_dynamic_overrides_back(mixed):
    folder, _ = mixed
    config = json.loads((folder / "gptq" / "quantize_config.json").read_text())
    assert config["dynamic"] and {v["bits"] for v in config["dynamic"].values()} | {config["bits"]} == {4, 8}
    assert_read_back_exactly(read_back(folder, "gptq"))


@pytest.mark.parametrize("export", ["compressed-tensors", "gptq"])
def test_a_mix_of_grids_reads_back_as_its_weights_and_the_engine_runs_it(mixed, export):
    """Our reader of quantized checkpoints (the engine, a recipe's model, ``quantize inspect``) reads
    each Linear on its own grid: every weight is the variant's, ``quantize inspect`` counts each
    packed tensor's weights by its grid's bits, and the engine, on the codes, gives the greedy
    tokens of the variant's dense export."""
    from formats.inspect import inspect_file
    from formats.sources import open_checkpoint
    from helpers.engine import prompts_from_text
    from runner import LLM, SamplingParams

    folder, _ = mixed
    ckpt = open_checkpoint(folder / export)
    ours = load_file(str(folder / "safetensors" / "model.safetensors"))
    assert len({ckpt.payload(name).spec for name in ckpt.quantized}) >= 2 and "mixed" in ckpt.label, ckpt.label
    for name in ckpt.quantized:
        assert torch.equal(ckpt.tensor(name).half(), ours[name].half()), name

    packed = ".weight_packed" if export == "compressed-tensors" else ".qweight"
    counted = {t.name.removesuffix(packed): t.weights for t in inspect_file(folder / export / "model.safetensors").tensors
               if t.name.endswith(packed)}
    assert counted == {name.removesuffix(".weight"): int(np.prod(ckpt.shape(name))) for name in ckpt.quantized}

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    runs, kinds = {}, {}
    for source in (export, "safetensors"):
        llm = LLM(folder / source, dtype="fp32", kv_memory=16 * 2**20)
        runs[source] = llm.generate(prompts_from_text()[:4], params)
        kinds[source] = {linear.kind for layer in llm.engine.model.layers for m in ("qkv", "o", "gate_up", "down")
                         for linear in layer[m]}
    assert len(kinds[export]) >= 2 and kinds["safetensors"] == {"dense"}, kinds
    assert [o.token_ids for o in runs[export]] == [o.token_ids for o in runs["safetensors"]]
    for a, b in zip(runs[export], runs["safetensors"]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def with_16_bit(tiny, tmp_path_factory):
    """RTN bits auto between int4 g128 and 16 bits, whose budget buys layer 2's down_proj its 16 bits,
    written as compressed-tensors, GPTQ and float safetensors."""
    ckpt, imatrix, windows = tiny
    loud = "model.layers.2.mlp.down_proj.weight"
    variant, imatrix = _loud_budget(ckpt, imatrix, ["int4-g128", "16-bit"], loud, ("safetensors", "compressed-tensors", "gptq"))
    out = tmp_path_factory.mktemp("bits16")
    build_variant(ckpt, variant, out, imatrix=imatrix, calibration=windows)
    return out / variant.name, loud


@pytest.mark.parametrize("export", ["compressed-tensors", "gptq"])
def test_a_mix_of_4_and_16_bit_linears_reads_back_and_the_engine_runs_it(with_16_bit, export):
    """The Linear the search left in 16 bits is read back as a float weight (compressed-tensors'
    ignore list, GPTQ's ``-:`` override), the others as their codes, and the engine runs the file
    as it runs the variant's dense export."""
    from formats.sources import open_checkpoint
    from helpers.engine import prompts_from_text
    from runner import LLM, SamplingParams

    folder, loud = with_16_bit
    ckpt = open_checkpoint(folder / export)
    ours = load_file(str(folder / "safetensors" / "model.safetensors"))
    assert loud not in ckpt.quantized and len(ckpt.quantized) == 7 * 6 - 1
    for name in [*ckpt.quantized, loud]:
        assert torch.equal(ckpt.tensor(name).half(), ours[name].half()), name
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for source in (export, "safetensors"):
        llm = LLM(folder / source, dtype="fp32", kv_memory=16 * 2**20)
        runs[source] = llm.generate(prompts_from_text()[:4], params)
        if source == export:
            kinds = [linear.kind for linear in llm.engine.model.layers[2]["down"]]
            assert kinds == ["dense"] and llm.engine.model.layers[1]["down"][0].kind != "dense", kinds
    assert [o.token_ids for o in runs[export]] == [o.token_ids for o in runs["safetensors"]]
    for a, b in zip(runs[export], runs["safetensors"]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_inspect_shows_a_mix_whose_override_it_cannot_read_without_a_scheme(mixed, tmp_path):
    """A ``dynamic`` regex that does not compile: ``quantize inspect`` lists the tensors as it does
    for any scheme it does not know, and opening the folder is refused in one line."""
    import shutil

    from formats.inspect import inspect_file
    from formats.sources import open_checkpoint

    folder = tmp_path / "gptq"
    shutil.copytree(mixed[0] / "gptq", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {"+:model.(layers": {"bits": 8}}
    (folder / "config.json").write_text(json.dumps(config))
    summary = inspect_file(folder / "model.safetensors")
    assert summary.quantization is None and summary.tensors
    with pytest.raises(InputError) as e:
        open_checkpoint(folder)
    assert "a regex that does not compile" in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def awq_mixed(tiny, tmp_path_factory):
    """AWQ bits auto among 4- and 8-bit grids (asymmetric, AWQ's default), as compressed-tensors, GPTQ (v2, zero-points
    as stored) and float safetensors."""
    ckpt, imatrix, windows = tiny
    out = tmp_path_factory.mktemp("awq-bits")
    variant = _variant(5.0, ["int4-g32", "int4-g128", "int8-g128"], "awq", ("safetensors", "compressed-tensors", "gptq"))
    return ckpt, out / variant.name, build_variant(ckpt, variant, out, imatrix=imatrix, calibration=windows)


def test_awq_bits_auto_writes_zero_pointed_grids_that_compressed_tensors_decompresses_to_its_weights(awq_mixed):
    """transformers cannot load an asymmetric mix (its packed path wants unpacked zero-points, its
    dequantizing path one grid), so compressed-tensors' own decompressor reads each Linear."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    ckpt, folder, built = awq_mixed
    config = json.loads((folder / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    groups = config["config_groups"]
    assert len(groups) >= 2 and not any(g["weights"]["symmetric"] for g in groups.values()), groups
    packed = load_file(str(folder / "compressed-tensors" / "model.safetensors"))
    ours = load_file(str(folder / "safetensors" / "model.safetensors"))
    compressor = BaseCompressor.load_from_registry(config["format"])
    read, bits = 0, 0.0
    for group in groups.values():
        scheme = QuantizationScheme.model_validate({"targets": group["targets"], "weights": group["weights"]})
        for module in (k.removesuffix(".weight_packed") for k in packed if k.endswith(".weight_packed")):
            if not any(re.fullmatch(t.removeprefix("re:"), module) for t in group["targets"]):
                continue
            state = {k.removeprefix(f"{module}."): v for k, v in packed.items() if k.startswith(f"{module}.")}
            assert "weight_zero_point" in state, module
            weight = compressor.decompress(state, scheme)["weight"]
            assert torch.equal(weight.half(), ours[f"{module}.weight"].half()), module
            spec_bits, size = group["weights"]["num_bits"], group["weights"]["group_size"]
            out, n_in = ckpt.shape(f"{module}.weight")
            bits += out * (n_in * spec_bits + n_in // size * (16 + spec_bits))
            read += 1
    assert read == 7 * 6
    assert bits / sum(np.prod(ckpt.shape(f"{m}.weight")) for m in ckpt.linear_modules) <= 5.0
    assert "-asym" in built.types_chosen and "int8" in built.types_chosen, built.types_chosen


@needs_gptqmodel
def test_gptqmodel_reads_awqs_zero_pointed_mix_back(awq_mixed):
    _, folder, _ = awq_mixed
    config = json.loads((folder / "gptq" / "quantize_config.json").read_text())
    assert config["dynamic"] and not config["sym"], config
    assert_read_back_exactly(read_back(folder, "gptq"))
