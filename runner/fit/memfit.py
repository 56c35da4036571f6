"""Will it fit, for how many users, how fast: memory and speed bounds of serving a model.

Memory on each GPU is weights + KV cache + activations (or llama.cpp's compute buffer) + the
runtime's fixed overhead, against the share of the GPU's memory the engine allows itself. Every
term is shown, so a customer can see why an answer is what it is:

- Weights: the real tensor list of the model (``runner.fit.model_shape``). GGUF file types use
  llama.cpp's per-tensor type rules (``core.file_types``), the same that make our GGUF files, so
  Q4_K_M costs what a Q4_K_M file holds (about 4.9 bits per weight with its Q6_K tensors), and a
  GGUF file is counted byte for byte. Integer formats add their scales (and zero points) per group;
  embeddings and the output head stay 16-bit, as GPTQ/AWQ/compressed-tensors checkpoints keep them.
- KV cache: per layer, values per token times the tokens it keeps: all of them for global
  attention, at most the window for sliding-window layers (Gemma 2/3), one latent vector per token
  for DeepSeek's multi-head latent attention. KV heads are split across tensor-parallel GPUs.
  llama.cpp gives the sliding layers one cache for all sequences, their windows plus one
  micro-batch (``Engine.cached_tokens``), and knows by itself which layers of a GGUF file slide.
- Activations: the engine's own sizing rule (``Engine``).

Speed bounds: decoding one token reads every active weight and the sequence's KV cache once, so
memory bandwidth bounds tokens/s; prefill is bounded by FLOPs at an assumed utilisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from core.errors import InputError
from core.file_types import FILE_TYPES, tensor_types
from formats.hf import is_linear_weight
from runner.fit.gpus import GIB, GPU, catalog
from runner.fit.model_shape import ModelShape, is_expert

# Integer weight formats: (bits, scale bits per group, zero-point bits per group, per-input-column
# index bits). None group: one scale per output channel.
_INT_FORMATS = {
    "int8": (8, 16, 0, 0),  # per-channel symmetric, fp16 scale (W8A8 checkpoints)
    "fp8": (8, 32, 0, 0),  # float8 e4m3 with a float32 per-channel scale
    "int4": (4, 16, 0, 0),  # symmetric groups, fp16 scales (compressed-tensors pack-quantized)
    "gptq": (4, 16, 4, 32),  # qweight, fp16 scales, packed 4-bit qzeros, int32 g_idx per column
    "awq": (4, 16, 4, 0),  # qweight, fp16 scales, packed 4-bit qzeros
}
_FLOAT_FORMATS = {"fp32": 32, "fp16": 16, "bf16": 16}
WEIGHT_FORMATS = [*_FLOAT_FORMATS, *_INT_FORMATS, *(t.lower() for t in FILE_TYPES)]

# KV-cache element sizes. int8/int4 are llama.cpp's q8_0/q4_0 cache types (blocks of 32 values
# with an fp16 scale: 8.5 and 4.5 bits); fp8 is vLLM's e4m3 cache (one scale per tensor); fp32 is
# transformers' cache for a float32 model.
KV_BITS = {"fp16": 16.0, "bf16": 16.0, "fp32": 32.0, "fp8": 8.0, "int8": 8.5, "int4": 4.5}

PREFILL_UTILISATION = 0.5  # share of peak FLOPs a prefill reaches: a bound, not a benchmark


@dataclass(frozen=True)
class Engine:
    """How a serving engine sizes its memory.

    ``utilisation``: the share of GPU memory it takes (vLLM's gpu_memory_utilization).
    ``overhead``: fixed runtime memory per GPU outside its pools (CUDA context, cuBLAS workspace,
    CUDA graphs), an estimate.
    """

    name: str
    utilisation: float
    overhead: int
    description: str

    def cached_tokens(self, window: int | None, context: int, users: int) -> int:
        """Tokens one layer keeps for ``users`` sequences of ``context`` tokens."""
        if window is None:
            return users * context
        if self.name == "llamacpp":
            # llama_kv_cache_iswa as llama-server runs it (no --swa-full): one cache of every
            # sequence's window plus a micro-batch of 512 tokens, in whole 256-cell pads
            return min(users * context, -(-(window * users + 512) // 256) * 256)
        return users * min(context, window)

    def activations(self, shape: ModelShape, users: int, context: int, tensor_parallel: int, element: int = 2) -> int:
        """Peak activation memory per GPU, in bytes. ``element``: bytes per activation value where
        the engine computes in the weights' dtype (transformers: 4 for float32 weights)."""
        h, vocab = shape.arch.hidden, shape.arch.vocab
        ff = shape.intermediate / tensor_parallel
        heads = math.ceil(shape.arch.heads / tensor_parallel)
        if self.name == "vllm":
            # the profile run: a batch of max_num_batched_tokens (8192) tokens through one layer at
            # a time in 16-bit (residual, norm, q/k/v, attention out; gate, up and their product),
            # plus float32 logits for max_num_seqs (256) sequences in the sampler
            tokens = 8192
            per_token = 4 * h + 3 * heads * shape.arch.head_dim + 3 * ff
            return int(tokens * per_token * 2 + min(users, 256) * vocab * 4)
        if self.name == "llamacpp":
            # the compute buffer of one micro-batch of n_ubatch (512) tokens: the largest of the
            # output stage (float32 logits and last hidden state), the MLP stage (gate and up) and
            # the attention stage (flash attention's fp16 mask over the context, and about 13
            # float32 hidden-wide tensors); the shape of llama.cpp's own reported buffer sizes
            # (ref model: 18.0, 21.0, 29.0 MiB at 2048, 8192, 16384 tokens; 258.5 MiB for
            # Llama-3-8B, whose logits dominate). Logits handed to the caller live in host memory.
            ubatch = 512
            return max(ubatch * (vocab + h) * 4, int(ubatch * (2 * ff + h)) * 4, ubatch * (2 * context + 13 * 4 * h))
        # transformers' generate: a prefill of every user's whole context at once, eager PyTorch in
        # the weights' dtype. Its peak is the last layer's MLP: four hidden-wide tensors alive (the
        # embeddings, the layer's input, the attention residual, the normed input) and three
        # intermediate-wide ones (act(gate), up, their product); float32 logits of the last
        # position only. Live-tensor peaks measured on the shared models: bench/fit_runtime.py.
        return int(users * context * (4 * h + 3 * ff) * element + users * vocab * 4)


ENGINES = {
    e.name: e
    for e in (
        Engine("vllm", 0.90, int(1.0 * GIB), "vLLM: 90% of GPU memory, paged KV pool, CUDA graphs"),
        Engine("llamacpp", 1.0, int(0.3 * GIB), "llama.cpp: weights, KV cache, compute buffer (flash attention)"),
        Engine("transformers", 1.0, int(0.5 * GIB), "transformers generate: whole-context prefill, static cache"),
    )
}


@dataclass(frozen=True)
class FitQuery:
    weights: str  # a WEIGHT_FORMATS name; ignored for a GGUF file or a quantized checkpoint, whose tensors are what they are
    group_size: int
    kv_cache: str
    context: int
    users: int
    gpu: GPU
    gpus: int
    engine: Engine


def weights_bytes(shape: ModelShape, fmt: str, group_size: int = 128) -> int:
    """Bytes of the model's weights in ``fmt`` (all GPUs together)."""
    if shape.stored_bytes is not None:
        return sum(shape.stored_bytes.values())
    key = fmt.lower()
    if key in _FLOAT_FORMATS:
        return sum(math.prod(s) * _FLOAT_FORMATS[key] for _, s in shape.tensors) // 8
    if key in _INT_FORMATS:
        bits, scale, zero, index = _INT_FORMATS[key]
        total = 0.0
        for name, s in shape.tensors:
            if not is_linear_weight(_rules_name(name, s), s[-2:]):  # decoder Linear and expert weights
                total += math.prod(s) * 16
                continue
            rows, cols = math.prod(s[:-1]), s[-1]
            groups = cols // group_size if key in ("int4", "gptq", "awq") and cols % group_size == 0 else 1
            total += math.prod(s) * bits + rows * groups * (scale + zero) + cols * index * math.prod(s[:-2])
        return int(total // 8)
    upper = fmt.upper()
    if upper not in FILE_TYPES:
        raise InputError(f"--weights {fmt}: unknown format (one of {', '.join(WEIGHT_FORMATS)})")
    named = [(_rules_name(n, s), s) for n, s in shape.tensors]
    types = tensor_types(upper, named, shape.arch)
    total = 0
    for name, s in named:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[types[name]]]
        total += math.prod(s) // block * size
    return total


def active_weights_bytes(shape: ModelShape, weights: int) -> float:
    """Weight bytes one token reads: a mixture of experts reads its routed experts only."""
    if shape.expert_fraction >= 1.0:
        return float(weights)
    sizes = shape.stored_bytes or {n: math.prod(s) for n, s in shape.tensors}
    total = sum(sizes.values())
    expert = sum(v for n, v in sizes.items() if is_expert(n))
    return weights * (1.0 - expert / total * (1.0 - shape.expert_fraction))


def kv_bytes_per_token(shape: ModelShape, kv_cache: str, tensor_parallel: int = 1) -> float:
    """KV bytes one token adds on one GPU while every layer still keeps it (within all windows)."""
    return sum(layer.values_per_token_on(tensor_parallel) for layer in shape.layers) * _kv_bits(kv_cache) / 8


def kv_bytes_total(shape: ModelShape, kv_cache: str, context: int, users: int, engine: Engine, tensor_parallel: int = 1) -> float:
    """KV bytes ``engine`` allocates on one GPU for ``users`` sequences of ``context`` tokens."""
    bits = _kv_bits(kv_cache)
    return sum(layer.values_per_token_on(tensor_parallel) * engine.cached_tokens(layer.window, context, users)
               for layer in shape.layers) * bits / 8


def kv_bytes_per_sequence(shape: ModelShape, kv_cache: str, context: int, tensor_parallel: int = 1) -> float:
    """KV bytes of one sequence of ``context`` tokens on one GPU: sliding-window layers stop
    growing at their window."""
    bits = _kv_bits(kv_cache)
    return sum(layer.values_per_token_on(tensor_parallel) * min(context, layer.window or context) for layer in shape.layers) * bits / 8


@dataclass
class FitResult:
    model: str
    parameters: int
    weights_format: str
    weights_bytes: int  # all GPUs
    bits_per_weight: float
    kv_cache_dtype: str
    kv_bytes_per_token: float  # one GPU, every layer still holding the token
    kv_bytes_per_sequence: float  # one GPU, one sequence of the context length
    kv_bytes_total: float  # one GPU, all users
    activation_bytes: int  # one GPU
    overhead_bytes: int  # one GPU
    total_bytes: float  # one GPU: weights share + KV + activations + overhead
    usable_bytes: float  # one GPU: its memory times the engine's utilisation
    free_bytes: float  # usable - total (negative: does not fit)
    fits: bool
    max_users: int  # at the given context
    max_context: int  # at the given users, capped at the model's trained context
    max_context_by_memory: int  # the same, not capped
    decode_tokens_per_s_max: float  # one user, the whole context in the cache: bandwidth bound
    decode_tokens_per_s_total: float  # all users decoding together
    prefill_seconds: float | None  # one user's whole context, at PREFILL_UTILISATION of peak
    smallest_gpu: str | None  # the catalog GPU with the least memory that fits (same count)
    query: dict

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def fit(shape: ModelShape, q: FitQuery, smallest: bool = True) -> FitResult:
    tp = q.gpus
    weights = weights_bytes(shape, q.weights, q.group_size)
    weights_per_gpu = weights / tp
    per_token = kv_bytes_per_token(shape, q.kv_cache, tp)
    per_sequence = kv_bytes_per_sequence(shape, q.kv_cache, q.context, tp)
    activations = q.engine.activations(shape, q.users, q.context, tp, _element(shape, q))
    overhead = q.engine.overhead
    usable = q.gpu.memory_bytes * q.engine.utilisation
    kv_total = kv_bytes_total(shape, q.kv_cache, q.context, q.users, q.engine, tp)
    total = weights_per_gpu + kv_total + activations + overhead
    room = usable - weights_per_gpu - overhead
    max_users = _max_users(shape, q, room, tp)
    max_context = _max_context(shape, q, room, tp)
    active = active_weights_bytes(shape, weights)
    bandwidth = q.gpu.bandwidth * tp
    one = bandwidth / (active + per_sequence * tp)
    every = q.users * bandwidth / (batch_weights_bytes(shape, weights, active, q.users) + q.users * per_sequence * tp)
    prefill = None
    if q.gpu.flops:
        flops = 2 * shape.active_parameters * q.context + _attention_flops(shape, q.context)
        prefill = flops / (q.gpu.flops * tp * PREFILL_UTILISATION)
    params = shape.parameters
    result = FitResult(
        model=shape.name, parameters=params,
        weights_format=shape.stored_as or q.weights.lower(),
        weights_bytes=weights, bits_per_weight=weights * 8 / params,
        kv_cache_dtype=q.kv_cache, kv_bytes_per_token=per_token, kv_bytes_per_sequence=per_sequence,
        kv_bytes_total=kv_total, activation_bytes=activations, overhead_bytes=overhead,
        total_bytes=total, usable_bytes=usable, free_bytes=usable - total, fits=total <= usable,
        max_users=max_users, max_context=min(max_context, shape.arch.max_context or max_context),
        max_context_by_memory=max_context, decode_tokens_per_s_max=one, decode_tokens_per_s_total=every,
        prefill_seconds=prefill, smallest_gpu=None,
        query={"weights": q.weights.lower(), "group_size": q.group_size, "kv_cache": q.kv_cache, "context": q.context,
               "users": q.users, "gpu": q.gpu.name, "gpus": q.gpus, "engine": q.engine.name},
    )
    if smallest:
        result.smallest_gpu = smallest_gpu(shape, q)
    return result


def smallest_gpu(shape: ModelShape, q: FitQuery) -> str | None:
    """The catalog GPU with the least memory that fits the query, among those the engine runs on
    (vLLM: not Apple's)."""
    for gpu in sorted(catalog().values(), key=lambda g: (g.memory_bytes, g.name)):
        if q.engine.name == "vllm" and gpu.vendor == "apple":
            continue
        trial = FitQuery(q.weights, q.group_size, q.kv_cache, q.context, q.users, gpu, q.gpus, q.engine)
        if fit(shape, trial, smallest=False).fits:
            return gpu.name
    return None


def _max_users(shape: ModelShape, q: FitQuery, room: float, tp: int) -> int:
    """The most users at ``q.context`` (activations grow with users for some engines)."""
    lo, hi = 0, 1
    while hi < 1 << 24 and _needs(shape, q, hi, q.context, tp) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _needs(shape, q, mid, q.context, tp) <= room else (lo, mid)
    return lo


def _max_context(shape: ModelShape, q: FitQuery, room: float, tp: int) -> int:
    """The longest context at ``q.users`` that fits (0 if not even one token does)."""
    lo, hi = 0, 1
    while hi < 1 << 30 and _needs(shape, q, q.users, hi, tp) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _needs(shape, q, q.users, mid, tp) <= room else (lo, mid)
    return lo


def _needs(shape: ModelShape, q: FitQuery, users: int, context: int, tp: int) -> float:
    activations = q.engine.activations(shape, users, context, tp, _element(shape, q))
    return kv_bytes_total(shape, q.kv_cache, context, users, q.engine, tp) + activations


def _element(shape: ModelShape, q: FitQuery) -> int:
    """Bytes per activation value: float32 models compute in float32, everything else in 16-bit."""
    return 4 if shape.stored_bytes is None and q.weights.lower() == "fp32" else 2


def batch_weights_bytes(shape: ModelShape, weights: int, active: float, users: int) -> float:
    """Weight bytes one decoding step of ``users`` sequences reads: a mixture of experts reads the
    union of the experts its tokens chose, all of them once the batch is large."""
    if shape.expert_fraction >= 1.0:
        return float(weights)
    untouched = (1.0 - shape.expert_fraction) ** users  # share of experts no token picked
    return weights - (weights - active) / (1.0 - shape.expert_fraction) * untouched


def _attention_flops(shape: ModelShape, context: int) -> float:
    """Causal attention over a prompt: QKᵀ and the weighted sum, half the square each."""
    per_layer = []
    for layer in shape.layers:
        span = min(context, layer.window or context)
        per_layer.append(2 * 2 * shape.arch.heads * shape.arch.head_dim * context * span / 2)
    return float(sum(per_layer))


def _kv_bits(kv_cache: str) -> float:
    if kv_cache not in KV_BITS:
        raise InputError(f"--kv-cache {kv_cache}: unknown (one of {', '.join(KV_BITS)})")
    return KV_BITS[kv_cache]


def _rules_name(name: str, shape: tuple[int, ...]) -> str:
    """transformers stores fused expert weights without a ``.weight`` suffix; llama.cpp's rules
    treat them as weights."""
    return f"{name}.weight" if len(shape) >= 2 and not name.endswith((".weight", ".bias")) else name
