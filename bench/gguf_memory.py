"""Peak memory of converting a 1B-parameter checkpoint to GGUF (default Q4_K_M).

Makes a synthetic Llama-shaped checkpoint (random bf16 weights, about 2 GB on disk, 1.03B
parameters: hidden 2048, FFN 5632, 20 layers, vocab 8192 with the bundled tokenizer), then runs
`quantize export` on it in a child process and prints its peak RSS: the converting process's peak
plus the largest peak of its encoder worker processes (an upper bound of their peak together, which
counts the pages a forked worker shares with its parent twice). Baseline for scale: the
checkpoint's own size, which a whole-model load would at least need. Target: below 1 GB.

    python bench/gguf_memory.py [--type Q4_K_M] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
    "vocab_size": 8192, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16",
}


def make_checkpoint(dest: Path, config: dict = CONFIG) -> int:
    """Write a synthetic Llama checkpoint tensor by tensor; returns its parameter count."""
    import torch

    from formats.hf import DenseSafetensorsWriter, HFCheckpoint

    c = config
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,))]
    if not c["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (v, h)))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)), (p + "mlp.down_proj.weight", (h, f)),
        ]
    writer = DenseSafetensorsWriter(dest, shapes, torch.bfloat16, HFCheckpoint.open(REPO / "recipes/bundled/tiny"))
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes:
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        writer.add(name, t)
    writer.finish()
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return sum(int(torch.Size(s).numel()) for _, s in shapes)


# Runs the CLI, then prints [own peak RSS, largest worker peak RSS] in KiB; atexit hooks run after
# concurrent.futures has joined its worker processes, so their usage is counted by then.
_EXPORT_AND_REPORT_PEAKS = """
import atexit, json, resource
atexit.register(lambda: print(json.dumps([resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)])))
from recipes.cli import main
main()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--keep", type=Path, help="keep the synthetic checkpoint here (reused when present)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gguf_memory_"))
    model = args.keep or work / "synthetic-1b"
    params = None
    if not (model / "config.json").is_file():
        start = time.perf_counter()
        params = make_checkpoint(model)
        print(f"synthetic checkpoint: {params / 1e9:.2f}B params in {time.perf_counter() - start:.0f} s")
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    out = work / f"synthetic-{args.type}.gguf"
    start = time.perf_counter()
    cmd = [sys.executable, "-c", _EXPORT_AND_REPORT_PEAKS, "export", str(model), "--gguf", args.type, "-o", str(out)]
    done = subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    own_kb, workers_kb = json.loads(done.stdout.strip().splitlines()[-1])
    peak_mb = (own_kb + workers_kb) / 1024
    print(f"converting process {own_kb / 1024:.0f} MiB + encoder workers {workers_kb / 1024:.0f} MiB")
    print(f"checkpoint on disk (baseline: a whole-model load needs at least this): {size / 2**20:.0f} MiB")
    print(f"quantize export -> {args.type}: {seconds:.0f} s, peak RSS {peak_mb:.0f} MiB "
          f"({peak_mb / (size / 2**20):.2f} of the checkpoint size); target < 1024 MiB: "
          f"{'PASS' if peak_mb < 1024 else 'FAIL'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
