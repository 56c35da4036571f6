"""Float number formats (fp8 e4m3/e5m2, nf4/fp4 as bitsandbytes has them), the percentile range,
and square-block granularity."""

import pytest
import torch

from conftest import TINY, write_recipe
from core.errors import InputError
from core.schemes import FOUR_BIT_CODES, QuantSpec, code_values
from formats.hf import HFCheckpoint
from quant.rtn import quantize_rtn, round_to_grid
from recipes.schema import load_recipe

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

REAL_WEIGHT = "model.layers.2.mlp.down_proj.weight"  # [256, 768], bf16


def normal(out=64, n_in=256, seed=0):
    return torch.randn(out, n_in, generator=torch.Generator().manual_seed(seed))


# --- nf4 / fp4: bitsandbytes' own quantizer is the reference -------------------------------------


def bnb_4bit(w: torch.Tensor, blocksize: int, quant_type: str):
    """bitsandbytes' codes (unpacked: the first of each pair is the high nibble), absmax and
    dequantized weights for ``w`` quantized in blocks of ``blocksize`` consecutive elements. It
    gets ``w`` in float32, so that it dequantizes to float32 as we do (it computes in float32 and
    would round its output to ``w``'s dtype)."""
    F = pytest.importorskip("bitsandbytes.functional")
    packed, state = F.quantize_4bit(w.float(), blocksize=blocksize, quant_type=quant_type)
    packed = packed.reshape(-1)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(w.shape)
    return codes, state.absmax, F.dequantize_4bit(packed.unsqueeze(1), state)


def with_ties(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` with its first row made of exact ties: a block whose absmax is 1, holding every
    midpoint between neighbouring code values, zeros of both signs and values just around 0."""
    w = w.clone()
    table = FOUR_BIT_CODES[fmt].sort().values
    row = torch.cat([torch.tensor([1.0, 0.0, -0.0, 1e-4, -1e-4, 0.002, -0.002]), (table[:-1] + table[1:]) / 2])
    w[0, : len(row)] = row.to(w.dtype)
    w[0, len(row) : 128] = 0.0  # the whole block, at either block size: its absmax stays 1
    return w


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("source", ["normal", "real"])
def test_4bit_codes_scales_and_values_equal_bitsandbytes(fmt, blocksize, source):
    if source == "normal":
        w = with_ties(normal(), fmt)
    else:
        w = HFCheckpoint.open(TINY).tensor(REAL_WEIGHT)  # bf16: we quantize it as given
    codes, absmax, values = bnb_4bit(w, blocksize, fmt)
    q = quantize_rtn(w, QuantSpec(4, True, "group", blocksize, format=fmt))
    assert q.codes.dtype == torch.uint8
    assert torch.equal(q.codes, codes)
    assert torch.equal(q.scales.reshape(-1), absmax)  # float32 absmax, no fp16 rounding
    assert torch.equal(q.dequantize(), values)


def test_4bit_tables_are_bitsandbytes_tables():
    F = pytest.importorskip("bitsandbytes.functional")
    for fmt, table in FOUR_BIT_CODES.items():
        assert torch.equal(table, F.get_4bit_type(fmt, device="cpu"))


# --- fp8 ------------------------------------------------------------------------------------------

FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0, 3, -6), "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2, -14)}


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("granularity, group_size", [("channel", None), ("group", 32), ("tensor", None)])
def test_fp8_codes_are_torch_casts_within_half_a_step(fmt, granularity, group_size):
    dtype, top, mantissa_bits, min_exponent = FP8[fmt]
    w = normal() * 0.02
    q = quantize_rtn(w, QuantSpec(8, True, granularity, group_size, format=fmt))
    n_groups = q.scales.shape[1]
    scale = q.scales.repeat_interleave(w.shape[1] // n_groups, dim=1)
    amax = w.abs().amax() if granularity == "tensor" else w.reshape(64, n_groups, -1).abs().amax(-1)
    assert torch.equal(q.scales, (amax / top).expand_as(q.scales))  # float32, no fp16 rounding
    unit = w * (1 / scale)
    assert torch.equal(q.codes, unit.clamp(-top, top).to(dtype).view(torch.uint8))
    # Dequantization is exact: the fp8 number times its float32 scale.
    assert torch.equal(q.dequantize(), q.codes.view(dtype).float() * scale)
    # Round to nearest: within half the spacing of fp8 numbers around each weight.
    exponent = torch.floor(torch.log2(unit.abs().clamp(min=2.0**min_exponent)))
    half_step = 0.5 * torch.exp2(exponent - mantissa_bits) * scale
    assert bool(((q.dequantize() - w).abs() <= half_step * (1 + 1e-6)).all())
    # The largest weight of each group lands on the format's largest number.
    assert float(q.codes.view(dtype).float().abs().amax()) == top


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_saturates_at_the_format_max(fmt):
    dtype, top, _, _ = FP8[fmt]
    spec = QuantSpec(8, format=fmt)
    w = torch.tensor([2 * top, -1e30, top * 1.01, -top, 3.0])
    codes = round_to_grid(w, torch.tensor(1.0), torch.tensor(0.0), spec)
    assert code_values(codes, fmt).tolist() == [top, -top, top, -top, 3.0]
    # Clipped by a percentile range: outliers saturate, nothing becomes NaN or Inf.
    x = normal(8, 256)
    x[:, 0] = 1e3
    q = quantize_rtn(x, QuantSpec(8, True, "channel", range="percentile", percentile=99, format=fmt))
    values = code_values(q.codes, fmt)
    assert bool(torch.isfinite(values).all())
    assert torch.equal(values[:, 0], torch.full((8,), top))


# --- percentile -----------------------------------------------------------------------------------


def one_outlier_per_channel(out=64, n_in=256):
    w = normal(out, n_in, seed=1) * 0.02
    w[torch.arange(out), torch.randint(0, n_in, (out,), generator=torch.Generator().manual_seed(2))] = 5.0
    return w, w.abs() < 1.0


@pytest.mark.parametrize(
    "spec",
    [QuantSpec(4, True, "channel"), QuantSpec(4, False, "channel"), QuantSpec(4, True, "channel", format="nf4"),
     QuantSpec(4, True, "tensor", format="fp4"), QuantSpec(4, False, "block", 64)],
    ids=lambda s: s.label,
)
def test_percentile_resolves_the_bulk_better_than_min_max(spec):
    w, bulk = one_outlier_per_channel()

    def bulk_mse(s):
        return float((quantize_rtn(w, s).dequantize() - w)[bulk].square().mean())

    clipped = QuantSpec(spec.bits, spec.symmetric, spec.granularity, spec.group_size, "percentile", spec.format, 99.0)
    assert bulk_mse(clipped) < 0.2 * bulk_mse(spec)


@pytest.mark.parametrize(
    "spec",
    [QuantSpec(4, True, "group", 32), QuantSpec(3, False, "channel"), QuantSpec(8, True, "tensor"),
     QuantSpec(4, True, "group", 64, format="nf4"), QuantSpec(8, True, "block", 32, format="fp8_e4m3"),
     QuantSpec(4, False, "tensor")],
    ids=lambda s: s.label,
)
def test_percentile_100_is_min_max(spec):
    w, _ = one_outlier_per_channel()
    a = quantize_rtn(w, spec)
    b = quantize_rtn(w, QuantSpec(spec.bits, spec.symmetric, spec.granularity, spec.group_size, "percentile", spec.format, 100.0))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)


def test_percentile_is_torch_quantile_of_each_group_or_of_the_whole_tensor():
    # torch.quantile interpolates with a float32 weight (ours is float64): a few ulps apart.
    w, _ = one_outlier_per_channel()
    q = quantize_rtn(w, QuantSpec(4, True, "group", 64, "percentile", "nf4", 99.0))
    torch.testing.assert_close(q.scales, torch.quantile(w.abs().reshape(64, 4, 64), 0.99, dim=-1), rtol=1e-5, atol=0)
    q = quantize_rtn(w, QuantSpec(8, True, "tensor", None, "percentile", "fp8_e4m3", 99.9))
    torch.testing.assert_close(q.scales, torch.quantile(w.abs().reshape(-1), 0.999).expand(64, 1) / 448, rtol=1e-5, atol=0)
    # Asymmetric: the (100 - p, p) percentiles; codes span the whole grid, outliers clip to its ends.
    q = quantize_rtn(w, QuantSpec(8, False, "channel", None, "percentile", percentile=90.0))
    lo, hi = torch.quantile(w, 0.1, dim=1), torch.quantile(w, 0.9, dim=1)
    torch.testing.assert_close(q.scales[:, 0], (hi - lo) / 255, rtol=2e-3, atol=0)  # scales are fp16, rounded up
    assert bool((q.codes.amin(1) == 0).all() and (q.codes.amax(1) == 255).all())


def test_percentile_must_be_above_50():
    with pytest.raises(ValueError, match="percentile"):
        QuantSpec(4, range="percentile", percentile=50)
    with pytest.raises(ValueError, match="percentile"):
        QuantSpec(4, range="percentile", percentile=100.5)


# --- block granularity ----------------------------------------------------------------------------


def test_int_blocks_share_one_scale_per_tile():
    w = normal(64, 128) * 0.02
    q = quantize_rtn(w, QuantSpec(8, True, "block", 32))
    assert q.scales.shape == q.zeros.shape == (2, 4)
    for i in range(2):
        for j in range(4):
            tile = w[32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)]
            scale = 2 * float(tile.abs().max()) / 255
            half = float(torch.tensor(scale).half())
            scale = half if half >= scale else float(torch.nextafter(torch.tensor(half).half(), torch.tensor(1.0).half()))
            assert q.scales[i, j].item() == scale
            err = q.dequantize()[32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)] - tile
            assert float(err.abs().max()) <= 0.5 * scale * (1 + 1e-5)
    assert q.bits_per_weight == pytest.approx(8 + 16 * 8 / (64 * 128))
    assert q.spec.label == "int8-b32-sym"


def test_fp8_blocks_as_deepseek_v3_stores_them():
    w = normal(256, 384) * 0.02
    q = quantize_rtn(w, QuantSpec(8, True, "block", 128, format="fp8_e4m3"))
    assert q.scales.shape == (2, 3)
    tiles = w.reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    assert torch.equal(q.scales, tiles / 448)
    scale = q.scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(q.dequantize(), q.codes.view(torch.float8_e4m3fn).float() * scale)
    assert bool(((q.dequantize() - w).abs() <= scale * 16 * (1 + 1e-6)).all())  # half of e4m3's widest step below 448
    assert q.bits_per_weight == pytest.approx(8 + 32 * 6 / (256 * 384))


def test_block_size_must_divide_both_dimensions():
    with pytest.raises(InputError, match="layers.0.o_proj: shape 64x96 is not a multiple of the block size 64"):
        quantize_rtn(normal(64, 96), QuantSpec(8, True, "block", 64), "layers.0.o_proj")
    with pytest.raises(InputError, match="layers.0.k_proj: shape 48x64"):
        quantize_rtn(normal(48, 64), QuantSpec(8, True, "block", 32), "layers.0.k_proj")


# --- the spec itself ------------------------------------------------------------------------------


def test_float_formats_have_fixed_width_and_no_zero_point():
    with pytest.raises(ValueError, match="'fp8_e4m3' is 8 bits wide, got bits 4"):
        QuantSpec(4, format="fp8_e4m3")
    with pytest.raises(ValueError, match="'nf4' is scale-only"):
        QuantSpec(4, False, format="nf4")
    with pytest.raises(ValueError, match="format must be one of"):
        QuantSpec(4, format="int4")


@pytest.mark.parametrize(
    "spec, label, bits_per_weight",
    [
        (QuantSpec(4, True, "group", 64, format="nf4"), "nf4-g64", 4 + 32 / 64),
        (QuantSpec(8, True, "channel", format="fp8_e4m3"), "fp8_e4m3-channel", 8 + 32 / 256),
        (QuantSpec(4, True, "tensor", range="mse", format="fp4"), "fp4-tensor-mse", 4 + 32 / (64 * 256)),
        (QuantSpec(4, False, "group", 128, "percentile"), "int4-g128-asym-p99.9", 4 + 20 / 128),
        (QuantSpec(8, True, "block", 32, "percentile", "fp8_e5m2", 99.0), "fp8_e5m2-b32-p99", 8 + 32 * 16 / (64 * 256)),
    ],
    ids=lambda x: x.label if isinstance(x, QuantSpec) else "",
)
def test_labels_and_bits_per_weight(spec, label, bits_per_weight):
    assert spec.label == label
    assert quantize_rtn(normal(), spec).bits_per_weight == pytest.approx(bits_per_weight)


def test_nan_weights_are_refused_by_name_for_every_format():
    w = normal()
    w[3, 7] = float("nan")
    for spec in [QuantSpec(4, format="nf4"), QuantSpec(8, format="fp8_e5m2", range="percentile"), QuantSpec(4, range="mse")]:
        with pytest.raises(InputError, match="layers.3.v_proj: weights contain NaN"):
            quantize_rtn(w, spec, "layers.3.v_proj")


# --- recipes --------------------------------------------------------------------------------------


def recipe(tmp_path, weights):
    return write_recipe(tmp_path, {"model": "m", "evaluation": {"text": "t"}, "calibration": {"text": "c"},
                                   "variants": [{"name": "v", "weights": weights}]})


def test_recipe_float_format_needs_no_bits(tmp_path):
    spec = load_recipe(recipe(tmp_path, {"method": "rtn", "format": "nf4", "granularity": "group", "group_size": 64})).variants[0].weights.spec
    assert spec == QuantSpec(4, True, "group", 64, format="nf4")
    spec = load_recipe(recipe(tmp_path, {"method": "gptq", "format": "fp8_e4m3", "bits": 8, "range": "percentile"})).variants[0].weights.spec
    assert spec == QuantSpec(8, True, "group", 128, "percentile", "fp8_e4m3", 99.9)
    spec = load_recipe(recipe(tmp_path, {"method": "rtn", "bits": 8, "granularity": "block", "group_size": 128,
                                         "range": "percentile", "percentile": 99.5})).variants[0].weights.spec
    assert spec.label == "int8-b128-sym-p99.5"


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"method": "rtn", "format": "fp8_e4m3", "bits": 4}, "field 'variants[0](v).weights.bits': format 'fp8_e4m3' is 8 bits wide, not 4"),
        ({"method": "gptq", "format": "nf4", "bits": 8}, "field 'variants[0](v).weights.bits': format 'nf4' is 4 bits wide, not 8"),
        ({"method": "rtn", "format": "nf4", "symmetric": False}, "field 'variants[0](v).weights.symmetric': format 'nf4' is scale-only"),
        ({"method": "rtn", "format": "nf5"}, "field 'variants[0](v).weights.format'"),
        ({"method": "rtn"}, "missing field 'variants[0](v).weights.bits'"),
        ({"method": "rtn", "bits": 4, "percentile": 99}, "field 'variants[0](v).weights.percentile': percentile is only valid with range 'percentile'"),
        ({"method": "gptq", "bits": 4, "range": "percentile", "percentile": 30}, "field 'variants[0](v).weights.percentile'"),
        ({"method": "rtn", "bits": 4, "granularity": "block"}, "granularity 'block' needs group_size"),
    ],
)
def test_recipe_errors_name_the_field(tmp_path, weights, message):
    with pytest.raises(InputError) as e:
        load_recipe(recipe(tmp_path, weights))
    assert message in str(e.value) and "\n" not in str(e.value)
