"""The CUDA path's quantized layers (runner/engine/cuda_linear.py) and their Triton kernel
(runner/engine/kernels/lowbit_gemm.py) against the product of the dequantized weights: int4 and
int8 codes, symmetric and not, groups of 32 to 256 inputs (48 too) or one scale per output,
GPTQ act-order, an AWQ folder's weights, split-K, the dequantized copy above the kernel's rows;
the weights the kernel refuses go to the path they took before, which says why; fp8 weights on
``torch._scaled_mm``.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton is first imported) in fp16 and fp32, whose loads it computes exactly (its bf16 loads are
broken); on a GPU the same tests run compiled, in bf16 too, and the CUDA-only tests at the end
check the engine's dispatch and that the kernel is faster than bf16 at one row."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels then run on the CPU

import torch.nn.functional as F  # noqa: E402

from core.schemes import QuantSpec  # noqa: E402
from core.tensors import QuantizedTensor  # noqa: E402
from formats.awq import AWQLayout  # noqa: E402
from quant.rtn import quantize_rtn  # noqa: E402
from runner.engine import cuda_linear  # noqa: E402
from runner.engine.cuda_linear import Fp8Linear, LowBitLinear  # noqa: E402
from runner.engine.linear import make_linear  # noqa: E402

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md): 3 s in the interpreter
lowbit_gemm = cuda_linear.lowbit_gemm
needs_triton = pytest.mark.skipif(lowbit_gemm is None, reason="Triton is not installed")
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])
ROWS = [1, 3, 16, 33]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # relative, over the whole output

# (bits, symmetric, group size or None for one scale per output, outputs, inputs)
WEIGHTS = [
    (4, True, 32, 72, 256),  # eight groups to a tile of 256 inputs
    (4, False, 128, 200, 256),  # outputs not a multiple of the tile's
    (4, False, 64, 33, 192),  # an odd number of outputs, a last input tile half full
    (4, True, 48, 56, 96),  # groups of 48: tiles of 16 inputs
    (4, False, None, 24, 130),  # per output, 130 inputs
    (8, True, None, 40, 100),
    (8, False, 256, 64, 256),
    (8, False, 32, 33, 160),
]


def _relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return ((ours.float() - expected).norm() / expected.norm()).item()


def _expected(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 product of the activations and the dequantized weights."""
    return F.linear(x.float(), q.dequantize().to(x.device), None if bias is None else bias.float())


def _inputs(rows: int, n_in: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, n_in, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _act_order_weight(bits: int, n_out: int, n_in: int, group: int) -> QuantizedTensor:
    """Random asymmetric codes whose groups are GPTQ act-order's: each of ``group`` inputs picked
    in a random order, as ``g_idx`` records them."""
    g = torch.Generator().manual_seed(bits)
    group_index = torch.empty(n_in, dtype=torch.int32)
    group_index[torch.randperm(n_in, generator=g)] = (torch.arange(n_in) // group).int()
    codes = torch.randint(0, 2**bits, (n_out, n_in), generator=g).to(torch.uint8)
    scales = torch.rand(n_out, n_in // group, generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 2**bits, scales.shape, generator=g).float()
    return QuantizedTensor(QuantSpec(bits, False, "group", group), codes, scales, zeros, group_index)


@needs_triton
@pytest.mark.parametrize("bits, symmetric, group, n_out, n_in", WEIGHTS)
def test_the_kernel_computes_the_dequantized_product(bits, symmetric, group, n_out, n_in):
    spec = QuantSpec(bits, symmetric, "group" if group else "channel", group)
    q = quantize_rtn(torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(n_out)) * 0.05, spec)
    assert cuda_linear.refusal(q, torch.float16, DEVICE) is None
    for dtype in DTYPES:
        packed = lowbit_gemm.pack(q, dtype, DEVICE)
        assert (packed.zeros is None) == symmetric  # a symmetric weight reads no zero-points
        bias = _inputs(1, n_out, dtype, 1)[0]
        for rows in ROWS:
            x = _inputs(rows, n_in, dtype, rows)
            assert _relative_error(lowbit_gemm.matmul(x, packed, bias), _expected(x, q, bias)) < TOLERANCE[dtype], (dtype, rows)


@needs_triton
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_weights_are_sorted_into_groups_and_read_their_inputs_the_same_way(bits):
    q = _act_order_weight(bits, 48, 256, 64)
    for dtype in DTYPES:
        packed = lowbit_gemm.pack(q, dtype, DEVICE)
        assert packed.order is not None and packed.group == 64
        for rows in (1, 16, 33):
            x = _inputs(rows, 256, dtype, rows)
            assert _relative_error(lowbit_gemm.matmul(x, packed), _expected(x, q, None)) < TOLERANCE[dtype], (dtype, rows)


@needs_triton
def test_split_k_gives_the_unsplit_product_and_the_same_bits_every_time():
    """The splits' partial sums are added in a fixed order by a second kernel, not by atomics."""
    q = quantize_rtn(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)), QuantSpec(4, False, "group", 32))
    packed = lowbit_gemm.pack(q, torch.float32, DEVICE)
    x = _inputs(5, 256, torch.float32, 0)
    whole = lowbit_gemm.matmul(x, packed, plan=lowbit_gemm.Schedule(16, 64, 64, 1, 4, 2))
    split = [lowbit_gemm.matmul(x, packed, plan=lowbit_gemm.Schedule(16, 64, 64, 4, 4, 2)) for _ in range(2)]
    assert torch.equal(split[0], split[1])
    torch.testing.assert_close(split[0], whole, rtol=1e-5, atol=1e-5)
    assert _relative_error(whole, _expected(x, q, None)) < 1e-6


@needs_triton
def test_decode_spreads_the_inputs_over_programs_when_outputs_are_few():
    scales = torch.empty(0, dtype=torch.bfloat16)
    w = lowbit_gemm.PackedWeight(scales, scales, None, None, bits=4, group=128, n_out=4096, n_in=4096)  # what a schedule reads
    decode, prefill = lowbit_gemm.schedule(1, w, 132), lowbit_gemm.schedule(1024, w, 132)
    assert decode.split_k > 1 and decode.block_m == 16
    assert prefill.split_k == 1 and prefill.block_m > 16  # tiles enough for every multiprocessor


@needs_triton
@pytest.mark.parametrize("rows", [3, 33])
def test_the_layer_runs_the_kernel_up_to_its_rows_and_a_dequantized_copy_above(rows):
    q = _act_order_weight(4, 40, 128, 32)
    dtype = torch.float32
    bias = _inputs(1, 40, dtype, 2)[0]
    layer = LowBitLinear(q, bias, dtype, DEVICE, dense_above=8)
    assert layer.kind.startswith("int4 triton")
    x = _inputs(rows, 128, dtype, rows)
    assert _relative_error(layer(x), _expected(x, q, bias)) < 1e-6
    dense = lowbit_gemm.dequantize(layer.packed, layer.buffer)  # the copy cuBLAS reads, in group order
    assert torch.equal(dense.cpu(), q.dequantize()[:, layer.packed.order.long().cpu()].T)


@needs_triton
def test_layers_of_one_dtype_share_one_dequantization_buffer():
    small, large = (quantize_rtn(torch.randn(n, 64), QuantSpec(8, True, "channel")) for n in (16, 32))
    first, second, third = (LowBitLinear(q, None, torch.float32, DEVICE) for q in (small, small, large))
    assert first.buffer is second.buffer and third.buffer.numel() >= 32 * 64
    assert LowBitLinear(small, None, torch.float32, DEVICE).buffer is third.buffer  # the newest, large enough


class _StoredTensors:
    """What a layout reads from a checkpoint folder: its tensors by name."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _autoawq_words(levels: torch.Tensor) -> torch.Tensor:
    """``[rows, O]`` 4-bit levels as AutoAWQ packs them: int32 ``[rows, O/8]``, nibble i of word k
    holding output ``8k + [0, 2, 4, 6, 1, 3, 5, 7][i]``."""
    nibbles = levels.reshape(levels.shape[0], -1, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]].to(torch.int64)
    words = (nibbles << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@needs_triton
def test_an_awq_folders_weights_run_on_the_kernel():
    g = torch.Generator().manual_seed(0)
    n_out, n_in, group = 64, 128, 32
    codes = torch.randint(0, 16, (n_out, n_in), generator=g).to(torch.uint8)
    zeros = torch.randint(0, 16, (n_out, n_in // group), generator=g).to(torch.uint8)
    scales = (torch.rand(n_out, n_in // group, generator=g) * 0.01 + 0.001).half()
    stored = _StoredTensors({"m.qweight": _autoawq_words(codes.T), "m.qzeros": _autoawq_words(zeros.T), "m.scales": scales.T.contiguous()})
    q = AWQLayout(QuantSpec(4, False, "group", group)).payload(stored, "m.weight", (n_out, n_in))
    assert torch.equal(q.codes, codes) and torch.equal(q.zeros, zeros.float())
    for dtype in DTYPES:
        layer = cuda_linear.cuda_linear(q, None, dtype, DEVICE, fallback=None)
        assert isinstance(layer, LowBitLinear) and layer.packed.zeros is not None
        x = _inputs(4, n_in, dtype, 0)
        assert _relative_error(layer(x), _expected(x, q, None)) < TOLERANCE[dtype]


def _refused_weights() -> dict[str, tuple[QuantizedTensor, torch.dtype, str]]:
    """Weights the kernels here refuse: the weight, the activations' dtype, the reason given."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 96, generator=g)
    unequal = _act_order_weight(4, 16, 128, 32)  # four groups, of 40, 24, 32 and 32 inputs
    sizes = (torch.arange(128) >= 40).int() + (torch.arange(128) >= 64).int() + (torch.arange(128) >= 96).int()
    unequal = QuantizedTensor(unequal.spec, unequal.codes, unequal.scales, unequal.zeros, sizes[torch.randperm(128, generator=g)])
    return {
        "int3": (quantize_rtn(w, QuantSpec(3, True, "group", 32)), torch.float32, "int3-g32-sym weights"),
        "nf4": (quantize_rtn(w, QuantSpec(4, True, "group", 32, format="nf4")), torch.float32, "nf4-g32 weights"),
        "int8-block": (quantize_rtn(w, QuantSpec(8, True, "block", 32)), torch.float32, "block scales"),
        "int4-g24": (quantize_rtn(w, QuantSpec(4, True, "group", 24)), torch.float32, "groups of 24 inputs"),
        "int4-odd-inputs": (quantize_rtn(torch.randn(16, 99, generator=g), QuantSpec(4, True, "channel")), torch.float32,
                            "99 inputs, an odd number"),
        "act-order-unequal": (unequal, torch.float32, "act-order groups of unequal sizes"),
        "fp8-fp16": (quantize_rtn(w, QuantSpec(8, True, "channel", format="fp8_e4m3")), torch.float16, "fp8 weights with torch.float16"),
        "fp8-block": (quantize_rtn(w, QuantSpec(8, True, "block", 32, format="fp8_e4m3")), torch.bfloat16, "fp8 by block"),
    }


REFUSED = list(_refused_weights())


def _former_path(q: QuantizedTensor, dtype: torch.dtype):
    return cuda_linear.cuda_linear(q, None, dtype, DEVICE, lambda: make_linear(q, None, dtype, DEVICE, cuda_kernels=False))


@needs_triton  # without it every weight is refused for that
@pytest.mark.parametrize("name", REFUSED)
def test_a_weight_the_kernels_refuse_takes_its_former_path_and_says_why(name):
    q, dtype, why = _refused_weights()[name]
    assert why in cuda_linear.refusal(q, dtype, DEVICE)
    layer = _former_path(q, dtype)
    assert why in layer.kind and "not this module's kernels" in layer.kind
    assert not isinstance(layer, (LowBitLinear, Fp8Linear))


@needs_triton
@pytest.mark.parametrize("name", REFUSED)
def test_the_former_path_computes_the_dequantized_product(name):
    q, dtype, _ = _refused_weights()[name]
    x = _inputs(3, q.shape[1], dtype, 0)
    assert _relative_error(_former_path(q, dtype)(x), _expected(x, q, None)) < TOLERANCE[dtype]


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_weights_multiply_rows_scaled_into_fp8_on_scaled_mm(granularity):
    """Each row of activations goes to e4m3 by its own absolute maximum (dynamic, per token): the
    product is that of the rounded rows, within bf16's rounding, and of the rows themselves within
    fp8's. torch's CPU build runs the same scaled product, so this holds off the GPU too."""
    q = quantize_rtn(torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * 0.05,
                     QuantSpec(8, True, granularity, format="fp8_e4m3"))
    x = _inputs(5, 64, torch.bfloat16, 0)
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() < cuda_linear.FP8_CAPABILITY:
        pytest.skip("no fp8 tensor cores on this GPU")
    layer = Fp8Linear(q, None, torch.bfloat16, DEVICE)
    ours = layer(x)
    row_scales = x.float().abs().amax(-1, keepdim=True) / 448
    rounded = (x.float() / row_scales).to(torch.float8_e4m3fn).float() * row_scales
    assert ours.dtype == torch.bfloat16
    assert _relative_error(ours, F.linear(rounded, q.dequantize().to(DEVICE))) < 1e-2
    assert _relative_error(ours, _expected(x, q, None)) < 6e-2


# ---------------------------------------------------------------- on a GPU: the engine's dispatch, speed

cuda_only = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")


@cuda_only
@needs_triton
@pytest.mark.parametrize("spec, kind", [(QuantSpec(4, False, "group", 128), "int4 triton"), (QuantSpec(8, True, "channel"), "int8 triton")])
def test_make_linear_on_cuda_runs_the_triton_kernel_and_a_dequantized_copy_above_its_rows(spec, kind):
    q = quantize_rtn(torch.randn(1024, 2048, generator=torch.Generator().manual_seed(0)) * 0.02, spec)
    layer = make_linear(q, None, torch.bfloat16, DEVICE)
    assert isinstance(layer, LowBitLinear) and layer.kind.startswith(kind)
    for rows in (1, 16, 64, cuda_linear.DENSE_ABOVE_ROWS + 1):
        x = _inputs(rows, 2048, torch.bfloat16, rows)
        assert _relative_error(layer(x), _expected(x, q, None)) < TOLERANCE[torch.bfloat16], rows


@cuda_only
def test_make_linear_on_cuda_runs_fp8_weights_on_scaled_mm_where_the_gpu_has_fp8():
    q = quantize_rtn(torch.randn(1024, 2048, generator=torch.Generator().manual_seed(0)) * 0.02,
                     QuantSpec(8, True, "channel", format="fp8_e4m3"))
    layer = make_linear(q, None, torch.bfloat16, DEVICE)
    if torch.cuda.get_device_capability() < cuda_linear.FP8_CAPABILITY:
        assert layer.kind.startswith("dequantized") and "fp8 tensor cores" in layer.kind
        return
    assert layer.kind == "fp8 scaled_mm"
    x = _inputs(7, 2048, torch.bfloat16, 0)
    assert _relative_error(layer(x), _expected(x, q, None)) < 6e-2


@cuda_only
@needs_triton
@pytest.mark.parametrize("spec, speedup", [(QuantSpec(4, False, "group", 128), 1.3), (QuantSpec(8, True, "channel"), 1.0)])
def test_one_row_reads_the_low_bit_weight_faster_than_bf16(spec, speedup):
    """Decoding is bound by the weight's bytes: int4 reads a quarter of bf16's, int8 half. The
    margins are a floor for a correct kernel, far under the 4x and 2x of the bytes."""
    from triton.testing import do_bench

    weight = torch.randn(8192, 8192, device=DEVICE) * 0.02
    dense = weight.to(torch.bfloat16)
    layer = make_linear(quantize_rtn(weight, spec), None, torch.bfloat16, DEVICE)
    x = torch.randn(1, 8192, device=DEVICE, dtype=torch.bfloat16)
    bf16_ms, ours_ms = do_bench(lambda: F.linear(x, dense)), do_bench(lambda: layer(x))
    assert bf16_ms / ours_ms >= speedup, (bf16_ms, ours_ms)
