"""Which ggml type each tensor gets in a GGUF file of a given file type.

These are llama.cpp's rules (``llama_tensor_get_type``): a K-quant file is a mixture, with more bits
for the tensors that hurt most when squeezed (the output head, some attn_v and ffn_down layers).
Reproducing them exactly is what makes our files byte-identical to ``llama-quantize``'s and makes
Q4_K_M mean the same thing here as everywhere else. Tensors are named by their Hugging Face names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from core.architecture import Architecture


@dataclass(frozen=True)
class FileType:
    name: str
    id: int  # general.file_type (llama_ftype)
    base: str  # the ggml type of tensors no rule singles out


FILE_TYPES: dict[str, FileType] = {
    ft.name: ft
    for ft in (
        FileType("F32", 0, "F32"),
        FileType("F16", 1, "F16"),
        FileType("BF16", 32, "BF16"),
        FileType("Q8_0", 7, "Q8_0"),
        FileType("Q4_0", 2, "Q4_0"),
        FileType("Q4_1", 3, "Q4_1"),
        FileType("Q5_0", 8, "Q5_0"),
        FileType("Q5_1", 9, "Q5_1"),
        FileType("Q2_K", 10, "Q2_K"),
        FileType("Q2_K_S", 21, "Q2_K"),
        FileType("Q3_K_S", 11, "Q3_K"),
        FileType("Q3_K_M", 12, "Q3_K"),
        FileType("Q3_K_L", 13, "Q3_K"),
        FileType("Q4_K_S", 14, "Q4_K"),
        FileType("Q4_K_M", 15, "Q4_K"),
        FileType("Q5_K_S", 16, "Q5_K"),
        FileType("Q5_K_M", 17, "Q5_K"),
        FileType("Q6_K", 18, "Q6_K"),
        FileType("IQ4_NL", 25, "IQ4_NL"),
        FileType("IQ4_XS", 30, "IQ4_XS"),
        FileType("IQ3_S", 26, "IQ3_S"),
        FileType("IQ3_M", 27, "IQ3_S"),
        FileType("IQ3_XS", 22, "IQ3_S"),
        FileType("IQ2_XS", 20, "IQ2_XS"),
        FileType("IQ2_XXS", 19, "IQ2_XXS"),
        FileType("IQ2_S", 28, "IQ2_XS"),
        FileType("IQ2_M", 29, "IQ2_S"),
        FileType("IQ3_XXS", 23, "IQ3_XXS"),
        FileType("IQ1_S", 24, "IQ1_S"),
        FileType("IQ1_M", 31, "IQ1_M"),
        FileType("TQ1_0", 36, "TQ1_0"),
        FileType("TQ2_0", 37, "TQ2_0"),
        FileType("MXFP4_MOE", 38, "MXFP4"),
    )
}
FLOAT_TYPES = ("F32", "F16", "BF16")
AUTO = "auto"  # a recipe's ``type: auto``: each tensor's type chosen within a budget, no fixed mixture

# When a row does not split into the chosen type's blocks (newer llama.cpp's fallbacks).
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "IQ4_XS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_S": "IQ4_NL", "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL",
             "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}
_TERNARY = ("TQ1_0", "TQ2_0")
# llama.cpp's "very low-bit" file types, with rules of their own (Q5_K head, Q2_K embedding, ...)
_LOW_BIT = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")
_IQ4 = ("IQ4_NL", "IQ4_XS")

# llama.cpp picks a tensor's rule by its GGUF name; these are the Hugging Face names that map to
# each. ffn_down covers dense, expert (``ffn_down_exps``) and shared-expert down projections alike.
_ROLES = (
    (re.compile(r"(^|\.)lm_head\.weight$"), "output"),
    (re.compile(r"embed_tokens\.weight$"), "token_embd"),
    (re.compile(r"self_attn\.v_proj\.weight$"), "attn_v"),
    (re.compile(r"self_attn\.k_proj\.weight$"), "attn_k"),
    (re.compile(r"self_attn\.o_proj\.weight$"), "attn_output"),
    # Phi-3's fused projection: llama.cpp gives attn_qkv the rules of attn_v (category_is_attn_v)
    (re.compile(r"self_attn\.qkv_proj\.weight$"), "attn_v"),
    (re.compile(r"\.(down_proj|w2)\.weight$"), "ffn_down"),
    (re.compile(r"self_attn\.q_proj\.weight$"), "attn_q"),
    (re.compile(r"\.(gate_proj|w1)\.weight$"), "ffn_gate"),
    (re.compile(r"\.(up_proj|gate_up_proj|w3)\.weight$"), "ffn_up"),  # Phi-3's fused gate_up is GGUF's ffn_up
)
# The types llama.cpp quantizes only with an importance matrix (tensor_requires_imatrix), except in
# the token embedding and the output head.
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
# A mixture-of-experts router (GGUF ffn_gate_inp) stays as converted, F32: llama.cpp never quantizes it.
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate\.weight$")


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Norms, biases, routers and other 1-D tensors keep full precision (F32) in every file type."""
    return len(shape) >= 2 and name.endswith("weight") and "norm" not in name and not _ROUTER.search(name)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of layers that get a bigger type: the first and last eighth, every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def block_size(ggml_type: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][0]


def tensor_types(file_type: str, tensors: list[tuple[str, tuple[int, ...]]], arch: Architecture,
                 has_imatrix: bool = False) -> dict[str, str]:
    """The ggml type of every tensor (by HF name) in a ``file_type`` GGUF file of this model."""
    ft = FILE_TYPES[file_type]
    model = _Model.of(arch)
    has_output = any(_role(name, True) == "output" for name, _ in tensors)
    types = {}
    for name, shape in tensors:
        if not is_quantizable(name, shape):
            types[name] = "F32"
        elif ft.base in FLOAT_TYPES:
            types[name] = ft.base
        else:
            chosen = _choose(ft, _role(name, has_output), _layer(name), model, shape, has_imatrix)
            types[name] = fit_rows(chosen, shape[-1])
    return types


@dataclass(frozen=True)
class _Model:
    """What llama.cpp's rules read off the model besides a tensor's name."""

    n_layers: int
    n_gqa: int  # query heads per KV head
    n_expert: int  # routed experts; 0 for a dense model
    is_70b: bool  # llama.cpp's LLM_TYPE_70B: 80 layers (llama with GQA, or qwen2)

    @staticmethod
    def of(arch: Architecture) -> _Model:
        n_gqa, n_expert = arch.query_groups, arch.experts
        llama_like = arch.gguf_arch == "llama" and n_gqa > 1
        is_70b = arch.layers == 80 and not n_expert and (llama_like or arch.gguf_arch == "qwen2")
        return _Model(arch.layers, n_gqa, n_expert, is_70b)


def _role(name: str, has_output: bool) -> str:
    for pattern, role in _ROLES:
        if pattern.search(name):
            return "output" if role == "token_embd" and not has_output else role
    return "other"


def _layer(name: str) -> int:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def _choose(ft: FileType, role: str, i: int, m: _Model, shape: tuple[int, ...], has_imatrix: bool) -> str:
    name, base, n, row = ft.name, ft.base, m.n_layers, shape[-1]
    if role == "output":
        if name == "MXFP4_MOE" or row % block_size(base):
            return "Q8_0"
        return "Q5_K" if name in (*_LOW_BIT, "IQ3_XXS") else base if base == "Q8_0" else "Q6_K"
    if name == "MXFP4_MOE":  # MXFP4 for the stacked experts (3-D), Q8_0 for every other tensor
        return base if len(shape) > 2 else "Q8_0"
    if role == "token_embd":
        if name in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return "IQ3_S"
        return "Q4_K" if name in _TERNARY else "Q2_K" if name in _LOW_BIT else base
    if name in _LOW_BIT:
        return _low_bit(name, role, i, m, base)
    if role == "attn_v":
        chosen = _attn_v(name, base, i, m, has_imatrix)
        if m.is_70b and chosen in ("Q3_K", "Q4_K"):  # 8 query heads share each V: more bits cost little
            chosen = "Q5_K"
        return "Q8_0" if m.n_expert == 8 else chosen  # Mixtral: a small tensor next to the experts
    if role == "attn_k" and m.n_expert == 8:
        return "Q8_0"
    if role == "attn_output" and m.n_expert == 8:
        return "Q5_K" if name in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
                                  *_IQ4) else base
    if name == "IQ3_XS" and role in ("attn_k", "attn_q"):
        return "IQ3_XXS"
    if name == "IQ3_XXS" and role in ("attn_k", "attn_q"):
        return "IQ2_S"
    if name == "IQ3_XS" and role in ("ffn_gate", "ffn_up") and n // 8 <= i < 7 * n // 8:
        return "IQ3_XXS"
    if role == "ffn_down":
        if name == "Q2_K":
            return "Q3_K"
        if name == "Q2_K_S" and i < n // 8:
            return "Q4_K"
        if name == "Q3_K_M":
            return "Q5_K" if i < n // 16 else "Q4_K"
        if name == "Q3_K_L":
            return "Q5_K"
        if name in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            return "Q6_K"
        if name == "Q4_K_S" and i < n // 8:
            return "Q5_K"
        if name == "IQ3_XXS" and not has_imatrix:
            return "Q4_K" if i < n // 8 else "Q3_K"
        if name == "IQ3_M" and (i < n // 8 or (m.n_expert == 8 and use_more_bits(i, n))):
            return "Q4_K"
        if name in _IQ4 and not has_imatrix and i < n // 8:
            return "Q5_K"
        if name in ("Q4_0", "Q5_0") and has_imatrix and i < n // 8:
            return "Q4_1" if name == "Q4_0" else "Q5_1"
    if role == "attn_output":
        if name == "Q2_K":
            return "Q3_K"
        if name in ("Q3_K_M", "IQ3_M"):
            return "Q4_K"
        if name == "IQ3_XXS":
            return "IQ3_S"
        if name == "Q3_K_L":
            return "Q5_K"
    return base


def _low_bit(name: str, role: str, i: int, m: _Model, base: str) -> str:
    """The IQ2 and IQ1 file types' rules, which replace the others (no 70B or 8-expert attn_v
    bump): more bits (Q2_K, or IQ3_S for IQ2_S and IQ2_M) for the tensors that need them."""
    more = "IQ3_S" if name in ("IQ2_S", "IQ2_M") else "Q2_K"
    if role == "attn_v":
        return "Q4_K" if m.n_gqa >= 4 or m.n_expert >= 4 else more
    if role == "attn_k" and m.n_expert == 8:
        return "Q4_K"
    if role == "ffn_down" and i < m.n_layers // 8:
        return more
    if role == "attn_output":
        return "Q5_K" if m.n_expert == 8 else "IQ3_S" if more == "IQ3_S" else "IQ2_XXS" if name in ("IQ1_S", "IQ1_M") else base
    return base


def _attn_v(name: str, base: str, i: int, m: _Model, has_imatrix: bool) -> str:
    if name == "Q2_K":
        return "Q4_K" if m.n_gqa >= 4 else "Q3_K"
    if name == "Q2_K_S" and m.n_gqa >= 4:
        return "Q4_K"
    if name == "Q3_K_M":
        return "Q5_K" if i < 2 else "Q4_K"
    if name == "Q3_K_L":
        return "Q5_K"
    if name in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, m.n_layers):
        return "Q6_K"
    if name == "Q4_K_S" and i < 4:
        return "Q5_K"
    if name in _IQ4 and m.n_gqa >= 4:
        return "Q5_K"
    if name == "IQ3_M" or (name in ("IQ3_XXS", "IQ3_XS", "IQ3_S") and m.n_gqa >= 4):
        return "Q4_K"
    if name == "IQ3_XXS":
        return "IQ3_XXS" if has_imatrix else "IQ3_S"
    return base


def imatrix_required_by(file_type: str, types: dict[str, str]) -> str | None:
    """The first tensor (HF name) whose ggml type llama.cpp makes only with an importance matrix
    in a ``file_type`` file (``tensor_requires_imatrix``: the IQ3_XXS, IQ2 and IQ1 types, and Q2_K
    in Q2_K_S), or None: llama-quantize refuses such a file without one."""
    needs = (*NEEDS_IMATRIX, "Q2_K") if file_type == "Q2_K_S" else NEEDS_IMATRIX
    return next((name for name, t in types.items() if t in needs and _role(name, True) not in ("output", "token_embd")), None)


def is_embedding_or_head(name: str) -> bool:
    """Whether a tensor (HF name) is the token embedding or the output head, which llama.cpp
    quantizes to any type without an importance matrix."""
    return _role(name, True) in ("output", "token_embd")


def mixed_file_type(types: dict[str, str], weights: dict[str, int]) -> str:
    """The file type a mix of per-tensor types is labelled with (``general.file_type``, and the
    type llama-quantize is given beside a tensor-type file): the first whose base type holds the
    most weights; Q8_0 where that is a float type."""
    held: dict[str, int] = {}
    for name, ggml_type in types.items():
        held[ggml_type] = held.get(ggml_type, 0) + weights[name]
    quantized = {t: n for t, n in held.items() if t not in FLOAT_TYPES}
    most = max(quantized, key=quantized.get) if quantized else "Q8_0"
    return next((ft.name for ft in FILE_TYPES.values() if ft.base == most), "Q8_0")


def fit_rows(ggml_type: str, row: int) -> str:
    """``ggml_type``, or llama.cpp's fallback where a row of ``row`` values does not split into its blocks."""
    if row % block_size(ggml_type) == 0:
        return ggml_type
    fallback = _FALLBACK.get(ggml_type, "F16")
    return fallback if row % block_size(fallback) == 0 else "F16"
