import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import TINY
from core.errors import InputError
from formats.hf import DenseSafetensorsWriter, HFCheckpoint, is_linear_weight, read_safetensors_header

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


def copy_model(tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(TINY, dest)
    for p in dest.iterdir():
        p.chmod(0o644)
    return dest


def test_reads_tensors_lazily_with_their_shapes():
    ckpt = HFCheckpoint.open(TINY)
    assert ckpt.architecture == "LlamaForCausalLM"
    assert len(ckpt.names) == 56
    assert ckpt.shape("model.embed_tokens.weight") == (8192, 256)
    t = ckpt.tensor("model.layers.0.mlp.down_proj.weight")
    assert t.shape == (256, 768) and t.dtype == torch.bfloat16


def test_linear_weights_are_the_decoder_projections():
    ckpt = HFCheckpoint.open(TINY)
    linear = [n for n in ckpt.names if is_linear_weight(n, ckpt.shape(n))]
    assert len(linear) == 6 * 7
    assert all(n.endswith("_proj.weight") for n in linear)


@pytest.mark.parametrize("cut", [4, 100, 1000, -1])
def test_truncated_safetensors_is_refused_with_the_file_name(tmp_path, cut):
    model = copy_model(tmp_path)
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(InputError, match="model.safetensors: .*(truncated|too short)"):
        HFCheckpoint.open(model)


def test_corrupted_header_is_refused(tmp_path):
    model = copy_model(tmp_path)
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="corrupted safetensors header"):
        read_safetensors_header(path)


def test_model_folder_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        HFCheckpoint.open(tmp_path / "nope")
    model = copy_model(tmp_path)
    (model / "config.json").unlink()
    with pytest.raises(InputError, match="no config.json"):
        HFCheckpoint.open(model)
    (model / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json: invalid JSON"):
        HFCheckpoint.open(model)
    shutil.copyfile(TINY / "config.json", model / "config.json")
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    with pytest.raises(InputError, match="no \\*.safetensors weights.*pytorch_model.bin are pickle files"):
        HFCheckpoint.open(model)


def test_dense_writer_round_trips_through_safetensors(tmp_path):
    ckpt = HFCheckpoint.open(TINY)
    tensors = {"b": torch.randn(3, 5), "a": torch.arange(7, dtype=torch.float32)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dest = tmp_path / str(dtype)
        writer = DenseSafetensorsWriter(dest, [(n, tuple(t.shape)) for n, t in tensors.items()], dtype, ckpt)
        for n, t in tensors.items():
            writer.add(n, t)
        writer.finish()
        assert not (tmp_path / f"{dest.name}.partial").exists()
        assert (dest / "tokenizer.json").is_file() and (dest / "config.json").is_file()
        with safe_open(str(dest / "model.safetensors"), "pt") as f:
            for n, t in tensors.items():
                torch.testing.assert_close(f.get_tensor(n), t.to(dtype), rtol=0, atol=0)


def test_dense_writer_leaves_nothing_when_aborted(tmp_path):
    ckpt = HFCheckpoint.open(TINY)
    writer = DenseSafetensorsWriter(tmp_path / "out", [("a", (2,)), ("b", (2,))], torch.float32, ckpt)
    writer.add("a", torch.zeros(2))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_safetensors_written_by_the_library_passes_validation(tmp_path):
    save_file({"x": torch.ones(4, 4, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    header = read_safetensors_header(tmp_path / "m.safetensors")
    assert header.tensors["x"]["shape"] == [4, 4]
