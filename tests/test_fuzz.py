"""The fuzzer of tests/helpers/fuzz_inputs.py on a fixed seed and a budget that runs in well under a minute:
hundreds of damaged GGUF, safetensors and config.json files through `inspect`, `fit` and `export`,
under a memory limit and a time limit, with the safetensors library and llama.cpp's GGUF parser as
oracles. It fails on any traceback, hang, memory error, slow refusal, leftover file, or a process
it leaves behind. (A longer run: the README's command.)"""

import json
import os
import subprocess
import sys
import uuid

from conftest import REPO
from helpers.processes import tagged_processes


def test_hundreds_of_damaged_files_get_clean_answers(tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "fuzz_inputs.py"), "--cases", "1500", "--seed", "20261201", "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "QUANTBENCH_TEST_TAG": tag},
    )
    failures = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert proc.returncode == 0 and not failures, "\n".join(failures) or proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["cases"] == 1500 and summary["failed"] == 0
    assert summary["llama_cpp_oracle"], "llama-cpp-python (the interop extra) is installed by make test"
    assert summary["refused"] > 1000 and summary["accepted"] > 200, summary  # the mutations reach both outcomes
    assert not tagged_processes(tag)
    assert not list(tmp_path.rglob("*.partial"))
