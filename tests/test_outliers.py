"""LLM.int8-style outlier columns: exact 16-bit columns, honest bits, less output error than RTN
where inputs have outliers, per-Linear statistics, and clear errors for broken calibration."""

import json

import pytest
import torch

from calib.text import token_windows
from conftest import BUNDLED, TINY, tiny_with
from core.errors import InputError
from core.schemes import QuantSpec
from core.tensors import MixedPrecisionTensor, dequantized
from formats.hf import HFCheckpoint, load_tokenizer
from quant.outliers import OutlierRule, channel_statistics, input_abs_max, mixed_precision_model, mixed_precision_rtn
from quant.rtn import quantize_rtn

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

SPEC = QuantSpec(4, False, "group", 64)


def _weight(out=48, n_in=256) -> torch.Tensor:
    w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(1)) * 0.05
    return w.to(torch.float16).to(torch.float32)  # as a bf16/fp16 checkpoint's weights are


def test_outlier_columns_dequantize_exactly_and_bits_count_them():
    w = _weight()
    columns = torch.tensor([3, 100, 255], dtype=torch.int32)
    mixed = mixed_precision_rtn(w, SPEC, columns, "w")
    assert isinstance(mixed, MixedPrecisionTensor) and mixed.dense.dtype == torch.float16
    restored = dequantized(mixed)
    assert torch.equal(restored[:, columns.long()], w[:, columns.long()])
    rest = torch.ones(256, dtype=torch.bool)
    rest[columns.long()] = False
    assert torch.equal(mixed.base.dequantize()[:, ~rest], torch.zeros(48, 3))  # zeroed in the base
    assert (restored[:, rest] - w[:, rest]).abs().max() > 0  # the rest really is quantized
    # 4-bit codes everywhere, fp16 scale + 4-bit zero per group of 64, fp16 columns, int32 indices
    expected = 4 + 48 * 4 * (16 + 4) / (48 * 256) + (16 * 48 * 3 + 32 * 3) / (48 * 256)
    assert mixed.bits_per_weight == pytest.approx(expected, rel=1e-12)


def test_keeping_outlier_columns_beats_rtn_on_inputs_with_outlier_channels():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 256, generator=g)
    planted = [17, 90, 201]
    x[:, planted] *= 40.0
    w = _weight()
    columns = OutlierRule().channels(x.abs().amax(0))
    assert columns.tolist() == planted
    plain = quantize_rtn(w, SPEC).dequantize()
    mixed = mixed_precision_rtn(w, SPEC, columns).dequantize()
    error = lambda q: (x @ (q - w).T).square().sum()  # noqa: E731
    assert error(mixed) < 0.2 * error(plain)


def test_rule_needs_both_the_absolute_threshold_and_the_relative_factor():
    a = torch.tensor([1.0, 1.0, 7.0, 2.5, 30.0])  # median 2.5
    assert OutlierRule(6.0, 1.0).channels(a).tolist() == [2, 4]
    assert OutlierRule(6.0, 4.0).channels(a).tolist() == [4]  # limit 10
    assert OutlierRule(0.0, 2.0).channels(a).tolist() == [2, 4]  # limit 5
    assert OutlierRule(0.0, 0.5).channels(a).tolist() == [2, 3, 4]  # limit 1.25


def test_channel_statistics_are_plain_numbers():
    stats = channel_statistics({"m": torch.tensor([1.0, 2.0, 3.0, 12.0])}, OutlierRule(6.0, 1.0))
    assert stats == {"m": {"outlier_channels": 1, "max_abs": 12.0, "max_over_median": 6.0}}
    json.dumps(stats)


def _windows(ckpt):
    return token_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 128, 4)


def test_mixed_precision_model_keeps_the_outlier_columns_it_reports():
    ckpt = HFCheckpoint.open(TINY)
    windows = _windows(ckpt)
    abs_max = input_abs_max(ckpt, windows)
    rule = OutlierRule(6.0, 2.0)
    layers = list(mixed_precision_model(ckpt, windows, SPEC, rule))
    assert len(layers) == ckpt.config["num_hidden_layers"]
    weights = {n: t for layer in layers for n, t in layer.tensors.items()}
    statistics = {n: s for layer in layers for n, s in layer.statistics.items()}
    assert len(weights) == 7 * len(layers) == len(statistics)
    assert statistics == channel_statistics(abs_max, rule)
    for name, tensor in weights.items():
        module = name.removesuffix(".weight")
        assert torch.equal(tensor.columns, rule.channels(abs_max[module]))
        assert tensor.columns.numel() == statistics[module]["outlier_channels"]
        kept = tensor.columns.long()  # bf16 weights in fp16: exact but for fp16's subnormals (steps of 2^-24)
        torch.testing.assert_close(tensor.dequantize()[:, kept], ckpt.tensor(name).float()[:, kept], rtol=0, atol=2.0**-25)
    assert sum(t.columns.numel() for t in weights.values()) > 0


def test_nan_activations_during_calibration_name_the_module(tmp_path):
    ckpt = HFCheckpoint.open(TINY)
    v = ckpt.tensor("model.layers.1.self_attn.v_proj.weight").clone()
    v[0, 0] = float("nan")  # poisons o_proj's input only
    poisoned = HFCheckpoint.open(tiny_with(tmp_path, {"model.layers.1.self_attn.v_proj.weight": v}))
    with pytest.raises(InputError, match=r"^model\.layers\.1\.self_attn\.o_proj: its calibration inputs contain NaN or Inf$"):
        input_abs_max(poisoned, _windows(ckpt))
