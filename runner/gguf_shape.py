"""A GGUF file as the memory-fit calculator sees it: its tensors' exact sizes and its metadata.

Only the header is read (``gguf.GGUFReader`` maps the file; tensor data is never touched), so a
70B file is described in a moment.
"""

from __future__ import annotations

from pathlib import Path

from quant.types import InputError
from runner.model_shape import LayerCache, ModelShape


def gguf_model_shape(path: Path) -> ModelShape:
    from gguf import GGUFReader

    if not path.is_file():
        raise InputError(f"{path}: file not found")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises whatever its parsing hits on a damaged file
        raise InputError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'bad header'})") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        values = [f.parts[i].tolist() for i in f.data]
        if f.types and f.types[0].name == "STRING":
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        values = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in values]
        return values[0] if len(values) == 1 else values

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise InputError(f"{path}: GGUF file without general.architecture")

    def need(key: str):
        value = field(f"{arch}.{key}")
        if value is None:
            raise InputError(f"{path}: GGUF metadata has no '{arch}.{key}'")
        return value

    n_layers = int(need("block_count"))
    hidden = int(need("embedding_length"))
    heads = _per_layer(need("attention.head_count"), n_layers)
    kv_heads = _per_layer(field(f"{arch}.attention.head_count_kv", heads), n_layers)
    head_dim = int(field(f"{arch}.attention.key_length", hidden // max(heads)))
    value_dim = int(field(f"{arch}.attention.value_length", head_dim))
    window = field(f"{arch}.attention.sliding_window")
    tensors = [(t.name, tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors]
    embd = next((shape for name, shape in tensors if name == "token_embd.weight"), None)
    vocab = embd[0] if embd else len(reader.fields["tokenizer.ggml.tokens"].data)
    experts = int(field(f"{arch}.expert_count", 0) or 0)
    used = int(field(f"{arch}.expert_used_count", 0) or 0)
    ffn = field(f"{arch}.expert_feed_forward_length") if experts else None
    ffn = int(ffn if ffn is not None else _per_layer(need("feed_forward_length"), n_layers)[0]) * (used if experts else 1)
    layers = [LayerCache(kv * (head_dim + value_dim), int(window) if window else None, kv) for kv in kv_heads]
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
        max_context=int(field(f"{arch}.context_length", 0) or 0),
        expert_fraction=used / experts if experts else 1.0,
        stored_bytes={t.name: int(t.n_bytes) for t in reader.tensors},
        stored_as="gguf file",
    )


def _per_layer(value, n_layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n_layers
