"""The engine (runner/engine/) against transformers: greedy tokens equal `generate`'s, whatever the
block size, the prefill chunking or preemption; every block free after every run; the cache's
bytes per token those of `quantize fit`; sampling reproducible by seed; bad requests refused."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY
from core.errors import InputError
from helpers.engine import OUTPUT, greedy, prompts_from_text, random_model, transformers_greedy
from runner import LLM, SamplingParams

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {
        "llama-tied": TINY,
        "llama-untied": random_model(root / "llama", "llama"),
        "mistral": random_model(root / "mistral", "mistral", sliding_window=24),  # windows shorter than the sequences
        "qwen2": random_model(root / "qwen2", "qwen2"),  # q/k/v biases
        # heads of 64 channels, which llama.cpp's quantized caches rotate
        "qwen2-wide": random_model(root / "qwen2-wide", "qwen2", hidden_size=256, intermediate_size=256),
    }


@pytest.fixture(scope="module")
def prompts():
    return prompts_from_text()


# the bundled model in the fast tier: the engine's tokens against transformers' on what users serve first
@pytest.mark.parametrize("name", [pytest.param("llama-tied", marks=pytest.mark.check), "llama-untied", "mistral", "qwen2"])
def test_greedy_tokens_equal_transformers_generate(models, prompts, name):
    ours, _ = greedy(models[name], prompts)
    assert ours == transformers_greedy(models[name], prompts)


@pytest.mark.parametrize("engine", [
    {"block_size": 1}, {"block_size": 7}, {"block_size": 64},
    {"max_num_batched_tokens": 8},  # every prompt longer than 8 is prefilled in chunks, beside decoding sequences
    {"max_num_seqs": 3},
])
def test_block_size_chunking_and_batch_limits_change_no_token(models, prompts, engine):
    reference, _ = greedy(models["llama-untied"], prompts)
    assert greedy(models["llama-untied"], prompts, **engine)[0] == reference


def test_preemption_recomputes_to_the_same_tokens(models, prompts):
    reference, _ = greedy(models["mistral"], prompts)
    from formats.hf import HFCheckpoint
    from runner.engine.kv_cache import bytes_per_token

    per_block = bytes_per_token(HFCheckpoint.open(models["mistral"]).arch, "fp32") * 16
    ours, llm = greedy(models["mistral"], prompts, kv_memory=12 * per_block, max_model_len=128, block_size=16)  # 12 blocks for 16 prompts
    assert llm.engine.scheduler.preemptions > 0
    assert ours == reference


def test_the_cache_costs_what_quantize_fit_says(models):
    from runner.engine.kv_cache import bytes_per_token
    from runner.fit.memfit import kv_bytes_per_token
    from runner.fit.model_shape import load_model_shape

    for name in models:
        shape = load_model_shape(str(models[name]))
        for kv in ("fp16", "bf16", "fp32", "fp8", "int8", "int4"):
            assert bytes_per_token(shape.arch, kv) == kv_bytes_per_token(shape, kv, 1)
    llm = LLM(TINY, kv_memory=8 * 2**20, block_size=16)
    per_block = 16 * kv_bytes_per_token(load_model_shape(str(TINY)), "bf16", 1)
    assert llm.engine.pool.nbytes == (llm.engine.blocks.num_blocks + 1) * per_block  # and one scratch block
    assert llm.engine.pool.nbytes <= 8 * 2**20


def test_sampling_is_reproducible_by_seed_whatever_shares_the_batch(prompts):
    llm = LLM(TINY, dtype="fp32", kv_memory=16 * 2**20)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(prompts[1], params)[0].token_ids
    crowd = llm.generate(prompts[:6], [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)])
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (5, 6)]
    together = llm.generate([prompts[0], prompts[1], prompts[2]], [others[0], params, others[1]])[1].token_ids
    assert alone == together and len(alone) == 12
    other = llm.generate(prompts[1], SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=99, ignore_eos=True))
    assert other[0].token_ids != alone
    assert len({tuple(o.token_ids) for o in crowd}) == 6


def test_stops_finish_reasons_logprobs_and_text(prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(TINY, dtype="fp32", kv_memory=16 * 2**20)
    free = llm.generate(prompts[4], SamplingParams(max_tokens=16, temperature=0, logprobs=0, ignore_eos=True))[0]
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[4] + free.token_ids])).logits[0, len(prompts[4]) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(free.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(free.logprobs), expected, atol=1e-4, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    assert free.text == tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop_token = free.token_ids[5]
    by_token = llm.generate(prompts[4], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_token], ignore_eos=True))[0]
    assert by_token.finish_reason == "stop" and by_token.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
    word = free.text.split()[2]
    by_string = llm.generate(prompts[4], SamplingParams(max_tokens=16, temperature=0, stop=[word], ignore_eos=True))[0]
    assert by_string.finish_reason == "stop" and by_string.text == free.text[: free.text.index(word)]
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    assert free.metrics.ttft_s > 0 and free.metrics.tpot_s > 0 and free.metrics.e2e_s >= free.metrics.ttft_s


def test_a_request_ended_early_frees_its_blocks_at_once(prompts):
    llm = LLM(TINY, dtype="fp32", kv_memory=16 * 2**20)
    engine = llm.engine
    seqs = [engine.add(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)) for p in prompts[:4]]
    for _ in range(5):
        engine.step()
    free, holds = engine.blocks.num_free, len(seqs[1].block_table)
    assert holds > 0
    engine.finish(seqs[1])
    assert engine.blocks.num_free == free + holds
    assert seqs[1].finish_reason == "abort" and not seqs[1].block_table
    while engine.unfinished:
        engine.step()
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("build, fragment", [
    (lambda m: LLM(m["gpt2"]), "is not one the engine runs"),
    (lambda m: LLM(TINY, kv_memory=1024), "one sequence of max_model_len 2048 needs"),
    (lambda m: LLM(TINY, max_model_len=4096), "longer than the model's context (2048 tokens)"),
    (lambda m: LLM(TINY, kv_memory=2**20, max_model_len=64).generate([[1] * 64]), "leaves no room in the context of 64"),
    (lambda m: SamplingParams(max_tokens=0), "max_tokens 0: must be 1 or more"),
    (lambda m: SamplingParams(top_p=0), "top_p 0"),
    (lambda m: LLM(TINY, kv_memory=2**20, max_model_len=64).generate([[9000]]), "outside the vocabulary"),
])
def test_bad_requests_get_one_line(models, tmp_path, build, fragment):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=256, n_positions=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(InputError) as e:
        build({**models, "gpt2": tmp_path / "gpt2"})
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_generate_streams_what_the_engine_returns(monkeypatch, capsys):
    from helpers.cli import quantize

    code, out, err = quantize(monkeypatch, capsys, "generate", TINY, "--prompt", "It was a truth", "--max-tokens", "12",
                              "--dtype", "fp32", "--kv-memory", "16MiB")
    assert code == 0, err
    expected = LLM(TINY, dtype="fp32", kv_memory=16 * 2**20).generate("It was a truth", SamplingParams(max_tokens=12, temperature=0))[0]
    assert out == "It was a truth" + expected.text + "\n"


def test_bench_reports_the_workload_it_ran(monkeypatch, capsys):
    import json

    from helpers.cli import quantize

    code, out, err = quantize(monkeypatch, capsys, "bench", TINY, "--requests", "6", "--concurrency", "2",
                              "--prompt-tokens", "8,16", "--output-tokens", "4,6", "--kv-memory", "16MiB", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["requests"] == 6 and result["output_tokens"] == 3 * 4 + 3 * 6
    assert 0 < result["ttft_s"]["median"] <= result["ttft_s"]["p99"] and result["tpot_s"]["mean"] > 0
    assert 0 < result["kv_blocks_peak"] <= result["kv_blocks_total"] and result["peak_rss_mib"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(result["output_tokens"] / result["seconds"])


@pytest.mark.parametrize("args, fragment", [
    (["generate", TINY, "--prompt", "x", "--max-tokens", "0"], "max_tokens 0"),
    (["generate", TINY, "--prompt", "x", "--kv-memory", "lots"], "--kv-memory lots"),
    (["bench", TINY, "--prompt-tokens", "8,a"], "--prompt-tokens 8,a"),
    (["bench", TINY, "--requests", "0"], "--requests 0"),
])
def test_engine_commands_refuse_bad_options_in_one_line(monkeypatch, capsys, args, fragment):
    from helpers.cli import assert_user_error, quantize

    assert_user_error(quantize(monkeypatch, capsys, *args), fragment)


@pytest.mark.parametrize("cache", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("name", ["llama-tied", "qwen2-wide"])
def test_a_quantized_cache_computes_what_the_recipe_simulation_scored(models, prompts, name, cache):
    """The engine stores q8_0/q4_0 blocks (or e4m3 values) and attends from them; the recipe's
    kv_cache simulation (quant/kv_cache.py) fake-quantizes transformers' keys and values the same
    way: the log-probabilities of the engine's tokens are the simulation's."""
    from transformers import AutoModelForCausalLM

    from formats.hf import HFCheckpoint
    from quant.kv_cache import KVCacheSpec, simulated_kv_cache

    llm = LLM(models[name], dtype="fp32", kv_cache_dtype=cache, kv_memory=16 * 2**20)
    outs = llm.generate(prompts[:4], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    model = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval()
    adjacent = HFCheckpoint.open(models[name]).arch.rope_pairs_adjacent_in_gguf
    to_simulation, to_float = [], []
    with torch.no_grad():
        for p, o in zip(prompts[:4], outs):
            ids, chosen = torch.tensor([p + o.token_ids]), torch.tensor(o.token_ids)[:, None]
            with simulated_kv_cache(model, KVCacheSpec(cache), adjacent):
                expected = torch.log_softmax(model(ids).logits[0, len(p) - 1 : -1], -1)
            unquantized = torch.log_softmax(model(ids).logits[0, len(p) - 1 : -1], -1)
            assert o.token_ids == expected.argmax(-1).tolist()
            to_simulation.append((torch.tensor(o.logprobs) - expected.gather(1, chosen)[:, 0]).abs())
            to_float.append((torch.tensor(o.logprobs) - unquantized.gather(1, chosen)[:, 0]).abs())
    # Float noise (other summation orders, attention in the rotated space) moves a few values across
    # a q8_0/q4_0 rounding edge now and then, and each such value moves the log-probabilities by
    # about 1e-3 (how often depends on the CPU's kernels): the engine is much nearer the
    # simulation than the unquantized model is, and fp8 (no rounding edges crossed) equals it.
    to_simulation, to_float = torch.cat(to_simulation), torch.cat(to_float)
    assert to_simulation.mean() < (1e-4 if cache == "fp8" else 0.3 * to_float.mean()), (to_simulation, to_float)


def test_a_quantized_cache_holds_more_tokens_in_the_same_memory():
    sizes = {cache: LLM(TINY, kv_cache_dtype=cache, kv_memory=8 * 2**20, block_size=16).engine.blocks.num_blocks
             for cache in ("bf16", "int8", "int4")}
    assert sizes["int8"] == pytest.approx(sizes["bf16"] * 16 / 8.5, rel=0.01)
    assert sizes["int4"] == pytest.approx(sizes["bf16"] * 16 / 4.5, rel=0.01)


def shared_start_prompts(start: int = 70, tails=(1, 5, 16, 23, 40, 2, 9, 33)) -> list[list[int]]:
    """Prompts that begin with the same ``start`` tokens (a system prompt), then differ."""
    ids = prompts_from_text([2000])[0]
    return [ids[:start] + ids[1000 + 50 * i : 1000 + 50 * i + t] for i, t in enumerate(tails)]


@pytest.mark.parametrize("name, engine", [
    ("llama-untied", {}), ("llama-untied", {"block_size": 7}), ("mistral", {}),
    ("qwen2-wide", {"kv_cache_dtype": "int4"}),  # cached blocks hold q4_0 codes, shared as they are
])
def test_prefix_caching_shares_blocks_and_changes_no_token(models, name, engine):
    prompts = shared_start_prompts()
    params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    plain = LLM(models[name], dtype="fp32", kv_memory=32 * 2**20, enable_prefix_caching=False, **engine)
    reference = [o.token_ids for o in plain.generate(prompts, params)]
    assert plain.engine.blocks.hit_tokens == 0
    llm = LLM(models[name], dtype="fp32", kv_memory=32 * 2**20, **engine)
    first = llm.generate(prompts[:1], params)  # computes and caches the shared start
    rest = llm.generate(prompts[1:] + prompts[:1], params)  # the first prompt again: all but its last block cached
    assert [o.token_ids for o in first + rest[:-1]] == reference and rest[-1].token_ids == reference[0]
    bs = llm.engine.block_size
    assert llm.engine.blocks.hit_tokens >= len(prompts) * (70 // bs) * bs
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_cached_blocks_give_way_least_recently_used_first(models):
    """A pool too small to keep every prefix: old ones are evicted, outputs stay the same."""
    from formats.hf import HFCheckpoint
    from runner.engine.kv_cache import bytes_per_token

    prompts = prompts_from_text([60, 50, 40, 60, 30, 60, 50, 40]) + shared_start_prompts()
    params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in LLM(models["mistral"], dtype="fp32", kv_memory=32 * 2**20, max_model_len=128,
                                          enable_prefix_caching=False).generate(prompts, params)]
    per_block = bytes_per_token(HFCheckpoint.open(models["mistral"]).arch, "fp32") * 16
    llm = LLM(models["mistral"], dtype="fp32", kv_memory=14 * per_block, max_model_len=128, block_size=16)
    ours = [llm.generate(p, params)[0].token_ids for p in prompts]  # one at a time: each leaves its blocks cached
    assert ours == reference
    blocks = llm.engine.blocks
    assert blocks.hit_tokens > 0
    assert blocks.num_free == blocks.num_blocks


def test_a_share_of_memory_is_capped_at_what_the_running_sequences_can_fill():
    llm = LLM(TINY, max_num_seqs=4, max_model_len=256, kv_memory=0.5, block_size=16)
    assert llm.engine.blocks.num_blocks == 4 * 256 // 16
    assert LLM(TINY, max_num_seqs=4, max_model_len=256, kv_memory=8 * 2**20, block_size=16).engine.blocks.num_blocks > 4 * 256 // 16


def test_the_block_size_is_vllms_for_the_device():
    """16 tokens on a GPU, 128 on a CPU (the engine's default, as vLLM's); given, it is kept."""
    llm = LLM(TINY, kv_memory=8 * 2**20)
    assert llm.engine.block_size == (16 if llm.engine.device.type == "cuda" else 128) == llm.engine.pool.block_size
    assert LLM(TINY, kv_memory=8 * 2**20, block_size=32).engine.blocks.block_size == 32


@pytest.mark.parametrize("name, engine", [pytest.param("mistral", {}, marks=pytest.mark.check), ("llama-untied", {"block_size": 7}),
                                          ("qwen2", {"speculative": "ngram"})])
def test_static_decode_steps_give_the_normal_layouts_tokens(models, prompts, monkeypatch, name, engine):
    """The decode path CUDA graphs replay (runner/engine/static_decode.py), run eagerly on the CPU:
    batches padded to their bucket, padding rows decoding into the scratch block, the block tables
    padded to max_model_len. Outputs of different lengths make the batches ragged."""
    from runner.engine.static_decode import StaticDecode

    params = [SamplingParams(max_tokens=6 + i % 7, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    options = dict(dtype="fp32", kv_memory=4 * 2**20, max_model_len=128, max_num_seqs=6) | engine
    reference = [o.token_ids for o in LLM(models[name], **options).generate(prompts, params)]
    llm = LLM(models[name], **options)
    llm.engine.decoder = llm.engine.static_decode()
    batches = []
    fill = StaticDecode.fill
    monkeypatch.setattr(StaticDecode, "fill", lambda self, seqs, bucket: (batches.append((len(seqs), bucket)), fill(self, seqs, bucket)))
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert any(n < bucket for n, bucket in batches) and any(n == bucket > 1 for n, bucket in batches)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_decode_buckets_are_vllms_up_to_max_num_seqs():
    from runner.engine.static_decode import buckets

    assert buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256]
    assert buckets(3) == [1, 2, 3] and buckets(1) == [1] and buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_enforce_eager_reaches_the_engine_from_the_commands(monkeypatch, capsys, command):
    from helpers.cli import quantize
    from runner.engine.engine import Engine

    configs = []
    build = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, model, config: (configs.append(config), build(self, model, config))[1])
    args = {"generate": ["--prompt", "It was", "--max-tokens", "2"], "bench": ["--requests", "1", "--prompt-tokens", "8",
                                                                            "--output-tokens", "2", "--json"]}[command]
    for eager in (["--enforce-eager"], []):
        code, _, err = quantize(monkeypatch, capsys, command, TINY, *args, "--kv-memory", "16MiB", *eager)
        assert code == 0, err
    assert [c.enforce_eager for c in configs] == [True, False]
    assert LLM(TINY, kv_memory=2**20, max_model_len=64, enforce_eager=True).engine.decoder is None
    graphs = LLM(TINY, kv_memory=2**20, max_model_len=64, max_num_seqs=2).engine.decoder
    assert (graphs is None) == (not torch.cuda.is_available())  # a CPU never runs graphs
    code, out, _ = quantize(monkeypatch, capsys, "serve", "--help")
    assert code == 0 and "--enforce-eager" in out


@pytest.mark.parametrize("engine", [
    pytest.param({}, marks=pytest.mark.check),
    {"max_num_batched_tokens": 24, "block_size": 16},  # prompts in chunks, several prompts a step
    {"kv_memory": 12, "block_size": 16, "max_model_len": 128},  # 12 blocks for 6 prompts: preemptions
])
def test_prompt_logprobs_are_transformers_whatever_the_chunks_cache_and_preemptions(prompts, engine):
    from transformers import AutoModelForCausalLM

    from formats.hf import HFCheckpoint
    from runner.engine.kv_cache import bytes_per_token

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    if "kv_memory" in engine:  # in blocks
        engine = engine | {"kv_memory": engine["kv_memory"] * 16 * bytes_per_token(HFCheckpoint.open(TINY).arch, "fp32")}
    llm = LLM(TINY, dtype="fp32", **{"kv_memory": 16 * 2**20, **engine})
    asked = shared_start_prompts()[:3] + prompts[:4]  # prompts[3] is one token: nothing to score
    llm.generate(asked[:1], SamplingParams(max_tokens=2, temperature=0))  # its blocks now cached: still scored in full
    outs = llm.generate(asked, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=3))
    plain = llm.generate(asked, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for ids, out, reference in zip(asked, outs, plain):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        expected = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)
        values, tops = logp.topk(3, -1)
        for position, top in enumerate(out.prompt_top_logprobs[1:]):
            assert list(top) == tops[position].tolist()
            torch.testing.assert_close(torch.tensor(list(top.values())), values[position], atol=1e-4, rtol=0)
        assert out.token_ids == reference.token_ids and reference.prompt_logprobs is None
    if "kv_memory" in engine:
        assert llm.engine.scheduler.preemptions > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_penalties_choose_as_transformers_and_openai_define_them(prompts):
    """repetition_penalty as transformers' generate applies it; presence and frequency penalties as
    OpenAI defines them, by a reference loop over transformers' logits; requests without penalties
    in the same batch keep their tokens, and the log-probabilities stay the model's own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    llm = LLM(TINY, dtype="fp32", kv_memory=16 * 2**20, speculative="ngram")  # penalized sequences take no guesses
    asked = prompts[1:4]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    repeated = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3, logprobs=0)
    openai = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.9)
    outs = llm.generate(asked + asked[:1] + asked[:1], [plain] * 3 + [repeated, openai])
    with torch.no_grad():
        reference = model.generate(torch.tensor([asked[0]]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3,
                                   attention_mask=torch.ones(1, len(asked[0]), dtype=torch.long))[0, len(asked[0]):].tolist()
        ids, counts = list(asked[0]), torch.zeros(model.config.vocab_size)
        for _ in range(24):
            scores = model(torch.tensor([ids])).logits[0, -1] - 0.9 * counts - 0.6 * (counts > 0)
            ids.append(int(scores.argmax()))
            counts[ids[-1]] += 1
    assert outs[3].token_ids == reference and outs[4].token_ids == ids[len(asked[0]):]
    assert outs[3].token_ids != outs[0].token_ids and outs[4].token_ids != outs[0].token_ids  # the penalties did something
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in LLM(TINY, dtype="fp32", kv_memory=16 * 2**20).generate(asked, plain)]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([asked[0] + reference])).logits[0, len(asked[0]) - 1 : -1], -1)
    torch.testing.assert_close(torch.tensor(outs[3].logprobs), logp.gather(1, torch.tensor(reference)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    favoured, banned = outs[0].token_ids[3], outs[0].token_ids[0]
    forced, avoided = llm.generate(asked[:1] * 2, [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=bias)
                                                   for bias in ({favoured: 100}, {banned: -100})])
    assert forced.token_ids == [favoured] * 6 and banned not in avoided.token_ids
    assert avoided.token_ids != outs[0].token_ids[:6]
    with pytest.raises(InputError, match="logit_bias: a token id outside"):
        llm.generate(asked[:1], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(InputError, match="repetition_penalty 0"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(InputError, match="must be in \\[-2, 2\\]"):
        SamplingParams(frequency_penalty=3)
