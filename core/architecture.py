"""The description of a decoder model's shape and conventions that every module reads
(formats/architecture.py reads it from a config.json or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Family:
    """What the layers that meet a model family need to know of it beyond its config: its name to
    llama.cpp, the transformers class that loads it, whether the engine runs it, and llama.cpp's
    sliding-window layer pattern for it. A new architecture starts with one entry in ``FAMILIES``."""

    gguf: str | None  # llama.cpp's architecture, where quantbench writes GGUF files for it
    causal_lm: str  # the transformers class of the text model
    runs_in_engine: bool = True
    sliding_pattern: int = 1  # llama.cpp's set_swa_pattern: every n-th layer global (1: no pattern)


# By Hugging Face model_type. Where several share a llama.cpp architecture, the first is the one a
# GGUF file of it reads back as (Mistral's dense models are llama to llama.cpp; Gemma 3's text
# model is gemma3, its multimodal wrapper too).
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM"),
    "mistral": Family("llama", "MistralForCausalLM"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM"),
    "gemma2": Family("gemma2", "Gemma2ForCausalLM", sliding_pattern=2),
    "gemma3_text": Family("gemma3", "Gemma3ForCausalLM", sliding_pattern=6),
    "phi3": Family("phi3", "Phi3ForCausalLM"),
    "gemma3": Family("gemma3", "Gemma3ForConditionalGeneration", runs_in_engine=False, sliding_pattern=6),
}
# Hugging Face model_type -> llama.cpp's architecture; a GGUF file's own name (llama, qwen2) maps to itself.
GGUF_ARCHITECTURES = {kind: f.gguf for kind, f in FAMILIES.items() if f.gguf}
# llama.cpp's architecture -> the Hugging Face model_type a GGUF file of it reads back as.
FROM_GGUF = {arch: next(kind for kind, f in FAMILIES.items() if f.gguf == arch) for arch in dict.fromkeys(GGUF_ARCHITECTURES.values())}
# llama.cpp's layer pattern of sliding-window attention, by its architecture: it reads only the window
# from the file, and which layers slide it knows by itself (llama_hparams::set_swa_pattern).
SLIDING_PATTERN = {f.gguf: f.sliding_pattern for f in FAMILIES.values() if f.gguf and f.sliding_pattern > 1}
RUNS_IN_ENGINE = tuple(kind for kind, f in FAMILIES.items() if f.runs_in_engine)


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
