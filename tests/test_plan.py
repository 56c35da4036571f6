"""`quantize plan`: the TTFT/TPOT arithmetic, the roofline against numbers worked by hand from the
model's config and the GPU's datasheet, the queue, the recommendation inside an accuracy budget,
the engine rule, refusals in one line, and the JSON."""

import json
import math
import statistics

import pytest

from helpers.cli import assert_user_error, quantize
from runner.fit.gpus import catalog, resolve_gpu
from runner.fit.model_shape import load_model_shape
from runner.plan.engines import choose_engine
from runner.plan.roofline import ALLREDUCE_LATENCY, STEP_OVERHEAD, Device, ModelWork, step_seconds
from runner.plan.serving import Load, colocated, disaggregated, end_to_end, wait_quantile
from runner.plan.variants import PlanVariant

# Llama-3.1-8B by hand (config.json): 32 layers, hidden 4096, 32 heads of 128, 8 KV heads, vocab
# 128256, untied head; 8,030,261,248 parameters (runner/fit/presets/SOURCES.md)
PARAMS = 8_030_261_248
EMBED = 128256 * 4096
KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # bytes in fp16
H100_BW, H100_FLOPS = 3350e9 * 0.8, 989.4e12 * 0.5  # the shares the roofline assumes


@pytest.mark.check
def test_the_worked_example_of_ttft_and_tpot():
    # 400 ms to the first token, then 199 more tokens at 25 ms: 5.375 s; at 50 ms: 10.35 s
    assert end_to_end(0.400, 0.025, 200) == pytest.approx(5.375, abs=1e-12)
    assert end_to_end(0.400, 0.050, 200) == pytest.approx(10.35, abs=1e-12)
    assert end_to_end(0.400, 0.050, 1) == 0.400  # one token: the first is all there is


@pytest.fixture(scope="module")
def llama8b():
    return load_model_shape("llama-3.1-8b")


def test_a_decode_step_reads_the_weights_and_the_cache_once(llama8b):
    work = ModelWork(llama8b, 2 * PARAMS, 16)
    device = Device(resolve_gpu("h100-80gb"))
    # batch 4 at 1,000 cached tokens each: bandwidth-bound (its FLOPs take a few microseconds)
    expected = (2 * PARAMS + 4 * 1000 * KV_PER_TOKEN) / H100_BW + STEP_OVERHEAD
    assert step_seconds(work, device, 4, 1000) == pytest.approx(expected, rel=1e-12)


def test_a_prefill_chunk_is_compute_bound(llama8b):
    work = ModelWork(llama8b, 2 * PARAMS, 16)
    device = Device(resolve_gpu("h100-80gb"))
    # 2,048 prompt tokens attending over 1,024 earlier ones on average: two FLOPs per multiplied
    # parameter (the untied embedding table is looked up, not multiplied), plus QKᵀ and AV
    flops = 2 * (PARAMS - EMBED) * 2048 + 4 * 32 * 128 * 2048 * 1024 * 32
    assert step_seconds(work, device, 0, 0, 2048, 1024) == pytest.approx(flops / H100_FLOPS + STEP_OVERHEAD, rel=1e-12)


def test_tensor_parallel_splits_the_bytes_and_adds_two_all_reduces_a_layer(llama8b):
    work = ModelWork(llama8b, 2 * PARAMS, 16, tp=2)
    gpu = resolve_gpu("h100-80gb")
    read = (2 * PARAMS / 2 + 1000 * KV_PER_TOKEN / 2) / H100_BW
    ring = ALLREDUCE_LATENCY + 2 * (2 - 1) / 2 * (1 * 4096 * 2) / gpu.interconnect
    assert step_seconds(work, Device(gpu, 2), 1, 1000) == pytest.approx(read + 2 * 32 * ring + STEP_OVERHEAD, rel=1e-12)


def test_a_cpu_engine_pays_per_step_and_per_sequence_outside_the_kernels(llama8b):
    work = ModelWork(llama8b, 2 * PARAMS, 16)
    gpu = resolve_gpu("h100-80gb")
    device = Device(gpu, step_overhead=0.030, sequence_overhead=0.0004)  # bench/plan_validation.py calibrates these
    # 8 decoding sequences and 3 prompts of 100 tokens in the step: 11 sequences' bookkeeping
    flops = 2 * (PARAMS - EMBED) * 308 + 4 * 32 * 128 * (8 * 1000 + 300 * 50) * 32
    read = 2 * PARAMS + 8 * 1000 * KV_PER_TOKEN + 3 * 50 * KV_PER_TOKEN
    kernels = max(read / H100_BW, flops / H100_FLOPS)
    assert step_seconds(work, device, 8, 1000, 300, 50, prompts=3) == pytest.approx(kernels + 0.030 + 11 * 0.0004, rel=1e-12)


def test_a_calibrated_curve_sets_the_matmul_rate_by_the_step_size(llama8b):
    """Two (tokens, share) points: the share at each, interpolated in log(tokens) between them,
    held beyond them; a prefill chunk's time follows the share at its own size."""
    work = ModelWork(llama8b, 2 * PARAMS, 16)
    gpu = resolve_gpu("h100-80gb")
    device = Device(gpu, flops_curve=((100, 0.2), (400, 0.4)))
    assert device.flops_at(100) == pytest.approx(0.2 * gpu.flops) and device.flops_at(10) == pytest.approx(0.2 * gpu.flops)
    assert device.flops_at(200) == pytest.approx(0.3 * gpu.flops)  # halfway in log(tokens)
    assert device.flops_at(400) == device.flops_at(4000) == pytest.approx(0.4 * gpu.flops)
    assert Device(gpu).flops_at(200) == Device(gpu).flops  # no curve: the one share
    flops = 2 * (PARAMS - EMBED) * 200 + 4 * 32 * 128 * 200 * 100 * 32
    assert step_seconds(work, device, 0, 0, 200, 100) == pytest.approx(flops / (0.3 * gpu.flops) + STEP_OVERHEAD, rel=1e-12)


@pytest.mark.check
def test_short_prompts_share_steps_with_the_decode_batch(llama8b):
    work = ModelWork(llama8b, 2 * PARAMS, 16)
    device = Device(resolve_gpu("h100-80gb"))
    one = colocated(work, device, Load(1, 200, 100), 2048)
    # one user: its prompt alone in a step on an idle server; then pure decode steps
    assert one.ttft_p50 == one.ttft_p99 == pytest.approx(one.step_mixed)
    assert one.tpot_p50 == pytest.approx(one.step_decode)
    p = colocated(work, device, Load(64, 200, 100), 2048)
    others = 63 / 64
    rate = p.tokens_per_s / 100

    def step(prompts: int) -> float:
        return step_seconds(work, device, p.decode_batch, 250, prompts * 200, 100, prompts)

    def mean_step(mean: float) -> float:  # over Poisson(mean) prompts, a step's cost affine from one prompt on
        return sum(math.exp(-mean) * mean**k / math.factorial(k) * (step(0) if k == 0 else step(1) + (k - 1) * (step(2) - step(1)))
                   for k in range(60))

    assert (p.step_decode, p.step_mixed) == (pytest.approx(step(0)), pytest.approx(step(1)))
    assert p.prefill_busy == pytest.approx(rate * (step(1) - step(0)))  # the prompts' share of the time
    m = 0.0  # prompts a step carries on average (Poisson): those that arrive during a step of the mean length
    for _ in range(200):
        m = rate * mean_step(m)
    # TPOT: the mean step, carrying the other users' prompts; TTFT: the step under way, then its own with the others'
    assert p.tpot_p50 == pytest.approx(mean_step(m * others), rel=1e-6)
    assert p.ttft_p50 == pytest.approx(p.tpot_p50 + step(1) + m * others * (step(2) - step(1)), rel=1e-6)
    assert rate * p.e2e_p50 == pytest.approx(64, rel=1e-3)  # Little's law: users = throughput x latency
    assert p.ttft_p99 > p.ttft_p50 and p.tpot_p99 > p.tpot_p50
    # a prompt longer than half the step's room is prefilled one after another: the M/D/1 queue
    long = colocated(work, device, Load(64, 1500, 100), 2048)
    assert long.step_mixed > p.step_mixed and long.prefill_busy < 1


def _simulated_closed_loop(work: ModelWork, device: Device, users: int, prompt: int, answers: list[int]) -> dict:
    """A continuously batched server, step by step: each step decodes a token of every running
    sequence and prefills whole every prompt that arrived before it began; a request is sent as
    the user's last one ends, so it reaches the server during the next step and joins the one
    after (at once where the server is idle). Step costs are the roofline's at the step's real
    decode batch and prompt count. Medians of TTFT and TPOT after the first wave."""
    context = prompt + sum(answers) / len(answers) / 2
    left, first, ttft, tpot = {}, {}, [], []
    sent_at = dict.fromkeys(range(users), 0.0)
    waiting, sent, now, issued, finished = list(range(users)), [], 0.0, 0, 0
    while finished < len(answers) - users:
        joining, waiting, sent = waiting, sent, []
        if not left and not joining:  # an idle server starts the next step when the request arrives
            joining, waiting = waiting, []
        now += step_seconds(work, device, len(left), context, len(joining) * prompt, prompt / 2, len(joining)) \
            if joining else step_seconds(work, device, len(left), context)
        done = [u for u in left if left[u] == 1]
        for u in left:
            left[u] -= 1
        for u in joining:
            left[u], first[u] = answers[issued] - 1, (now, answers[issued], issued >= users)
            ttft.append((issued >= users, now - sent_at[u]))
            issued += 1
        for u in done:
            start, length, counted = first[u]
            tpot.append((counted, (now - start) / (length - 1)))
            del left[u]
            finished += 1
            sent_at[u] = now
            if issued < len(answers):
                sent.append(u)
    return {name: statistics.median(v for counted, v in pairs if counted) for name, pairs in (("ttft", ttft), ("tpot", tpot))}


@pytest.mark.check
@pytest.mark.parametrize("users", [1, 8, 32, 64])
def test_the_serving_model_matches_a_simulated_closed_loop_of_independent_users(llama8b, users):
    """The batched model (a Poisson number of prompts per step, the wait for the step under way,
    Little's law for the decode batch) against the server it describes, simulated with the same
    step costs, TTFT within 15% (a median of whole steps) and TPOT within 5%. Answers of random
    length, as real users' are: with answers of 75, 100 and 125 tokens in turn the users fall
    into lock-step, prompts arrive in bursts, and the simulated TTFT is 1.3x the model's at 8
    users and 1.8-3.7x at 32-128 (docs/plan.md)."""
    import random

    work, device = ModelWork(llama8b, 2 * PARAMS, 16), Device(resolve_gpu("h100-80gb"))
    draw = random.Random(users)
    answers = [draw.randint(50, 150) for _ in range(users * 40)]
    predicted = colocated(work, device, Load(users, 200, 100), 2048)
    simulated = _simulated_closed_loop(work, device, users, 200, answers)
    assert predicted.ttft_p50 == pytest.approx(simulated["ttft"], rel=0.15)
    assert predicted.tpot_p50 == pytest.approx(simulated["tpot"], rel=0.05)


def test_the_prefill_queue_is_m_d_1():
    assert wait_quantile(0.3, 1.0, 0.5) == 0  # most requests find the prefill free
    mean = 0.9 / (2 * 0.1)  # Pollaczek-Khinchine, deterministic service
    assert wait_quantile(0.9, 1.0, 0.99) == pytest.approx(mean / 0.9 * math.log(0.9 / 0.01))
    assert wait_quantile(1.0, 1.0, 0.5) == math.inf


def test_one_user_waits_for_nothing_and_a_full_load_obeys_littles_law(llama8b):
    work = ModelWork(llama8b, 2 * PARAMS, 16)
    device = Device(resolve_gpu("h100-80gb"))
    one = colocated(work, device, Load(1, 1000, 200), 2048)
    assert one.ttft_p50 == one.ttft_p99 == pytest.approx(one.step_mixed)  # one chunk; one user never queues
    assert one.tpot_p50 == pytest.approx(one.step_decode, rel=0.05)
    many = colocated(work, device, Load(128, 1000, 200), 2048)
    rate = many.tokens_per_s / 200
    service = many.step_mixed  # 1,000 tokens fit one chunk
    mean_e2e = min(many.prefill_busy * service / (2 * (1 - many.prefill_busy)), 127 * service) + service + 199 * many.tpot_p50
    assert rate * mean_e2e == pytest.approx(128, rel=1e-3)  # users = throughput x latency
    assert many.tpot_p99 >= many.tpot_p50 > one.tpot_p50  # a bigger batch, and prefill chunks among the steps
    # a prefix cache holding 60% of each prompt cuts the prefill, so TTFT
    cached = colocated(work, device, Load(128, 1000, 200, 0.6), 2048)
    assert cached.ttft_p99 < many.ttft_p99


def test_disaggregated_ttft_includes_the_kv_transfer(llama8b):
    work = ModelWork(llama8b, 2 * PARAMS, 16)
    device = Device(resolve_gpu("h100-80gb"))
    p = disaggregated(work, device, 1, device, 1, Load(1, 4000, 100), 450e9)
    assert p.kv_transfer == pytest.approx(4000 * KV_PER_TOKEN / 450e9)
    assert p.ttft_p50 == pytest.approx(p.step_mixed + p.kv_transfer)  # no queue for one user
    assert p.tpot_p50 == p.tpot_p99 == p.step_decode  # decode never meets a prefill


def _report(tmp_path, variants, budget=True):
    """A recipe run's report.json for Llama-3.1-8B (sizes of its real exports' bits per weight)."""
    rows = [{"name": "original", "method": "source (bfloat16)", "bits_per_weight": 16.0, "size_mb": PARAMS * 2 / 1e6,
             "kld": None, "files": []}]
    misses = {}
    for name, method, bpw, files, missed in variants:
        rows.append({"name": name, "method": method, "bits_per_weight": bpw, "size_mb": PARAMS * bpw / 8e6, "kld": 0.01,
                     "files": [{"path": f, "bytes": 1} for f in files]})
        misses[name] = missed
    report = {"model": "llama", "variants": rows,
              "recommendation": {"budget": {"kld": 0.02} if budget else None, "misses": misses if budget else {}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    return tmp_path


def test_the_cheapest_variant_inside_the_budget_is_recommended_and_cheaper_ones_say_why(monkeypatch, capsys, tmp_path):
    run = _report(tmp_path, [
        ("w4-gptq", "gptq int4-g128-sym", 4.6, ["w4-gptq/compressed-tensors"], []),
        ("w3-gguf", "gguf Q3_K_S", 3.6, ["w3-gguf/m-Q3_K_S.gguf"], ["KLD 0.0900 > 0.02"]),
        ("w4-rtn", "rtn int4-g128-sym", 4.5, ["w4-rtn/safetensors"], []),  # no export vLLM serves at 4 bits
    ])
    # short prompts, long answers, a tight TPOT: decode-bound, where fewer bytes mean fewer GPUs
    code, out, err = quantize(monkeypatch, capsys, "plan", "llama-3.1-8b", "--users", "32", "--prompt-tokens", "200",
                              "--output-tokens", "400", "--ttft", "2s", "--tpot", "40ms", "--gpu", "l4",
                              "--variants", run, "--json")
    assert code == 0, err
    plan = json.loads(out)
    rec = plan["recommendation"]
    assert rec["variant"] == "w4-gptq" and rec["meets"] and rec["bytes_measured"]
    assert rec["weights_bytes"] == pytest.approx(PARAMS * 4.6 / 8)
    assert plan["engine"]["engine"] == "vllm"
    assert str(run / "w4-gptq" / "compressed-tensors") in plan["engine"]["commands"][0]
    # the 3-bit file is as cheap or cheaper and misses the accuracy budget
    cheaper = {c["variant"]: c["fails"] for c in plan["cheaper_failing"]}
    assert any("outside the accuracy budget: KLD 0.0900 > 0.02" in f for f in cheaper["w3-gguf"])
    rtn = [c for c in plan["candidates"] if c["variant"] == "w4-rtn"]
    assert rtn and all("no export an engine serves" in c["fails"][0] for c in rtn)
    p = rec["prediction"]
    assert p["e2e_p50"] == pytest.approx(p["ttft_p50"] + 399 * p["tpot_p50"])
    assert p["ttft_p99"] <= 2.0 and p["tpot_p99"] <= 0.040
    original = [c for c in plan["candidates"] if c["variant"] == "original" and c["layout"] == "colocated"][0]
    assert original["cost_per_hour"] > rec["cost_per_hour"]  # 16-bit weights need more L4s for the same TPOT
    assert rec["cost_per_hour"] == pytest.approx(rec["gpus"] * catalog()["l4"].price_per_hour)
    assert rec["cost_per_million_tokens"] == pytest.approx(rec["cost_per_hour"] / (rec["tokens_per_s"] * 3600) * 1e6)
    assert {"split_pays_from_users", "by_load"} <= set(plan["disaggregation"])


def test_one_user_on_a_laptop_gets_ollama_with_the_gguf_file(tmp_path):
    gguf = tmp_path / "q4" / "m-Q4_K_M.gguf"
    variant = PlanVariant("q4", "gguf Q4_K_M", 4.9e9, "fp16", {"gguf": gguf})
    choice = choose_engine("m", variant, resolve_gpu("apple-m4-pro-64gb"), 1, 1, 1, 4096, 2048)
    assert choice.engine == "ollama"
    assert choice.commands == [f"ollama create m-q4_k_m -f {tmp_path / 'q4' / 'm-Q4_K_M.Modelfile'}", "ollama run m-q4_k_m"]
    split = choose_engine("m", PlanVariant("w4", "gptq int4", 5e9, "fp8", {"compressed-tensors": tmp_path / "w4"}),
                          resolve_gpu("h100-80gb"), 2, 1, 64, 8192, 2048, disaggregated=(2, 3))
    assert split.engine == "sglang-pd" and any("--disaggregation-mode prefill" in c for c in split.commands)
    assert any("--kv-cache-dtype fp8_e4m3" in c for c in split.commands)


def test_the_cli_prints_the_plan_and_its_command(monkeypatch, capsys):
    code, out, err = quantize(monkeypatch, capsys, "plan", "qwen2.5-0.5b", "--users", "4", "--prompt-tokens", "500",
                              "--output-tokens", "100", "--ttft", "500ms", "--tpot", "30ms", "--gpu", "l4,a10")
    assert code == 0, err
    assert "recommended" in out and "vllm serve Qwen/Qwen2.5-0.5B" in out and "TTFT" in out


@pytest.mark.check
def test_a_custom_device_keeps_its_commas_in_a_list_of_gpus(monkeypatch, capsys):
    from runner.fit.gpus import split_gpus

    assert split_gpus("l4, a10") == ["l4", "a10"]
    assert split_gpus("custom:48,960,100,l4") == ["custom:48,960,100", "l4"]
    assert split_gpus("custom:48,960,l4") == ["custom:48,960", "l4"]
    code, out, err = quantize(monkeypatch, capsys, "plan", "qwen2.5-0.5b", "--users", "2", "--prompt-tokens", "200",
                              "--output-tokens", "50", "--tpot", "1s", "--gpu", "custom:64,50,2", "--json")
    assert code == 0, err
    assert json.loads(out)["recommendation"]["gpu"] == "custom:64,50,2"


@pytest.mark.parametrize("args, fragments", [
    (["--prompt-tokens", "40000", "--output-tokens", "200", "--tpot", "30ms"], ["40,200 tokens exceeds", "context of 32,768",
                                                                               "at most 32,568 tokens"]),
    (["--prompt-tokens", "500", "--output-tokens", "100", "--tpot", "0.05ms"], ["no candidate meets the targets", "relax --tpot to at least"]),
    (["--prompt-tokens", "500", "--output-tokens", "100"], ["no target: give --ttft, --tpot"]),
    (["--prompt-tokens", "500", "--output-tokens", "100", "--ttft", "soon"], ["--ttft soon: a positive duration"]),
    (["--prompt-tokens", "500", "--output-tokens", "100", "--ttft", "1s", "--prefix-share", "1"], ["--prefix-share 1.0"]),
    (["--prompt-tokens", "500", "--output-tokens", "100", "--ttft", "1s", "--gpu", "h1000"], ["--gpu h1000: unknown GPU"]),
])
def test_refusals_are_one_line_naming_what_to_relax(monkeypatch, capsys, args, fragments):
    assert_user_error(quantize(monkeypatch, capsys, "plan", "qwen2.5-0.5b", "--users", "8", *args), *fragments)


def test_a_gguf_file_given_as_the_model_is_the_file_its_engine_serves(monkeypatch, capsys, tmp_path):
    """Planning a GGUF file itself (no recipe run): it is the variant, and the commands load it."""
    from conftest import TINY
    from formats.hf import HFCheckpoint
    from recipes.variants import build_variant, gguf_variant

    path = tmp_path / "tiny-Q4_K_M.gguf"
    build_variant(HFCheckpoint.open(TINY), gguf_variant("Q4_K_M"), tmp_path, gguf_path=path)
    for gpu, users, engine in (("apple-m4-pro-64gb", 1, "ollama"), ("apple-m4-pro-64gb", 4, "llama.cpp"), ("l4", 4, "llama.cpp")):
        code, out, err = quantize(monkeypatch, capsys, "plan", str(path), "--users", str(users), "--prompt-tokens", "200",
                                  "--output-tokens", "50", "--tpot", "1s", "--gpu", gpu, "--json")
        assert code == 0, err
        chosen = json.loads(out)["engine"]
        assert chosen["engine"] == engine and chosen["weights"] == str(path), chosen
        assert str(path.with_suffix(".Modelfile" if engine == "ollama" else ".gguf")) in " ".join(chosen["commands"])
    bare = tmp_path / "bare" / "model.gguf"  # a GGUF file from elsewhere, no Modelfile beside it
    bare.parent.mkdir()
    bare.write_bytes(path.read_bytes())
    code, out, err = quantize(monkeypatch, capsys, "plan", str(bare), "--users", "1", "--prompt-tokens", "200",
                              "--output-tokens", "50", "--tpot", "1s", "--gpu", "apple-m4-pro-64gb", "--json")
    commands = json.loads(out)["engine"]["commands"]
    assert commands[0] == f"printf 'FROM %s\\n' {bare} > {bare.with_suffix('.Modelfile')}" and commands[1].startswith("ollama create")
