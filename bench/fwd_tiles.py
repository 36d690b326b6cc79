"""``python -m bench.fwd_tiles [MxN,...] [--casting C] [--kernels K,...] [--out DIR]``: the resident forward's tile
(rows per program × warps) at every candidate holding 8-64 elements per thread, and the heuristic's, for the Pallas
kernels from JAX (``rms_norm``, and the fused add's ``rms_norm_add``, whose forward has its own table) and for the
Triton reference from torch (``triton``, and its fused add's forward ``triton_add``; each tile with the row length a
run-time argument and a compile-time constant, ``Config.n_const``, as a third element).

Every candidate is timed by its kernels' durations over rotated inputs (``timing.time_kernels``, the suite's method;
JAX's through XLA's launch), with the resident forward's L1 hints (``l1_hints.resident``), in two rounds, the second
in reverse order, in one process. Writes ``fwd_tiles_<gpu>.md`` and ``.json``: per shape and kernel the heuristic's
tile (where the heuristic takes two passes, the resident tile of its rows and warps), the fastest (by the slower of
its two rounds) and every candidate. The committed tables are what ``pallas_config.FWD_RESIDENT``/
``FWD_ADD_RESIDENT`` and ``triton_config.FWD_RESIDENT``/``FWD_RESIDENT_BY_MODEL`` cite. Bytes: the plain forward
2·M·N·2, the fused add's 4·M·N·2 (x and residual in, y and h out).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import report, suite, timing
from pallas_norm import l1_hints
from pallas_norm.pallas_config import next_pow2

SHAPES = tuple((m, n) for m in (4096, 32768) for n in suite.NS)
KERNELS = ("pallas", "pallas_add", "triton", "triton_add")
TRITON = ("triton", "triton_add")  # tiles (rows, warps, n_const)
BYTES = {"pallas": 2, "pallas_add": 4, "triton": 2, "triton_add": 4}  # bytes moved per element (× itemsize 2)
CASTINGS = ("llama", "gemma")


def candidates(n: int) -> list[tuple[int, int]]:
    """(rows, warps) of resident tiles of ``n`` columns (padded to a power of two) at most 16384 elements, with
    8-64 elements per thread."""
    n_pad = next_pow2(n)
    rows = [1 << k for k in range(max(1, 16384 // n_pad).bit_length())]
    return [(r, w) for r in rows for w in (1, 2, 4, 8, 16, 32)
            if r * n_pad <= 16384 and 8 <= r * n_pad // (32 * w) <= 64]


def kernel_tiles(kernel: str, n: int) -> list[tuple]:
    """``candidates(n)``; for the Triton reference's kernels each with run-time N and N constant."""
    if kernel in TRITON:
        return [(r, w, const) for r, w in candidates(n) for const in (False, True)]
    return candidates(n)


def _heuristic(kernel: str, m: int, n: int, casting: str = "llama") -> tuple:
    """The heuristic's (rows, warps) (the Triton reference's with n_const) for 16-bit rows, on this GPU's model and
    SM count where there is a GPU (else 132 SMs and no model)."""
    if kernel in TRITON:
        from torch_bridge import triton_config, triton_launch

        x = torch.empty(0, device="cuda") if torch.cuda.is_available() else torch.empty(0)
        c = triton_config.forward_config(n, triton_launch.sm_count(x) if x.is_cuda else 132, 2, casting == "llama",
                                         m, kernel == "triton_add", triton_launch.gpu_model(x))
        return c.block_m, c.num_warps, c.n_const
    from pallas_norm import pallas_config
    c = pallas_config.heuristic(m, n, backward=False, fused=kernel == "pallas_add", product_in_dtype=casting == "llama")
    return c.block_rows, c.num_warps


def _callables(kernel: str, m: int, n: int, casting: str = "llama"):
    """``tile -> zero-argument callable`` running the forward once per rotated input set (``.reps`` of them)."""
    reps = timing.rotations(m * n * 2 * BYTES[kernel] // 2)
    offset, hints = timing.casting_offset(casting), l1_hints.resident(next_pow2(n))
    sets = [timing.inputs(m, n, torch.bfloat16, offset, seed=i) for i in range(reps)]  # dy: the fused add's residual
    if kernel in TRITON:
        from torch_bridge import triton_config, triton_kernels

        def make(tile):
            cfg = triton_config.Config(tile[0], next_pow2(n), tile[1], l1_hints=hints, n_const=tile[2])
            if kernel == "triton_add":
                return lambda: [triton_kernels.rms_norm_fwd(x, w, timing.EPS, offset, casting, cfg, residual=r,
                                                            h_dtype=x.dtype) for x, w, r in sets]
            return lambda: [triton_kernels.rms_norm_fwd(x, w, timing.EPS, offset, casting, cfg) for x, w, _ in sets]
        return make, reps
    import jax

    import pallas_norm
    from bench.providers import jax_owned
    from pallas_norm.pallas_config import Config

    own = [tuple(jax_owned(t) for t in s) for s in sets]
    del sets
    kw = dict(eps=timing.EPS, offset=offset, casting=casting, impl="pallas")

    def make(tile):
        cfg = Config(tile[0], next_pow2(n), tile[1], l1_hints=hints)
        if kernel == "pallas_add":
            f = jax.jit(lambda ss: [pallas_norm.rms_norm_add(x, r, w, config=cfg, **kw) for x, w, r in ss])
        else:
            f = jax.jit(lambda ss: [pallas_norm.rms_norm(x, w, config=cfg, **kw) for x, w, _ in ss])
        return lambda: f(own)
    return make, reps


def _tile_of(row: dict) -> tuple:
    return (row["rows"], row["warps"]) if row.get("n_const") is None else (row["rows"], row["warps"], row["n_const"])


def run(shapes=SHAPES, kernels=KERNELS, casting: str = "llama") -> dict:
    rows = []
    for (m, n), kernel in ((s, k) for s in shapes for k in kernels):
        make, reps = _callables(kernel, m, n, casting)
        tiles = kernel_tiles(kernel, n)
        if (heur := _heuristic(kernel, m, n, casting)) not in tiles:  # timed beside them whatever its elements/thread
            tiles = [heur] + tiles
        for rnd, order in enumerate((tiles, tiles[::-1])):
            for tile in order:
                fn = make(tile)
                fn.reps = reps
                sec = timing.time_kernels(fn, timing.sync_any)
                tbps = BYTES[kernel] * m * n * 2 / sec / 1e12
                const = dict(n_const=tile[2]) if kernel in TRITON else {}
                rows.append(dict(kernel=kernel, m=m, n=n, rows=tile[0], warps=tile[1], **const, round=rnd, tbps=tbps))
                print(kernel, m, n, tile, rnd, f"{tbps:.3f}", flush=True)
        del make
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype="bfloat16", casting=casting), rows=rows)


def markdown(result: dict) -> str:
    env, rows = result["env"], result["rows"]
    casting = env.get("casting", "llama")
    out = [f"# The resident forward's tile: {env['gpu']}, bf16, casting={casting}", "",
           f"{timing.versions(env)}. Made by "
           "`python -m bench.fwd_tiles`: TB/s by the kernels' own durations over rotated inputs, two rounds (the "
           "second in reverse order) in one process; `pallas` and `pallas_add` (the fused add's forward, 4·M·N·2 bytes) "
           "from JAX, `triton` and `triton_add` (the Triton reference's) from torch. A tile is (rows per program, "
           "warps), the Triton reference's with N a compile-time constant or not; the fastest is by the slower of "
           "its two rounds.", "", "| kernel | M×N | heuristic | heuristic TB/s | fastest | fastest TB/s | "
           "every tile: TB/s (round 1 / round 2) |", "|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["m"], r["n"]), {}).setdefault(_tile_of(r), []).append(r["tbps"])
    for (kernel, m, n), tiles in groups.items():
        heur = _heuristic(kernel, m, n, casting)
        best = max(tiles, key=lambda t: min(tiles[t]))
        every = "; ".join(f"{t}: " + " / ".join(f"{v:.2f}" for v in vs) for t, vs in tiles.items())
        h = f"{min(tiles[heur]):.3f}" if heur in tiles else "–"
        out.append(f"| {kernel} | {m}×{n} | {heur} | {h} | {best} | {min(tiles[best]):.3f} | {every} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fwd_tiles", description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="?", type=timing.parse_shapes, default=SHAPES, help="comma-separated MxN")
    parser.add_argument("--kernels", type=lambda t: tuple(t.split(",")), default=KERNELS, help=", ".join(KERNELS))
    parser.add_argument("--casting", default="llama", choices=CASTINGS)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if unknown := set(args.kernels) - set(KERNELS):
        parser.error(f"--kernels takes {', '.join(KERNELS)}, got {sorted(unknown)}")
    if (code := timing.gpu_or_exit_code(parser.prog)) is not None:
        return code
    result = run(args.shapes, args.kernels, args.casting)
    stem = "fwd_tiles" if args.casting == "llama" else f"fwd_tiles_{args.casting}"
    print(report.save_table(result, args.out, stem, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
