"""The small types every stage shares: how a tensor is quantized, and what a quantized tensor holds.

Recipes build specs, quantizers produce quantized tensors, writers and evaluators consume them.
Keeping them here (and nowhere else) lets formats/ and evalsuite/ work on any quantizer's output
without knowing how it was made.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, Union

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

Granularity = Literal["tensor", "channel", "group", "block"]
RangeChoice = Literal["minmax", "mse", "percentile"]
NumberFormat = Literal["int", "fp8_e4m3", "fp8_e5m2", "nf4", "fp4"]

# The float formats' fixed widths. They are scale-only: a code stands for a fixed number and the
# group's scale stretches it; the integer format spreads 2**bits levels around a zero-point.
FORMAT_BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "nf4": 4, "fp4": 4}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# bitsandbytes 0.50.2's 4-bit code tables (bitsandbytes/functional.py, get_4bit_type), as the
# float32 values it uses (its raw table divided by its largest magnitude), indexed by the 4-bit code.
# nf4: quantiles of N(0, 1) with equal probability mass (QLoRA), sorted, exact 0 at code 7.
# fp4: 1 sign, 2 exponent, 1 mantissa bit, in bit-pattern order (codes 0 and 8 are +0 and -0).
FOUR_BIT_CODES = {
    "nf4": torch.tensor([
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ], dtype=torch.float32),
    "fp4": torch.tensor([
        0.0, 0.0052083334885537624, 0.6666666865348816, 1.0,
        0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
        -0.0, -0.0052083334885537624, -0.6666666865348816, -1.0,
        -0.3333333432674408, -0.5, -0.1666666716337204, -0.25,
    ], dtype=torch.float32),
}


# The largest code magnitude of each float format: a group's range maps onto ±FORMAT_MAX.
# 448 (e4m3fn), 57344 (e5m2), and 1 for nf4/fp4, whose tables bitsandbytes normalises.
FORMAT_MAX = {fmt: float(torch.finfo(dtype).max) for fmt, dtype in FP8_DTYPES.items()} | {
    fmt: float(table.abs().max()) for fmt, table in FOUR_BIT_CODES.items()
}


def code_values(codes: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """The number each uint8 code stands for, before its scale (and zero-point) apply: the level
    itself for integers, the fp8 number whose bit pattern it is, the table entry for nf4/fp4.

    This is the one decoder: dequantization here and the quantizers' error terms (quant/rtn.py)
    both use it, so a checkpoint reader and a quantizer can never disagree on what a code means."""
    if fmt == "int":
        return codes.to(torch.float32)
    if fmt in FP8_DTYPES:
        return codes.view(FP8_DTYPES[fmt]).to(torch.float32)
    return FOUR_BIT_CODES[fmt].to(codes.device)[codes.long()]


@dataclass(frozen=True)
class QuantSpec:
    """A weight-quantization scheme.

    Weights are quantized along the input dimension of a Linear weight ``[out, in]``: one scale
    (and zero-point when asymmetric) per tensor, per output channel, per group of ``group_size``
    consecutive input columns of one output channel, or per square ``group_size x group_size``
    block (rows x columns, as DeepSeek-V3's fp8 weights and compressed-tensors' "block" strategy).
    ``range`` picks each group's range: its min and max, the shrunken range with the least squared
    error (clipping a few outliers to resolve the rest more finely), or the ``percentile`` of the
    magnitudes (symmetric) or the (100 - p, p) percentiles (asymmetric).

    ``format`` is what a code means: ``int`` levels with ``bits`` 2-8, or a scale-only float
    format of fixed width (fp8 e4m3/e5m2 as torch casts them; nf4/fp4 with bitsandbytes' tables).
    """

    bits: int
    symmetric: bool = True
    granularity: Granularity = "channel"
    group_size: int | None = None
    range: RangeChoice = "minmax"
    format: NumberFormat = "int"
    percentile: float = 99.9

    def __post_init__(self) -> None:
        if self.format != "int" and self.format not in FORMAT_BITS:
            raise ValueError(f"format must be one of int, {', '.join(FORMAT_BITS)}; got '{self.format}'")
        if self.format == "int" and not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be between 2 and 8, got {self.bits}")
        if self.format != "int":
            if self.bits != FORMAT_BITS[self.format]:
                raise ValueError(f"format '{self.format}' is {FORMAT_BITS[self.format]} bits wide, got bits {self.bits}")
            if not self.symmetric:
                raise ValueError(f"format '{self.format}' is scale-only: it needs symmetric true")
        if self.granularity not in ("tensor", "channel", "group", "block"):
            raise ValueError(f"granularity must be tensor, channel, group or block; got '{self.granularity}'")
        if self.granularity in ("group", "block"):
            if self.group_size is None or self.group_size < 1:
                raise ValueError(f"granularity '{self.granularity}' needs a positive group_size")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only valid with granularity 'group' or 'block', not '{self.granularity}'")
        if self.range not in ("minmax", "mse", "percentile"):
            raise ValueError(f"range must be minmax, mse or percentile; got '{self.range}'")
        if not 50 < self.percentile <= 100:
            raise ValueError(f"percentile must be above 50 and at most 100, got {self.percentile}")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``int4-g128-asym``, ``int8-b128-sym``, ``nf4-g64``, ``fp8_e4m3-channel-p99.9``."""
        grain = {"tensor": "tensor", "channel": "channel", "group": f"g{self.group_size}", "block": f"b{self.group_size}"}
        if self.format == "int":
            name = f"int{self.bits}-{grain[self.granularity]}-{'sym' if self.symmetric else 'asym'}"
        else:
            name = f"{self.format}-{grain[self.granularity]}"
        return name + {"minmax": "", "mse": "-mse", "percentile": f"-p{self.percentile:g}"}[self.range]


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes with their scales, in the weight's own ``[out, in]`` layout (unpacked).

    ``codes`` are uint8: integer levels in ``[0, 2**bits - 1]``, fp8 bit patterns, or nf4/fp4
    table indices (see ``code_values``). The real value is ``(code_values(codes) - zeros) *
    scales``, with scales and zeros broadcast over each group. Symmetric integer specs use the
    fixed mid-level zero ``2**(bits-1)`` and float formats the zero 0, so one dequantization
    formula serves all. Scales and zeros are ``[out, n_groups]``, or ``[out/B, in/B]`` for
    ``B x B`` blocks. Groups are runs of consecutive input columns, unless ``group_index`` says
    which group each column belongs to (GPTQ with act-order forms groups in the order it visits
    columns; GPTQ checkpoints store this as ``g_idx``). Writers pack codes into their own layouts;
    nothing here assumes a file format.
    """

    spec: QuantSpec
    codes: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # float32 [out, n_groups] or [out/B, in/B]
    zeros: torch.Tensor  # float32, the shape of scales
    group_index: torch.Tensor | None = None  # int32 [in]: the group of each input column

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def rows(self, rows: slice) -> QuantizedTensor:
        """The quantized rows ``rows`` of this weight: rows are quantized independently (blocks
        excepted), so a fused projection splits into its parts without re-quantizing."""
        if self.spec.granularity == "block":
            raise ValueError("block-quantized weights do not split by rows")
        return replace(self, codes=self.codes[rows], scales=self.scales[rows], zeros=self.zeros[rows])

    def dequantize(self) -> torch.Tensor:
        out, n_in = self.codes.shape
        values = code_values(self.codes, self.spec.format)
        if self.group_index is not None:
            g = self.group_index.long()
            return (values - self.zeros[:, g]) * self.scales[:, g]
        if self.spec.granularity == "block":
            rows, cols = self.scales.shape
            q = values.reshape(rows, out // rows, cols, n_in // cols)
            w = (q - self.zeros[:, None, :, None]) * self.scales[:, None, :, None]
            return w.reshape(out, n_in)
        n_groups = self.scales.shape[1]
        q = values.reshape(out, n_groups, n_in // n_groups)
        w = (q - self.zeros.unsqueeze(-1)) * self.scales.unsqueeze(-1)
        return w.reshape(out, n_in)

    @property
    def bits_per_weight(self) -> float:
        """Code bits plus the amortised cost of the scales (fp16 for integers, as their checkpoints
        store them; fp32 for float formats, as bitsandbytes and fp8 checkpoints store them), of
        zero-points when asymmetric, and of a 32-bit group index per input column where there is one."""
        per_scale = (16 if self.spec.format == "int" else 32) + (0 if self.spec.symmetric else self.spec.bits)
        n_scales = 1 if self.spec.granularity == "tensor" else self.scales.numel()
        index_bits = 0 if self.group_index is None else 32 * self.group_index.numel()
        return self.spec.bits + (per_scale * n_scales + index_bits) / self.codes.numel()


@dataclass(frozen=True)
class GGMLTensor:
    """A tensor already encoded in one ggml type (F32, F16, Q8_0, ...), rows in the weight's layout.

    ``raw`` is what goes into a GGUF file for this tensor: float arrays for F32/F16/BF16, and a
    ``uint8 [rows, row_bytes]`` array of blocks for block-quantized types. Rows are independent,
    so a writer may reorder rows (llama's Q/K permutation) without re-quantizing.
    """

    ggml_type: str
    raw: np.ndarray
    shape: tuple[int, ...]

    def dequantize(self) -> torch.Tensor:
        """float32 values, decoded a few MiB of rows at a time: gguf-py's decoders hold several
        float32 intermediates of their input's size (about 17 bytes a weight for Q4_K), which for
        a 128256-row embedding would be 9 GB at once."""
        kind = GGMLQuantizationType[self.ggml_type]
        raw = self.raw.reshape(-1, self.raw.shape[-1])
        out = np.empty((raw.shape[0], self.shape[-1]), np.float32)
        step = max(1, _DECODE_CHUNK // out.shape[1])
        for start in range(0, raw.shape[0], step):
            out[start : start + step] = dequantize(raw[start : start + step], kind).reshape(-1, out.shape[1])
        return torch.from_numpy(out).reshape(self.shape)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        """float32 values of the rows ``index`` picks (a slice, or row numbers) of the weight as
        ``[rows, last dimension]``, decoding only those: an output head read a slice at a time."""
        raw = self.raw.reshape(-1, self.raw.shape[-1])
        picked = raw[index] if isinstance(index, slice) else raw[index.cpu().numpy()]
        values = dequantize(picked, GGMLQuantizationType[self.ggml_type]).reshape(-1, self.shape[-1])
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.raw.nbytes / int(np.prod(self.shape))


_DECODE_CHUNK = 2**20  # weights per decoded slice of a ggml tensor: 4 MiB of float32


@dataclass(frozen=True)
class StoredGGMLTensor(GGMLTensor):
    """A GGUF source's tensor exactly as its file stores it (llama's q/k rows interleaved, Gemma's
    norms plus one), so a GGUF file written from it holds the same bytes; ``values`` is the weight
    as the model computes with it."""

    values: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.values

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        return self.values.reshape(-1, self.shape[-1])[index]


# What a quantizer hands downstream for one tensor: left as it was, integer-quantized (possibly with
# 16-bit outlier columns), or ggml-encoded.
TensorPayload = Union[torch.Tensor, QuantizedTensor, GGMLTensor, "MixedPrecisionTensor"]


def dequantized(payload: TensorPayload) -> torch.Tensor:
    """The float32 weights a payload stands for: what an evaluation or a dense export uses."""
    if isinstance(payload, torch.Tensor):
        return payload.to(torch.float32)
    return payload.dequantize()


def float_rows(payload: TensorPayload, index: slice | torch.Tensor) -> torch.Tensor:
    """The float32 rows ``index`` picks (a slice, or row numbers) of the weights a payload stands
    for, as ``[rows, last dimension]``. A float tensor's rows and ggml blocks' are converted alone,
    so that an 8B model's 128256-row embedding or head need not be in float32 whole (2 GiB); other
    payloads are decoded whole first (a caller taking many slices of one decodes it once)."""
    if isinstance(payload, torch.Tensor):
        return payload.reshape(-1, payload.shape[-1])[index].to(torch.float32)
    if isinstance(payload, GGMLTensor):
        return payload.rows(index)
    whole = payload.dequantize()
    return whole.reshape(-1, whole.shape[-1])[index]


class LayerResult(NamedTuple):
    """One decoder layer's output of a calibrated pass (GPTQ, AWQ, SmoothQuant, outlier columns):
    its tensors by weight name (on the CPU), the per-Linear input statistics
    (``quant.outliers.channel_statistics``) by module name, and the relative output error of each
    Linear it quantized (``quant.error``), by module name, where the pass measured it."""

    tensors: dict[str, TensorPayload]
    statistics: dict[str, dict]
    errors: dict[str, float]


class InputError(Exception):
    """A mistake in what the user gave us (a file, a recipe field, a flag).

    The message is one line that names the offending file, field or tensor; the command line prints
    it without a traceback and exits with status 2. Names come from untrusted files, so control
    characters in them are shown escaped and a message of runaway length is cut in the middle:
    whatever a file holds, the error stays one readable line.
    """

    def __init__(self, message: str):
        super().__init__(_one_line(str(message)))


def _one_line(text: str, limit: int = 1000) -> str:
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else f"{text[: limit * 3 // 4]} ... {text[-limit // 4 :]}"


@dataclass(frozen=True)
class MixedPrecisionTensor:
    """A quantized weight whose few outlier input columns are kept in fp16 (LLM.int8-style).

    Input channels that carry very large activations multiply their weight column's rounding error;
    keeping those columns in 16 bits removes the largest share of the output error for a few bits
    per weight. ``base`` covers the whole ``[out, in]`` weight with the outlier columns zeroed (so
    they do not widen any group's range); ``dense`` holds those columns, listed in ``columns``.
    """

    base: QuantizedTensor
    columns: torch.Tensor  # int32 [k]: the input columns kept in 16 bits
    dense: torch.Tensor  # float16 [out, k]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    def dequantize(self) -> torch.Tensor:
        w = self.base.dequantize()
        w[:, self.columns.long()] = self.dense.to(torch.float32)
        return w

    @property
    def bits_per_weight(self) -> float:
        """The base's bits (its codes cover every column) plus 16 bits per kept weight and a 32-bit
        index per kept column."""
        out, n_in = self.base.shape
        return self.base.bits_per_weight + (16 * self.dense.numel() + 32 * self.columns.numel()) / (out * n_in)


# Hugging Face model_type -> llama.cpp's architecture (Mistral's dense models are llama to llama.cpp).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding: base frequency, scaling (transformers' rope_type and its
    parameters), and how many of a head's channels rotate."""

    theta: float
    scaling: str = "default"  # default, linear, llama3, yarn, dynamic, ...
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_context: int = 8192  # llama3: original_max_position_embeddings
    dims: int = 0  # rotated channels per head


@dataclass(frozen=True)
class Architecture:
    """One decoder-only model's shape and conventions, read once from its config.json or GGUF
    metadata (formats/architecture.py); every module reads this instead of the raw config."""

    model_type: str  # Hugging Face model_type (for a GGUF file: its llama.cpp architecture)
    layers: int
    hidden: int
    heads: int
    kv_heads: tuple[int, ...]  # per layer (0 for a layer without attention)
    head_dim: int  # query/key channels per head
    value_dim: int  # value channels per head
    intermediate: int  # the MLP's width; each expert's, in a mixture of experts
    vocab: int
    max_context: int  # 0 where the model does not say
    norm_eps: float
    rope: Rope
    tied_embeddings: bool
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for global attention
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    experts: int = 0  # routed experts; 0 for a dense model
    experts_per_token: int = 0
    shared_experts: int = 0
    latent_cache: int | None = None  # multi-head latent attention: values one token caches per layer
    explicit_head_dim: bool = False  # config.json names head_dim (llama.cpp's converter then writes key_length)
    # Conventions beyond Llama's, each named after what it changes in the forward pass:
    norm_offset: float = 0.0  # Gemma: a norm scales by (offset + weight); llama.cpp's files hold the sum
    post_norms: bool = False  # Gemma 2/3: the attention and MLP outputs are normed before the residual
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's queries and keys, before rope
    embedding_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    query_scale: float | None = None  # attention's score scale where it is not head_dim ** -0.5 (Gemma)
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    activation: str = "silu"  # the MLP gate's: silu, or gelu_pytorch_tanh (Gemma)
    local_rope: Rope | None = None  # Gemma 3: the sliding-window layers' own rope
    fused_projections: bool = False  # Phi-3: one qkv_proj and one gate_up_proj per layer

    @property
    def score_scale(self) -> float:
        """What attention multiplies query-key products by."""
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    def rope_of(self, layer: int) -> Rope:
        """The rope ``layer`` rotates with (Gemma 3's sliding layers have their own)."""
        return self.local_rope if self.local_rope is not None and self.windows[layer] is not None else self.rope

    @property
    def gguf_arch(self) -> str | None:
        """llama.cpp's name for this architecture, where quantbench exports GGUF files for it."""
        return GGUF_ARCHITECTURES.get(self.model_type)  # a GGUF file's own name (llama, qwen2) maps to itself

    @property
    def rope_pairs_adjacent_in_gguf(self) -> bool:
        """Whether llama.cpp keeps each head's rotary pairs side by side (its "normal" rope, for the
        llama architecture) where transformers keeps the two halves apart: our converter then
        permutes the q/k rows, and a quantized KV cache sees its blocks of keys in that order."""
        return self.gguf_arch == "llama"

    @property
    def query_groups(self) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        kv = max(self.kv_heads)
        return self.heads // kv if kv else 1

    def cache_values_per_token(self, layer: int) -> int:
        """Key and value channels one token adds to ``layer``'s cache (a latent vector under MLA)."""
        if self.latent_cache is not None:
            return self.latent_cache
        return self.kv_heads[layer] * (self.head_dim + self.value_dim)
