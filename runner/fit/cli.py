"""``quantize fit``: check the options, run the calculator, show its working."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from core.errors import InputError
from runner.fit.gpus import GIB, resolve_gpu
from runner.fit.memfit import ENGINES, KV_BITS, WEIGHT_FORMATS, FitQuery, FitResult, fit
from runner.fit.model_shape import load_model_shape
from runner.fit.quantize_memory import QuantizingMemory, quantizing_memory

_LIMITS = {"--context": (1, 10_000_000), "--users": (1, 1_000_000), "--gpus": (1, 4096), "--group-size": (1, 65536)}


@dataclass
class FitOutput:
    """What ``quantize fit`` prints: a serving fit, or the memory of a quantization run."""

    result: FitResult | QuantizingMemory
    model: str

    def as_dict(self) -> dict:
        return self.result.as_dict()

    def print(self, console: Console) -> None:
        if isinstance(self.result, QuantizingMemory):
            _print_quantizing(console, self.model, self.result)
        else:
            _print_fit(console, self.result)


DEFAULT_GPU = "h100-80gb"


def fit_command(model: str, weights: str, group_size: int, kv_cache: str, context: int, users: int,
                gpu: str | None, gpus: int, engine: str, quantizing: str | None) -> FitOutput:
    """Without ``gpu``, serving is sized for DEFAULT_GPU and quantizing for this machine's RAM."""
    for flag, value in (("--context", context), ("--users", users), ("--gpus", gpus), ("--group-size", group_size)):
        low, high = _LIMITS[flag]
        if not low <= value <= high:
            raise InputError(f"{flag} {value}: must be between {low} and {high:,}")
    if weights.lower() not in WEIGHT_FORMATS:
        raise InputError(f"--weights {weights}: unknown format (one of {', '.join(WEIGHT_FORMATS)})")
    if kv_cache not in KV_BITS:
        raise InputError(f"--kv-cache {kv_cache}: unknown (one of {', '.join(KV_BITS)})")
    if engine not in ENGINES:
        raise InputError(f"--engine {engine}: unknown (one of {', '.join(ENGINES)})")
    if quantizing is not None and quantizing not in ("rtn", "gptq", "awq"):
        raise InputError(f"--quantizing {quantizing}: one of rtn, gptq, awq")
    device = resolve_gpu(gpu) if gpu else None
    shape = load_model_shape(model)
    if quantizing is not None:
        memory = quantizing_memory(shape, quantizing)
        memory.machine_bytes = device.memory_bytes if device else _ram_bytes()
        memory.fits = memory.peak_bytes <= memory.machine_bytes
        return FitOutput(memory, shape.name)
    query = FitQuery(weights, group_size, kv_cache, context, users, device or resolve_gpu(DEFAULT_GPU), gpus, ENGINES[engine])
    return FitOutput(fit(shape, query), shape.name)


def _ram_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _print_fit(console: Console, r: FitResult) -> None:
    q = r.query
    per = f" per GPU (x{q['gpus']}, tensor parallel)" if q["gpus"] > 1 else ""
    console.print(f"[bold]{escape(r.model)}[/bold]: {r.parameters / 1e9:.2f}B parameters, {r.weights_format} "
                  f"({r.bits_per_weight:.2f} bits per weight), KV cache {r.kv_cache_dtype}, {q['users']} user(s) x "
                  f"{q['context']:,} tokens on {q['gpu']}{per}, engine {q['engine']}")
    t = Table("memory" + per, "bytes", "", title=None)
    t.add_row("weights", _gib(r.weights_bytes / q["gpus"]), f"{r.weights_bytes / q['gpus'] / 2**20:,.0f} MiB")
    t.add_row("KV cache per token", f"{r.kv_bytes_per_token / 1024:,.1f} KiB", "every layer holding it")
    t.add_row("KV cache per user", _gib(r.kv_bytes_per_sequence), f"{q['context']:,} tokens")
    t.add_row("KV cache, all users", _gib(r.kv_bytes_total), "")
    t.add_row("activations / compute buffer", _gib(r.activation_bytes), "")
    t.add_row("runtime overhead", _gib(r.overhead_bytes), "")
    t.add_row("[bold]total[/bold]", f"[bold]{_gib(r.total_bytes)}[/bold]", f"of {_gib(r.usable_bytes)} usable")
    t.add_row("free" if r.fits else "[red]short[/red]", _gib(abs(r.free_bytes)), "")
    console.print(t)
    verdict = "[green]fits[/green]" if r.fits else "[red]does not fit[/red]"
    console.print(f"{verdict}; at most {r.max_users:,} users at {q['context']:,} tokens; at most "
                  f"{r.max_context:,} tokens for {q['users']} user(s)"
                  + (f" (memory would allow {r.max_context_by_memory:,})" if r.max_context_by_memory > r.max_context else ""))
    console.print(f"decode ceiling (memory bandwidth): {r.decode_tokens_per_s_max:,.1f} tokens/s for one user, "
                  f"{r.decode_tokens_per_s_total:,.1f} tokens/s for {q['users']} user(s) together")
    if r.prefill_seconds is not None:
        console.print(f"prefill of {q['context']:,} tokens: about {r.prefill_seconds:.2f} s (at half the peak FLOPs)")
    console.print(f"smallest catalog GPU that fits ({q['gpus']} of them): {r.smallest_gpu or 'none'}")


def _print_quantizing(console: Console, model: str, m: QuantizingMemory) -> None:
    t = Table("while quantizing with " + m.method, "memory", title=Text(model))
    for part, size in m.breakdown.items():
        t.add_row(part, _gib(size))
    t.add_row("[bold]peak[/bold]", f"[bold]{_gib(m.peak_bytes)}[/bold]")
    console.print(t)
    verdict = "[green]fits[/green]" if m.fits else "[red]does not fit[/red]"
    console.print(f"{verdict} in {_gib(m.machine_bytes)}")
