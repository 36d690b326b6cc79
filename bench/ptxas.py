"""ptxas's resource report of the Mosaic GPU kernels compiled in this process: registers, spills, and what the
registers leave of an SM.

Mosaic GPU's runtime compiles each kernel in-process and, with ``MOSAIC_GPU_DUMP_PTXAS=1`` in the environment,
prints ptxas's verbose report on the process's own file descriptors (the C library's standard output, past
Python's ``sys.stdout``; seen on the H100). ``capture()`` redirects descriptors 1 and 2 while kernels compile
and parses what ptxas said. The Triton-lowered kernels' resources come from the driver instead
(``torch_bridge.cuda_driver.CudaKernel.registers``).

Why it matters (H100, 2026-11-25, ``bench/results/mosaic_long_rows_experiments_h100.md``): the Mosaic backward
reaches 255 registers per thread from 8192 columns per CTA, which leaves 2 CTAs of one warpgroup per SM whatever
``programs_per_sm`` asks for.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from pallas_norm import backend, mosaic_config
from pallas_norm.pallas_config import REGISTERS_PER_SM

ENV = "MOSAIC_GPU_DUMP_PTXAS"
WARP_ALLOCATION = 256  # registers are allocated per warp in units of 256

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def parse(text: str) -> dict[str, dict[str, int]]:
    """``{kernel: {"registers", "spill_stores", "stack"}}`` from ptxas's verbose report (``-v``): each entry
    function's "Function properties" line and its "Used N registers" line."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name = m.group(1)
            out[name] = {"registers": 0, "spill_stores": 0, "stack": 0}
        elif name is not None and (m := _FRAME.search(line)):
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)))
        elif name is not None and (m := _USED.search(line)):
            out[name]["registers"] = int(m.group(1))
    return out


def resident_ctas(registers: int, threads: int) -> int:
    """CTAs of ``threads`` threads that the register file of one SM holds at ``registers`` per thread."""
    per_warp = -(-registers * 32 // WARP_ALLOCATION) * WARP_ALLOCATION
    return REGISTERS_PER_SM // (per_warp * -(-threads // 32)) if registers else 0


@contextlib.contextmanager
def capture() -> Iterator[dict[str, dict[str, int]]]:
    """Collects ``parse``'s report of every Mosaic kernel compiled inside the block (filled on exit). Sets
    ``MOSAIC_GPU_DUMP_PTXAS`` for the process (Mosaic reads it when it compiles); what else is written to standard
    output or error meanwhile is passed on (to standard error, after the block)."""
    os.environ[ENV] = "1"
    report: dict[str, dict[str, int]] = {}
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile() as tmp:
        for fd in saved:
            os.dup2(tmp.fileno(), fd)
        try:
            yield report
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            report.update(parse(text))
            rest = [line for line in text.splitlines() if not line.startswith(("ptxas", "    "))]
            if any(line.strip() for line in rest):
                print("\n".join(rest), file=sys.stderr, flush=True)


def mosaic_resources(report: dict[str, dict[str, int]], mode: str, plan: mosaic_config.Plan | None) -> str:
    """The main kernel's line of ptxas's ``report`` (``capture``): registers, spill bytes, and the CTAs per
    SM those registers allow against the ones the plan's persistent grid asks for ("" when nothing was compiled:
    a launcher built earlier)."""
    main = next((r for name, r in report.items() if f"norm_{mode}" in name and "reduce" not in name), None)
    if main is None:
        return ""
    text = f"{main['registers']} regs, {main['spill_stores']} B spilled"
    if plan is not None:
        asked = -(-plan.programs * plan.cluster // backend.num_sms())
        text += f", {resident_ctas(main['registers'], mosaic_config.THREADS)} CTAs/SM by registers (asks {asked})"
    return text
