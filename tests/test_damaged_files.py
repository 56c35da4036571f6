"""Damaged and hostile GGUF and safetensors files: one line naming the file and the field or tensor,
exit 2, in well under a second, and nothing left behind, for `inspect`, `fit` and `export`.

Each case is one that an earlier version answered with a traceback, minutes of work, gigabytes of
memory, or a file llama.cpp then refused."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.fuzz_inputs import gguf_slots
from helpers.cli import assert_user_error, quantize


# ---------------------------------------------------------------- GGUF


def write_gguf(path, tensors: bool = True, **overrides):
    """A small llama GGUF file: the metadata `fit` reads and two tensors."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    meta = {"block_count": 2, "embedding_length": 64, "head_count": 2, "head_count_kv": 1,
            "feed_forward_length": 128, "context_length": 256} | overrides
    for key, value in meta.items():
        w.add_uint32(f"llama.{key}" if not key.startswith("head") else f"llama.attention.{key}", value)
    w.add_token_list([f"t{i}" for i in range(16)])
    w.add_token_types([1] * 16)
    if tensors:
        w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
        w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def patched(path, label: str, value: int, *more: tuple[str, int]):
    """The file with the header field ``label`` (as fuzz_inputs.gguf_slots names it) set to ``value``,
    and so on for each further (label, value)."""
    data = bytearray(path.read_bytes())
    slots = {what: (offset, width) for offset, width, what in gguf_slots(bytes(data))}
    for label, value in ((label, value), *more):
        offset, width = slots[label]
        data[offset : offset + width] = value.to_bytes(width, "little")
    path.write_bytes(bytes(data))
    return path


def key_index(path, key: str) -> int:
    from formats.gguf_file import read_gguf_header

    return list(read_gguf_header(path).fields).index(key)


def refused_quickly(monkeypatch, capsys, command: str, path, *fragments: str):
    start = time.perf_counter()
    result = quantize(monkeypatch, capsys, command, path)
    assert time.perf_counter() - start < 1.0, "a damaged small file must be refused in well under a second"
    assert_user_error(result, str(path.name), *fragments)


@pytest.mark.check
@pytest.mark.parametrize("command", ["inspect", "fit"])
def test_a_huge_metadata_array_length_is_refused_at_once(monkeypatch, capsys, tmp_path, command):
    path = write_gguf(tmp_path / "m.gguf")
    patched(path, f"key {key_index(path, 'tokenizer.ggml.token_type')} array length", 2**40)
    refused_quickly(monkeypatch, capsys, command, path, "tokenizer.ggml.token_type", "1,099,511,627,776 elements")


@pytest.mark.check
@pytest.mark.parametrize("element_type, fragment", [(8, "claims"), (9, "array of arrays"), (10, "claims"), (77, "not a GGUF value type")])
def test_a_changed_array_element_type_is_refused_at_once(monkeypatch, capsys, tmp_path, element_type, fragment):
    path = write_gguf(tmp_path / "m.gguf")
    key = key_index(path, "tokenizer.ggml.tokens")
    patched(path, f"key {key} element type", element_type, (f"key {key} array length", 2**33))
    for command in ("inspect", "fit"):
        refused_quickly(monkeypatch, capsys, command, path, fragment)


@pytest.mark.check
@pytest.mark.parametrize("command", ["inspect", "fit"])
def test_a_gguf_file_without_tensors_is_refused(monkeypatch, capsys, tmp_path, command):
    refused_quickly(monkeypatch, capsys, command, write_gguf(tmp_path / "m.gguf", tensors=False), "holds no tensors")


@pytest.mark.check
@pytest.mark.parametrize("overrides, fragment", [
    ({"block_count": 0}, "'llama.block_count' is 0"),
    ({"block_count": 2**32 - 1}, "'llama.block_count' is 4294967295"),
    ({"head_count": 0}, "'llama.attention.head_count' is 0 in every layer"),
    ({"head_count_kv": 0}, "2 attention heads and 0 KV heads"),
    ({"embedding_length": 0}, "'llama.embedding_length' is 0"),
])
def test_fit_refuses_impossible_hyper_parameters(monkeypatch, capsys, tmp_path, overrides, fragment):
    refused_quickly(monkeypatch, capsys, "fit", write_gguf(tmp_path / "m.gguf", **overrides), fragment)


@pytest.mark.check
@pytest.mark.parametrize("label, value, fragment, llama_cpp_refuses", [
    ("tensor 1 offset", 2**20, "output_norm.weight' has data offset 1,048,576", True),  # past the end of the file
    ("tensor 0 dim 1", 17, "output_norm.weight' has data offset 4,096, but the tensors before it end at 4,352", True),
    ("tensor 1 dim 0", 2**20, "past the end of the file", False),  # llama.cpp's model loader refuses it, not its parser
    ("tensor 1 type", 99, "type id 99, not a ggml type", True),
    ("tensor 1 type", 4, "type id 4, not a ggml type", True),  # Q4_2, long removed from ggml
    ("tensor count", 0, "holds no tensors", False),  # valid GGUF, but llama.cpp finds no model in it
    ("version", 1, "version 1", True),
])
def test_inspect_refuses_what_llama_cpp_refuses(monkeypatch, capsys, tmp_path, label, value, fragment, llama_cpp_refuses):
    path = patched(write_gguf(tmp_path / "m.gguf"), label, value)
    refused_quickly(monkeypatch, capsys, "inspect", path, fragment)
    assert llama_cpp_gguf().accepts(path) is not llama_cpp_refuses


@pytest.mark.check
def test_inspect_refuses_a_tensor_whose_data_lies_past_the_end(monkeypatch, capsys, tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    refused_quickly(monkeypatch, capsys, "inspect", path, "output_norm.weight", "past the end of the file")


def llama_cpp_gguf():
    from helpers.fuzz_inputs import LlamaCppGGUF

    return LlamaCppGGUF()


def test_our_own_gguf_header_reader_agrees_with_gguf_py_on_a_real_export(small_run):
    from gguf import GGUFReader

    from formats.gguf_file import read_gguf_header

    out, _ = small_run
    path = next((out / "q4_k_m-imatrix").glob("*.gguf"))
    ours, theirs = read_gguf_header(path), GGUFReader(path)
    assert [(t.name, t.shape, t.type, t.offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type, int(t.data_offset), int(t.n_bytes))
        for t in theirs.tensors]
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert ours.fields["tokenizer.ggml.tokens"] == [str(bytes(theirs.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
                                                    for i in theirs.fields["tokenizer.ggml.tokens"].data]


# ---------------------------------------------------------------- safetensors


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A small random Llama with the bundled tokenizer (hidden 64, two layers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY

    folder = tmp_path_factory.mktemp("small") / "model"
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, vocab_size=8192, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder)
    return folder


def damaged(small_model, tmp_path, change) -> Path:
    """A copy of the small model whose safetensors header went through ``change(header dict)``
    (or whose raw header bytes are ``change``'s result, when it returns bytes)."""
    folder = tmp_path / "model"
    shutil.copytree(small_model, folder)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    raw = change(header)
    raw = raw if isinstance(raw, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return folder


def first(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def last(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def _set(header, key, value, name=first):
    header[name(header)][key] = value


def _swap_offsets(header, a: str, b: str) -> None:
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]


SAFETENSORS_DAMAGE = {
    "deep nesting": (lambda h: json.dumps(h).encode()[:-1] + b', "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                     "not UTF-8 JSON"),
    "metadata a list": (lambda h: h.update(__metadata__=["format", "pt"]), "__metadata__ must map names to strings"),
    "metadata values not strings": (lambda h: h.update(__metadata__={"format": 1}), "__metadata__ must map names to strings"),
    "shape of strings": (lambda h: _set(h, "shape", ["8192", "64"]), 'has shape ["8192", "64"]'),
    "shape of floats": (lambda h: _set(h, "shape", [8192.0, 64]), "not a list of non-negative integers"),
    "negative shape": (lambda h: _set(h, "shape", [-1, 64]), "not a list of non-negative integers"),
    "dtype a number": (lambda h: _set(h, "dtype", 7), "has dtype 7, not a safetensors dtype"),
    "offsets strings": (lambda h: _set(h, "data_offsets", ["0", "16"]), 'has data_offsets ["0", "16"]'),
    "offsets floats": (lambda h: _set(h, "data_offsets", [0.0, 16.0]), "not two non-negative integers"),
    "offsets reversed": (lambda h: _set(h, "data_offsets", h[first(h)]["data_offsets"][::-1]), "before it begins"),
    "offsets out of order": (lambda h: _swap_offsets(h, "model.norm.weight", "model.embed_tokens.weight"),
                             "has 128 bytes, but its shape [8192, 64] in BF16 needs 1,048,576"),
    "offsets overlapping": (lambda h: _set(h, "data_offsets", [o - 2 for o in h[last(h)]["data_offsets"]], last),
                            "overlaps the tensor before it"),
    "offsets outside the file": (lambda h: _set(h, "data_offsets", [o + 64 for o in h[last(h)]["data_offsets"]], last),
                                 "leaves a gap"),
}


@pytest.mark.check
@pytest.mark.parametrize("case", SAFETENSORS_DAMAGE)
def test_damaged_safetensors_headers_get_one_line(monkeypatch, capsys, tmp_path, small_model, case):
    from helpers.fuzz_inputs import safetensors_accepts

    change, fragment = SAFETENSORS_DAMAGE[case]
    folder = damaged(small_model, tmp_path, change)
    assert not safetensors_accepts(folder / "model.safetensors")  # the library refuses it too
    refused_quickly(monkeypatch, capsys, "inspect", folder / "model.safetensors", fragment)
    out = tmp_path / "out"
    assert_user_error(quantize(monkeypatch, capsys, "export", folder, "--gguf", "Q8_0", "-o", out / "m.gguf"), fragment)
    assert not out.exists()


@pytest.mark.check
def test_a_float_shape_stops_export_before_any_file(monkeypatch, capsys, tmp_path, small_model):
    folder = damaged(small_model, tmp_path, lambda h: _set(h, "shape", [8192, 64.0], lambda h: "model.embed_tokens.weight"))
    assert_user_error(quantize(monkeypatch, capsys, "export", folder, "--gguf", "Q8_0", "-o", tmp_path / "m.gguf"),
                      "model.embed_tokens.weight", "not a list of non-negative integers")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no .gguf, no Modelfile, no .partial


@pytest.mark.check
def test_an_empty_header_stops_export_before_any_file(monkeypatch, capsys, tmp_path, small_model):
    folder = tmp_path / "model"
    shutil.copytree(small_model, folder)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"{}      ")
    assert_user_error(quantize(monkeypatch, capsys, "export", folder, "--gguf", "Q8_0", "-o", tmp_path / "m.gguf"),
                      "hold no tensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def resaved(small_model, tmp_path, change) -> Path:
    """A copy of the small model whose tensors went through ``change(state dict)``, saved by the
    safetensors library (a valid file whose tensors are not what the config says)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(small_model, folder)
    state = load_file(folder / "model.safetensors")
    change(state)
    save_file(state, folder / "model.safetensors")
    return folder


@pytest.mark.check
@pytest.mark.parametrize("change, fragment", [
    (lambda s: s.pop("model.layers.1.mlp.down_proj.weight"), "no tensor 'model.layers.1.mlp.down_proj.weight' in the checkpoint"),
    (lambda s: s.update({"model.layers.1.mlp.down.weight": s.pop("model.layers.1.mlp.down_proj.weight")}),
     "no tensor 'model.layers.1.mlp.down_proj.weight' in the checkpoint"),
    (lambda s: s.update({"model.layers.2.mlp.down_proj.weight": s["model.layers.1.mlp.down_proj.weight"].clone()}),
     "tensor 'model.layers.2.mlp.down_proj.weight' in model.safetensors is not part of the LlamaForCausalLM"),
    (lambda s: s.update({"model.norm.weight": s["model.norm.weight"][:32].clone()}),
     "tensor 'model.norm.weight' has shape [32], the config gives [64]"),
    (lambda s: s.update({"model.norm.weight": s["model.norm.weight"].to(__import__("torch").int32)}),
     "tensor 'model.norm.weight' is I32; a float checkpoint holds F32, F16 or BF16"),
])
def test_export_names_the_tensor_that_disagrees_with_the_config(monkeypatch, capsys, tmp_path, small_model, change, fragment):
    """An earlier version converted such checkpoints to GGUF files llama.cpp then refused."""
    folder = resaved(small_model, tmp_path, change)
    assert_user_error(quantize(monkeypatch, capsys, "export", folder, "--gguf", "Q8_0", "-o", tmp_path / "m.gguf"), fragment)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.check
def test_a_tensor_name_with_a_newline_or_markup_gives_one_line(monkeypatch, capsys, tmp_path, small_model):
    for name, shown in (("bad\nname", "tensor 'bad\\nname'"), ("[/red]x", "tensor '[/red]x'")):
        folder = resaved(small_model, tmp_path / name.replace("/", "_"), lambda s: s.update({name: s["model.norm.weight"].clone()}))
        assert_user_error(quantize(monkeypatch, capsys, "export", folder, "--gguf", "Q8_0", "-o", tmp_path / "m.gguf"),
                          shown, "is not part of the LlamaForCausalLM")
