"""Latency under load: ``users`` requests always in flight (each finished one replaced at once, as
``quantize bench --concurrency`` and a busy service run them), served by continuous batching with
chunked prefill on one model copy, or by separate prefill and decode pools.

Co-located (Sarathi-Serve, vLLM's chunked prefill): every step carries one decode token of each
running sequence; while a prompt waits, the step also carries a chunk of it, filling the step's
token budget. Prompts that fit the step's room two or more at a time share steps (``_batched``:
a Poisson number per step, measured against vLLM CPU and our server by
bench/plan_validation.py); longer ones are prefilled one after another, first come first served:

- TTFT = the wait for the prompts ahead + the prompt's own chunks, each a *mixed* step;
- TPOT = the mean step: a mixed step when some prompt is being prefilled (a share ρ of the time,
  the prefill's utilisation), a pure decode step otherwise. The chunk's cost lands on every
  running user's TPOT; a bigger chunk serves prompts sooner and slows decode more.

Disaggregated (DistServe, Splitwise): prefill instances run whole prompts; the KV cache then
crosses the link to a decode instance, which runs pure decode steps. TTFT gains the transfer;
TPOT loses the prefill interference.

The closed loop ties it together: ``users = throughput x end-to-end latency`` (Little's law), and
the decode batch is the users in their decode phase. The wait for the prefill is that of an M/D/1
queue (Poisson arrivals, fixed service): mean ρS/(2(1-ρ)), an exponential tail of that mean (the
p50 and p99 below), capped at the other users' prompts (a closed loop cannot queue more). The p99 TPOT counts the mixed steps a request meets among its O-1 as binomial.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from runner.plan.roofline import Device, ModelWork, step_seconds

Z99 = 2.326  # the standard normal's 99th percentile


def end_to_end(ttft: float, tpot: float, output_tokens: int) -> float:
    """A request's latency: its first token at TTFT, each of the other O-1 one TPOT later
    (400 ms TTFT, 200 tokens at 25 ms: 0.4 + 199 x 0.025 = 5.375 s)."""
    return ttft + (output_tokens - 1) * tpot


@dataclass(frozen=True)
class Load:
    users: int  # requests in flight on this copy (or pool pair)
    prompt: int  # tokens per prompt
    output: int  # tokens per answer
    prefix_share: float = 0.0  # share of each prompt already in the prefix cache

    @property
    def new_tokens(self) -> int:
        """Prompt tokens to compute: the prefix cache holds the rest; the last token is always computed."""
        return max(1, math.ceil(self.prompt * (1 - self.prefix_share)))


@dataclass(frozen=True)
class Prediction:
    ttft_p50: float  # seconds
    ttft_p99: float
    tpot_p50: float  # seconds per output token after the first, per request
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float
    tokens_per_s: float  # output tokens per second of this copy (or pool pair)
    decode_batch: float  # sequences decoding together, on average
    prefill_busy: float  # share of time a prefill runs (per prefill instance)
    step_decode: float  # seconds of a pure decode step
    step_mixed: float  # seconds of a step carrying a prefill chunk (co-located), else the prefill itself
    chunk: int  # prefill tokens per step (co-located), 0 for disaggregated
    kv_transfer: float = 0.0  # seconds to move one prompt's KV cache (disaggregated)

    def as_dict(self) -> dict:
        return asdict(self)


def wait_quantile(rho: float, service: float, q: float) -> float:
    """The ``q`` quantile of the wait in an M/D/1 queue of utilisation ``rho`` and service time
    ``service``: P(wait > t) = ρ·exp(-ρt/mean), mean = ρS/(2(1-ρ)) (Pollaczek-Khinchine)."""
    if rho <= 0:
        return 0.0
    if rho >= 1:
        return math.inf
    if 1 - q >= rho:
        return 0.0
    mean = rho * service / (2 * (1 - rho))
    return mean / rho * math.log(rho / (1 - q))


def _mean_wait(rho: float, service: float, ahead: float) -> float:
    """M/D/1's mean wait, but never more than the ``ahead`` seconds of prompts that can be queued
    (the other users' own, in a closed loop: one user never waits)."""
    return min(rho * service / (2 * (1 - rho)), ahead)


def _closed_loop(users: int, service: float, servers: int, after_first: float) -> float:
    """Requests per second when ``users`` are always in flight, each taking the prefill wait and
    its ``service`` at one of ``servers`` queues, then ``after_first`` seconds (the mean case)."""
    cap = servers / service
    lo, hi = 0.0, cap
    for _ in range(60):
        rate = (lo + hi) / 2
        rho = rate * service / servers
        e2e = _mean_wait(rho, service, max(0, users - servers) * service / servers) + service + after_first
        lo, hi = (rate, hi) if rate * e2e < users else (lo, rate)
    return lo


def colocated(work: ModelWork, device: Device, load: Load, chunk: int) -> Prediction | None:
    """One copy serving ``load`` with chunked prefill of at most ``chunk`` tokens a step (decode
    tokens included, as vLLM's max_num_batched_tokens); None when the decode tokens alone fill it.
    Prompts short enough that several fit a step's room share steps (``batched``); longer ones
    are prefilled one after another, a chunk a step."""
    decode = float(load.users)
    if chunk - math.ceil(decode) < 1:
        return None
    batched = _batched(work, device, load, chunk)
    if batched is not None:
        return batched
    new, cached = load.new_tokens, load.prompt - load.new_tokens
    decode_context = load.prompt + load.output / 2
    rate = t_dec = t_mix = service = mean_step = 0.0
    for _ in range(40):
        budget = chunk - math.ceil(decode)
        if budget < 1:
            return None
        pieces = math.ceil(new / budget)
        piece = new / pieces
        t_dec = step_seconds(work, device, round(decode), decode_context)
        t_mix = step_seconds(work, device, round(decode), decode_context, piece, cached + new / 2)
        service = pieces * t_mix
        rate, mean_step = _solve(load, service, t_dec, t_mix)
        following = rate * (load.output - 1) * mean_step
        if abs(following - decode) < 1e-3:
            break
        decode = 0.5 * decode + 0.5 * min(following, load.users)
    rho = rate * service
    mixed = _mixed_share(rho, t_dec, t_mix)
    tpot99 = t_dec + (t_mix - t_dec) * min(1.0, mixed + Z99 * math.sqrt(mixed * (1 - mixed) / max(load.output - 1, 1)))
    ahead = (load.users - 1) * service
    ttft50 = service + min(wait_quantile(rho, service, 0.5), ahead)
    ttft99 = service + min(wait_quantile(rho, service, 0.99), ahead)
    return Prediction(ttft50, ttft99, mean_step, tpot99, end_to_end(ttft50, mean_step, load.output),
                      end_to_end(ttft99, tpot99, load.output), rate * load.output, decode, rho, t_dec, t_mix, chunk)


def _batched(work: ModelWork, device: Device, load: Load, chunk: int) -> Prediction | None:
    """Prompts that share steps: vLLM's scheduler and ours fill a step's token budget with every
    waiting prompt that fits, so a prompt never queues behind another while the step has room.

    In the closed loop a request is sent as another finishes, at the end of a step; by the time it
    reaches the server, the next step (the other users' decode) is under way, so it waits for that
    step, then is prefilled whole in the one after, with the prompts of the others that arrived
    meanwhile: TTFT is those two steps (one, for a single user, whose server is idle). A step
    carries on average ``m = rate x step`` prompts (Poisson); a request's own O-1 decode steps
    carry the other users' prompts, ``m (users-1)/users`` each on average, and its TPOT is their
    mean. Solved with the decode batch (Little's law) by fixed point. None where two prompts do
    not fit the room the decode tokens leave, or the prompts that arrive in a step at p99 would
    not: then they queue, as ``colocated`` models them one after another."""
    new, cached = load.new_tokens, load.prompt - load.new_tokens
    if 2 * new > chunk - 1:
        return None
    decode_context, chunk_context = load.prompt + load.output / 2, cached + new / 2
    others = (load.users - 1) / load.users

    def step(decode: float, prompts: float) -> float:
        return step_seconds(work, device, decode, decode_context, prompts * new, chunk_context, prompts)

    decode, rate, per_step, ttft, tpot = float(load.users), 0.0, 0.0, 0.0, 0.0
    for _ in range(60):
        costs = _StepCosts(step(decode, 0), step(decode, 1), step(decode, 2))
        lo, hi = 0.0, float(load.users)
        for _ in range(50):  # the prompts per step at which users = rate x (TTFT + (O-1) TPOT)
            per_step = (lo + hi) / 2
            rate = per_step / costs.mean(per_step)  # m prompts arrive during a step of the mean length
            tpot = costs.mean(per_step * others)
            ttft = costs.carrying(per_step * others) + (tpot if load.users > 1 else 0.0)
            lo, hi = (per_step, hi) if rate * end_to_end(ttft, tpot, load.output) < load.users else (lo, per_step)
        following = min(rate * (load.output - 1) * tpot, load.users - 1e-9)
        if abs(following - decode) < 1e-4:
            break
        decode = 0.5 * decode + 0.5 * following
    peak = per_step + Z99 * math.sqrt(per_step)
    if (1 + peak) * new > chunk - math.ceil(decode) or new > (chunk - math.ceil(decode)) / 2:
        return None
    busy = min(peak, load.users - 1) * others
    ttft99 = costs.carrying(busy) + (costs.mean(busy) if load.users > 1 else 0.0)
    tpot99 = costs.mean((per_step + Z99 * math.sqrt(per_step / max(load.output - 1, 1))) * others)
    return Prediction(ttft, ttft99, tpot, tpot99, end_to_end(ttft, tpot, load.output), end_to_end(ttft99, tpot99, load.output),
                      rate * load.output, decode, min(1.0, rate * (costs.one - costs.none)), costs.none, costs.one, chunk)


@dataclass(frozen=True)
class _StepCosts:
    """A step's seconds at one decode batch with no prompt, one, and two: affine from one prompt on
    (compute-bound), not below it, where a decode step can be bound by its reads instead."""

    none: float
    one: float
    two: float

    def carrying(self, others: float) -> float:
        """A step with one prompt and ``others`` more on average."""
        return self.one + others * (self.two - self.one)

    def mean(self, m: float) -> float:
        """The mean step when the prompts it carries are Poisson of mean ``m``."""
        some = 1 - math.exp(-m)  # P(at least one)
        return self.none + some * (self.one - self.none) + (m - some) * (self.two - self.one)


def _mixed_share(rho: float, t_dec: float, t_mix: float) -> float:
    """The share of steps carrying a chunk, when a prefill runs a share ``rho`` of the time."""
    mixed, pure = rho / t_mix, (1 - rho) / t_dec
    return mixed / (mixed + pure)


def _solve(load: Load, service: float, t_dec: float, t_mix: float) -> tuple[float, float]:
    """(requests per second, mean step) of the closed loop at a given decode batch."""
    lo, hi = 0.0, 1 / service
    step = t_dec
    for _ in range(60):
        rate = (lo + hi) / 2
        rho = rate * service
        mixed = _mixed_share(rho, t_dec, t_mix)
        step = mixed * t_mix + (1 - mixed) * t_dec
        e2e = _mean_wait(rho, service, (load.users - 1) * service) + service + (load.output - 1) * step
        lo, hi = (rate, hi) if rate * e2e < load.users else (lo, rate)
    return lo, step


def disaggregated(work: ModelWork, prefill: Device, prefill_instances: int, decode: Device, decode_instances: int,
                  load: Load, link: float, max_chunk: int = 8192) -> Prediction:
    """``prefill_instances`` copies on ``prefill`` devices run whole prompts (in pieces of at most
    ``max_chunk`` tokens); each prompt's KV cache crosses ``link`` (bytes/s) to one of
    ``decode_instances`` copies, which run pure decode steps."""
    new, cached = load.new_tokens, load.prompt - load.new_tokens
    pieces = math.ceil(new / max_chunk)
    service = pieces * step_seconds(work, prefill, 0, 0, new / pieces, cached + new / 2)
    transfer = work.kv_bytes(load.prompt) / link
    decode_context = load.prompt + load.output / 2
    batch = load.users / decode_instances
    rate = t_dec = 0.0
    for _ in range(40):
        t_dec = step_seconds(work, decode, max(1, round(batch)), decode_context)
        rate = _closed_loop(load.users, service, prefill_instances, transfer + (load.output - 1) * t_dec)
        following = rate * (load.output - 1) * t_dec / decode_instances
        if abs(following - batch) < 1e-3:
            break
        batch = 0.5 * batch + 0.5 * min(following, load.users / decode_instances)
    rho = rate * service / prefill_instances
    ahead = max(0, load.users - prefill_instances) * service / prefill_instances  # a router sends to an idle instance first
    ttft50 = service + transfer + min(wait_quantile(rho, service, 0.5), ahead)
    ttft99 = service + transfer + min(wait_quantile(rho, service, 0.99), ahead)
    return Prediction(ttft50, ttft99, t_dec, t_dec, end_to_end(ttft50, t_dec, load.output), end_to_end(ttft99, t_dec, load.output),
                      rate * load.output, batch, rho, t_dec, service, 0, transfer)
