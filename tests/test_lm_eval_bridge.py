"""lm-eval through our scorer: the bridge answers lm-eval's requests with the numbers our own
tasks use, those numbers match transformers' logits, and lm-eval's own evaluator, run on local
task YAML over the bundled task files, scores what our scorer scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.errors import InputError
from evalsuite.loglikelihood import continuation_logprobs, encode_pair
from evalsuite.metrics import causal_lm_logprobs

try:
    from lm_eval.api.instance import Instance

    from evalsuite.lm_eval_bridge import QuantbenchLM, cut_at_stop, run_lm_eval, task_manager, write_local_task_yaml
    MISSING = None
except (ImportError, InputError) as e:
    MISSING = f"lm-eval is not installed ({e}): pip install -e '.[dev]' (or pip install 'quantbench[tasks]')"


@pytest.fixture(scope="module", autouse=True)
def _needs_lm_eval():
    # a failure, not a skip: these checks must run wherever the tests run (each test fails on its
    # own, so a missing lm-eval does not stop the rest of the suite from being collected)
    if MISSING:
        pytest.fail(MISSING, pytrace=False)


REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "bundled" / "tiny"
ORDER = REPO / "recipes" / "bundled" / "tasks" / "persuasion_order.jsonl"
CLOZE = REPO / "recipes" / "bundled" / "tasks" / "persuasion_cloze.jsonl"
MAX_LENGTH, VOCAB, BOS = 2048, 8192, 0
LIMIT = 40


def _examples(path: Path, n: int) -> list[dict]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [json.loads(line) for line in lines[:n]]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def lm(tiny):
    model, tokenizer = tiny
    return QuantbenchLM(causal_lm_logprobs(model), tokenizer, MAX_LENGTH, VOCAB, BOS)


@pytest.fixture(scope="module")
def order_ours(tiny):
    """Our scorer on the first LIMIT order examples: [(context, choice)] and their results."""
    model, tokenizer = tiny
    texts = [(e["context"], c) for e in _examples(ORDER, LIMIT) for c in e["choices"]]
    pairs = [encode_pair(tokenizer, ctx, cont, BOS) for ctx, cont in texts]
    return texts, pairs, continuation_logprobs(causal_lm_logprobs(model), pairs, MAX_LENGTH, VOCAB)


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    write_local_task_yaml("qb_order", ORDER, out)
    write_local_task_yaml("qb_cloze", CLOZE, out)
    return task_manager(out)


def _instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i, ("t", i, 1)) for i, a in enumerate(args)]


def test_loglikelihood_matches_our_scorer_and_transformers(tiny, lm, order_ours):
    model, _ = tiny
    texts, pairs, ours = order_ours
    n = 20 * 4  # the first 20 examples, every choice
    bridged = lm.loglikelihood(_instances("loglikelihood", texts[:n]))
    assert len(bridged) == n
    for (lp, greedy), (our_lp, our_greedy) in zip(bridged, ours[:n]):
        assert lp == pytest.approx(our_lp, abs=1e-4) and greedy == our_greedy
    # independently, from transformers' logits: one right-padded batch with its attention mask,
    # log-softmax gathered at each continuation's tokens
    rows = [ctx + cont for ctx, cont in pairs[:n]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [BOS] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    for j, ((ctx, cont), (lp, greedy)) in enumerate(zip(pairs[:n], bridged)):
        picked = logp[j, len(ctx) - 1: len(ctx) + len(cont) - 1]
        target = torch.tensor(cont)
        assert lp == pytest.approx(picked.gather(-1, target[:, None]).sum().item(), abs=1e-4)
        assert greedy == bool((picked.argmax(-1) == target).all())
    # and the pairs are lm-eval's own: context ids, then continuation ids, splitting the whole text
    ctx, cont = pairs[0]
    assert lm.tokenizer.decode(ctx + cont) == texts[0][0] + texts[0][1]


def test_simple_evaluate_order_task_matches_our_accuracy(lm, order_ours, manager):
    texts, _, ours = order_ours

    class Recording(QuantbenchLM):
        """The bridge, keeping what lm-eval asks it."""

        asked: list[tuple] = []

        def loglikelihood(self, requests):
            self.asked.extend(r.args for r in requests)
            return super().loglikelihood(requests)

    recording = Recording(lm.logprobs, lm.tokenizer, MAX_LENGTH, VOCAB, BOS)
    outcome = run_lm_eval(recording, ["qb_order"], manager, limit=LIMIT, num_fewshot=0)["qb_order"]
    assert outcome.chance == 0.25
    # lm-eval asked for exactly our strings: no delimiter added, our choices carry their own space
    assert sorted(recording.asked) == sorted(texts)
    examples = _examples(ORDER, LIMIT)
    direct = []
    for i, example in enumerate(examples):
        totals = [lp for lp, _ in ours[4 * i: 4 * i + 4]]
        direct.append(max(range(4), key=totals.__getitem__) == example["gold"])
    assert outcome.metric == "acc" and len(outcome.correct) == LIMIT
    assert outcome.correct == direct
    assert outcome.accuracy == pytest.approx(sum(direct) / LIMIT)
    assert outcome.accuracy > 0.25 + 0.3, outcome.accuracy  # the tiny model orders words far above chance


def test_loglikelihood_rolling_is_the_sum_of_token_logprobs(tiny, lm):
    model, tokenizer = tiny
    text = "Anne had been forced into prudence in her youth, she learned romance as she grew older."
    (rolled,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    ids = [BOS] + tokenizer.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    direct = logp.gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()
    assert rolled == pytest.approx(direct, abs=1e-4)
    # windows shorter than the text: every token is still scored once, with what context fits
    short = QuantbenchLM(lm.logprobs, tokenizer, 8, VOCAB, BOS)
    (windowed,) = short.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    assert windowed < 0 and windowed != pytest.approx(direct, abs=1e-3)


def test_simple_evaluate_cloze_task(lm, manager, tiny):
    outcome = run_lm_eval(lm, ["qb_cloze"], manager, limit=20, num_fewshot=0)["qb_cloze"]
    model, tokenizer = tiny
    pairs = [encode_pair(tokenizer, e["context"], e["target"], BOS) for e in _examples(CLOZE, 20)]
    direct = [greedy for _, greedy in continuation_logprobs(causal_lm_logprobs(model), pairs, MAX_LENGTH, VOCAB)]
    assert outcome.metric == "acc" and outcome.correct == direct and outcome.chance == 0
    assert outcome.accuracy == pytest.approx(sum(direct) / 20)


def test_generate_until_greedy_matches_transformers(tiny, lm):
    model, tokenizer = tiny
    context = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who"
    (ours,) = lm.generate_until(_instances("generate_until", [(context, {"until": [], "max_gen_toks": 5})]))
    ids = tokenizer.encode(context, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=BOS,
                             pad_token_id=BOS)
    assert ours == tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    (stopped,) = lm.generate_until(_instances("generate_until", [(context, {"until": [ours[3:5]], "max_gen_toks": 5})]))
    assert stopped == cut_at_stop(ours, [ours[3:5]])
    # a caller's generator is used as given, then cut at the stop strings
    seen = []

    def generate(prompts, kwargs):
        seen.append((prompts, kwargs))
        return ["  one. two." for _ in prompts]

    with_engine = QuantbenchLM(lm.logprobs, tokenizer, MAX_LENGTH, VOCAB, BOS, generate=generate)
    result = with_engine.generate_until(_instances("generate_until", [("a", {"until": ["."]}), ("b", {"until": "two"})]))
    assert result == ["  one", "  one. "]
    # it gets the prompts as the scorer tokenizes them, and the settings that apply
    assert seen[0][0] == [tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("b", add_special_tokens=False)]
    assert seen[0][1][1] == {"until": ["two"], "max_gen_toks": 256}
