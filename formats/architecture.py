"""The one description of a model's architecture, and the tensors its config.json says it has.

``core.architecture.Architecture`` holds what every module needs to know about a model (layers,
widths, heads, KV heads, head size, rope, norms, biases, sliding windows, experts, tied
embeddings); it is read here, once, from a config.json (through transformers' own config class, so
its defaults apply) or from a GGUF file's metadata. The GGUF writer, llama.cpp's type rules, the
memory-fit calculator and the engine read it instead of deriving head sizes and KV heads from raw
config keys each in its own way.

Building the model from its config on the meta device (shapes, no storage) gives, for every
architecture transformers knows, the exact list of tensors a checkpoint must hold (names, shapes,
tied heads, biases, experts), so a checkpoint is checked against the model it claims to be before
any work starts, and the memory-fit calculator counts the same parameters a real load would.

A config's sizes are checked first: a config is as untrusted as the weights, and a layer count of
a billion would otherwise keep transformers building modules for hours.
"""

from __future__ import annotations

import numpy as np
import torch

from core.architecture import SLIDING_PATTERN, Architecture, Rope
from core.errors import InputError

MAX_GGUF_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS


def from_config(config: dict, where: str) -> Architecture:
    """The architecture a config.json's contents describe, with transformers' defaults for what it
    leaves out; ``where`` names the config in errors."""
    return from_transformers(transformers_config(config, where), config, where)


def from_transformers(hf, config: dict, where: str) -> Architecture:
    """The architecture of the transformers config ``hf``, made of the config.json contents ``config``."""
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    raw = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def size(name: str) -> int:
        value = getattr(text, name, None)  # transformers maps each architecture's own key names onto these
        if not isinstance(value, int) or value < 1:
            raise InputError(f"{where}: this {text.model_type} config gives no {name}")
        return value

    layers, heads, hidden = size("num_hidden_layers"), size("num_attention_heads"), size("hidden_size")
    kv_lora = getattr(text, "kv_lora_rank", None)
    if kv_lora:  # DeepSeek's multi-head latent attention
        head_dim, value_dim = text.qk_nope_head_dim + text.qk_rope_head_dim, text.v_head_dim
    else:
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        value_dim = head_dim
    kv = getattr(text, "num_key_value_heads", None) or heads
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
    experts = getattr(text, "n_routed_experts", None) or getattr(text, "num_local_experts", None) \
        or getattr(text, "num_experts", None) or 0
    intermediate = (getattr(text, "moe_intermediate_size", None) if experts else None) \
        or getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return Architecture(
        model_type=text.model_type,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=(kv,) * layers,
        head_dim=head_dim,
        value_dim=value_dim,
        intermediate=intermediate,
        vocab=size("vocab_size"),
        max_context=int(getattr(text, "max_position_embeddings", 0) or 0),
        norm_eps=float(getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None)
                       or getattr(text, "layer_norm_epsilon", None) or 1e-6),
        rope=_rope_of(text, raw, head_dim, where),
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        windows=tuple(window if t == "sliding_attention" else None for t in types),
        qkv_bias=bool(getattr(text, "attention_bias", False)) or text.model_type == "qwen2",  # Qwen2: always
        output_bias=bool(getattr(text, "attention_bias", False)),
        mlp_bias=bool(getattr(text, "mlp_bias", False)),
        experts=experts,
        experts_per_token=(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
        shared_experts=getattr(text, "n_shared_experts", 0) or 0,
        latent_cache=kv_lora + text.qk_rope_head_dim if kv_lora else None,
        explicit_head_dim=bool(raw.get("head_dim")),
        **_conventions(text, hidden, head_dim, where),
    )


_GEMMA = ("gemma", "gemma2", "gemma3_text")


def _conventions(text, hidden: int, head_dim: int, where: str) -> dict:
    """The forward-pass conventions (``Architecture``'s fields after ``explicit_head_dim``) of a
    transformers text config: Gemma's norms, scales, soft-caps and local rope, Qwen3's and Gemma
    3's q/k norms, Phi-3's fused projections."""
    kind = text.model_type
    scalar = getattr(text, "query_pre_attn_scalar", None)
    params = getattr(text, "rope_parameters", None)
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    return dict(
        norm_offset=1.0 if kind in _GEMMA else 0.0,
        post_norms=kind in ("gemma2", "gemma3_text"),
        qk_norm=kind in ("qwen3", "gemma3_text"),
        embedding_scale=hidden ** 0.5 if kind in _GEMMA else 1.0,
        query_scale=_positive(scalar, "query_pre_attn_scalar", where) ** -0.5 if scalar is not None else None,
        attn_softcap=_positive(text.attn_logit_softcapping, "attn_logit_softcapping", where)
        if getattr(text, "attn_logit_softcapping", None) is not None else None,
        final_softcap=_positive(text.final_logit_softcapping, "final_logit_softcapping", where)
        if getattr(text, "final_logit_softcapping", None) is not None else None,
        activation=str(getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None) or "silu"),
        local_rope=_rope_params(local, {}, text, head_dim, where) if isinstance(local, dict) else None,
        fused_projections=kind == "phi3",
    )

def from_gguf(fields: dict, tensors: dict[str, tuple[int, ...]], where: str) -> Architecture:
    """The architecture a GGUF file's metadata (``fields``) and tensor shapes describe, each value
    checked to be a whole number in range, so a damaged file gets one line, not a division by zero."""
    meta = _GGUFMetadata(fields, where)
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InputError(f"{where}: GGUF file without general.architecture")
    layers = meta.whole(f"{arch}.block_count", 1, MAX_GGUF_LAYERS)
    hidden = meta.whole(f"{arch}.embedding_length", 1, _LARGE)
    heads = meta.per_layer(f"{arch}.attention.head_count", layers)
    kv_heads = meta.per_layer(f"{arch}.attention.head_count_kv", layers, heads)
    if max(heads) == 0:
        raise InputError(f"{where}: GGUF metadata '{arch}.attention.head_count' is 0 in every layer")
    for i, (q, kv) in enumerate(zip(heads, kv_heads)):
        if (q == 0) != (kv == 0) or (kv and q % kv):
            raise InputError(f"{where}: GGUF metadata gives layer {i} {q} attention heads and {kv} KV heads "
                             "(query heads must be a multiple of KV heads)")
    head_dim = meta.whole(f"{arch}.attention.key_length", 1, _LARGE, hidden // max(heads) or None)
    value_dim = meta.whole(f"{arch}.attention.value_length", 1, _LARGE, head_dim)
    window = meta.whole(f"{arch}.attention.sliding_window", 0, _LARGE, 0)
    softcap = {k: fields.get(f"{arch}.{k}_logit_softcapping") for k in ("attn", "final")}
    tokens = fields.get("tokenizer.ggml.tokens")
    if "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"][0]
    elif isinstance(tokens, list):
        vocab = len(tokens)
    else:
        raise InputError(f"{where}: GGUF file with neither token_embd.weight nor tokenizer.ggml.tokens: no vocabulary size")
    experts = meta.whole(f"{arch}.expert_count", 0, 1 << 16, 0)
    used = meta.whole(f"{arch}.expert_used_count", 0, max(experts, 1), 0) if experts else 0
    if experts and not used:
        raise InputError(f"{where}: GGUF metadata '{arch}.expert_used_count' is missing or 0 for {experts} experts")
    if experts and f"{arch}.expert_feed_forward_length" in fields:
        intermediate = meta.whole(f"{arch}.expert_feed_forward_length", 1, _LARGE)
    else:
        intermediate = meta.per_layer(f"{arch}.feed_forward_length", layers)[0]
    theta = fields.get(f"{arch}.rope.freq_base", 10000.0)
    return Architecture(
        model_type=arch,
        layers=layers,
        hidden=hidden,
        heads=heads[0],
        kv_heads=tuple(kv_heads),
        head_dim=head_dim,
        value_dim=value_dim,
        intermediate=intermediate,
        vocab=vocab,
        max_context=meta.whole(f"{arch}.context_length", 0, _LARGE, 0),
        norm_eps=float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope=Rope(float(theta) if isinstance(theta, (int, float)) else 10000.0,
                  dims=meta.whole(f"{arch}.rope.dimension_count", 0, _LARGE, head_dim)),
        tied_embeddings="output.weight" not in tensors,
        windows=llama_cpp_windows(arch, layers, window),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        output_bias="blk.0.attn_output.bias" in tensors,
        experts=experts,
        experts_per_token=used,
        post_norms="blk.0.post_attention_norm.weight" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        attn_softcap=float(softcap["attn"]) if isinstance(softcap["attn"], (int, float)) and softcap["attn"] else None,
        final_softcap=float(softcap["final"]) if isinstance(softcap["final"], (int, float)) and softcap["final"] else None,
        fused_projections="blk.0.attn_qkv.weight" in tensors,
    )


_LARGE = 1 << 31


def llama_cpp_windows(arch: str, layers: int, window: int) -> tuple[int | None, ...]:
    """The sliding window of each layer as llama.cpp runs a GGUF file of ``arch`` with
    ``attention.sliding_window`` = ``window``: a pattern of n has every n-th layer global; Phi-3's
    window is read and then switched off (llama.cpp's "Phi SWA is currently disabled")."""
    if not window or arch == "phi3":
        return (None,) * layers
    n = SLIDING_PATTERN.get(arch, 1)
    return tuple(window if n == 1 or i % n < n - 1 else None for i in range(layers))


class _GGUFMetadata:
    """Typed access to a GGUF header's hyper-parameters, refusing what is not a whole number in range."""

    def __init__(self, fields: dict, where: str):
        self.fields, self.where = fields, where

    def whole(self, key: str, low: int, high: int, default: int | None = None) -> int:
        value = self.fields.get(key)
        if value is None:
            if default is None:
                raise InputError(f"{self.where}: GGUF metadata has no '{key}'")
            return default
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not low <= value <= high:
            raise InputError(f"{self.where}: GGUF metadata '{key}' is {str(value)[:40]}, not a whole number "
                             f"from {low} to {high:,}")
        return int(value)

    def per_layer(self, key: str, layers: int, default: list[int] | None = None) -> list[int]:
        """A value given once for all layers, or as an array of one value per layer."""
        value = self.fields.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, np.ndarray):
            return [self.whole(key, 0, _LARGE)] * layers
        if value.dtype.kind not in "iu" or value.size != layers or (value.size and not 0 <= value.min() <= value.max() <= _LARGE):
            raise InputError(f"{self.where}: GGUF metadata '{key}' is not {layers} whole numbers, one per layer")
        return [int(v) for v in value]


def _rope_of(text, raw: dict, head_dim: int, where: str) -> Rope:
    """The rope of a transformers config: its ``rope_parameters`` (Gemma 3 keeps one per layer
    type: the global layers' is the model's), or the older ``rope_scaling`` and ``rope_theta`` of
    the raw config, which transformers 5 folds into the same."""
    params = getattr(text, "rope_parameters", None) or raw.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return _rope_params(params if isinstance(params, dict) else {}, raw, text, head_dim, where)


def _rope_params(params: dict, raw: dict, text, head_dim: int, where: str) -> Rope:
    """The rope of one set of transformers rope parameters."""
    theta = params.get("rope_theta", raw.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor") or getattr(text, "partial_rotary_factor", None) or 1.0
    rope = Rope(
        theta=_positive(theta, "rope_theta", where),
        scaling=str(params.get("rope_type", params.get("type", "default")) or "default"),
        factor=_positive(params.get("factor", 1.0), "rope factor", where),
        low_freq_factor=_positive(params.get("low_freq_factor", 1.0), "rope low_freq_factor", where),
        high_freq_factor=_positive(params.get("high_freq_factor", 4.0), "rope high_freq_factor", where),
        original_context=int(_positive(params.get("original_max_position_embeddings", 8192),
                                       "rope original_max_position_embeddings", where)),
        dims=int(head_dim * _positive(partial, "partial_rotary_factor", where)),
    )
    if rope.scaling == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise InputError(f"{where}: rope high_freq_factor {rope.high_freq_factor} must exceed low_freq_factor {rope.low_freq_factor}")
    return rope


def _positive(value: object, key: str, where: str) -> float:
    """A number of the config that must be finite and above zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InputError(f"{where}: {key} is {str(value)[:40]}; it must be a positive number")
    return float(value)

# Sizes a config gives, each a positive integer no larger than this (well beyond any real model:
# the module count, layers times experts, is what building costs).
_SIZE_LIMITS = {
    "num_hidden_layers": 1024, "num_local_experts": 4096, "n_routed_experts": 4096, "num_experts": 4096,
    "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "moe_intermediate_size": 1 << 22,
    "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14, "head_dim": 1 << 16,
    "vocab_size": 1 << 26, "max_position_embeddings": 1 << 31, "sliding_window": 1 << 31,
    "num_experts_per_tok": 4096, "kv_lora_rank": 1 << 16, "qk_rope_head_dim": 1 << 16, "qk_nope_head_dim": 1 << 16,
}


def transformers_config(config: dict, where: str):
    """The transformers config of a config.json's contents; ``where`` names it in errors."""
    from transformers import AutoConfig

    check_sizes(config, where)
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise InputError(f"{where}: config has no model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers raises whatever its config code hits on a bad value
        raise InputError(f"{where}: transformers cannot read this {model_type} config ({_first_line(e)})") from None


def meta_model(config, where: str) -> torch.nn.Module:
    """The causal LM of a transformers ``config`` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # a config transformers accepted can still fail to build (sizes that do not divide)
        raise InputError(f"{where}: transformers cannot build model_type '{config.model_type}' ({_first_line(e)})") from None


def expected_tensors(hf, where: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors a checkpoint of the transformers config ``hf`` holds, name -> shape, and those
    it may leave out (an output head tied to the embedding)."""
    model = meta_model(hf, where)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    listed = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return shapes, set(shapes) - listed


def check_sizes(config: dict, where: str) -> None:
    """Refuse a config (or its ``text_config``) whose sizes are not positive integers within reason."""
    for part in (config, config.get("text_config")):
        if not isinstance(part, dict):
            continue
        for key, limit in _SIZE_LIMITS.items():
            value = part.get(key)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise InputError(f"{where}: {key} is {str(value)[:40]}; it must be a whole number from 1 to {limit:,}")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
