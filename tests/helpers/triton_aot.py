"""Triton kernels compiled for a CUDA GPU that is not on this machine, with Triton's own ptxas: a
launch inside ``compiling_for`` compiles the kernel as a launch on that GPU would and runs
nothing, so the code that launches it is the code checked. What the interpreter cannot see shows
up here: code a GPU build rejects, registers spilled to the stack, shared memory past the chip's.

Triton decides at decoration time whether a kernel is interpreted, so this runs in a process
without ``TRITON_INTERPRET`` (tests/test_lowbit_compile.py starts one)."""

from __future__ import annotations

import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class _AbsentGPU:
    """What a kernel launch asks of Triton's active driver, for a GPU of one compute capability."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextmanager
def compiling_for(capability: int) -> Iterator[list]:
    """Launches compile for compute capability ``capability`` (90: Hopper) instead of running;
    yields the list each compiled kernel is appended to, as (kernel name, compiled kernel)."""
    compiled, run, previous = [], JITFunction.run, driver._active  # no CUDA here: no default driver to reset to

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    driver.set_active(_AbsentGPU(capability))
    JITFunction.run = compile_only
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver.set_active(previous)


def resources(kernel) -> dict[str, int]:
    """A compiled kernel's registers per thread, stack bytes (spills) and shared memory bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        report = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                                check=True).stdout
    fields = dict(item.split(":") for line in report.splitlines() if "REG:" in line for item in line.split() if ":" in item)
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": kernel.metadata.shared}
