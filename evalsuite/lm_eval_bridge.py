"""lm-evaluation-harness on our models: an ``lm_eval.api.model.LM`` over a log-probability callable.

lm-eval's tasks ask a model for three things: the log-likelihood of a continuation after a context
(multiple choice, cloze), the log-likelihood of a whole text (perplexity tasks), and greedy text up
to a stop string (generation tasks). ``QuantbenchLM`` answers the first two with the same scorer
our own tasks use (``evalsuite.loglikelihood``), so a task scores the same through either path, and
the third with the caller's generator (the engine, transformers' ``generate``) or, without one,
greedy decoding through the log-probabilities themselves.

Only task runs that go through lm-eval import this module; lm-eval is an optional extra.
Nothing here downloads: tasks are local YAML files (``write_local_task_yaml``) over local JSONL.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

from evalsuite.loglikelihood import continuation_logprobs, encode_pair, rolling_logprob
from evalsuite.metrics import LogProbs
from quant.types import InputError

try:
    import lm_eval
    from lm_eval.api.model import LM
except ImportError:  # pragma: no cover - exercised only where the extra is missing
    raise InputError("lm-eval is not installed: pip install 'quantbench[tasks]'") from None

Generate = Callable[[list[str], list[dict]], list[str]]

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
        contexts = [r.args[0] for r in requests]
        kwargs = [dict(r.args[1]) if len(r.args) > 1 and r.args[1] else {} for r in requests]
        if self.generate is not None:
            texts = list(self.generate(contexts, kwargs))
            if len(texts) != len(contexts):
                raise ValueError(f"generate returned {len(texts)} texts for {len(contexts)} prompts")
        else:
            texts = [self._greedy(c, k) for c, k in zip(contexts, kwargs)]
        out = []
        for request, text, k in zip(requests, texts, kwargs):
            text = cut_at_stop(text, _until(k))
            self.cache_hook.add_partial("generate_until", request.args, text)
            out.append(text)
        return out

    def _greedy(self, context: str, gen_kwargs: dict) -> str:
        """Greedy decoding one token at a time (no KV cache: simple, and fine for short answers)."""
        until = _until(gen_kwargs)
        max_new = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        ids = self.tokenizer.encode(context, add_special_tokens=False) if context else []
        ids = ids or [self.bos]
        generated: list[int] = []
        for _ in range(max_new):
            # the callable drops the last position's prediction: a placeholder after the text makes
            # the prediction after the text's own last token the final row
            window = (ids + generated)[-(self.max_length - 1):] + [0]
            lp = self.logprobs(torch.tensor([window], dtype=torch.long))
            token = int(lp[0, -1].argmax())
            if self.eos is not None and token == self.eos:
                break
            generated.append(token)
            if until and any(s in self.tokenizer.decode(generated) for s in until):
                break
        return self.tokenizer.decode(generated)


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


def run_lm_eval(lm: LM, tasks: list[str], include_path: Path | None, limit: int | None,
                num_fewshot: int | None, seed: int = 0) -> dict[str, TaskOutcome]:
    """Run lm-eval's own evaluator on ``lm``; per task its accuracy and which examples were right."""
    from lm_eval.tasks import TaskManager

    # with local tasks, skip indexing lm-eval's thousands of built-in YAMLs (seconds; they download)
    manager = (TaskManager() if include_path is None
               else TaskManager(include_path=str(include_path), include_defaults=False))
    results = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
        log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    out = {}
    for name, samples in results["samples"].items():
        samples = sorted(samples, key=lambda s: s["doc_id"])
        metric = _metric(name, samples)
        correct = [bool(s[metric]) for s in samples]
        accuracy = sum(correct) / len(correct) if correct else math.nan
        out[name] = TaskOutcome(name, metric, accuracy, correct)
    return out


def _metric(task: str, samples: list[dict]) -> str:
    if not samples:
        return "acc"
    names = samples[0].get("metrics") or [k for k in samples[0] if k not in _SAMPLE_FIELDS]
    if "acc" in names:
        return "acc"
    for name in names:
        value = samples[0].get(name)
        if isinstance(value, (int, float)):  # bools included
            return name
    raise InputError(f"lm-eval task {task}: no numeric per-example metric in its samples")


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
