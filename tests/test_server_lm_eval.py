"""lm-eval's own client for OpenAI-style servers (``local-completions``) against `quantize serve`
started as a user starts it: a task scores the same through the server as in process."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY
from helpers.serving import serving

NAME = "tiny"


def test_lm_eval_scores_a_served_model_as_it_scores_the_model_in_process(tmp_path):
    """lm-eval's own client for OpenAI-style servers (``local-completions``), tokenizing through
    the server's /tokenize, against the same tasks run in-process through our bridge: the same
    log-likelihoods (prompts batched 4 a request, each scored by echo), the same greedy
    generations, and the same answers."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalsuite.lm_eval_bridge import QuantbenchLM, run_lm_eval, task_manager, write_local_task_yaml
    from evalsuite.metrics import causal_lm_logprobs

    tasks = TINY.parent / "tasks"
    write_local_task_yaml("qb_order", tasks / "persuasion_order.jsonl", tmp_path)
    write_local_task_yaml("qb_cloze", tasks / "persuasion_cloze.jsonl", tmp_path)
    manager = task_manager(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    ours = QuantbenchLM(causal_lm_logprobs(model), tokenizer, 2048, model.config.vocab_size, model.config.bos_token_id)
    with serving(TINY, "--dtype", "fp32", "--max-model-len", "2048", "--served-model-name", NAME) as (url, _):
        served = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=NAME, tokenizer_backend="auto",
                                     tokenized_requests=True, batch_size=4, num_concurrent=1, max_length=2048, max_retries=1)
        assert type(served.tokenizer).__name__ == "RemoteTokenizer"  # found our /tokenizer_info and /tokenize
        pairs = [("Anne walked", " to the sea"), ("It was", " a truth"), ("", " Persuasion"), ("She said", " nothing.")]
        instances = [Instance("loglikelihood", {}, pair, i, ("t", i, 1)) for i, pair in enumerate(pairs)]
        for (lp, greedy), (our_lp, our_greedy) in zip(served.loglikelihood(instances), ours.loglikelihood(instances)):
            assert lp == pytest.approx(our_lp, abs=1e-3) and greedy == our_greedy
        asks = [(text, {"until": ["."], "max_gen_toks": 12}) for text in ("Anne walked", "It was a truth", "Captain Wentworth")]
        generations = [Instance("generate_until", {}, ask, i, ("g", i, 1)) for i, ask in enumerate(asks)]
        texts = served.generate_until(generations)
        assert texts == ours.generate_until(generations) and all(texts)
        remote = run_lm_eval(served, ["qb_order", "qb_cloze"], manager, limit=24, num_fewshot=0)
        local = run_lm_eval(ours, ["qb_order", "qb_cloze"], manager, limit=24, num_fewshot=0)
        for task in ("qb_order", "qb_cloze"):
            assert remote[task].accuracy == local[task].accuracy and remote[task].correct == local[task].correct
