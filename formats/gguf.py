"""GGUF files that llama.cpp, Ollama and LM Studio load, written one tensor at a time.

The writer takes a plan (every tensor's HF name, shape and ggml type) so that the header and tensor
table can be written before any data; then the ggml payloads arrive one by one and go straight to
disk. Tensor names, the llama Q/K row permutation, hyper-parameters and the tokenizer follow
llama.cpp's converter so llama.cpp sees the same model transformers does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

from core.architecture import GGUF_ARCHITECTURES, SLIDING_PATTERN, Architecture, Rope
from core.errors import InputError
from core.file_types import AUTO, FILE_TYPES, is_quantizable, mixed_file_type
from core.rope import llama3_bands, to_pairs_side_by_side
from core.tensors import GGMLTensor, StoredGGMLTensor
from formats.architecture import llama_cpp_windows
from formats.checkpoint_format import CheckpointFormat, ExportContents
from formats.hf import HFCheckpoint
from formats.hub import model_name
from formats.modelfile import modelfile_name, write_modelfile
from formats.outputs import Outputs
from formats.sentencepiece_json import is_sentencepiece_bpe, read_sentencepiece_json
from formats.sentencepiece_model import SentencePieceModel, read_sentencepiece


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3, Gemma 3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3 keeps its fused projections fused
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",  # Gemma 2/3
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Gemma's post_attention_layernorm norms the attention's output; Llama's, the MLP's input.
_POST_NORM_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight"}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def gguf_name(hf_name: str, arch: Architecture) -> str | None:
    """The llama.cpp name of an HF tensor of a model of ``arch``, or None for tensors the converter drops."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.match(hf_name)
    names = {**_LAYER_NAMES, **_POST_NORM_NAMES} if arch.post_norms else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"blk.{m.group(1)}.{names[m.group(2)]}"
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    raise InputError(f"tensor '{hf_name}' has no GGUF name (supported layouts: {', '.join(sorted(set(GGUF_ARCHITECTURES.values())))})")


def gguf_order(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order: non-layer tensors first, then by layer number, then by name."""
    m = re.match(r"^blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def architecture_of(ckpt: HFCheckpoint) -> str:
    """llama.cpp's architecture for the checkpoint, or one line saying it has none we export."""
    if ckpt.arch.gguf_arch is None:
        raise InputError(
            f"{ckpt.path}: model_type '{ckpt.arch.model_type}' ({ckpt.architecture}) is not supported for GGUF export "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    _check_llama_cpp_assumptions(ckpt.arch, ckpt.path / "config.json")
    return ckpt.arch.gguf_arch


class GGUFFileWriter:
    """Writes one GGUF file at ``path`` from a plan of ``(hf_name, shape, ggml_type)`` in GGUF tensor
    order (commands write it under a temporary name and rename it: formats/outputs.py)."""

    def __init__(self, path: Path, ckpt: HFCheckpoint, file_type_id: int, plan: list[tuple[str, tuple[int, ...], str]]):
        self.path = path
        self.arch = ckpt.arch
        writer = GGUFWriter(None, architecture_of(ckpt))
        carried = ckpt.carried_fields() if hasattr(ckpt, "carried_fields") else {}  # a GGUF source's
        writer.add_name(carried.pop("general.name", (model_name(ckpt.path),))[0])
        writer.add_file_type(file_type_id)
        writer.add_quantization_version(2)
        _add_hparams(writer, self.arch)
        try:
            _add_tokenizer(writer, ckpt, carried)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # a damaged tokenizer file
            raise InputError(f"{ckpt.path}: the tokenizer files are not a tokenizer this converter reads "
                             f"({type(e).__name__}: {str(e)[:80]})") from None
        # Tensors the checkpoint lacks (rope_freqs) take their place in llama.cpp's order, as
        # llama-quantize writes them; each is written when the tensor before it has been.
        self._generated = _generated_tensors(self.arch)
        entries = [(gguf_name(hf, self.arch), hf, shape, ggml_type) for hf, shape, ggml_type in plan]
        entries += [(name, None, data.shape, None) for name, data in self._generated.items()]
        entries.sort(key=lambda e: gguf_order(e[0]))
        for name, hf_name, shape, ggml_type in entries:
            if hf_name is None:
                data = self._generated[name]
                writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes)
            else:
                qtype = GGMLQuantizationType[ggml_type]
                writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, qtype), raw_dtype=qtype)
        writer.write_header_to_file(self.path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        self._writer = writer
        self._sequence = [hf_name or name for name, hf_name, _, _ in entries]
        self._next = 0
        self._write_generated()

    def _write_generated(self) -> None:
        while self._next < len(self._sequence) and self._sequence[self._next] in self._generated:
            self._writer.write_tensor_data(self._generated[self._sequence[self._next]])
            self._next += 1

    def add(self, hf_name: str, payload: GGMLTensor) -> None:
        if self._sequence[self._next] != hf_name:
            raise RuntimeError(f"tensor '{hf_name}' arrived out of plan order (expected '{self._sequence[self._next]}')")
        self._next += 1
        if isinstance(payload, StoredGGMLTensor):  # a GGUF source's tensor, kept as its file holds it
            self._writer.write_tensor_data(np.ascontiguousarray(payload.raw))
            self._write_generated()
            return
        raw = payload.raw
        if hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")) and self.arch.rope_pairs_adjacent_in_gguf:
            raw = to_pairs_side_by_side(raw, self.arch.kv_heads[0] if ".k_proj." in hf_name else self.arch.heads)
        if self.arch.norm_offset and hf_name.endswith("norm.weight"):  # norms stay F32 in every file type
            raw = raw + np.float32(self.arch.norm_offset)
        self._writer.write_tensor_data(np.ascontiguousarray(raw))
        self._write_generated()

    def finish(self) -> Path:
        self._writer.close()
        if self._next != len(self._sequence):
            raise RuntimeError(f"GGUF export incomplete: {self._next} of {len(self._sequence)} tensors written")
        return self.path

    def abort(self) -> None:
        self._writer.close()
        self.path.unlink(missing_ok=True)


class GGUFFormat(CheckpointFormat):
    """The ``gguf`` export: one file named after the model and its file type, with an Ollama
    Modelfile beside it (formats/modelfile.py)."""

    name = "gguf"
    folder = False
    ggml = True

    def file_name(self, model: str, file_type: str | None) -> str:
        return f"{model}-{file_type}.gguf"

    def files(self, path: Path, file_type: str | None = None) -> dict[str, Path]:
        files = {self.name: path, "modelfile": path.with_name(modelfile_name(path.name))}
        if file_type == AUTO:  # a mix no file type names: llama-quantize's recipe for it beside
            files["tensor_types"] = path.with_name(path.stem + ".tensor-types.txt")
        return files

    def open(self, outputs: Outputs, paths: dict[str, Path], contents: ExportContents) -> GGUFFileWriter:
        writer = self.writer(outputs.stage(paths[self.name]), contents)
        write_modelfile(outputs.stage(paths["modelfile"]), paths[self.name].name, contents.source)
        if "tensor_types" in paths:
            outputs.stage(paths["tensor_types"]).write_text(tensor_type_file(contents))
        return writer

    def writer(self, dest: Path, contents: ExportContents) -> GGUFFileWriter:
        return GGUFFileWriter(dest, contents.source, FILE_TYPES[file_type_of(contents)].id, _typed(contents))


FORMAT = GGUFFormat()


def file_type_of(contents: ExportContents) -> str:
    """The file type a GGUF file is labelled with: the variant's, or for ``type: auto`` the one
    its mix is closest to (core/file_types.py: ``mixed_file_type``)."""
    if contents.file_type != AUTO:
        return contents.file_type
    source = contents.source
    return mixed_file_type(contents.ggml_types, {n: int(np.prod(source.shape(n))) for n in contents.names})


def tensor_type_file(contents: ExportContents) -> str:
    """llama-quantize's ``--tensor-type-file`` for the file's mix: one ``pattern=TYPE`` a line for
    every tensor it quantizes, the pattern the tensor's GGUF name anchored (llama.cpp matches each
    pattern with ``std::regex_search``, so an unanchored ``blk.1.`` would also match ``blk.11.``).
    ``llama-quantize --imatrix M --tensor-type-file F model-F32.gguf out.gguf TYPE``, TYPE the
    file's label, then writes the same tensors, byte for byte."""
    source = contents.source
    lines = [f"^{re.escape(gguf_name(n, source.arch))}$={contents.ggml_types[n]}"
             for n in contents.names if is_quantizable(n, tuple(source.shape(n)))]
    return "".join(line + "\n" for line in lines)


def _typed(contents: ExportContents) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, contents.source.shape(n), contents.ggml_types[n]) for n in contents.names]


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    return n // block * block_bytes


def _add_hparams(writer: GGUFWriter, arch: Architecture) -> None:
    rope = arch.rope
    if rope.scaling == "linear":
        writer.add_rope_scaling_type("linear")
        writer.add_rope_scaling_factor(rope.factor)
    elif rope.scaling == "llama3" and arch.gguf_arch != "llama":
        raise InputError("config.json: rope type 'llama3' is only supported for llama models in GGUF export")
    elif rope.scaling not in ("default", "llama3"):  # llama3: the rope_freqs tensor carries it; Phi-3's longrope is refused
        raise InputError(f"config.json: rope type '{rope.scaling}' is not supported for GGUF export yet (supported: default, linear, llama3)")
    writer.add_context_length(arch.max_context)
    writer.add_embedding_length(arch.hidden)
    writer.add_block_count(arch.layers)
    writer.add_feed_forward_length(arch.intermediate)
    writer.add_head_count(arch.heads)
    writer.add_head_count_kv(arch.kv_heads[0])
    writer.add_layer_norm_rms_eps(arch.norm_eps)
    writer.add_rope_freq_base(rope.theta)
    writer.add_rope_dimension_count(rope.dims)
    writer.add_vocab_size(arch.vocab)
    if arch.explicit_head_dim:  # as llama.cpp's converter: only where config.json gives head_dim
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.value_dim)
    windows = {w for w in arch.windows if w is not None}
    if windows or arch.gguf_arch in ("gemma2", "gemma3", "phi3"):  # phi3: 0 says "none" (Phi-4)
        writer.add_sliding_window(windows.pop() if windows else 0)
    if arch.attn_softcap is not None:
        writer.add_attn_logit_softcapping(arch.attn_softcap)
    if arch.final_softcap is not None:
        writer.add_final_logit_softcapping(arch.final_softcap)


def _check_llama_cpp_assumptions(arch: Architecture, where: Path) -> None:
    """Refuse a model that llama.cpp would run differently from transformers because it takes
    something for granted that this config changes: Gemma's layer pattern of sliding windows, its
    attention scale, its soft-caps and Gemma 3's local rope."""
    kind = arch.gguf_arch
    windows = [w for w in arch.windows if w is not None]
    if len(set(windows)) > 1:
        raise InputError(f"{where}: sliding windows of several sizes ({sorted(set(windows))}); GGUF holds one")
    if kind in SLIDING_PATTERN:
        expected = llama_cpp_windows(kind, arch.layers, windows[0] if windows else 0)
        if tuple(arch.windows) != expected:
            raise InputError(f"{where}: layer_types do not follow llama.cpp's {kind} pattern (every "
                             f"{SLIDING_PATTERN[kind]}th layer global, the others sliding)")
        large = {"gemma2": 46, "gemma3": 62}[kind]  # llama.cpp's 27B: its scale from the hidden size
        scale = (arch.hidden // arch.heads if arch.layers == large else arch.head_dim) ** -0.5
        if arch.query_scale is not None and abs(arch.score_scale - scale) > 1e-6 * scale:
            raise InputError(f"{where}: query_pre_attn_scalar {arch.score_scale ** -2:g} is not the "
                             f"{scale ** -2:g} llama.cpp assumes for a {arch.layers}-layer {kind}")
    if kind == "gemma2" and (arch.attn_softcap is None or arch.final_softcap is None):
        raise InputError(f"{where}: a gemma2 config without attn_logit_softcapping and final_logit_softcapping "
                         "(llama.cpp always soft-caps Gemma 2)")
    if kind == "gemma3":
        if arch.attn_softcap is not None:
            raise InputError(f"{where}: attn_logit_softcapping is set; llama.cpp's gemma3 does not soft-cap attention")
        local = arch.local_rope
        if local is not None and (local.theta != 10000.0 or local.scaling != "default"):
            raise InputError(f"{where}: the sliding layers' rope (theta {local.theta:g}, {local.scaling}) is not "
                             "the theta 10000 default rope llama.cpp's gemma3 gives them")


def _generated_tensors(arch: Architecture) -> dict[str, np.ndarray]:
    """Tensors llama.cpp needs that the checkpoint does not hold: Llama 3.1's ``rope_freqs``."""
    if arch.rope.scaling != "llama3":
        return {}
    return {"rope_freqs.weight": llama3_divisors(arch.rope).astype(np.float32)}


def llama3_divisors(rope: Rope) -> np.ndarray:
    """Llama 3.1's rope scaling stretches each rotary frequency by its own factor; llama.cpp reads
    the per-frequency divisors from ``rope_freqs.weight`` (transformers computes the same from
    config.json at load time): 1 for short wavelengths, ``factor`` for long ones, and a smooth
    blend between ``original_max_position_embeddings / high_freq_factor`` and ``/ low_freq_factor``."""
    freqs = 1.0 / rope.theta ** (np.arange(0, rope.dims, 2, dtype=np.float64) / rope.dims)
    short, long, smooth = llama3_bands(rope, 2 * np.pi / freqs)
    return np.where(short, 1.0, np.where(long, rope.factor, 1.0 / ((1 - smooth) / rope.factor + smooth)))


def _add_tokenizer(writer: GGUFWriter, ckpt: HFCheckpoint, carried: dict[str, tuple[object, tuple]]) -> None:
    """Embed the tokenizer as llama.cpp's converter does: SentencePiece when the checkpoint has a
    tokenizer.model (Llama-2, Mistral v0.1) or a tokenizer.json BPE with byte fallback (the same
    tokenizers as transformers 5 saves them), else the byte-level BPE of tokenizer.json; a GGUF
    source's own tokenizer metadata (``carried``), as it is."""
    if carried:
        for key, (value, types) in carried.items():
            items = value.tolist() if isinstance(value, np.ndarray) else value
            if isinstance(items, list) and not items:  # gguf-py writes no empty arrays
                continue
            writer.add_key_value(key, items, types[0], sub_type=types[1] if len(types) > 1 else None)
        return
    json_path = ckpt.path / "tokenizer.json"
    tok = ckpt.side_file("tokenizer.json")
    tok_cfg = ckpt.tokenizer_config
    if (ckpt.path / "tokenizer.model").is_file():
        spm_path = ckpt.path / "tokenizer.model"
        vocab = _add_sentencepiece_vocab(writer, ckpt, tok, tok_cfg, read_sentencepiece(spm_path), spm_path)
    elif is_sentencepiece_bpe(tok):
        spm = read_sentencepiece_json(tok, json_path, _token_text(tok_cfg.get("unk_token")))
        vocab = _add_sentencepiece_vocab(writer, ckpt, tok, tok_cfg, spm, json_path)
    elif tok:
        vocab = _add_bpe_vocab(writer, ckpt, tok, json_path)
    else:
        raise InputError(f"{ckpt.path}: no tokenizer.json or tokenizer.model (GGUF export embeds the tokenizer)")

    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        token = _token_text(tok_cfg.get(f"{key}_token"))
        if token is not None and token in vocab:
            add(vocab[token])
        elif isinstance(ckpt.config.get(f"{key}_token_id"), int):
            add(ckpt.config[f"{key}_token_id"])
    writer.add_add_bos_token(_post_processor_adds(tok, "bos", tok_cfg))
    writer.add_add_eos_token(_post_processor_adds(tok, "eos", tok_cfg))
    template = tok_cfg.get("chat_template")
    if template is None and (ckpt.path / "chat_template.jinja").is_file():
        template = (ckpt.path / "chat_template.jinja").read_text()
    if isinstance(template, str):
        writer.add_chat_template(template)


def _token_text(token: object) -> str | None:
    """A special token of tokenizer_config.json: its text, written plainly or as an AddedToken."""
    return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None


def _add_bpe_vocab(writer: GGUFWriter, ckpt: HFCheckpoint, tok: dict, path: Path) -> dict[str, int]:
    """A byte-level BPE vocabulary with its merges and pre-tokenizer preset; returns text -> id."""
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise InputError(
            f"{path}: only BPE tokenizers (byte-level, or SentencePiece-style with byte fallback) and SentencePiece "
            f"tokenizer.model files are supported for GGUF export (this is {model.get('type')})"
        )
    pre_name = _pre_tokenizer_name(tok.get("pre_tokenizer") or {}, path)
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    for t in added.values():
        vocab[t["content"]] = t["id"]
    n_vocab = max(ckpt.arch.vocab, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(TokenType.UNUSED)] * n_vocab
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = int(TokenType.NORMAL)
    for i, t in added.items():
        types[i] = int(TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    return vocab


def _add_sentencepiece_vocab(writer: GGUFWriter, ckpt: HFCheckpoint, tok: dict, tok_cfg: dict,
                             spm: SentencePieceModel, path: Path) -> dict[str, int]:
    """A SentencePiece vocabulary (read from ``path``: tokenizer.model, or tokenizer.json through
    formats/sentencepiece_json.py): pieces with the scores llama.cpp merges by and their kinds,
    then the tokens the HF tokenizer adds on top (tokenizer.json, tokenizer_config.json,
    added_tokens.json); returns text -> id.

    Unlike llama.cpp's converter, user-defined pieces stay user-defined: SentencePiece and
    transformers always cut them out whole, and llama.cpp does so only for that type; and the
    unknown piece stays unknown, as SentencePiece types it.
    """
    if spm.model_type != "bpe":
        raise InputError(f"{path}: SentencePiece {spm.model_type} models are not supported for GGUF export (BPE only)")
    n_vocab = ckpt.arch.vocab
    if len(spm.pieces) > n_vocab:
        raise InputError(f"{path}: {len(spm.pieces)} pieces but config.json has vocab_size {n_vocab}")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [int(TokenType.UNUSED)] * n_vocab
    for i, (piece, score, kind) in enumerate(spm.pieces):
        tokens[i], scores[i], types[i] = piece, score, kind  # SentencePiece's kinds are GGUF's TokenType values
    added_path = ckpt.path / "added_tokens.json"
    added = {i: {"content": text} for text, i in (json.loads(added_path.read_text()) if added_path.is_file() else {}).items()}
    added.update({int(i): t for i, t in tok_cfg.get("added_tokens_decoder", {}).items()})
    added.update({t["id"]: t for t in tok.get("added_tokens", [])})
    for i, t in sorted(added.items()):
        if i >= n_vocab:
            raise InputError(f"{ckpt.path}: added token {t['content']!r} has id {i}, beyond vocab_size {n_vocab}")
        if types[i] == int(TokenType.UNKNOWN) and tokens[i] == t["content"]:
            continue
        special = bool(t.get("special"))
        tokens[i] = t["content"] if special else t["content"].replace("\u2581", " ")
        scores[i] = -1000.0
        types[i] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(spm.add_dummy_prefix)
    return {text: i for i, text in enumerate(tokens)}


# Pre-tokenizer split patterns of the common byte-level BPE families -> llama.cpp's preset names.
_PRE_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def _pre_tokenizer_name(pre: dict, path: Path) -> str:
    """llama.cpp's name for the way this tokenizer splits text before BPE.

    llama.cpp does not read the split rules from the file; it knows them by preset name, and a wrong
    name tokenizes some texts differently. So only recognised splitters are accepted.
    """
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [p.get("type") for p in steps]
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        if pattern in _PRE_PATTERNS:
            return _PRE_PATTERNS[pattern]
    raise InputError(
        f"{path}: this pre-tokenizer is not one llama.cpp knows by name "
        f"(supported: GPT-2 byte-level, Llama-3 and Qwen2 split patterns)"
    )


def _post_processor_adds(tok: dict, which: str, tok_cfg: dict) -> bool:
    """Whether transformers' tokenizer puts a bos/eos token around a single text by itself."""
    if f"add_{which}_token" in tok_cfg:
        return bool(tok_cfg[f"add_{which}_token"])
    post = tok.get("post_processor") or {}
    if post.get("type") != "TemplateProcessing":
        return False
    single = post.get("single", [])
    specials = [i for i, item in enumerate(single) if "SpecialToken" in item]
    seq = next((i for i, item in enumerate(single) if "Sequence" in item), 0)
    return any(i < seq for i in specials) if which == "bos" else any(i > seq for i in specials)
