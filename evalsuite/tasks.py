"""Task accuracy, example by example, so a report can say which answers a variant changed.

A task is a JSONL file: ``{"context", "choices", "gold"}`` lines make a multiple-choice task (right
when the gold choice has the highest log-probability after the context, lm-eval's ``acc``);
``{"context", "target"}`` lines make a cloze task (right when greedy decoding writes the target,
LAMBADA's rule). The same files run through lm-eval with the YAML that
``evalsuite.lm_eval_bridge`` writes for them, and score the same.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from core.errors import InputError
from evalsuite.loglikelihood import Request, continuation_logprobs, encode_pair
from evalsuite.metrics import LogProbs


@dataclass(frozen=True)
class Task:
    name: str
    examples: list[dict]
    num_fewshot: int = 0

    @property
    def multiple_choice(self) -> bool:
        return "choices" in self.examples[0]

    @property
    def chance(self) -> float:
        """What guessing scores: one over the number of choices; nothing for a cloze."""
        return 1 / len(self.examples[0]["choices"]) if self.multiple_choice else 0.0


def load_task(path: Path, name: str | None = None, limit: int | None = None, num_fewshot: int = 0) -> Task:
    """The first ``limit`` examples of a task file, checked line by line."""
    examples = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read task file ({getattr(e, 'strerror', None) or e})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except ValueError:
            raise InputError(f"{path}, line {number}: not JSON") from None
        _check_example(example, path, number)
        examples.append(example)
    if not examples:
        raise InputError(f"{path}: no examples")
    if len({"choices" in e for e in examples}) > 1:
        raise InputError(f"{path}: mixes multiple-choice and cloze examples")
    if num_fewshot >= len(examples):
        raise InputError(f"{path}: num_fewshot {num_fewshot} needs more than {len(examples)} examples")
    return Task(name or path.stem, examples[:limit] if limit else examples, num_fewshot)


def _check_example(example: object, path: Path, number: int) -> None:
    where = f"{path}, line {number}"
    if not isinstance(example, dict) or not isinstance(example.get("context"), str):
        raise InputError(f"{where}: an example needs a 'context' string")
    if "choices" in example:
        choices, gold = example["choices"], example.get("gold")
        if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
            raise InputError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        if not (isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(choices)):
            raise InputError(f"{where}: 'gold' must be the index of the right choice (0 to {len(choices) - 1})")
    elif not (isinstance(example.get("target"), str) and example["target"]):
        raise InputError(f"{where}: an example needs 'choices' and 'gold', or a non-empty 'target'")


def answer(example: dict) -> str:
    return example["choices"][example["gold"]] if "choices" in example else example["target"]


def _prompt(task: Task, index: int, seed: int) -> str:
    """The example's context after ``num_fewshot`` other examples with their answers, drawn with a
    seed of their own per example so every variant sees the same prompts."""
    if not task.num_fewshot:
        return task.examples[index]["context"]
    others = [i for i in range(len(task.examples)) if i != index]
    shots = random.Random(seed * 1_000_003 + index).sample(others, task.num_fewshot)
    head = "".join(task.examples[i]["context"] + answer(task.examples[i]) + "\n\n" for i in shots)
    return head + task.examples[index]["context"]


def run_task(logprobs: LogProbs, tokenizer, task: Task, max_length: int, vocab_size: int, bos: int,
             seed: int = 0) -> list[bool]:
    """Whether the model answers each example right, in order."""
    requests: list[Request] = []
    for i, example in enumerate(task.examples):
        context = _prompt(task, i, seed)
        for continuation in example.get("choices", [example.get("target")]):
            requests.append(encode_pair(tokenizer, context, continuation, bos))
    scored = continuation_logprobs(logprobs, requests, max_length, vocab_size)
    correct, at = [], 0
    for example in task.examples:
        if "choices" in example:
            totals = [lp for lp, _ in scored[at:at + len(example["choices"])]]
            correct.append(max(range(len(totals)), key=totals.__getitem__) == example["gold"])
            at += len(totals)
        else:
            correct.append(scored[at][1])
            at += 1
    return correct
