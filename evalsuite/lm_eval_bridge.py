"""lm-evaluation-harness on our models: an ``lm_eval.api.model.LM`` over a log-probability callable.

lm-eval's tasks ask a model for three things: the log-likelihood of a continuation after a context
(multiple choice, cloze), the log-likelihood of a whole text (perplexity tasks), and text up to a
stop string (generation tasks). ``QuantbenchLM`` answers the first two with the same scorer our own
tasks use (``evalsuite.loglikelihood``), so a task scores the same through either path, and the
third with the caller's generator (the engine running the variant's own files) or, without one,
greedy decoding through the log-probabilities themselves. Generation is greedy whatever a task's
``gen_kwargs`` say about sampling: a report compares a variant's answers with the original's one
by one, and sampling would add flips of its own.

Only task runs that go through lm-eval import this module; lm-eval is an optional extra.
Nothing here downloads: lm-eval's loading and evaluation run ``offline()``, so a task reads local
files (``write_local_task_yaml``) or data already in the Hugging Face cache, and fails otherwise.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import torch
import yaml

from core.errors import InputError
from evalsuite.loglikelihood import continuation_logprobs, encode_pair, rolling_logprob
from evalsuite.metrics import LogProbs

try:
    import datasets.config
    import huggingface_hub.constants
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager
except ImportError:  # pragma: no cover - exercised only where the extra is missing
    raise InputError("lm-eval is not installed: pip install 'quantbench[tasks]'") from None


@contextmanager
def offline() -> Iterator[None]:
    """Inside, the Hugging Face libraries download nothing, so a task reads local files or the
    cache and fails otherwise; outside, they are as the user set them (a model id elsewhere in the
    job may be downloaded, formats/hub.py). Both libraries read their settings once, at import, so
    their constants are switched along with the variables."""
    with ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}))
        for module, name in ((huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                             (datasets.config, "HF_DATASETS_OFFLINE")):
            stack.enter_context(mock.patch.object(module, name, True))
        yield


# prompts as token ids, each with its greedy generation settings {"until": [...], "max_gen_toks": n}
# -> the generated texts, in order
Generate = Callable[[list[list[int]], list[dict]], list[str]]

DEFAULT_MAX_GEN_TOKS = 256


class QuantbenchLM(LM):
    """An lm-eval model over ``logprobs`` ([batch, T] ids -> [batch, T - 1, vocab] log-softmax)."""

    def __init__(self, logprobs: LogProbs, tokenizer, max_length: int, vocab_size: int, bos: int,
                 generate: Generate | None = None):
        super().__init__()
        self.logprobs = logprobs
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.bos = bos
        self.generate = generate
        self.generated = 0  # generation requests answered: whether a task generated at all
        self.eos = getattr(tokenizer, "eos_token_id", None)

    # lm-eval reads these from a model; a single-process model is rank 0 of 1.
    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "quantbench").replace("/", "__")

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        if not requests:
            return []
        pairs = [encode_pair(self.tokenizer, context, continuation, self.bos)
                 for context, continuation in (r.args for r in requests)]
        scored = continuation_logprobs(self.logprobs, pairs, self.max_length, self.vocab_size)
        for request, result in zip(requests, scored):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return scored

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args[:1]
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            total = rolling_logprob(self.logprobs, tokens, self.max_length, self.vocab_size, self.bos) if tokens else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        if not requests:
            return []
        self.generated += len(requests)
        settings = [_settings(r.args[1] if len(r.args) > 1 else None) for r in requests]
        prompts = [self.prompt_ids(r.args[0], k["max_gen_toks"]) for r, k in zip(requests, settings)]
        if self.generate is not None:
            texts = list(self.generate(prompts, settings))
            if len(texts) != len(prompts):
                raise ValueError(f"generate returned {len(texts)} texts for {len(prompts)} prompts")
        else:
            texts = [self._greedy(p, k) for p, k in zip(prompts, settings)]
        out = []
        for request, text, k in zip(requests, texts, settings):
            text = cut_at_stop(text, k["until"])
            self.cache_hook.add_partial("generate_until", request.args, text)
            out.append(text)
        return out

    def prompt_ids(self, context: str, max_new: int) -> list[int]:
        """A generation prompt's token ids as the scorer sees a context (no special tokens; an empty
        one becomes bos), cut from the left to leave room for ``max_new`` tokens."""
        ids = (self.tokenizer.encode(context, add_special_tokens=False) if context else []) or [self.bos]
        return ids[-max(1, self.max_length - max_new):]

    def _greedy(self, ids: list[int], settings: dict) -> str:
        """Greedy decoding one token at a time (no KV cache: simple, and fine for short answers)."""
        generated: list[int] = []
        for _ in range(settings["max_gen_toks"]):
            # the callable drops the last position's prediction: a placeholder after the text makes
            # the prediction after the text's own last token the final row
            window = (ids + generated)[-(self.max_length - 1):] + [0]
            lp = self.logprobs(torch.tensor([window], dtype=torch.long), len(window) - 2)
            token = int(lp[0, -1].argmax())
            if self.eos is not None and token == self.eos:
                break
            generated.append(token)
            if settings["until"] and any(s in self.tokenizer.decode(generated) for s in settings["until"]):
                break
        return self.tokenizer.decode(generated)


def _settings(gen_kwargs: dict | None) -> dict:
    """What of a request's generation kwargs applies: its stop strings and length."""
    gen_kwargs = dict(gen_kwargs or {})
    return {"until": _until(gen_kwargs), "max_gen_toks": int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))}


def _until(gen_kwargs: dict) -> list[str]:
    until = gen_kwargs.get("until") or []
    return [until] if isinstance(until, str) else [s for s in until if s]


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    cut = len(text)
    for stop in until:
        at = text.find(stop)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


@dataclass
class TaskOutcome:
    name: str
    metric: str
    accuracy: float
    correct: list[bool]  # per example, by lm-eval's doc_id
    chance: float  # what guessing scores: the mean over examples of 1 / choices (0 where not multiple choice)


def task_manager(include_path: Path | None) -> TaskManager:
    """lm-eval's task index: its built-in tasks (indexing them takes seconds, so keep one), or
    only the task YAMLs in ``include_path``."""
    if include_path is None:
        return TaskManager()
    return TaskManager(include_path=str(include_path), include_defaults=False)


def load_tasks(tasks: list[str], manager: TaskManager) -> None:
    """Build the tasks as lm-eval will (their data included), for a one-line error before any
    model runs: a task lm-eval does not know, or data that is not on this machine."""
    for task in tasks:
        if task not in manager.all_tasks:
            raise InputError(f"lm-eval task '{task}': lm-eval knows no task or group of that name")
        try:
            with offline():
                manager.load([task])
        except Exception as e:  # datasets and lm-eval raise many kinds; all mean the same to a user
            detail = " ".join(str(e).split())[:300]
            raise InputError(f"lm-eval task '{task}': cannot load it offline ({type(e).__name__}: {detail}); "
                             "its data must be in local files or already in the Hugging Face cache") from None


def run_lm_eval(lm: LM, tasks: list[str], manager: TaskManager, limit: int | None,
                num_fewshot: int | None, seed: int = 0) -> dict[str, TaskOutcome]:
    """Run lm-eval's own evaluator on ``lm``; per task (a group's, each of its tasks) its accuracy
    and which examples were right."""
    with offline():
        results = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
            log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    out = {}
    for name, samples in sorted(results["samples"].items()):
        samples = sorted(samples, key=lambda s: s["doc_id"])
        metric = _metric(name, samples)
        correct = [bool(s[metric]) for s in samples]
        accuracy = sum(correct) / len(correct) if correct else math.nan
        chance = sum(1 / len(s["arguments"]) if len(s["arguments"]) > 1 else 0.0 for s in samples) / max(1, len(samples))
        out[name] = TaskOutcome(name, metric, accuracy, correct, chance)
    return out


def _metric(task: str, samples: list[dict]) -> str:
    """The per-example metric that says right or wrong: ``acc`` where there is one, else the
    first whose every value is 0 or 1 (``exact_match``, say). A report's flips and paired
    intervals are over right and wrong answers; a task scored otherwise (perplexity, BLEU) has
    no place in them."""
    if not samples:
        return "acc"
    names = samples[0].get("metrics") or [k for k in samples[0] if k not in _SAMPLE_FIELDS]
    for name in sorted(names, key=lambda n: n != "acc"):
        if all(isinstance(s.get(name), (int, float)) and s[name] in (0, 1) for s in samples):
            return name
    raise InputError(f"lm-eval task '{task}': no per-example metric is right-or-wrong (0 or 1) "
                     f"among {', '.join(names)}; quantbench compares answers")


_SAMPLE_FIELDS = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                  "doc_hash", "prompt_hash", "target_hash"}


def write_local_task_yaml(name: str, jsonl: Path, out_dir: Path) -> Path:
    """An lm-eval task YAML for one of our JSONL task files, reading the file where it lies.

    ``{"context", "choices", "gold"}`` files become ``multiple_choice`` tasks, ``{"context",
    "target"}`` files ``loglikelihood`` tasks (lm-eval's acc there is whether greedy decoding writes
    the target). Our choices and targets carry their own leading space, so the target delimiter is
    empty: the continuation lm-eval asks about is exactly our string.
    """
    jsonl = Path(jsonl).resolve()
    first = _first_example(jsonl)
    config: dict = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(jsonl)}},
        "test_split": "test",
        "doc_to_text": "{{context}}",
        "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    if "choices" in first:
        config.update(output_type="multiple_choice", doc_to_choice="{{choices}}", doc_to_target="{{gold}}")
    elif "target" in first:
        config.update(output_type="loglikelihood", doc_to_target="{{target}}")
    else:
        raise InputError(f"{jsonl}: an example needs 'choices' and 'gold', or a 'target'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _first_example(jsonl: Path) -> dict:
    try:
        with jsonl.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    example = json.loads(line)
                    if isinstance(example, dict):
                        return example
                    break
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{jsonl}: cannot read task file ({getattr(e, 'strerror', None) or e})") from None
    raise InputError(f"{jsonl}: no JSON object examples")
