import pytest
import torch

from core.errors import InputError
from core.schemes import QuantSpec
from quant.rtn import quantize_rtn

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


def heavy_tailed(out: int = 64, n_in: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g) * 0.02
    w[torch.rand(out, n_in, generator=g) < 0.01] *= 20  # a few outliers, as real weights have
    return w


SPECS = [
    QuantSpec(8, True, "channel"),
    QuantSpec(8, False, "channel"),
    QuantSpec(4, True, "group", 32),
    QuantSpec(4, False, "group", 64),
    QuantSpec(4, True, "tensor"),
    QuantSpec(3, False, "group", 128),
    QuantSpec(2, False, "channel"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_codes_in_range_and_error_within_half_a_step(spec):
    w = heavy_tailed()
    q = quantize_rtn(w, spec)
    assert q.codes.dtype == torch.uint8
    assert int(q.codes.max()) <= 2**spec.bits - 1
    groups = q.scales.shape[1]
    step = q.scales.repeat_interleave(w.shape[1] // groups, dim=1)
    err = (q.dequantize() - w).abs()
    # Round to nearest with the range covered: every weight is within half a step of its level.
    assert bool((err <= 0.5 * step * (1 + 1e-5)).all())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_zero_is_exact(spec):
    w = heavy_tailed()
    w[:, ::5] = 0.0
    deq = quantize_rtn(w, spec).dequantize()
    assert bool((deq[:, ::5] == 0).all())


def test_matches_a_naive_group_by_group_reference():
    w = heavy_tailed(8, 64, seed=3)
    q = quantize_rtn(w, QuantSpec(4, False, "group", 16))
    for r in range(8):
        for g in range(4):
            x = w[r, g * 16 : (g + 1) * 16]
            lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            scale = (hi - lo) / 15
            half = float(torch.tensor(scale).half())
            scale = half if half >= scale else float(torch.nextafter(torch.tensor(half).half(), torch.tensor(1.0).half()))
            zero = min(max(round(-lo / scale), 0), 15)
            codes = [min(max(round(v / scale) + zero, 0), 15) for v in x.tolist()]
            assert q.codes[r, g * 16 : (g + 1) * 16].tolist() == codes
            assert q.scales[r, g].item() == pytest.approx(scale, rel=0, abs=0)
            assert q.zeros[r, g].item() == zero


def test_finer_granularity_and_more_bits_lower_the_error():
    w = heavy_tailed()

    def mse(spec):
        return float((quantize_rtn(w, spec).dequantize() - w).pow(2).mean())

    assert mse(QuantSpec(4, True, "group", 32)) < mse(QuantSpec(4, True, "channel")) < mse(QuantSpec(4, True, "tensor"))
    assert mse(QuantSpec(8, True, "channel")) < mse(QuantSpec(4, True, "channel")) < mse(QuantSpec(3, True, "channel"))


def test_symmetric_grid_is_gptqs():
    """Symmetric scale 2·absmax/(2**bits - 1) around zero 2**(bits-1), as GPTQ's quantizer and
    GPTQ checkpoints have it; the largest weight clips by at most half a step (checked for every
    weight in the half-a-step test above)."""
    w = heavy_tailed(8, 64, seed=4)
    q = quantize_rtn(w, QuantSpec(4, True, "channel"))
    for r in range(8):
        amax = float(w[r].abs().max())
        scale = 2 * amax / 15
        half = float(torch.tensor(scale).half())
        scale = half if half >= scale else float(torch.nextafter(torch.tensor(half).half(), torch.tensor(1.0).half()))
        assert q.scales[r, 0].item() == scale
        assert q.zeros[r, 0].item() == 8
        assert q.codes[r].tolist() == [min(max(round(v / scale) + 8, 0), 15) for v in w[r].tolist()]


def test_bits_per_weight_counts_scales_and_zero_points():
    w = heavy_tailed(64, 256)
    assert quantize_rtn(w, QuantSpec(4, True, "group", 32)).bits_per_weight == pytest.approx(4 + 16 / 32)
    assert quantize_rtn(w, QuantSpec(4, False, "group", 32)).bits_per_weight == pytest.approx(4 + 20 / 32)
    assert quantize_rtn(w, QuantSpec(8, True, "tensor")).bits_per_weight == pytest.approx(8, abs=1e-3)


def test_bad_inputs_name_the_tensor():
    with pytest.raises(InputError, match="layers.0.q_proj.*multiple of group_size 48"):
        quantize_rtn(torch.ones(4, 64), QuantSpec(4, True, "group", 48), "layers.0.q_proj")
    w = torch.ones(4, 64)
    w[1, 2] = float("nan")
    with pytest.raises(InputError, match="layers.1.up_proj.*NaN"):
        quantize_rtn(w, QuantSpec(8), "layers.1.up_proj")


def test_spec_rejects_inconsistent_settings():
    with pytest.raises(ValueError):
        QuantSpec(9)
    with pytest.raises(ValueError):
        QuantSpec(4, True, "group")
    with pytest.raises(ValueError):
        QuantSpec(4, True, "channel", 128)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_range_never_loses_to_min_max_and_wins_on_heavy_tails(symmetric):
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 256)) * 0.02  # a few large outliers per row
    errors = {}
    for rng in ("minmax", "mse"):
        spec = QuantSpec(4, symmetric, "group", 64, rng)
        errors[rng] = (quantize_rtn(w, spec).dequantize() - w).square().reshape(64, 4, 64).sum(-1)
    assert bool((errors["mse"] <= errors["minmax"] + 1e-12).all())  # the full range is one of the candidates
    assert errors["mse"].sum() < 0.97 * errors["minmax"].sum()
