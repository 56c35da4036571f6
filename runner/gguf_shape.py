"""A GGUF file as the memory-fit calculator sees it: its tensors' exact sizes and its metadata.

Only the header is read (formats.gguf_file checks it against the file's size; tensor data is never
touched), so a 70B file is described in a moment. Every hyper-parameter the calculator uses is
checked to be a whole number in range first, so a damaged file gets one line, not a division by
zero or a layer list of a billion entries.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from formats.gguf_file import GGUFHeader, read_gguf_header
from quant.types import InputError
from runner.model_shape import LayerCache, ModelShape

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
_LARGE = 1 << 31


def gguf_model_shape(path: Path) -> ModelShape:
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    header = read_gguf_header(path)
    if not header.tensors:
        raise InputError(f"{path}: the GGUF file holds no tensors (a vocabulary-only file?), so no model to size")
    meta = _Metadata(path, header)
    arch = header.fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InputError(f"{path}: GGUF file without general.architecture")
    n_layers = meta.whole(f"{arch}.block_count", 1, MAX_LAYERS)
    hidden = meta.whole(f"{arch}.embedding_length", 1, _LARGE)
    heads = meta.per_layer(f"{arch}.attention.head_count", n_layers)
    kv_heads = meta.per_layer(f"{arch}.attention.head_count_kv", n_layers, heads)
    if max(heads) == 0:
        raise InputError(f"{path}: GGUF metadata '{arch}.attention.head_count' is 0 in every layer")
    for i, (q, kv) in enumerate(zip(heads, kv_heads)):
        if (q == 0) != (kv == 0) or (kv and q % kv):
            raise InputError(f"{path}: GGUF metadata gives layer {i} {q} attention heads and {kv} KV heads "
                             "(query heads must be a multiple of KV heads)")
    head_dim = meta.whole(f"{arch}.attention.key_length", 1, _LARGE, hidden // max(heads) or None)
    value_dim = meta.whole(f"{arch}.attention.value_length", 1, _LARGE, head_dim)
    window = meta.whole(f"{arch}.attention.sliding_window", 0, _LARGE, 0)
    tensors = [(t.name, t.shape) for t in header.tensors]
    embd = next((shape for name, shape in tensors if name == "token_embd.weight"), None)
    tokens = header.fields.get("tokenizer.ggml.tokens")
    if embd:
        vocab = embd[0]
    elif isinstance(tokens, list):
        vocab = len(tokens)
    else:
        raise InputError(f"{path}: GGUF file with neither token_embd.weight nor tokenizer.ggml.tokens: no vocabulary size")
    experts = meta.whole(f"{arch}.expert_count", 0, 1 << 16, 0)
    used = meta.whole(f"{arch}.expert_used_count", 0, max(experts, 1), 0) if experts else 0
    if experts and not used:
        raise InputError(f"{path}: GGUF metadata '{arch}.expert_used_count' is missing or 0 for {experts} experts")
    if experts and f"{arch}.expert_feed_forward_length" in header.fields:
        ffn = meta.whole(f"{arch}.expert_feed_forward_length", 1, _LARGE) * used
    else:
        ffn = meta.per_layer(f"{arch}.feed_forward_length", n_layers)[0] * (used or 1)
    layers = [LayerCache(kv * (head_dim + value_dim), window or None, kv) for kv in kv_heads]
    config = {"architecture": arch, "num_hidden_layers": n_layers, "num_attention_heads": heads[0],
              "num_key_value_heads": kv_heads[0], "hidden_size": hidden}
    return ModelShape(
        name=path.name,
        config=config,
        tensors=tensors,
        layers=layers,
        hidden=hidden,
        intermediate=ffn,
        vocab=vocab,
        heads=heads[0],
        head_dim=head_dim,
        max_context=meta.whole(f"{arch}.context_length", 0, _LARGE, 0),
        expert_fraction=used / experts if experts else 1.0,
        stored_bytes={t.name: t.n_bytes for t in header.tensors},
        stored_as="gguf file",
    )


class _Metadata:
    """Typed access to a header's hyper-parameters, refusing what is not a whole number in range."""

    def __init__(self, path: Path, header: GGUFHeader):
        self.path, self.fields = path, header.fields

    def _refuse(self, key: str, value: object, low: int, high: int) -> InputError:
        return InputError(f"{self.path}: GGUF metadata '{key}' is {str(value)[:40]}, not a whole number from {low} to {high:,}")

    def whole(self, key: str, low: int, high: int, default: int | None = None) -> int:
        value = self.fields.get(key)
        if value is None:
            if default is None:
                raise InputError(f"{self.path}: GGUF metadata has no '{key}'")
            return default
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not low <= value <= high:
            raise self._refuse(key, value, low, high)
        return int(value)

    def per_layer(self, key: str, n_layers: int, default: list[int] | None = None) -> list[int]:
        """A value given once for all layers, or as an array of one value per layer."""
        value = self.fields.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, np.ndarray):
            return [self.whole(key, 0, _LARGE)] * n_layers
        if value.dtype.kind not in "iu" or value.size != n_layers or (value.size and not 0 <= value.min() <= value.max() <= _LARGE):
            raise InputError(f"{self.path}: GGUF metadata '{key}' is not {n_layers} whole numbers, one per layer")
        return [int(v) for v in value]
