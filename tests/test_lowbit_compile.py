"""The low-bit Triton kernel (runner/engine/kernels/lowbit_gemm.py) compiled for GPUs that are not
here, as ``matmul`` launches it by every row of its schedule tables: it builds for Hopper (sm_90)
and Ampere (sm_80), and on Hopper no variant spills registers or asks for more shared memory
than the chip has. Triton's interpreter (tests/test_lowbit_kernels.py) checks what the kernel
computes but not that a GPU build accepts it: a return inside a compile-time branch ran there and
failed to build here. Runs in its own process (helpers/triton_aot.py says why), about 25 s. The
same holds under Triton 3.6, the GPU machines' version (checked by hand with it on the path)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Triton is not imported here: tests/test_lowbit_kernels.py turns its interpreter on before it is.
TRITON = importlib.util.find_spec("triton")
TOOLS = Path(TRITON.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" if TRITON else None
pytestmark = pytest.mark.skipif(TOOLS is None or not (TOOLS / "cuobjdump").exists(),
                                reason="Triton, with its CUDA tools (ptxas, cuobjdump), is not installed")

REPO = Path(__file__).resolve().parents[1]
HOPPER_SHARED = 227 * 1024  # the most shared memory one block may have on an H100 or H200

COMPILE = """
import json, sys, torch
from helpers.triton_aot import compiling_for, resources
from core.schemes import QuantSpec
from core.tensors import QuantizedTensor
from quant.rtn import quantize_rtn
from runner.engine.kernels import lowbit_gemm

capability = int(sys.argv[1])
n = 1024
order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
act_order = quantize_rtn(torch.randn(n, n), QuantSpec(4, False, "group", 128))
act_order = QuantizedTensor(act_order.spec, act_order.codes, act_order.scales, act_order.zeros, (order // 128).int())
weights = {  # per dtype, the variants with the most registers
    torch.bfloat16: {"int4-g128-asym act-order": act_order, "int8-g128-asym": quantize_rtn(torch.randn(n, n), QuantSpec(8, False, "group", 128)),
                     "int4-g32-sym": quantize_rtn(torch.randn(n, n), QuantSpec(4, True, "group", 32))},
    torch.float32: {"int4-g128-asym": quantize_rtn(torch.randn(n, n), QuantSpec(4, False, "group", 128))},
}
tables = {torch.bfloat16: lowbit_gemm.SCHEDULES, torch.float32: lowbit_gemm.FP32_SCHEDULES}
report = []
for dtype, named in weights.items():
    for name, q in named.items():
        w = lowbit_gemm.pack(q, dtype, torch.device("cpu"))
        for rows_max, *tiles in tables[dtype]:
            rows = rows_max or 256
            plan = lowbit_gemm.schedule(rows, w, 132)._replace(split_k=2)  # a split, so the summing kernel builds too
            with compiling_for(capability) as compiled:
                lowbit_gemm.matmul(torch.zeros(rows, n, dtype=dtype), w, plan=plan)
                lowbit_gemm.dequantize(w, torch.empty(n * n, dtype=dtype))
            for kernel_name, kernel in compiled:
                report.append({"case": f"{dtype} {name} {rows} rows {kernel_name} {tuple(plan)}", **resources(kernel)})
print(json.dumps(report))
"""


def _compiled(capability: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    done = subprocess.run([sys.executable, "-c", COMPILE, str(capability)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_schedule_builds_for_hopper_without_spilling_registers():
    report = _compiled(90)
    kernels = {r["case"].split(" _")[1].split()[0] for r in report}
    assert kernels == {"gemm_kernel", "sum_splits_kernel", "dequantize_kernel"} and len(report) >= 3 * 10
    spilled = [r for r in report if r["stack"] > 0 or r["shared"] > HOPPER_SHARED]
    assert not spilled, spilled


def test_every_schedule_builds_for_ampere():
    assert all(r["registers"] <= 255 for r in _compiled(80))
