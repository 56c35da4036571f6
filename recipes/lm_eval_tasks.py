"""A recipe's lm-eval tasks: checked before any model runs, then run on every model of the job.

A task named in ``evaluation.tasks`` by an lm-eval YAML file, or by a name lm-eval knows (a task
or a group: ``arc_easy``, ``mmlu``), goes through lm-eval's own evaluator on the same scorer our
tasks use (evalsuite/lm_eval_bridge.py). A group counts as one task of the report, its examples
those of all its tasks (MMLU's accuracy over questions, as lm-eval weights it by size). Text
generation runs on the engine wherever the engine runs the variant itself (recipes/speed.py says
where), and on the evaluated model otherwise.

lm-eval is imported only here and only when a recipe has such a task: it is an optional extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from core.errors import InputError
from recipes.schema import BUNDLED_TASKS, TaskSpec

# what generated a task's text, in the report: the engine on the variant's own files (real low-bit
# weights and KV cache), or the model the perplexity and log-likelihoods were computed with
ENGINE = "engine"
EVALUATED = "evaluated model"


@dataclass
class LMEvalTask:
    name: str  # in the report
    lm_eval_name: str  # lm-eval's name of the task or group
    manager: object  # lm_eval.tasks.TaskManager
    limit: int | None
    num_fewshot: int | None


def prepare(specs: list[TaskSpec]) -> list[LMEvalTask]:
    """The recipe's lm-eval tasks, each built once the way lm-eval will (data included), so a
    missing extra, an unknown name or data not on this machine stops the job before it starts."""
    if not specs:
        return []
    try:
        from evalsuite import lm_eval_bridge as bridge
    except InputError as e:
        raise InputError(f"task '{specs[0].task}': {e}") from None
    managers: dict[Path | None, object] = {}  # lm-eval's index of its own tasks takes seconds: once
    tasks = []
    for spec in specs:
        folder = Path(spec.task).parent if spec.is_file else None
        name = _yaml_task_name(Path(spec.task)) if spec.is_file else spec.task
        if folder not in managers:
            managers[folder] = bridge.task_manager(folder)
        if not spec.is_file and name not in managers[folder].all_tasks:
            bundled = ", ".join(sorted(p.stem for p in BUNDLED_TASKS.glob("*.jsonl")))
            raise InputError(f"task '{name}': not a bundled task ({bundled}) nor a task or group lm-eval knows "
                             "(task files end in .jsonl or .yaml)")
        bridge.load_tasks([name], managers[folder])
        tasks.append(LMEvalTask(spec.name, name, managers[folder], spec.limit, spec.num_fewshot))
    return tasks


def run(task: LMEvalTask, logprobs, tokenizer, max_length: int, vocab_size: int, bos: int, generate=None) -> dict:
    """One model's answers to ``task``: right or wrong per example, what guessing scores, the
    metric that decided, and what generated the text where the task generates."""
    from evalsuite.lm_eval_bridge import QuantbenchLM, run_lm_eval

    lm = QuantbenchLM(logprobs, tokenizer, max_length, vocab_size, bos, generate)
    outcomes = list(run_lm_eval(lm, [task.lm_eval_name], task.manager, task.limit, task.num_fewshot).values())
    correct = [c for o in outcomes for c in o.correct]
    if not correct:
        raise InputError(f"lm-eval task '{task.lm_eval_name}': no examples")
    answers = {"correct": correct, "chance": sum(o.chance * len(o.correct) for o in outcomes) / len(correct),
               "metric": "/".join(sorted({o.metric for o in outcomes}))}
    if lm.generated:
        answers["generated_by"] = EVALUATED if generate is None else ENGINE
    return answers


def engine_generator(source: Path, kv_cache: str):
    """Greedy generation on the engine running ``source``, opened at the first request: for
    ``QuantbenchLM(generate=...)``."""
    from runner.engine.llm import LLM
    from runner.engine.sampling import SamplingParams

    engine: list[LLM] = []

    def generate(prompts: list[list[int]], settings: list[dict]) -> list[str]:
        if not engine:
            engine.append(LLM(source, kv_cache_dtype=kv_cache, kv_memory=0.25))
        params = [SamplingParams(max_tokens=k["max_gen_toks"], temperature=0, stop=k["until"] or None) for k in settings]
        return [out.text for out in engine[0].generate(prompts, params)]

    return generate


def _yaml_task_name(path: Path) -> str:
    config = read_yaml(path)
    config = config if isinstance(config, dict) else {}
    name = config["task"] if isinstance(config.get("task"), str) else config.get("group")
    if not isinstance(name, str) or not name:
        raise InputError(f"{path}: an lm-eval task YAML needs a 'task' (or 'group') name")
    return name


class _Lenient(yaml.SafeLoader):
    """lm-eval's YAML tags (``!function utils.process_docs``) read as plain values: only the
    names and file paths are wanted here, and nothing is ever executed."""


_Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)


def read_yaml(path: Path):
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_Lenient)
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the task YAML ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: malformed YAML ({' '.join(str(e).split())[:200]})") from None
