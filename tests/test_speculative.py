"""Speculative decoding (runner/engine/speculative.py): greedy output equals plain decoding token
for token, whatever the proposer guesses; sampled output is distributed as the target's alone
(a chi-square test at a fixed seed, which the draft's own distribution fails); every block of the
target's cache and the draft's is free afterwards; bad options get one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import TINY
from core.errors import InputError
from runner import LLM, SamplingParams
from runner.engine.speculative import NgramProposer, SpeculativeConfig
from helpers.engine import prompts_from_text, random_model


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A draft with the target's tokenizer that guesses differently (random weights)."""
    return random_model(tmp_path_factory.mktemp("draft") / "draft", "llama", num_hidden_layers=1)


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory):
    """A draft whose distributions overlap the target's without being them: the target's weights
    with noise, so that rejection sampling both keeps and refuses guesses."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("near") / "near"
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "layers" in name:
                p.add_(torch.randn_like(p) * p.std() * 0.6)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder)
    return folder


def run(prompts, params, **engine):
    llm = LLM(TINY, dtype="fp32", kv_memory=32 * 2**20, max_num_seqs=4, **engine)
    outs = llm.generate(prompts, params)
    e = llm.engine
    assert e.blocks.num_free == e.blocks.num_blocks
    if engine.get("speculative", "").startswith("draft"):
        assert e.proposer.blocks.num_free == e.proposer.blocks.num_blocks
    return outs, e


@pytest.mark.parametrize("speculative", ["self", "other", "ngram", "ngram,k=8", "self=int4", "self=int3,k=3"])
def test_greedy_output_is_plain_decodings_token_for_token(draft, speculative):
    spec = {"self": f"draft={TINY}", "other": f"draft={draft}"}.get(speculative, speculative)
    prompts = prompts_from_text([3, 17, 40, 1, 64, 9, 25, 90])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    plain, _ = run(prompts, params)
    ours, engine = run(prompts, params, speculative=spec)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    for a, b in zip(ours, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert engine.spec_proposed > 0
    if speculative == "self":  # the target guessing for itself: every guess is right
        assert engine.spec_accepted == engine.spec_proposed
    if speculative.startswith("self="):  # its own rounded copy: most guesses right, not all
        assert 0.3 * engine.spec_proposed < engine.spec_accepted < engine.spec_proposed


def test_self_speculation_drafts_on_low_bit_kernels_and_shares_the_rest():
    """``self=int4``: the draft's layers run on the int4 kernel in bf16; a bf16 target's draft uses
    the target's own embedding, head and final norm, an fp32 target's bf16 copies; the draft's
    blocks are all free after the run."""
    from runner.engine.linear import Int4Linear

    for dtype in ("bf16", "fp32"):
        llm = LLM(TINY, dtype=dtype, kv_memory=32 * 2**20, max_num_seqs=4, speculative="self=int4")
        llm.generate(prompts_from_text([5, 30]), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        draft, target = llm.engine.proposer.model, llm.engine.model
        assert all(isinstance(layer[name][0], Int4Linear) for layer in draft.layers for name in ("qkv", "o", "gate_up", "down"))
        assert not isinstance(target.layers[0]["qkv"][0], Int4Linear)
        assert draft.dtype == torch.bfloat16 and draft.embed.dtype == torch.bfloat16
        shared = draft.embed is target.embed and draft.lm_head is target.lm_head and draft.norm is target.norm
        assert shared == (dtype == "bf16")
        assert llm.engine.proposer.blocks.num_free == llm.engine.proposer.blocks.num_blocks


def test_a_recipe_variant_of_the_same_model_drafts(tmp_path):
    """``draft=DIR`` takes a recipe's variant folder (its compressed-tensors export) of the target."""
    from formats.hf import HFCheckpoint
    from recipes.schema import Variant
    from recipes.variants import build_variant

    variant = Variant.model_validate({"name": "w4", "weights": {"method": "rtn", "bits": 4, "granularity": "group",
                                                                 "group_size": 32}, "exports": ["compressed-tensors"]})
    build_variant(HFCheckpoint.open(TINY), variant, tmp_path)
    prompts = prompts_from_text([3, 40])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain, _ = run(prompts, params)
    ours, engine = run(prompts, params, speculative=f"draft={tmp_path / 'w4'}")
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    assert 0 < engine.spec_accepted < engine.spec_proposed


def test_guesses_under_preemption_change_no_token():
    """A pool too small for every sequence: preempted sequences lose their guesses, and guesses
    only take blocks that are free; the tokens stay plain decoding's."""
    from formats.hf import HFCheckpoint
    from runner.engine.kv_cache import bytes_per_token

    prompts = prompts_from_text([3, 17, 40, 1, 64, 9, 25, 90])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain, _ = run(prompts, params)
    per_block = bytes_per_token(HFCheckpoint.open(TINY).arch, "fp32") * 16
    llm = LLM(TINY, dtype="fp32", kv_memory=10 * per_block, max_model_len=128, max_num_seqs=8, speculative="ngram", block_size=16)
    ours = llm.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    engine = llm.engine
    assert engine.scheduler.preemptions > 0 and engine.spec_proposed > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_stop_tokens_and_max_tokens_cut_inside_an_accepted_run():
    prompts = prompts_from_text([20, 30])
    plain, _ = run(prompts, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    stop = plain[0].token_ids[3]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    reference, _ = run(prompts, params)
    ours, _ = run(prompts, params, speculative=f"draft={TINY}")
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    assert ours[0].token_ids[-1] == stop and ours[0].finish_reason == "stop"
    assert all(len(o.token_ids) <= 7 for o in ours)


def chi_square_bound(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's 99.9% point (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def joint_distribution(model_path, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(first two tokens) under ``model_path`` at ``params``, exactly."""
    from transformers import AutoModelForCausalLM

    from runner.engine.sampling import probabilities

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        first = probabilities(model(torch.tensor([prompt])).logits[0, -1], params)
        out = {}
        for t1 in first.nonzero()[:, 0].tolist():
            second = probabilities(model(torch.tensor([prompt + [t1]])).logits[0, -1], params)
            for t2 in second.nonzero()[:, 0].tolist():
                out[(t1, t2)] = float(first[t1] * second[t2])
    return out


def chi_square(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the pairs expected at least 5 times, the rest pooled."""
    big = [k for k, p in expected.items() if p * n >= 5]
    stat, rest_seen, rest_expected = 0.0, n, n
    for k in big:
        e = expected[k] * n
        stat += (counts.get(k, 0) - e) ** 2 / e
        rest_seen -= counts.get(k, 0)
        rest_expected -= e
    if rest_expected >= 5:
        stat += (rest_seen - rest_expected) ** 2 / rest_expected
    return stat, len(big) - (rest_expected < 5)


def sampled_pairs(prompt: list[int], params: SamplingParams, speculative, n: int = 3000):
    """The first two tokens of ``n`` requests of 3 tokens, seeds 0..n-1: the first comes from the
    prompt's step, the second is a guess verified by rejection sampling (or the target's draw after
    a refusal), the third the target's own after an accepted guess."""
    llm = LLM(TINY, dtype="fp32", kv_memory=64 * 2**20, max_num_seqs=256, speculative=speculative)
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=params.temperature, top_k=params.top_k,
                                                      ignore_eos=True, seed=s) for s in range(n)])
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        key = tuple(o.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts, llm.engine


def test_sampled_output_with_a_draft_is_distributed_as_the_targets(near_draft):
    prompt, params, n = prompts_from_text([12])[0], SamplingParams(temperature=1.0, top_k=4), 3000
    counts, engine = sampled_pairs(prompt, params, f"draft={near_draft}", n)
    assert engine.spec_proposed >= n and 0 < engine.spec_accepted < engine.spec_proposed  # guesses kept and refused
    stat, dof = chi_square(counts, joint_distribution(TINY, prompt, params), n)
    assert stat < chi_square_bound(dof), (stat, dof)
    wrong, wrong_dof = chi_square(counts, joint_distribution(near_draft, prompt, params), n)
    assert wrong > 10 * chi_square_bound(wrong_dof)  # the test can tell: the draft's own distribution is far off


def test_sampled_output_with_a_self_draft_is_distributed_as_the_targets():
    prompt, params, n = prompts_from_text([12])[0], SamplingParams(temperature=1.0, top_k=4), 3000
    counts, engine = sampled_pairs(prompt, params, "self=int3", n)
    assert engine.spec_proposed >= n and 0 < engine.spec_accepted < engine.spec_proposed
    stat, dof = chi_square(counts, joint_distribution(TINY, prompt, params), n)
    assert stat < chi_square_bound(dof), (stat, dof)


def test_sampled_output_with_ngram_guesses_is_distributed_as_the_targets():
    """A lookup's guess is a point mass: kept with probability p(guess), else the draw excludes it."""
    prompt, params, n = prompts_from_text([12])[0], SamplingParams(temperature=1.0, top_k=20), 3000
    plain = LLM(TINY, dtype="fp32", kv_memory=16 * 2**20)
    for _ in range(4):  # put the likeliest first tokens in the prompt, so that a one-token lookup finds them
        prompt = list(plain.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=4))[0].top_logprobs[0]) + prompt
    counts, engine = sampled_pairs(prompt, params, SpeculativeConfig("ngram", prompt_lookup_min=1), n)
    assert engine.spec_proposed >= n / 2 and engine.spec_accepted < engine.spec_proposed
    stat, dof = chi_square(counts, joint_distribution(TINY, prompt, params), n)
    assert stat < chi_square_bound(dof), (stat, dof)


def test_ngram_lookup_takes_what_followed_the_latest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", prompt_lookup_max=3, prompt_lookup_min=2))
    tokens = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 2, 6, 7])
    assert proposer._lookup(tokens, 3) == [3, 4, 2]  # "6 7" last seen before 3 4 2
    assert proposer._lookup(np.array([1, 2, 3, 4]), 3) == []


def test_ngram_guesses_follow_how_many_were_kept():
    """All kept: guess k again; a refusal after j kept: guess j + 1 (the lookup itself still finds k)."""
    from runner.engine.sequence import Sequence

    proposer = NgramProposer(SpeculativeConfig("ngram", num_tokens=6, prompt_lookup_min=2))
    passage = list(range(10, 40))
    seq = Sequence(0, passage + passage[:3], SamplingParams(), None)
    assert proposer.propose([seq], [6])[0] == [passage[3:9]]
    seq.output_ids = passage[3:10]  # every guess kept, then the target's own token
    assert proposer.propose([seq], [6])[0] == [passage[10:16]]
    seq.output_ids += passage[10:12] + [99]  # two kept, then a refusal
    assert proposer._wanted(seq.id, seq.prompt_ids + seq.output_ids) == 3
    seq.output_ids += [12, 13]  # back on the passage ("99 12 13" is not in it: "12 13" is)
    assert proposer.propose([seq], [6])[0] == [passage[4:7]]
    proposer.release(seq)
    assert proposer._last == {}


class GuessEverything:
    """A proposer that guesses all it is allowed to (token 5), so that the budget alone limits guesses."""

    def propose(self, seqs, limits):
        return [[5] * k for k in limits], [None] * len(seqs)

    def release(self, seq):
        pass


def test_guesses_never_crowd_out_another_sequences_tokens():
    """Guesses take only the step's budget left after every running sequence's own next tokens (its
    decode token, or the rest of its prompt): with a budget of 6 tokens, 4 sequences and k=8, every
    running sequence is scheduled every step (before, the oldest one's guesses took the whole
    budget while a younger one's prompt waited)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for budget in (6, 64):
        llm = LLM(TINY, dtype="fp32", kv_memory=32 * 2**20, max_num_seqs=4, max_num_batched_tokens=budget,
                  speculative="ngram,k=8")
        llm.engine.proposer = GuessEverything()
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def every_running_scheduled():
            running = {s.id for s in scheduler.running}
            work = schedule()
            assert running <= {s.id for s, _ in work}
            return work

        scheduler.schedule = every_running_scheduled
        llm.generate(prompts_from_text([3, 5, 8, 13]), params)
        assert llm.engine.spec_proposed > 0


@pytest.mark.parametrize("text, fragment", [
    ("medusa", "ngram, draft=DIR"), ("ngram,k=0", "k=N"), ("draft=", "ngram, draft=DIR"),
    ("draft=/no/such/model", "/no/such/model"), ("self=int9", "self=intB"), ("self=nf4", "self=intB"),
])
def test_bad_speculative_options_get_one_line(text, fragment):
    with pytest.raises(InputError, match=fragment.replace("=", "=").replace(".", r"\.")):
        LLM(TINY, kv_memory=8 * 2**20, speculative=text)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    other = random_model(tmp_path / "other", "llama", vocab_size=1024)
    with pytest.raises(InputError, match="vocabulary of 1024"):
        LLM(TINY, kv_memory=8 * 2**20, speculative=f"draft={other}")


def test_bench_with_speculative_reports_acceptance_and_speedup(monkeypatch, capsys):
    import json

    from helpers.cli import quantize

    code, out, err = quantize(monkeypatch, capsys, "bench", TINY, "--requests", "2", "--concurrency", "1", "--prompt-tokens",
                              "40", "--output-tokens", "12", "--speculative", "ngram,k=3", "--kv-memory", "16MiB", "--json")
    assert code == 0, err
    spec = json.loads(out)["speculative"]
    assert spec["method"] == "ngram" and spec["guesses_per_step"] == 3 and 0 <= spec["acceptance_rate"] <= 1
    assert spec["plain_output_tokens_per_s"] > 0
    assert spec["speedup"] == pytest.approx(json.loads(out)["output_tokens_per_s"] / spec["plain_output_tokens_per_s"])
