"""``python -m bench.ffi_launch [MxN,...] [--out DIR]``: the Pallas forward of rows held in registers, launched by
XLA against the same kernel compiled by the ``triton`` package and launched by jaxlib's Triton call
(``pallas_norm.triton_ffi``, ``Config.ffi_launch``), per tile (rows per program, warps), beside ``impl=None`` and
Mosaic GPU; and whether the torch launch route (``backend="pallas"``) gives ``impl=None``'s bits.

Every variant is timed from JAX by its kernels' durations over rotated inputs (``timing.time_kernels``, the suite's
method), in two rounds in one process. Writes ``ffi_launch_<gpu>.md`` and ``.json``; the committed table is what
``pallas_config.FWD_FFI_RESIDENT`` cites. Bytes: 2·M·N·2.
"""

from __future__ import annotations

import argparse

import torch

from bench import report, timing
from pallas_norm.pallas_config import next_pow2

SHAPES = ((4096, 8192), (32768, 8192), (4096, 16384), (32768, 16384), (8192, 32768), (16384, 32768))
TILES = ((1, 8), (1, 16), (1, 32))


def _variants(n: int) -> dict[str, dict]:
    """name -> ``rms_norm`` keyword arguments: each tile launched by XLA and by jaxlib's call, Mosaic, the default."""
    from pallas_norm.pallas_config import Config

    out = {}
    for rows, warps in TILES:
        for ffi in (False, True):
            cfg = Config(rows, next_pow2(n), warps, ffi_launch=ffi)
            out[f"({rows}, {warps}) {'jaxlib' if ffi else 'XLA'}"] = dict(impl="pallas", config=cfg)
    return {**out, "mosaic": dict(impl="mosaic"), "impl=None": dict(impl=None)}


def _torch_route_bits(m: int, n: int, x, w) -> bool:
    """Whether the torch launch route's forward (what ``backend="pallas"`` runs on CUDA tensors) gives JAX's bits."""
    import jax

    import pallas_norm
    from torch_bridge import launch_route

    y_jax = torch.from_dlpack(jax.block_until_ready(pallas_norm.rms_norm(x, w, eps=timing.EPS)))
    xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
    launcher = launch_route.forward_launcher(m, n, xt.dtype, wt.dtype, timing.EPS, 0.0, "llama", xt.get_device())
    return bool(torch.equal(launcher(xt, wt)[0], y_jax))


def run(shapes=SHAPES) -> dict:
    import jax

    import pallas_norm
    from bench.providers import jax_owned

    rows, bits = [], {}
    for m, n in shapes:
        reps = timing.rotations(m * n * 2)
        sets = [tuple(jax_owned(t) for t in timing.inputs(m, n, torch.bfloat16, 0.0, seed=i)[:2]) for i in range(reps)]
        variants = _variants(n)
        for rnd, order in enumerate((list(variants), list(variants)[::-1])):
            for name in order:
                kw = variants[name]
                f = jax.jit(lambda ss, kw=kw: [pallas_norm.rms_norm(x, w, eps=timing.EPS, **kw) for x, w in ss])
                fn = lambda f=f: f(sets)  # noqa: E731
                fn.reps = reps
                try:
                    tbps = 2 * m * n * 2 / timing.time_kernels(fn, timing.sync_any) / 1e12
                except Exception as err:  # noqa: BLE001 - a variant that cannot run here is recorded, not fatal
                    tbps = None
                    print(m, n, name, "failed:", type(err).__name__, str(err)[:200], flush=True)
                rows.append(dict(m=m, n=n, variant=name, round=rnd, tbps=tbps))
                print(m, n, name, rnd, tbps, flush=True)
        bits[f"{m}x{n}"] = _torch_route_bits(m, n, *sets[0])
        del sets
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype="bfloat16", casting="llama"), rows=rows, torch_route_bits=bits)


def markdown(result: dict) -> str:
    env, rows = result["env"], result["rows"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["m"], r["n"]), {}).setdefault(r["variant"], []).append(r["tbps"])
    names = list(next(iter(groups.values()))) if groups else []
    fmt = lambda vs: "err" if None in vs else " / ".join(f"{v:.3f}" for v in vs)  # noqa: E731
    out = [f"# The resident forward launched by XLA or by jaxlib's Triton call: {env['gpu']}, bf16, casting=llama", "",
           f"{timing.versions(env)}. Made by "
           "`python -m bench.ffi_launch`: TB/s (round 1 / round 2) by the kernels' own durations over rotated inputs, "
           "from JAX. A tile is (rows per program, warps); `XLA`: the `pallas_call` launched by XLA (which asks the "
           "most shared memory, the least L1, of every kernel using any); `jaxlib`: the same Triton IR compiled by "
           "the triton package and launched by jaxlib's Triton call (`Config.ffi_launch`). `torch route = JAX`: the "
           "torch launch route's forward gives `impl=None`'s bits.", "",
           "| M×N | " + " | ".join(names) + " | torch route = JAX |", "|---|" + "---|" * (len(names) + 1)]
    for (m, n), by in groups.items():
        same = result["torch_route_bits"].get(f"{m}x{n}")
        out.append(f"| {m}×{n} | " + " | ".join(fmt(by[k]) for k in names) + f" | {'yes' if same else 'NO'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ffi_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="?", type=timing.parse_shapes, default=SHAPES, help="comma-separated MxN")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if (code := timing.gpu_or_exit_code(parser.prog)) is not None:
        return code
    result = run(args.shapes)
    print(report.save_table(result, args.out, "ffi_launch", markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
