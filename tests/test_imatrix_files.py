"""Importance matrices: computed from text, written and read in llama.cpp's formats, used by export."""

import struct

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import BUNDLED, TINY
from core.errors import InputError
from formats.gguf import gguf_name
from formats.hf import HFCheckpoint
from formats.imatrix import read_imatrix, write_imatrix
from helpers.cli import assert_user_error, quantize

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


TINY_ARCH = HFCheckpoint.open(TINY).arch


@pytest.fixture(scope="module")
def tiny_imatrix(tmp_path_factory):
    from calib.text import token_windows
    from formats.hf import HFCheckpoint, load_tokenizer
    from recipes.importance import model_imatrix

    ckpt = HFCheckpoint.open(TINY)
    windows = token_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 512, 4)
    return model_imatrix(ckpt, windows), windows.numel()


def test_every_decoder_linear_gets_a_positive_column_profile(tiny_imatrix):
    means, _ = tiny_imatrix
    assert len(means) == 6 * 7 and "lm_head.weight" not in means
    for name, v in means.items():
        assert v.dtype == np.float32 and v.ndim == 1 and (v > 0).all() and np.isfinite(v).all()
    # q, k and v read the same normalised input, so they see the same activations
    np.testing.assert_array_equal(means["model.layers.2.self_attn.q_proj.weight"], means["model.layers.2.self_attn.v_proj.weight"])
    assert means["model.layers.2.mlp.down_proj.weight"].shape == (768,)


def test_gguf_imatrix_round_trip(tmp_path, tiny_imatrix):
    means, tokens = tiny_imatrix
    by_gguf = {gguf_name(n, TINY_ARCH): v for n, v in means.items()}
    path = tmp_path / "im.gguf"
    write_imatrix(path, by_gguf, tokens, ["calib.txt"], 512)
    reader = GGUFReader(path)  # the layout llama-quantize reads: <name>.in_sum2 / <name>.counts
    assert reader.fields["imatrix.chunk_size"].contents() == 512
    assert reader.fields["imatrix.datasets"].contents() == ["calib.txt"]
    names = {t.name for t in reader.tensors}
    assert "blk.0.ffn_down.weight.in_sum2" in names and "blk.0.ffn_down.weight.counts" in names
    back = read_imatrix(path)
    assert back.keys() == by_gguf.keys()
    for name, v in by_gguf.items():
        np.testing.assert_allclose(back[name], v, rtol=1e-6)


def test_legacy_dat_imatrix_is_read(tmp_path):
    values = np.array([2.0, 4.0, 6.0], dtype=np.float32)
    blob = struct.pack("<i", 1) + struct.pack("<i", 19) + b"blk.0.attn_q.weight" + struct.pack("<ii", 2, 3)
    blob += values.tobytes() + struct.pack("<i", 10) + struct.pack("<i", 4) + b"data"
    path = tmp_path / "old.dat"
    path.write_bytes(blob)
    np.testing.assert_array_equal(read_imatrix(path)["blk.0.attn_q.weight"], values / 2)  # sums over 2 calls


def test_damaged_imatrix_files_are_refused(tmp_path):
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\xff\xff\xff\xff" * 4)
    with pytest.raises(InputError, match="junk.dat: not an imatrix file"):
        read_imatrix(junk)
    cut = tmp_path / "cut.dat"
    cut.write_bytes(struct.pack("<ii", 1, 19) + b"blk.0")
    with pytest.raises(InputError, match="cut.dat: truncated"):
        read_imatrix(cut)


@pytest.mark.parametrize("file_type", ["Q4_K_M", "IQ4_XS"])
def test_export_with_an_imatrix_file_matches_llama_quantize(tmp_path, tiny_imatrix, monkeypatch, capsys, file_type):
    oracle = pytest.importorskip("helpers.ggml_oracle")
    if not oracle.available():
        pytest.skip("llama-cpp-python is the 'interop' extra")
    from core.file_types import FILE_TYPES

    means, tokens = tiny_imatrix
    path = tmp_path / "im.gguf"
    write_imatrix(path, {gguf_name(n, TINY_ARCH): v for n, v in means.items()}, tokens, ["calib.txt"], 512)
    code, _, err = quantize(monkeypatch, capsys, "export", TINY, "--gguf", file_type, "-o", tmp_path / "ours.gguf", "--imatrix", path)
    assert code == 0, err
    code, _, err = quantize(monkeypatch, capsys, "export", TINY, "--gguf", "F32", "-o", tmp_path / "f32.gguf")
    assert code == 0, err
    oracle.llama_quantize_file(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", FILE_TYPES[file_type].id, imatrix=read_imatrix(path))
    ours = {t.name: bytes(t.data) for t in GGUFReader(tmp_path / "ours.gguf").tensors}
    theirs = {t.name: bytes(t.data) for t in GGUFReader(tmp_path / "theirs.gguf").tensors}
    assert ours == theirs
    assert (tmp_path / "ours.Modelfile").read_text().startswith("FROM ./ours.gguf")


def test_export_bad_inputs(tmp_path, monkeypatch, capsys):
    assert_user_error(quantize(monkeypatch, capsys, "export", TINY, "--gguf", "Q4_K_X", "-o", tmp_path / "a.gguf"),
                      "--gguf Q4_K_X", "Q4_K_M")
    wrong = tmp_path / "wrong.gguf"
    write_imatrix(wrong, {"blk.99.attn_q.weight": np.ones(256, np.float32)}, 10, ["x"], 512)
    assert_user_error(quantize(monkeypatch, capsys, "export", TINY, "--gguf", "Q4_K_M", "-o", tmp_path / "b.gguf",
                               "--imatrix", wrong), "blk.99.attn_q.weight", "matches no tensor")
    assert_user_error(quantize(monkeypatch, capsys, "export", tmp_path / "nope", "--gguf", "Q8_0", "-o", tmp_path / "c.gguf"),
                      "nope", "not found")
    # llama-quantize refuses IQ3_XS without an importance matrix (its IQ3_XXS tensors need one): so do we
    assert_user_error(quantize(monkeypatch, capsys, "export", TINY, "--gguf", "iq3_xs", "-o", tmp_path / "d.gguf"),
                      "IQ3_XS needs an importance matrix", "IQ3_XXS")
    assert not list(tmp_path.glob("*.gguf.partial")) and not (tmp_path / "b.gguf").exists()
