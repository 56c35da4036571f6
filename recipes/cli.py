"""The ``quantize`` command.

``quantize RECIPE.yaml`` runs a recipe (shorthand for ``quantize run RECIPE.yaml``); subcommands
cover the other jobs. User mistakes print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from core.errors import InputError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Make LLMs smaller and measure what each smaller variant costs.\n\n"
    "Usage: quantize RECIPE.yaml [--out DIR]  (same as: quantize run RECIPE.yaml)",
)
console = Console(stderr=True)
# A report table needs about 110 columns; rich assumes 80 when output is not a terminal.
stdout = Console() if sys.stdout.isatty() else Console(width=160)


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="Recipe YAML: model, evaluation text, variants and exports."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: the recipe's 'output', else runs/<recipe name>)."),
    executor: Optional[str] = typer.Option(None, "--executor", help="local, ray (a local Ray started for the job) or ray=ADDRESS (a running cluster); default: the recipe's 'executor', else local."),
) -> None:
    """Quantize every variant of a recipe, write its files, and report before/after accuracy."""
    from evalsuite.report import table
    from recipes.pipeline import run_recipe
    from recipes.schema import check_executor, load_recipe

    if executor is not None:
        try:
            check_executor(executor)
        except ValueError as e:
            raise InputError(f"--executor: {e}") from None
    spec = load_recipe(recipe)
    out_dir = out or spec.output or Path("runs") / recipe.stem
    report = run_recipe(spec, out_dir, console, executor)
    stdout.print(table(report))
    stdout.print(escape(f"Report: {out_dir / 'report.md'}  {out_dir / 'report.html'}  {out_dir / 'report.json'}"))


@app.command()
def export(
    model: Path = typer.Argument(..., help="Hugging Face model folder (config.json, *.safetensors, tokenizer) or id (org/name[@revision]), a GPTQ/AWQ/compressed-tensors/bitsandbytes folder, or a GGUF file."),
    gguf: str = typer.Option(..., "--gguf", help="GGUF file type: F32 F16 BF16 Q8_0 Q6_K Q5_K_M Q5_K_S Q4_K_M Q4_K_S Q3_K_L Q3_K_M Q3_K_S Q2_K Q2_K_S Q5_1 Q5_0 Q4_1 Q4_0 IQ4_NL IQ4_XS IQ3_S IQ3_M IQ3_XS IQ3_XXS IQ2_M IQ2_S IQ2_XS IQ2_XXS IQ1_S IQ1_M TQ1_0 TQ2_0 MXFP4_MOE, or auto (each tensor's type chosen within --bpw or --size)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output .gguf file (an Ollama Modelfile is written beside it)."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix: a llama.cpp imatrix file (.gguf or .dat), or a calibration text to compute one from (with --gguf auto, also to measure each tensor's KL divergence on)."),
    bpw: Optional[float] = typer.Option(None, "--bpw", help="With --gguf auto: the budget in bits per weight of tensor data."),
    size: Optional[str] = typer.Option(None, "--size", help="With --gguf auto: the budget in bytes of tensor data, e.g. 4.2GB."),
) -> None:
    """Convert a checkpoint to a GGUF file in one step, as llama.cpp's converter and quantizer would (from a GGUF file: a tensor whose type stays keeps its bytes), or in the mix of types that loses least within a budget (--gguf auto)."""
    from formats.outputs import Outputs, check_output_path
    from formats.sources import open_checkpoint
    from calib.text import token_windows
    from core.file_types import AUTO, FILE_TYPES
    from formats.hf import load_tokenizer
    from recipes.importance import is_imatrix_file, load_or_compute_imatrix
    from recipes.kld_gains import GAIN_WINDOWS
    from recipes.pipeline import progress_bar
    from recipes.variants import build_variant, export_paths, gguf_variant, plan_variant

    file_type = AUTO if gguf.lower() == AUTO else gguf.upper()
    if file_type not in FILE_TYPES and file_type != AUTO:
        raise InputError(f"--gguf {gguf}: unknown GGUF file type (choose from {', '.join(FILE_TYPES)}, or auto)")
    if file_type != AUTO and (bpw is not None or size is not None):
        raise InputError("--bpw and --size are budgets for --gguf auto")
    text = imatrix if imatrix is not None and imatrix.is_file() and not is_imatrix_file(imatrix) else None
    variant = gguf_variant(file_type, imatrix is not None, bpw=bpw, size=size, measured=text is not None)
    ckpt = open_checkpoint(model)
    for path in export_paths(ckpt, variant, out.parent, gguf_path=out).values():
        check_output_path(path, folder=False)
    plan_variant(ckpt, variant, imatrix is not None)
    with progress_bar(console) as progress, Outputs() as outputs:  # the .gguf and its Modelfile appear together
        importance = load_or_compute_imatrix(ckpt, imatrix, progress) if imatrix is not None else None
        windows = token_windows(load_tokenizer(ckpt), text, 512, GAIN_WINDOWS) if file_type == AUTO and text else None
        built = build_variant(ckpt, variant, out.parent, progress, imatrix=importance, gguf_path=out,
                              calibration=windows, outputs=outputs)
        outputs.commit()
    stdout.print(escape(f"{out}: {file_type}, {out.stat().st_size / 2**20:.2f} MiB, {built.bits_per_weight:.3f} bits per weight"))


@app.command("imatrix")
def imatrix_command(
    model: Path = typer.Argument(..., help="Hugging Face model folder, or id (org/name[@revision])."),
    text: Path = typer.Option(..., "--text", help="Calibration text (UTF-8)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output imatrix file, llama.cpp's GGUF format (llama-quantize --imatrix reads it)."),
    windows: int = typer.Option(128, "--windows", min=1, help="At most this many 512-token windows of the text."),
) -> None:
    """Compute an importance matrix (mean squared activation per input column of every Linear layer)."""
    from formats.gguf import gguf_name
    from formats.hf import HFCheckpoint
    from formats.hub import local_model
    from formats.imatrix import write_imatrix
    from formats.outputs import Outputs, check_output_path
    from recipes.importance import compute_imatrix
    from recipes.pipeline import progress_bar

    check_output_path(out, folder=False)
    ckpt = HFCheckpoint.open(local_model(model))
    with progress_bar(console) as progress:
        means, tokens = compute_imatrix(ckpt, text, progress, windows)
    with Outputs() as outputs:
        write_imatrix(outputs.stage(out), {gguf_name(n, ckpt.arch): v for n, v in means.items()}, tokens, [str(text)], 512)
        outputs.commit()
    stdout.print(escape(f"{out}: {len(means)} matrices from {tokens} tokens of {text}"))


@app.command()
def compare(
    run_a: Path = typer.Argument(..., help="A run's output folder (or its report.json)."),
    run_b: Path = typer.Argument(..., help="Another run's output folder (or its report.json)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Also write the comparison as Markdown here."),
) -> None:
    """Put two runs' reports side by side, variant by variant."""
    from evalsuite.compare import load_report, markdown, side_by_side
    from formats.outputs import Outputs, check_output_path

    head, rows = side_by_side(load_report(run_a), load_report(run_b))
    if out is not None:
        check_output_path(out, folder=False)
        with Outputs() as outputs:
            outputs.stage(out).write_text(markdown(run_a, run_b, head, rows), encoding="utf-8")
            outputs.commit()
    t = Table(title=Text(f"A: {run_a}   B: {run_b}"))
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    stdout.print(t)


@app.command()
def inspect(file: Path = typer.Argument(..., help="A .gguf or .safetensors file.")) -> None:
    """Show a model file's metadata and tensors: names, types, shapes, bits per weight."""
    from formats.inspect import inspect_file

    summary = inspect_file(file)
    scheme = f" ({summary.quantization})" if summary.quantization else ""
    stdout.print(f"[bold]{escape(str(summary.path))}[/bold]: {summary.format}{escape(scheme)}, {len(summary.tensors)} tensors, "
                 f"{summary.bits_per_weight:.3f} bits per weight")
    # Names and values come from the file: shown as plain text, never read as rich markup.
    if summary.metadata:
        meta = Table("key", "value", title="metadata")
        for key, value in summary.metadata.items():
            meta.add_row(Text(key), Text(value))
        stdout.print(meta)
    tensors = Table("name", "type", "shape", "bpw", title="tensors")
    for t in summary.tensors:
        tensors.add_row(Text(t.name), t.type, "x".join(map(str, t.shape)), f"{t.bits_per_weight:.3f}")
    stdout.print(tensors)


@app.command()
def fit(
    model: str = typer.Argument(..., help="A preset (e.g. llama-3.1-8b; --list shows them), a model folder or config.json, a GGUF file, or a Hugging Face id (org/name[@revision]; only its config.json is fetched)."),
    weights: str = typer.Option("bf16", "--weights", "-w", help="fp32 bf16 fp16 fp8 int8 int4 gptq awq, or a GGUF file type (q4_k_m, q8_0, ...)."),
    group_size: int = typer.Option(128, "--group-size", help="Group size of int4, gptq and awq weights."),
    kv_cache: str = typer.Option("fp16", "--kv-cache", help="KV-cache dtype: fp16 bf16 fp32 fp8 int8 int4."),
    context: int = typer.Option(8192, "--context", "-c", help="Tokens per user (prompt and output)."),
    users: int = typer.Option(1, "--users", "-u", help="Concurrent sequences."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="A catalog GPU (e.g. a100-40gb, rtx-4090) or custom:MEM_GIB,BANDWIDTH_GBS; default h100-80gb (with --quantizing: this machine's RAM)."),
    gpus: int = typer.Option(1, "--gpus", help="GPUs, with tensor parallelism."),
    engine: str = typer.Option("vllm", "--engine", help="vllm, llamacpp or transformers: how the engine sizes its memory."),
    quantizing: Optional[str] = typer.Option(None, "--quantizing", help="Instead: memory needed to quantize the model with rtn, gptq or awq."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (fields in docs/fit.md)."),
) -> None:
    """Will a model fit on a GPU: memory breakdown, how many users, how long a context, how fast."""
    import json

    from runner.fit.cli import fit_command

    result = fit_command(model, weights, group_size, kv_cache, context, users, gpu, gpus, engine, quantizing)
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        result.print(stdout)


@app.command()
def plan(
    model: str = typer.Argument(..., help="A preset (e.g. llama-3.1-8b), a model folder or config.json, a GGUF file, or a Hugging Face id."),
    users: int = typer.Option(..., "--users", "-u", help="Requests in flight at once."),
    prompt_tokens: int = typer.Option(..., "--prompt-tokens", help="Tokens per prompt."),
    output_tokens: int = typer.Option(..., "--output-tokens", help="Tokens per answer."),
    ttft: Optional[str] = typer.Option(None, "--ttft", help="Time to first token target, e.g. 500ms or 0.5s."),
    tpot: Optional[str] = typer.Option(None, "--tpot", help="Time per output token target, e.g. 30ms."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Catalog GPUs to consider, comma-separated, or custom:MEM_GIB,BANDWIDTH_GBS,TFLOPS (default: the whole catalogue)."),
    variants: Optional[Path] = typer.Option(None, "--variants", help="A recipe run's output folder: its variants (bytes, KV cache, exports, accuracy budget) are the candidates."),
    prefix_share: float = typer.Option(0.0, "--prefix-share", help="Share of each prompt already in the prefix cache (a shared system prompt), 0 to <1."),
    kv_cache: str = typer.Option("fp16", "--kv-cache", help="Without --variants: KV-cache dtypes to try, comma-separated (fp16, fp8, int8, int4)."),
    at: str = typer.Option("p99", "--at", help="Which prediction must meet the targets: p50 or p99."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (fields in docs/plan.md)."),
) -> None:
    """Plan a deployment against TTFT/TPOT targets: GPUs, variant, engine and its command, cost, co-located or disaggregated."""
    import json

    from runner.fit.gpus import split_gpus
    from runner.plan.cli import PlanRequest, parse_duration, plan_command

    request = PlanRequest(model, users, prompt_tokens, output_tokens, parse_duration("--ttft", ttft), parse_duration("--tpot", tpot),
                          split_gpus(gpu) if gpu else None, variants, prefix_share,
                          [k.strip() for k in kv_cache.split(",") if k.strip()], at)
    result = plan_command(request)
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        result.print(stdout)


# The engine's options, the same for every command that runs it (generate, bench).
_DTYPE = typer.Option("auto", "--dtype", help="Weights and activations: auto (the checkpoint's), bf16, fp16, fp32.")
_KV_DTYPE = typer.Option("auto", "--kv-cache-dtype", help="KV cache: auto (as --dtype), bf16, fp16, fp32, fp8 (e4m3), int8 or int4 (llama.cpp q8_0/q4_0 blocks).")
_BLOCK = typer.Option(None, "--block-size", help="Tokens per KV-cache block (default: 16 on a GPU, 128 on a CPU, as vLLM).")
_SEQS = typer.Option(256, "--max-num-seqs", help="Most sequences running at once.")
_TOKENS = typer.Option(2048, "--max-num-batched-tokens", help="Most tokens in one step (decode tokens and prompt chunks).")
_KV_MEMORY = typer.Option(None, "--kv-memory", help="KV pool: bytes (e.g. 2GiB, 512MiB) or a share of free memory (e.g. 0.3; default 0.5, capped at what --max-num-seqs sequences fill).")
_MAX_LEN = typer.Option(None, "--max-model-len", help="Longest sequence, prompt and output (default: the model's context).")
_SPEC = typer.Option(None, "--speculative", help="Guess tokens and verify them in one step: ngram (prompt lookup), or "
                     "draft=DIR (a smaller model with the same tokenizer, or a recipe's variant folder of this one), or "
                     "self=int4 (this model with its layers' weights rounded to 4 bits in memory; int2-int8); "
                     "',k=N' guesses per step (default 4).")
_PREFIX = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                       help="Share the KV blocks of prompts' common starts between requests.")
_EAGER = typer.Option(False, "--enforce-eager", help="No CUDA graphs: decode steps run op by op (a CPU always runs so).")


def _llm(model: Path, dtype: str, kv_cache_dtype: str, block_size: int | None, max_num_seqs: int, max_num_batched_tokens: int,
         kv_memory: Optional[str], max_model_len: Optional[int], enable_prefix_caching: bool,
         speculative: Optional[str] = None, enforce_eager: bool = False):
    from runner.engine.engine import parse_memory
    from runner.engine.llm import LLM

    return LLM(model, dtype, kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens,
               parse_memory(kv_memory) if kv_memory is not None else None, max_model_len,
               enable_prefix_caching=enable_prefix_caching, speculative=speculative, enforce_eager=enforce_eager)


@app.command()
def generate(
    model: Path = typer.Argument(..., help="A Hugging Face model folder or id (org/name[@revision]), a quantized one, a GGUF file (run dequantized), or a recipe's variant folder."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The text to continue."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 for greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(-1, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Makes sampling reproducible."),
    dtype: str = _DTYPE, kv_cache_dtype: str = _KV_DTYPE, block_size: int | None = _BLOCK, max_num_seqs: int = _SEQS,
    max_num_batched_tokens: int = _TOKENS, kv_memory: Optional[str] = _KV_MEMORY, max_model_len: Optional[int] = _MAX_LEN,
    enable_prefix_caching: bool = _PREFIX, speculative: Optional[str] = _SPEC, enforce_eager: bool = _EAGER,
) -> None:
    """Continue a prompt with the engine, streaming the text to the terminal."""
    from runner.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    llm = _llm(model, dtype, kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens, kv_memory, max_model_len,
               enable_prefix_caching, speculative, enforce_eager)
    sys.stdout.write(prompt)
    for piece in llm.stream(prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


@app.command()
def bench(
    model: Path = typer.Argument(..., help="A Hugging Face model folder or id (org/name[@revision]), a quantized one, a GGUF file (run dequantized), or a recipe's variant folder."),
    requests: int = typer.Option(32, "--requests", help="Requests in the workload."),
    concurrency: int = typer.Option(8, "--concurrency", help="Requests in flight at once (each finished one is replaced)."),
    prompt_tokens: str = typer.Option("32,64,128,256", "--prompt-tokens", help="Prompt lengths, in turn."),
    output_tokens: str = typer.Option("16,64,128,256", "--output-tokens", help="Output lengths, in turn (greedy, EOS ignored)."),
    text: Optional[Path] = typer.Option(None, "--text", help="Where prompts are cut from (default: the bundled evaluation text)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout (fields in docs/runner.md)."),
    dtype: str = _DTYPE, kv_cache_dtype: str = _KV_DTYPE, block_size: int | None = _BLOCK, max_num_seqs: int = _SEQS,
    max_num_batched_tokens: int = _TOKENS, kv_memory: Optional[str] = _KV_MEMORY, max_model_len: Optional[int] = _MAX_LEN,
    enable_prefix_caching: bool = _PREFIX, speculative: Optional[str] = _SPEC, enforce_eager: bool = _EAGER,
) -> None:
    """Measure the engine on a fixed workload: TTFT, TPOT, inter-token latency, tokens/s, KV blocks, memory."""
    import json

    from recipes.pipeline import progress_bar
    from runner.bench import Workload, run_bench

    workload = Workload(requests, concurrency, _lengths(prompt_tokens, "--prompt-tokens"), _lengths(output_tokens, "--output-tokens"))
    text = text or Path(__file__).parent / "bundled" / "eval.txt"
    runs = [None, speculative] if speculative else [None]  # with --speculative, plain decoding first: the baseline
    results = []
    with progress_bar(console) as progress:
        for spec in runs:
            llm = _llm(model, dtype, kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens, kv_memory,
                       max_model_len, enable_prefix_caching, spec, enforce_eager)
            task = progress.add_task("requests" + (f" ({spec})" if spec else ""), total=workload.requests)
            results.append(run_bench(llm, text, workload, lambda: progress.advance(task)))
            del llm
    result = results[-1]
    if speculative:
        result.speculative |= {"plain_output_tokens_per_s": results[0].output_tokens_per_s,
                               "speedup": result.output_tokens_per_s / results[0].output_tokens_per_s}
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
        return
    t = Table("", "mean", "median", "p99", title=Text(f"{model}: {result.requests} requests, {concurrency} at a time"))
    for name, s in (("TTFT", result.ttft_s), ("TPOT", result.tpot_s), ("inter-token", result.itl_s)):
        t.add_row(name, *(f"{v * 1000:,.1f} ms" for v in (s.mean, s.median, s.p99)))
    stdout.print(t)
    stdout.print(f"{result.output_tokens:,} output tokens in {result.seconds:.2f} s: {result.output_tokens_per_s:,.1f} tokens/s, "
                 f"{result.requests_per_s:.2f} requests/s; KV blocks at peak {result.kv_blocks_peak:,} of "
                 f"{result.kv_blocks_total:,}; {result.preemptions} preemptions; peak RSS {result.peak_rss_mib:,.0f} MiB")
    if result.speculative:
        s = result.speculative
        stdout.print(f"speculative {escape(s['method'])}, {s['guesses_per_step']} guesses a step: {s['acceptance_rate']:.1%} "
                     f"accepted; {s['speedup']:.2f}x plain decoding's {s['plain_output_tokens_per_s']:,.1f} tokens/s")


@app.command()
def serve(
    model: Path = typer.Argument(..., help="A Hugging Face model folder or id (org/name[@revision]), a recipe's variant folder, or its export."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Requests queued beyond the running ones before 429."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model's name in the API (default: the folder's, or the id)."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template", help="A Jinja chat template file (default: the tokenizer's, else plain 'Role: text')."),
    max_request_bytes: Optional[int] = typer.Option(None, "--max-request-bytes", help="Larger request bodies get 413 before parsing (default: 1 MiB + 64 bytes per token of context)."),
    dtype: str = _DTYPE, kv_cache_dtype: str = _KV_DTYPE, block_size: int | None = _BLOCK, max_num_seqs: int = _SEQS,
    max_num_batched_tokens: int = _TOKENS, kv_memory: Optional[str] = _KV_MEMORY, max_model_len: Optional[int] = _MAX_LEN,
    enable_prefix_caching: bool = _PREFIX, speculative: Optional[str] = _SPEC, enforce_eager: bool = _EAGER,
) -> None:
    """Serve a model with the engine behind an OpenAI-compatible API (completions, chat, streaming, /metrics)."""
    from formats.hub import hub_id
    from runner.server.serve import check_options
    from runner.server.serve import serve as run_server

    check_options(host, port, max_waiting, max_request_bytes)
    llm = _off_the_main_thread(lambda: _llm(model, dtype, kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens,
                                            kv_memory, max_model_len, enable_prefix_caching, speculative, enforce_eager))
    run_server(llm, host, port, served_model_name or (str(model) if hub_id(model) else model.resolve().name), api_key, max_waiting, chat_template,
               lambda line: console.print(escape(line), highlight=False), max_request_bytes)


def _off_the_main_thread(build):
    """``build()`` run on a thread that ends before serving starts. Each thread that runs torch ops
    gets its own OpenMP team, and libgomp counts every team's threads: once they outnumber the
    cores, it makes all of them sleep almost at once between parallel regions, so every small op
    of an engine step pays a wake-up. Built here, the model's team ends with its thread, and the
    engine thread's is the only one left."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = build()
        except BaseException as error:  # raised again on the calling thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="quantbench-load")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _lengths(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InputError(f"{flag} {text}: comma-separated whole numbers, e.g. 32,64,128") from None


def main() -> None:
    args = sys.argv[1:]
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    if args and not args[0].startswith("-") and args[0] not in commands:
        args = ["run", *args]
    try:
        app(args=args, prog_name="quantize")  # usage errors: typer prints them and exits with 2
    except InputError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)

if __name__ == "__main__":
    main()
