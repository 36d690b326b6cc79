"""``python -m bench.offline_triton MxN,... [--fwd] [--fused] [--dtype D] [--casting C] [--model M]``: the Triton
reference's kernels of a forward or backward compiled for sm_90 without a GPU, as ``bench.offline`` does for the
Pallas kernels.

The reference's own launcher runs on ``meta`` tensors of the shape with every launch captured
(``triton_launch.launch``, on an abstract GPU of 132 SMs named ``model``): each kernel, its grid, arguments and
meta-parameters. Each is specialised as Triton specialises a launch (its arguments' types and 16-divisibility, ints
of 1 as constants), compiled by the ``triton`` package and assembled by ``ptxas -v``. Per kernel: registers, spill
bytes, shared memory, barriers (in loops too), how many programs an SM holds at once and how many its persistent
grid puts on each SM (``--maxnreg``: assembled under that register cap instead of the launcher's). Forty-ninth
session: the fused add's backward of Gemma's rows of 2560 and 5120 held as pieces took 162 registers, so 3 of the 4
(2560, 4 warps) and 1 of the 2 (5120, 8 warps) programs per SM its grid asks fitted at once; under a cap of 128 all
fit, spilling 24 B. Since the fiftieth the launcher asks that cap (``triton_kernels.backward_register_cap``). The
pieces' backward at 2304 on 4 warps (157 registers, Llama's product) would fit 3 of 4; on 2 warps (the heuristic's)
239 registers, 4 fit.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from unittest import mock

import torch

from bench import offline, timing
from pallas_norm import triton_ffi
from pallas_norm.pallas_config import cdiv

SMS = offline.SMS


@contextlib.contextmanager
def captured(model: str = "h200", sms: int = SMS) -> Iterator[list[tuple]]:
    """Within: the reference's launches append ``(kernel, grid, args, meta)`` instead of running, on a GPU of ``sms``
    SMs named ``model``; a launch naming ``max_registers`` is compiled as the launcher does, its ``meta`` given that
    cap as ``maxnreg`` where it takes more registers (``triton_launch.fitted_cap``)."""
    from torch_bridge import triton_launch

    calls: list[tuple] = []

    def capture(key, kernel, grid, args, meta, *, interpret):
        meta = meta()
        cap = triton_launch.fitted_cap(meta.pop("max_registers", None),
                                       lambda: report(kernel, tuple(grid), tuple(args), meta).registers)
        calls.append((kernel, tuple(grid), tuple(args), {**meta, "maxnreg": cap} if cap else meta))

    with mock.patch.object(triton_launch, "launch", capture), \
            mock.patch.object(triton_launch, "sm_count", lambda x: sms), \
            mock.patch.object(triton_launch, "gpu_model", lambda x: model):
        yield calls


def specialization(kernel, args: tuple, meta: dict) -> tuple[dict, dict, dict, dict]:
    """``(signature, constexprs, attrs, options)`` of a launch as Triton's JIT builds them: each argument's type
    and specialisation (``native_specialize_impl``: 16-divisible pointers and ints, ints of 1 constant), the
    meta-parameters named by the kernel as constexprs, the rest (``num_warps``, ...) as compile options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, args)):
        kind, spec = native_specialize_impl(CUDABackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = spec
        elif isinstance(spec, str) and (parsed := CUDABackend.parse_attr(spec)):
            attrs[(i,)] = parsed
    for name in kernel.arg_names[len(args):]:
        signature[name] = "constexpr"
        constexprs[name] = meta[name]
    options = {k: v for k, v in meta.items() if k not in kernel.arg_names}
    return signature, constexprs, attrs, options


def report(kernel, grid: tuple, args: tuple, meta: dict) -> offline.Report:
    """One captured launch compiled for sm_90 and assembled (``offline.Report``); ``asks``: programs per SM of a
    grid whose programs walk several row blocks (an ``ITERS`` argument above 1), else None."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature, constexprs, attrs, options = specialization(kernel, args, meta)
    binary = compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                     options=options)
    ptx = binary.asm["ptx"]
    res = offline.assemble(ptx)
    named = dict(zip(kernel.arg_names, args))
    persistent = isinstance(named.get("ITERS"), int) and named["ITERS"] > 1
    warps = options.get("num_warps", 4)
    shared = binary.metadata.shared
    return offline.Report(kernel.__name__, warps, grid, options.get("maxnreg"), res["registers"],
                          res["spill_stores"], shared, ptx.count("bar.sync"), offline.loop_barriers(ptx),
                          triton_ffi.contractible_ops(ptx),
                          offline.programs_per_sm(res["registers"], warps, shared),
                          cdiv(grid[0] * (grid[1] if len(grid) > 1 else 1), SMS) if persistent else None)


def launches(m: int, n: int, *, backward: bool = True, fused: bool = False, dtype: torch.dtype = torch.bfloat16,
             casting: str = "llama", model: str = "h200") -> list[tuple]:
    """Every launch ``(kernel, grid, args, meta)`` the reference makes for the forward (or ``backward``; ``fused``:
    the fused add's) of ``m`` × ``n`` ``dtype`` rows with a weight of that dtype, in order (``captured``)."""
    from torch_bridge import triton_kernels

    offset = timing.casting_offset(casting)
    x = torch.empty((m, n), dtype=dtype, device="meta")
    w = torch.empty((n,), dtype=dtype, device="meta")
    rstd = torch.empty((m,), dtype=torch.float32, device="meta")
    with captured(model) as calls:
        if backward:
            triton_kernels.rms_norm_bwd(x, x, w, rstd, offset, casting, True, True, dh_out=x if fused else None)
        else:
            fused_kw = dict(residual=x, h_dtype=dtype) if fused else {}
            triton_kernels.rms_norm_fwd(x, w, 1e-6, offset, casting, **fused_kw)
    return calls


def reports(m: int, n: int, *, maxnreg: int | None = None, **kw) -> list[offline.Report]:
    """``report`` of every one of ``launches(m, n, **kw)``; ``maxnreg``: the kernels walking rows (all but the
    dweight reduction) assembled under that register cap (0: none, whatever cap the launcher asked; None: as
    launched, ``triton_kernels.backward_register_cap``'s)."""
    def capped(kernel, meta: dict) -> dict:
        if maxnreg is None or "dweight" in kernel.__name__:
            return meta
        uncapped = {k: v for k, v in meta.items() if k != "maxnreg"}
        return {**uncapped, "maxnreg": maxnreg} if maxnreg else uncapped

    return [report(kernel, grid, args, capped(kernel, meta)) for kernel, grid, args, meta in launches(m, n, **kw)]


def main(argv: list[str]) -> None:
    p = offline.parser("python -m bench.offline_triton", "The Triton reference's kernels")
    p.set_defaults(model="h200")
    p.add_argument("--maxnreg", type=int, default=None,
                   help="assemble the row kernels under this register cap (0: none; default: the launcher's)")
    args = p.parse_args(argv)
    for m, n in args.shapes:
        for r in reports(m, n, backward=not args.fwd, fused=args.fused, dtype=getattr(torch, args.dtype),
                         casting=args.casting, model=args.model, maxnreg=args.maxnreg):
            print(f"{m}x{n} {r.line()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
