"""A seeded fuzzer of the commands that read files users bring: `quantize inspect`, `fit` and `export`.

Seeds: a small random Llama checkpoint (hidden 64, two layers, a 320-token byte-level BPE
tokenizer) and its F16 and Q8_0 GGUF exports. Each case mutates one seed (a header field set to
an edge value, a JSON field of the safetensors header or config.json replaced by a hostile one,
flipped or random bytes, a cut, a duplicated or deleted chunk) and runs the real command line,
``recipes.cli.main``, in this process, under a time limit per case and a memory limit on the
process. A case fails on:

- any exception other than a clean exit (a traceback a user would see; MemoryError included);
- an exit other than 0, or 2 with exactly one line on stderr;
- a command slower than ``--slow`` seconds, or a time-out (a hang);
- after a failed export, any file in its output folder; after any command, a ``.partial`` file;
- a file that the safetensors library or llama.cpp's own GGUF parser refuses but the command
  accepted (the differential oracles; llama.cpp's is used where llama-cpp-python is installed);
- and, once all cases have run, any child process still alive.

Run it long, as the README says: ``python tests/helpers/fuzz_inputs.py --cases 5000 --seed 1``. It prints one
line per failure (the case's seed and mutation, to replay it with ``--only``) and a JSON summary
on the last line; the exit status is 1 if any case failed. tests/test_fuzz.py runs a short
budget of it in the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import io
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

EDGE_INTS = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 63, 64, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1,
             2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


class Hang(Exception):
    pass


@dataclass
class Outcome:
    case: str
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    codes: list[int] = field(default_factory=list)  # exit status of each command that ended


# ---------------------------------------------------------------- seeds


def build_seeds(work: Path) -> dict[str, Path]:
    """The seed files, made deterministically under ``work/seeds``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import AutoConfig, AutoModelForCausalLM

    seeds = work / "seeds"
    model = seeds / "model"
    if (seeds / "done").is_file():
        return _seed_paths(seeds)
    shutil.rmtree(seeds, ignore_errors=True)
    model.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = (REPO / "recipes" / "bundled" / "eval.txt").read_text(encoding="utf-8")[:20000]
    tok.train_from_iterator([text], trainer)
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
    vocab = tok.get_vocab_size()
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
                                  max_position_embeddings=256, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model)
    for file_type in ("F16", "Q8_0"):
        run_cli(["export", str(model), "--gguf", file_type, "-o", str(seeds / f"model-{file_type}.gguf")])
    (seeds / "done").write_text("")
    return _seed_paths(seeds)


def _seed_paths(seeds: Path) -> dict[str, Path]:
    return {"model": seeds / "model", "F16": seeds / "model-F16.gguf", "Q8_0": seeds / "model-Q8_0.gguf"}


# ---------------------------------------------------------------- the command line, in process


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """Run ``quantize ARGS`` as the console script does; (exit status, stdout, stderr)."""
    from rich.console import Console

    import recipes.cli as cli

    out, err = io.StringIO(), io.StringIO()
    saved = cli.console, cli.stdout, sys.argv
    cli.console, cli.stdout = Console(file=err, width=200), Console(file=out, width=200)
    sys.argv = ["quantize", *args]
    code = 0
    try:
        with contextlib.redirect_stdout(out):
            cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        cli.console, cli.stdout, sys.argv = saved
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------- mutations


def gguf_slots(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, width, what) of every count, length, type, dim and offset in a valid GGUF header."""
    slots = [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "metadata count")]
    n_tensors, n_kv = struct.unpack_from("<qq", data, 8)
    pos = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(what: str) -> None:
        nonlocal pos
        slots.append((pos, 8, what))
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    for i in range(n_kv):
        string(f"key {i} length")
        slots.append((pos, 4, f"key {i} type"))
        (t,) = struct.unpack_from("<i", data, pos)
        pos += 4
        if t == 9:
            slots.append((pos, 4, f"key {i} element type"))
            slots.append((pos + 4, 8, f"key {i} array length"))
            et, n = struct.unpack_from("<iQ", data, pos)
            pos += 12
            if et == 8:
                for j in range(n):
                    if j < 3 or j == n - 1:
                        slots.append((pos, 8, f"key {i} element {j} length"))
                    (m,) = struct.unpack_from("<Q", data, pos)
                    pos += 8 + m
            else:
                pos += n * sizes[et]
        elif t == 8:
            string(f"key {i} string length")
        else:
            slots.append((pos, sizes[t], f"key {i} value"))
            pos += sizes[t]
    for i in range(n_tensors):
        string(f"tensor {i} name length")
        slots.append((pos, 4, f"tensor {i} dims"))
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4
        for d in range(nd):
            slots.append((pos, 8, f"tensor {i} dim {d}"))
            pos += 8
        slots.append((pos, 4, f"tensor {i} type"))
        slots.append((pos + 4, 8, f"tensor {i} offset"))
        pos += 12
    return slots


def mutate_gguf(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.random()
    if kind < 0.6:
        offset, width, what = rng.choice(gguf_slots(data))
        (old,) = struct.unpack_from({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[width], data, offset)
        value = rng.choice(EDGE_INTS + [old + 1, old - 1, old * 2, old + 2**width, rng.getrandbits(8 * width)])
        value %= 2 ** (8 * width)
        out = bytearray(data)
        struct.pack_into({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[width], out, offset, value)
        return bytes(out), f"{what} {old} -> {value}"
    return mutate_bytes(data, rng, header=min(len(data), 4096))


def mutate_bytes(data: bytes, rng: random.Random, header: int) -> tuple[bytes, str]:
    """Generic damage, mostly within the first ``header`` bytes where the parsing happens."""
    out = bytearray(data)
    kind = rng.randrange(6)
    where = rng.randrange(header) if rng.random() < 0.85 else rng.randrange(len(data))
    if kind == 0:
        out[where] ^= 1 << rng.randrange(8)
        return bytes(out), f"bit flip at {where}"
    if kind == 1:
        n = rng.randint(1, 16)
        out[where : where + n] = bytes(rng.getrandbits(8) for _ in range(n))[: len(out) - where]
        return bytes(out), f"{n} random bytes at {where}"
    if kind == 2:
        return bytes(out[:where]), f"cut at {where}"
    if kind == 3:
        n = rng.randint(1, 64)
        return bytes(out[:where] + out[where + n :]), f"{n} bytes deleted at {where}"
    if kind == 4:
        n = rng.randint(1, 64)
        return bytes(out[:where] + out[where : where + n] + out[where:]), f"{n} bytes duplicated at {where}"
    return bytes(out + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))), "garbage appended"


HOSTILE_JSON = [None, True, -1, 1.5, 2**64, "x", "F32", [], [-1], [1.5], ["1"], [2**64], [[1]], {}, {"a": 1},
                [0, 0], [10**12, 10**12 + 4], [4, 0], "[/red]", "a\nb"]


def mutate_safetensors(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    kind = rng.random()
    if kind < 0.25:
        return mutate_bytes(data, rng, header=8 + n)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    h = copy.deepcopy(header)
    if kind < 0.65:
        key = rng.choice(["dtype", "shape", "data_offsets"])
        value = rng.choice(HOSTILE_JSON + [[d + rng.choice([-1, 1]) for d in h[name][key]] if key != "dtype" else "I32"])
        h[name][key] = value
        what = f"{name}.{key} = {json.dumps(value)}"
    elif kind < 0.72:
        other = rng.choice(names)
        h[name]["data_offsets"], h[other]["data_offsets"] = h[other]["data_offsets"], h[name]["data_offsets"]
        what = f"offsets of {name} and {other} swapped"
    elif kind < 0.8:
        h["__metadata__"] = rng.choice([[], 1, {"a": 1}, {"a": {"b": "c"}}, None, "x"])
        what = f"__metadata__ = {json.dumps(h['__metadata__'])}"
    elif kind < 0.87:
        new = rng.choice(["model.layers.9.mlp.up_proj.weight", "bad\nname", "[/red]", "model.norm.weight.x", ""])
        h[new] = h.pop(name)
        what = f"{name} renamed {json.dumps(new)}"
    elif kind < 0.92:
        del h[name]
        what = f"{name} removed"
    elif kind < 0.96:
        depth = rng.choice([50, 5000, 200000])
        blob = ("[" * depth + "]" * depth).encode()
        raw = json.dumps(h).encode()
        raw = raw[:-1] + b', "deep": ' + blob + b"}"
        return _pack_safetensors(raw, body), f"nesting {depth} deep"
    else:
        raw = json.dumps(h).encode()
        first = json.dumps({name: h[name]})[1:-1].encode()
        return _pack_safetensors(raw[:-1] + b", " + first + b"}", body), f"{name} listed twice"
    return _pack_safetensors(json.dumps(h).encode(), body), what


def _pack_safetensors(raw: bytes, body: bytes) -> bytes:
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def mutate_config(config: dict, rng: random.Random) -> tuple[dict, str]:
    c = copy.deepcopy(config)
    key = rng.choice(["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                      "intermediate_size", "max_position_embeddings", "head_dim", "model_type", "rms_norm_eps",
                      "tie_word_embeddings", "quantization_config", "rope_parameters", "sliding_window"])
    value = rng.choice([0, -1, 1, 3, 2**31, 10**9, 10**30, 1.5, "64", None, [], {}, "gemma3", "nope", True,
                        {"quant_method": "gptq"}, {"rope_type": "yarn", "factor": 0}, {"rope_type": "linear"},
                        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4, "high_freq_factor": 4},
                        {"rope_type": "default", "rope_theta": -1}])
    if value is None and rng.random() < 0.5:
        c.pop(key, None)
        return c, f"config.json: {key} removed"
    c[key] = value
    return c, f"config.json: {key} = {json.dumps(value)}"


# ---------------------------------------------------------------- oracles


class LlamaCppGGUF:
    """llama.cpp's own GGUF header parser (gguf_init_from_file in the libggml that llama-cpp-python ships)."""

    def __init__(self) -> None:
        import llama_cpp

        lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
        self.lib = ctypes.CDLL(str(lib))

        class Params(ctypes.Structure):
            _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

        self.params = Params(True, None)
        self.lib.gguf_init_from_file.restype = ctypes.c_void_p
        self.lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
        self.lib.gguf_free.argtypes = [ctypes.c_void_p]
        callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        self._quiet = callback(lambda level, text, data: None)  # kept alive: ggml holds the pointer
        self.lib.ggml_log_set.argtypes = [callback, ctypes.c_void_p]
        self.lib.ggml_log_set(self._quiet, None)

    def accepts(self, path: Path) -> bool:
        ctx = self.lib.gguf_init_from_file(str(path).encode(), self.params)
        if ctx:
            self.lib.gguf_free(ctx)
        return bool(ctx)


def safetensors_accepts(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
        return True
    except Exception:
        return False


# ---------------------------------------------------------------- one case


def check(args: list[str], outcome: Outcome, limit: float, slow: float, out_dir: Path | None = None,
          product: set[str] | None = None) -> int | None:
    """Run one command of a case; record what is wrong with how it ended. Returns its exit status."""
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        code, _, err = run_cli(args)
    except Hang:
        outcome.problems.append(f"{args[0]}: no answer within {limit:.0f} s")
        return None
    except BaseException as e:  # noqa: BLE001 - anything else is a traceback the user would see
        signal.setitimer(signal.ITIMER_REAL, 0)
        outcome.problems.append(f"{args[0]}: {type(e).__name__}: {str(e)[:200]}\n{traceback.format_exc(limit=-4)}")
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - start
    outcome.seconds = max(outcome.seconds, seconds)
    outcome.codes.append(code)
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 2 and not (len(lines) == 1 and lines[0].startswith("error: ")):
        outcome.problems.append(f"{args[0]}: exit 2 without one error line: {err[:300]!r}")
    elif code not in (0, 2):
        outcome.problems.append(f"{args[0]}: exit {code}: {err[:300]!r}")
    if seconds > slow:
        outcome.problems.append(f"{args[0]}: took {seconds:.2f} s")
    if out_dir is not None:
        left = sorted(p.name for p in out_dir.rglob("*")) if out_dir.exists() else []
        expected = sorted(product or ()) if code == 0 else []
        if left != expected:
            outcome.problems.append(f"{args[0]}: exit {code} left {left} in its output folder (expected {expected})")
    return code


def run_case(index: int, seed: int, seeds: dict[str, Path], work: Path, limit: float, slow: float,
             gguf_oracle: LlamaCppGGUF | None) -> Outcome:
    rng = random.Random(f"{seed}:{index}")
    target = rng.choice(["gguf", "gguf", "safetensors", "safetensors", "config"])
    case = work / "case"
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir(parents=True)
    if target == "gguf":
        source = seeds[rng.choice(["F16", "Q8_0"])]
        data, what = mutate_gguf(source.read_bytes(), rng)
        outcome = Outcome(f"{seed}:{index} {source.name}: {what}")
        path = case / "model.gguf"
        path.write_bytes(data)
        codes = [check(["inspect", str(path)], outcome, limit, slow),
                 check(["fit", str(path), "--json"], outcome, limit, slow)]
        if gguf_oracle is not None and not gguf_oracle.accepts(path) and 0 in codes:
            outcome.problems.append("llama.cpp refuses this GGUF file, but a command accepted it")
    else:
        model = case / "model"
        shutil.copytree(seeds["model"], model)
        if target == "safetensors":
            data, what = mutate_safetensors((model / "model.safetensors").read_bytes(), rng)
            (model / "model.safetensors").write_bytes(data)
        else:
            config, what = mutate_config(json.loads((model / "config.json").read_text()), rng)
            (model / "config.json").write_text(json.dumps(config))
        outcome = Outcome(f"{seed}:{index} {target}: {what}")
        out = case / "out"
        codes = [check(["inspect", str(model / "model.safetensors")], outcome, limit, slow),
                 check(["export", str(model), "--gguf", "Q8_0", "-o", str(out / "m.gguf")], outcome, limit, slow,
                       out_dir=out, product={"m.gguf", "m.Modelfile"})]
        if target == "config":
            codes.append(check(["fit", str(model), "--json"], outcome, limit, slow))
        if target == "safetensors" and not safetensors_accepts(model / "model.safetensors") and codes[0] == 0:
            outcome.problems.append("the safetensors library refuses this file, but inspect accepted it")
    partials = sorted(str(p.relative_to(case)) for p in case.rglob("*.partial"))
    if partials:
        outcome.problems.append(f"left {partials}")
    if not outcome.problems:
        shutil.rmtree(case, ignore_errors=True)
    else:
        shutil.rmtree(work / f"failed-{index}", ignore_errors=True)
        case.rename(work / f"failed-{index}")
    return outcome


def _children() -> list[int]:
    """This process's child processes (every thread's), by pid."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def _hang(signum, frame):
    raise Hang()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("runs/fuzz"))
    parser.add_argument("--limit", type=float, default=20.0, help="seconds before a command counts as hung")
    parser.add_argument("--slow", type=float, default=3.0, help="seconds beyond which a command counts as too slow")
    parser.add_argument("--memory-gib", type=float, default=3.0, help="address space the commands may add, GiB")
    parser.add_argument("--only", type=int, action="append", help="run just these case indices")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    seeds = build_seeds(args.work)
    try:
        gguf_oracle = LlamaCppGGUF()
    except (ImportError, OSError):
        gguf_oracle = None
    for warm in (["inspect", str(seeds["F16"])], ["fit", str(seeds["F16"]), "--json"]):
        run_cli(warm)  # imports and first-call costs are not the cases' time
    shutil.rmtree(args.work / "case", ignore_errors=True)
    run_cli(["export", str(seeds["model"]), "--gguf", "Q8_0", "-o", str(args.work / "case" / "warm.gguf")])
    vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vm + int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _hang)
    indices = args.only or range(args.cases)
    failed, slowest, start, codes = [], (0.0, ""), time.perf_counter(), []
    for index in indices:
        outcome = run_case(index, args.seed, seeds, args.work, args.limit, args.slow, gguf_oracle)
        slowest = max(slowest, (outcome.seconds, outcome.case))
        codes += outcome.codes
        if outcome.problems:
            failed.append(outcome.case)
            print(f"FAIL {outcome.case}: " + " | ".join(outcome.problems), flush=True)
    strays = _children()
    if strays:
        failed.append(f"child processes {strays} still running after the cases")
        print(f"FAIL {failed[-1]}", flush=True)
    summary = {"cases": len(indices), "failed": len(failed), "commands": len(codes), "accepted": codes.count(0),
               "refused": codes.count(2), "seconds": round(time.perf_counter() - start, 1),
               "slowest_s": round(slowest[0], 3), "slowest": slowest[1], "llama_cpp_oracle": gguf_oracle is not None}
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
