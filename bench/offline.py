"""``python -m bench.offline MxN,... [--fwd] [--fused] [--dtype D] [--casting C]``: the Pallas kernels (Triton
lowering, ``impl="pallas"``) of a forward or backward on an H100, without one: lowered for an abstract H100 of 132
SMs, each kernel's Triton IR compiled by the ``triton`` package for sm_90 the way jaxlib's launch compiles it
(``pallas_norm.triton_ffi``: its warps and stages; ``register_cap`` and ``pin_rounding``'s PTX where a persistent grid
would be launched that way) and assembled by ``ptxas -v`` (the one ``triton`` ships). Per kernel: registers, spill
bytes, static shared memory, the ``bar.sync`` barriers inside loops (a cross-warp exchange every iteration) and the
floating-point ops the assembler may contract into FMAs.

The config is the GPU's heuristic (``pallas_config.heuristic`` as where ``triton_ffi`` is available), lowered as XLA
would launch it: the Triton IR is the same for both launches. XLA compiles its launches with its own Triton, so for
kernels XLA launches this reads the ``triton`` package's compile, not XLA's. Thirty-ninth session
(``bench/results/probes_h100_2026-11-28_thirtyninth.md`` §5): the per-head backward at 256 columns held three
barriers per row block, which the same binary launched by jaxlib ran at half XLA's speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import jax
import torch

from bench import ptxas, timing
from pallas_norm import backend, pallas_config, triton_ffi
from torch_bridge import launch_route
from torch_bridge.xla_program import parse_program

SMS = 132  # an H100's
SHARED_PER_SM = 228 * 1024  # bytes of shared memory an H100 SM holds, of which each resident program reserves
SHARED_RESERVED = 1024  # bytes (the driver's)
PROGRAMS_PER_SM = 32  # resident programs (thread blocks) per SM, at most
_LOOP = re.compile(r"^(\$L__BB\d+_\d+):.*Loop Header", re.M)


@dataclasses.dataclass(frozen=True)
class Report:
    """One kernel's ``ptxas -v`` resources (``maxnreg``: the cap it was assembled under, None for none), its
    barriers (``barriers`` in the whole kernel, ``loop_barriers`` inside loops), ``contractible``: the PTX's
    floating-point ``mul``/``add``/``sub`` without a rounding modifier (0 where jaxlib would launch it: pinned),
    ``per_sm``: how many of its programs an SM holds at once (``programs_per_sm``) and ``asks``: how many its
    persistent grid puts on each SM (None for a grid of row blocks, which runs in waves)."""

    name: str
    num_warps: int
    grid: tuple[int, int, int]
    maxnreg: int | None
    registers: int
    spill_stores: int
    shared: int
    barriers: int
    loop_barriers: int
    contractible: int
    per_sm: int
    asks: int | None = None

    def line(self) -> str:
        """The report as the CLIs print it."""
        return (f"{self.name} warps={self.num_warps} grid={self.grid} maxnreg={self.maxnreg}: {self.registers} "
                f"registers, {self.spill_stores} B spilled, {self.shared} B shared, {self.barriers} barriers "
                f"({self.loop_barriers} in loops), {self.contractible} contractible ops, {self.per_sm} per SM"
                + (f" (its grid asks {self.asks})" if self.asks else ""))


def programs_per_sm(registers: int, num_warps: int, shared: int) -> int:
    """How many programs of ``num_warps`` warps, ``registers`` per thread and ``shared`` bytes of shared memory an H100
    SM holds at once: what its register file holds (``ptxas.resident_ctas``: allocated per warp in steps of 256), at
    most ``pallas_config.THREADS_PER_SM`` threads and ``PROGRAMS_PER_SM`` programs, each program's shared memory plus
    ``SHARED_RESERVED`` from ``SHARED_PER_SM``."""
    threads = 32 * num_warps
    return min(ptxas.resident_ctas(registers, threads), pallas_config.THREADS_PER_SM // threads,
               SHARED_PER_SM // (shared + SHARED_RESERVED), PROGRAMS_PER_SM)


def abstract_h100():
    """A context in which ``jax.jit(...).lower`` targets an (abstract) H100 of ``SMS`` SMs, without one: the Triton IR
    and modules XLA would receive there."""
    device = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", SMS, "cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


@contextlib.contextmanager
def _on_h100(model: str = "") -> Iterator[None]:
    """``abstract_h100`` with ``backend.num_sms`` reading ``SMS`` (the heuristics' grids) and ``backend.gpu_model``
    ``model`` (the per-model tables', e.g. "h200": the same chip and SM count)."""
    saved = backend.num_sms, backend.gpu_model
    backend.num_sms, backend.gpu_model = (lambda: SMS), (lambda: model)
    try:
        with abstract_h100():
            yield
    finally:
        backend.num_sms, backend.gpu_model = saved


def gpu_config(m: int, n: int, *, backward: bool, fused: bool = False) -> pallas_config.Config:
    """The heuristic's config on an H100 where ``triton_ffi`` is available (inside ``_on_h100``)."""
    saved = pallas_config._available
    pallas_config._available = lambda: True
    try:
        return pallas_config.heuristic(m, n, backward=backward, fused=fused)
    finally:
        pallas_config._available = saved


def loop_barriers(ptx: str) -> int:
    """``bar.sync`` lines between each loop header's label and the last branch back to it."""
    count = 0
    for found in _LOOP.finditer(ptx):
        body = ptx[found.end():]
        backs = list(re.finditer(rf"\bbra(?:\.uni)?\s+{re.escape(found.group(1))};", body))
        count += body[:backs[-1].start()].count("bar.sync") if backs else 0
    return count


def assemble(ptx: str) -> dict[str, int]:
    """``ptxas -v`` (the one ``triton`` ships) of one kernel's PTX for sm_90a: its registers, spill stores, stack."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    (res,) = ptxas.parse(out).values()
    return res


def compile_kernel(name: str, ttir: str, num_warps: int, num_stages: int, grid, maxnreg: int | None,
                   pinned: bool = False, persistent: bool = False) -> Report:
    """``ttir`` compiled for sm_90 by the ``triton`` package (``triton_ffi.triton_binary``; ``pinned``: its PTX through
    ``triton_ffi.pin_rounding``, as jaxlib's launch assembles it) and assembled by ptxas; ``persistent``: its grid
    is a persistent one (``Report.asks``)."""
    binary = triton_ffi.triton_binary(ttir, 90, num_warps, num_stages, maxnreg)
    ptx = triton_ffi.pin_rounding(binary.asm["ptx"]) if pinned else binary.asm["ptx"]
    res = assemble(ptx)
    shared = binary.metadata.shared
    return Report(name, num_warps, tuple(grid), maxnreg, res["registers"], res["spill_stores"], shared,
                  ptx.count("bar.sync"), loop_barriers(ptx), triton_ffi.contractible_ops(ptx),
                  programs_per_sm(res["registers"], num_warps, shared),
                  pallas_config.cdiv(grid[0], SMS) if persistent else None)


def reports(m: int, n: int, *, backward: bool = True, fused: bool = False, dtype: torch.dtype = torch.bfloat16,
            casting: str = "llama", config: pallas_config.Config | None = None, model: str = "") -> list[Report]:
    """Every Triton-lowered kernel of ``impl="pallas"``'s forward or backward of ``m`` × ``n`` ``dtype`` rows
    (weight in ``dtype``; ``fused``: the fused add's) on ``config`` (None: ``gpu_config``, with ``model``'s
    per-model tables), in launch order."""
    offset = timing.casting_offset(casting)
    with _on_h100(model):
        config = config or gpu_config(m, n, backward=backward, fused=fused)
        lowered = dataclasses.replace(config, ffi_launch=False)  # a Pallas config: the launch route lowers "pallas"
        if backward:
            module = launch_route._lower_backward(m, n, dtype, dtype, offset, casting, lowered, fused)
        else:
            module = launch_route._lower_forward(m, n, dtype, dtype, 1e-6, offset, casting, lowered,
                                                 *((dtype, dtype) if fused else ()))
        module = module.compiler_ir("stablehlo")
        cap = pallas_config.register_cap(config) if config.ffi_launch else None
    # jaxlib launches the config's kernel (not the dweight reduction); a persistent grid walks several row blocks
    by_jaxlib = lambda c: config.ffi_launch and not c.name.endswith("dweight_reduce")  # noqa: E731
    persistent = lambda c: (config.programs is not None and c.grid[0] == config.programs  # noqa: E731
                            and config.programs < pallas_config.cdiv(m, config.block_rows))
    return [compile_kernel(c.name, c.ttir, c.num_warps, c.num_stages, c.grid, cap if by_jaxlib(c) else None,
                           pinned=by_jaxlib(c), persistent=persistent(c)) for c in parse_program(module).calls]


def parser(prog: str = "python -m bench.offline", what: str = "The Pallas kernels") -> argparse.ArgumentParser:
    """The CLI: shapes, ``--fwd``, ``--fused``, ``--dtype``, ``--casting`` (the module docstring)."""
    p = argparse.ArgumentParser(prog=prog, description=f"{what} compiled for an H100 without one: registers, spills, "
                                "shared memory, barriers inside loops.")
    p.add_argument("shapes", type=timing.parse_shapes, help="comma-separated MxN")
    p.add_argument("--fwd", action="store_true", help="the forward's kernels (default: the backward's)")
    p.add_argument("--fused", action="store_true", help="the fused residual add's kernels")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--casting", default="llama", choices=("llama", "gemma", "none"))
    p.add_argument("--model", default="", help='the GPU model whose per-model tables apply, e.g. "h200"')
    return p


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    for m, n in args.shapes:
        for r in reports(m, n, backward=not args.fwd, fused=args.fused, dtype=getattr(torch, args.dtype),
                         casting=args.casting, model=args.model):
            print(f"{m}x{n} {r.line()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
