"""GGUF export beyond the bundled Llama: Mistral, Qwen2 (q/k/v biases), the Llama-3 pre-tokenizer,
and the refusals for what llama.cpp could not load. Models are small random ones made here, with
the bundled tokenizer; llama.cpp must compute the same next-token distribution as transformers."""

import json
import shutil

import pytest
import torch
from gguf import TokenType

from conftest import BUNDLED, EVAL_TEXT, TINY

from formats.gguf import _PRE_PATTERNS
from formats.hf import HFCheckpoint, load_tokenizer
from formats.sentencepiece_json import read_sentencepiece_json
from formats.sources import open_checkpoint
from helpers.model_zoo import ZOO, llama_cpp_and_transformers, make_model
from core.errors import InputError
from recipes.variants import build_variant, gguf_variant


@pytest.mark.parametrize("model_type, extra", [
    ("mistral", {}),
    ("qwen2", {}),
    ("llama", {"attention_bias": True}),  # llama with q/k biases: they are permuted like the weights
])
def test_llama_cpp_computes_what_transformers_computes(tmp_path, model_type, extra):
    folder = make_model(tmp_path / model_type, model_type, **extra)
    ours, ref = llama_cpp_and_transformers(folder, tmp_path)
    diff = (ours - ref).abs()
    print(f"{model_type}: mean |dlogp| {diff.mean():.2e}, max {diff.max():.2e}")
    # A wrong permutation, bias or rope setting gives errors of whole nats.
    assert diff.mean() < 1e-4 and diff.max() < 2e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.98
    assert ref.exp().max() > 0.05  # the random model is not near-uniform: the check has teeth


def test_llama3_rope_scaling_is_carried_by_rope_freqs(tmp_path):
    """Llama-3.1's per-frequency rope scaling; a short original context puts most rotary
    frequencies in the scaled and blended bands, so a wrong factor shows in every position."""
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = make_model(tmp_path / "l31", "llama", rope_parameters=rope)
    ours, ref = llama_cpp_and_transformers(folder, tmp_path)
    assert (ours - ref).abs().mean() < 1e-4
    unscaled = make_model(tmp_path / "l3", "llama")
    ids = torch.tensor([list(range(100, 228))])
    with torch.inference_mode():
        a = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=ids).logits.log_softmax(-1)
        b = AutoModelForCausalLM.from_pretrained(unscaled).eval()(input_ids=ids).logits.log_softmax(-1)
    assert (a - b).abs().mean() > 100 * (ours - ref).abs().mean()  # the scaling matters to this model


def test_llama3_pre_tokenizer_tokenizes_like_transformers(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra")
    from transformers import AutoTokenizer

    folder = make_model(tmp_path / "l3", "llama")
    tok = json.loads((folder / "tokenizer.json").read_text())
    llama3 = next(p for p, name in _PRE_PATTERNS.items() if name == "llama-bpe")
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": llama3}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    ckpt = HFCheckpoint.open(folder)
    path = build_variant(ckpt, gguf_variant("Q8_0"), tmp_path, gguf_path=tmp_path / "m.gguf").files[0]
    text = EVAL_TEXT.read_text() + "\n1234567 numbers, 3.14159 and   spaces\t\ttabs\r\n"
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    hf_ids = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == hf_ids
    gpt2_ids = AutoTokenizer.from_pretrained(TINY)(text, add_special_tokens=False)["input_ids"]
    assert hf_ids != gpt2_ids  # the two splitters really differ on this text


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=256, n_positions=64)).save_pretrained(folder)
    shutil.copy(TINY / "tokenizer.json", folder)
    with pytest.raises(InputError, match="model_type .gpt2.*not supported.*gemma2, gemma3, gemma3_text, llama, mistral, phi3, qwen2, qwen3"):
        build_variant(HFCheckpoint.open(folder), gguf_variant("Q8_0"), tmp_path)
    assert not list(tmp_path.glob("**/*.gguf*"))


def test_shape_that_disagrees_with_config_is_refused(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 1024
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"mlp.down_proj.weight' has shape \[256, 768\], the config gives \[256, 1024\]"):
        build_variant(HFCheckpoint.open(folder), gguf_variant("Q4_K_M"), tmp_path)
    assert not list(tmp_path.glob("**/*.gguf*"))


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    folder = make_model(tmp_path / "m", "llama")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Whitespace"}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InputError, match="pre-tokenizer is not one llama.cpp knows"):
        build_variant(HFCheckpoint.open(folder), gguf_variant("Q8_0"), tmp_path)
    assert not list(tmp_path.glob("**/*.gguf*"))


TRICKY_TEXT = "\n1234567 numbers, 3.14159 and   spaces\t\ttabs\r\n  leading, café, naïve, 東京, emoji 🙂.\n\n"


@pytest.fixture(scope="module")
def llama2_folder(tmp_path_factory):
    """A Llama-2-style checkpoint: a SentencePiece BPE tokenizer.model trained here with Llama-2's
    settings (byte fallback, split digits, no normalization), the tokenizer.json transformers makes
    from it, and a small random model over its vocabulary."""
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is in the 'dev' extra")
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("llama2")
    spm.SentencePieceTrainer.train(
        input=str(BUNDLED / "calib.txt"), model_prefix=str(folder / "tokenizer"), vocab_size=3000, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True, character_coverage=0.9999, user_defined_symbols=["<sep>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
        "add_bos_token": True, "add_eos_token": False,
    }))
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)  # writes tokenizer.json
    return make_model(folder, "llama", tokenizer_from=None, vocab_size=3000, bos_token_id=1, eos_token_id=2)


def test_sentencepiece_model_is_read_as_the_sentencepiece_library_reads_it(llama2_folder):
    import sentencepiece as spm

    from formats.sentencepiece_model import read_sentencepiece

    ours = read_sentencepiece(llama2_folder / "tokenizer.model")
    lib = spm.SentencePieceProcessor(model_file=str(llama2_folder / "tokenizer.model"))
    assert len(ours.pieces) == lib.vocab_size() == 3000
    assert [(p, s) for p, s, _ in ours.pieces] == [(lib.IdToPiece(i), lib.GetScore(i)) for i in range(3000)]
    kinds = [(lib.IsUnknown(i), lib.IsControl(i), lib.IsByte(i)) for i in range(3000)]
    assert [(k == 2, k == 3, k == 6) for _, _, k in ours.pieces] == kinds
    assert ours.model_type == "bpe" and ours.add_dummy_prefix


def test_sentencepiece_tokenizer_tokenizes_like_transformers(llama2_folder, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra")
    from transformers import AutoTokenizer

    path = build_variant(HFCheckpoint.open(llama2_folder), gguf_variant("Q8_0"), tmp_path,
                         gguf_path=tmp_path / "m.gguf").files[0]
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    hf = AutoTokenizer.from_pretrained(llama2_folder)
    text = EVAL_TEXT.read_text() + TRICKY_TEXT
    hf_ids = hf(text)["input_ids"]
    assert hf_ids[0] == 1  # <s>: Llama-2 tokenizers add it, and so must the GGUF's metadata
    assert llm.tokenize(text.encode(), add_bos=llm.metadata["tokenizer.ggml.add_bos_token"] == "true", special=True) == hf_ids
    assert hf.convert_tokens_to_ids("<0xF0>") in hf_ids  # the emoji took the byte fallback
    assert llm.detokenize(hf_ids[1:]).decode() == " " + text  # bytes reassembled; the prefix space kept
    # A user-defined piece is cut out whole, as SentencePiece does. (Text right after one is not
    # compared: llama.cpp prepends a space there, as transformers' legacy Llama tokenizer did.)
    assert llm.tokenize(b"<sep>", add_bos=False, special=True) == hf("<sep>", add_special_tokens=False)["input_ids"] == [3]


def test_llama_cpp_computes_what_transformers_computes_with_sentencepiece(llama2_folder, tmp_path):
    ours, ref = llama_cpp_and_transformers(llama2_folder, tmp_path)
    assert (ours - ref).abs().mean() < 1e-4


def test_corrupt_sentencepiece_model_is_refused(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(TINY, folder)
    (folder / "tokenizer.model").write_bytes(b"\x0a\xff\xff\xff\x0f" + b"x" * 10)
    with pytest.raises(InputError, match=r"tokenizer.model: not a SentencePiece model"):
        build_variant(HFCheckpoint.open(folder), gguf_variant("Q8_0"), tmp_path)
    assert not list(tmp_path.glob("**/*.gguf*"))


# ---------------------------------------------------------------- tokenizer.json alone (transformers 5)


def _export_and_load(folder, tmp_path, vocab_only: bool = False):
    import llama_cpp

    path = build_variant(HFCheckpoint.open(folder), gguf_variant("Q8_0"), tmp_path, gguf_path=tmp_path / "m.gguf").files[0]
    return path, llama_cpp.Llama(model_path=str(path), vocab_only=vocab_only, n_ctx=64, verbose=False)


def _llama_cpp_ids(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=llm.metadata["tokenizer.ggml.add_bos_token"] == "true", special=True)


@pytest.fixture(scope="module", params=["llama2", "gemma3"])
def json_only_folder(request, tmp_path_factory):
    """A Llama-2- or Gemma-3-shaped random model whose tokenizer is a byte-fallback BPE trained
    here, saved by transformers' LlamaTokenizer / GemmaTokenizer: tokenizer.json, no tokenizer.model."""
    from helpers.spm_tokenizers import save_sentencepiece_bpe

    folder = tmp_path_factory.mktemp(request.param)
    style, model_type, extra = {"llama2": ("llama", "llama", {}), "gemma3": ("gemma", *ZOO["gemma3"])}[request.param]
    ids = save_sentencepiece_bpe(folder, style, vocab_size=3000)
    make_model(folder, model_type, tokenizer_from=None, **{**extra, "vocab_size": 3000, "pad_token_id": 0,
               "bos_token_id": ids.get("<s>", ids.get("<bos>")), "eos_token_id": ids.get("</s>", ids.get("<eos>"))})
    assert not (folder / "tokenizer.model").exists()
    return folder


def test_tokenizer_json_sentencepiece_bpe_tokenizes_like_transformers(json_only_folder, tmp_path):
    """The export's llama tokenizer gives transformers' tokens for the evaluation text, and the
    vocabulary is typed as SentencePiece types it."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra")
    from transformers import AutoTokenizer

    from formats.gguf_file import read_gguf_header

    path, llm = _export_and_load(json_only_folder, tmp_path)
    hf = AutoTokenizer.from_pretrained(json_only_folder)
    text = EVAL_TEXT.read_text() + TRICKY_TEXT
    hf_ids = hf(text)["input_ids"]
    assert hf_ids[0] == hf.bos_token_id and len(hf_ids) > 30000
    assert _llama_cpp_ids(llm, text) == hf_ids
    assert hf.convert_tokens_to_ids("<0xF0>") in hf_ids  # the emoji took the byte fallback
    gemma = "gemma" in json_only_folder.name
    assert llm.detokenize(hf_ids[1:]).decode() == ("" if gemma else " ") + text
    # transformers reads the file's tokenizer back (the GGUF as a source) as the same tokenizer
    assert load_tokenizer(open_checkpoint(path))(text)["input_ids"] == hf_ids

    fields = read_gguf_header(path).fields
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.add_space_prefix"] is (not gemma)
    tokens, types, scores = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    by_text = dict(zip(tokens, zip(types, scores)))
    assert all(by_text[f"<0x{b:02X}>"] == (TokenType.BYTE, 0.0) for b in range(256))
    assert by_text["<unk>"][0] == TokenType.UNKNOWN
    specials = ["<pad>", "<eos>", "<bos>", "<mask>"] if gemma else ["<s>", "</s>"]
    assert all(by_text[t][0] == TokenType.CONTROL for t in specials)
    assert fields["tokenizer.ggml.bos_token_id"] == hf.bos_token_id and fields["tokenizer.ggml.eos_token_id"] == hf.eos_token_id
    normal = [(text, score) for text, kind, score in zip(tokens, types, scores) if kind == TokenType.NORMAL]
    assert len(normal) == 3000 - 256 - len(specials) - 1
    merged, chars = [s for t, s in normal if len(t) > 1], [s for t, s in normal if len(t) == 1]
    # Pieces in the order the trainer merged them, each scored by its merge; characters below all.
    assert len(merged) > 2000 and merged == sorted(merged, reverse=True) and max(chars) < min(merged)

    # The scores carry the merge order: with every piece at -1000 (llama.cpp's LlamaHfVocab),
    # llama.cpp merges left to right and tokenizes differently.
    import formats.gguf as gguf_module
    from formats.sentencepiece_model import SentencePieceModel

    def flat(*args, **kwargs):
        spm = read_sentencepiece_json(*args, **kwargs)
        return SentencePieceModel([(p, -1000.0, k) for p, _, k in spm.pieces], spm.model_type, spm.add_dummy_prefix)

    (tmp_path / "flat").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_module, "read_sentencepiece_json", flat)
        _, flat_llm = _export_and_load(json_only_folder, tmp_path / "flat", vocab_only=True)
    assert _llama_cpp_ids(flat_llm, text) != hf_ids


def _tiny_tokenizer_json(normalizer, pre_tokenizer, merges=("a b", "\u2581 ab", "ab c", "a bc", "b c")) -> dict:
    """A byte-fallback BPE over "▁ab c": specials, the 256 byte pieces, merged pieces, characters."""
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["ab", "\u2581ab", "abc", "bc", "\u2581", "a", "b", "c"]
    return {"normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "added_tokens": [{"id": 1, "content": "<s>", "special": True}],
            "model": {"type": "BPE", "byte_fallback": True, "unk_token": "<unk>", "dropout": None,
                      "vocab": {t: i for i, t in enumerate(vocab)}, "merges": list(merges)}}


@pytest.mark.check
def test_tokenizer_json_pieces_are_scored_by_merge_and_typed(tmp_path):
    """Each piece scores minus the rank of the first merge making it (abc: "ab c" at 2, not "a bc"
    at 3); characters below every merged piece; bytes and the unknown piece typed as SentencePiece
    types them. The four normalizations llama.cpp reproduces give its space prefix; others, and a
    byte fallback missing byte pieces, are refused in one line naming the file."""
    from formats.sentencepiece_model import BYTE, NORMAL, UNKNOWN

    path = tmp_path / "tokenizer.json"
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    prepend = {"type": "Prepend", "prepend": "\u2581"}
    gemma_split = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    spm = read_sentencepiece_json(_tiny_tokenizer_json(None, metaspace), path)
    pieces = {text: (score, kind) for text, score, kind in spm.pieces}
    assert len(spm.pieces) == 3 + 256 + 8 and spm.model_type == "bpe" and spm.add_dummy_prefix
    assert [pieces[t] for t in ("ab", "\u2581ab", "abc", "bc")] == [(0.0, NORMAL), (-1.0, NORMAL), (-2.0, NORMAL), (-4.0, NORMAL)]
    assert [pieces[t] for t in ("\u2581", "a", "b", "c")] == [(-5.0 - i, NORMAL) for i in range(263, 267)]
    assert pieces["<0x41>"] == (0.0, BYTE) and pieces["<unk>"] == (0.0, UNKNOWN)
    assert pieces["<s>"][1] == NORMAL  # the caller types added tokens (CONTROL here), from added_tokens

    prefixes = [read_sentencepiece_json(_tiny_tokenizer_json(norm, pre), path).add_dummy_prefix for norm, pre in (
        ({"type": "Sequence", "normalizers": [prepend, replace]}, None),  # Llama-2 as transformers 4 wrote it
        (replace, None), (replace, gemma_split),  # Gemma, transformers 4 and 5
        (None, {**metaspace, "prepend_scheme": "never"}))]
    assert prefixes == [True, False, False, False]

    for norm, pre, message in (
        ({"type": "NFKC"}, None, "normalizer NFKC is not one llama.cpp"),
        (None, {"type": "Whitespace"}, "pre-tokenizer Whitespace is not one llama.cpp"),
    ):
        with pytest.raises(InputError, match=f"^{path}: {message}"):
            read_sentencepiece_json(_tiny_tokenizer_json(norm, pre), path)
    split = {**metaspace, "split": True}  # harmless while no piece holds "▁" past its start
    assert read_sentencepiece_json(_tiny_tokenizer_json(None, split), path).add_dummy_prefix
    tok = _tiny_tokenizer_json(None, split)
    tok["model"]["vocab"]["c\u2581"] = len(tok["model"]["vocab"])
    with pytest.raises(InputError, match="Metaspace splits words apart but pieces hold '▁' inside"):
        read_sentencepiece_json(tok, path)
    tok = _tiny_tokenizer_json(None, metaspace)
    del tok["model"]["vocab"]["<0x41>"]
    with pytest.raises(InputError, match="byte fallback needs the 256 pieces <0x00>..<0xFF>; the vocabulary has 255"):
        read_sentencepiece_json(tok, path)


def test_tokenizer_json_converted_from_sentencepiece_gives_the_tokenizer_models_vocabulary(llama2_folder, tmp_path):
    """The tokenizer.json transformers converts from a SentencePiece model, exported without the
    tokenizer.model: the same pieces and types as the tokenizer.model's export, scores in the same
    order, and llama.cpp's tokens equal to transformers'."""
    import numpy as np
    from transformers import AutoTokenizer

    from formats.gguf_file import read_gguf_header

    json_only = tmp_path / "json-only"
    shutil.copytree(llama2_folder, json_only)
    (json_only / "tokenizer.model").unlink()
    from_model, _ = _export_and_load(llama2_folder, tmp_path / "model", vocab_only=True)
    from_json, llm = _export_and_load(json_only, tmp_path / "json", vocab_only=True)
    a, b = read_gguf_header(from_model).fields, read_gguf_header(from_json).fields
    assert list(a["tokenizer.ggml.tokens"]) == list(b["tokenizer.ggml.tokens"])
    assert list(a["tokenizer.ggml.token_type"]) == list(b["tokenizer.ggml.token_type"])
    normal = np.asarray(a["tokenizer.ggml.token_type"]) == TokenType.NORMAL
    rank_a, rank_b = (np.argsort(-np.asarray(f["tokenizer.ggml.scores"])[normal], kind="stable") for f in (a, b))
    assert normal.sum() > 2500 and (rank_a == rank_b).all()
    text = EVAL_TEXT.read_text() + TRICKY_TEXT
    assert _llama_cpp_ids(llm, text) == AutoTokenizer.from_pretrained(json_only)(text)["input_ids"]
