"""``python -m bench.ffi_launch [MxN,...] [--tiles R:W[:C],...] [--casting C] [--dtype D] [--routes plain,fused,torch]
[--out DIR]``: the Pallas forward of rows held in registers, launched by XLA against the same kernel compiled by the
``triton`` package and launched by jaxlib's Triton call (``pallas_norm.triton_ffi``, ``Config.ffi_launch``), per tile
(rows per program, warps; with the resident L1 hints the heuristic gives), beside ``impl=None`` and Mosaic GPU; and
whether the torch launch route (``backend="pallas"``) gives ``impl=None``'s bits.

Routes: ``plain`` ``rms_norm`` from JAX (2·M·N·s bytes), ``fused`` the fused add's forward ``rms_norm_add`` from JAX
(4·M·N·s: x and residual in, y and h out), ``torch`` the plain forward of the same config by the torch launch route
(``launch_route.forward_launcher``, which launches XLA's binary with the driver's carveout, or the ``triton``
package's where the config asks for jaxlib's launch; Mosaic GPU's variant: its module on the heuristic's
``MosaicConfig``, compiled by Mosaic GPU's runtime, as ``impl=None`` runs it where it lowers there). A tile that serves
JAX well can lose the torch route (probes_h200_2026-11-29_fortysixth.md §2-3), so the tables need all three.

Every variant is timed by its kernels' durations over rotated inputs (``timing.time_kernels``, the suite's method), in
two rounds in one process, the second in reverse order. Writes ``ffi_launch_<gpu>.md`` and ``.json`` (a table per
route); the committed tables are what ``pallas_config.FWD_FFI_RESIDENT`` and ``ffi_tables`` cite.
"""

from __future__ import annotations

import argparse

import torch

from bench import report, timing
from pallas_norm.pallas_config import next_pow2

SHAPES = ((4096, 8192), (32768, 8192), (4096, 16384), (32768, 16384), (8192, 32768), (16384, 32768))
TILES = ((1, 8), (1, 16), (1, 32))
ROUTES = ("plain", "fused", "torch")
BYTES = {"plain": 2, "fused": 4, "torch": 2}  # elements moved per row element, × the itemsize


def parse_tiles(text: str) -> tuple[tuple[int, ...], ...]:
    """``"R:W,R:W:C"`` as ``((R, W), (R, W, C))``: rows per program, warps and, for the forward in two passes over
    column chunks (``ffi_tables.FWD_FFI_TWO_PASS``' design), the chunk's columns."""
    try:
        tiles = tuple(tuple(int(v) for v in t.split(":")) for t in text.split(","))
    except ValueError:
        tiles = ()
    if not tiles or any(len(t) not in (2, 3) for t in tiles):
        raise argparse.ArgumentTypeError(f"tiles must be comma-separated ROWS:WARPS or ROWS:WARPS:CHUNK, got {text!r}")
    return tiles


def _variants(n: int, tiles=TILES) -> dict[str, dict]:
    """name -> ``rms_norm`` keyword arguments: each tile launched by XLA and by jaxlib's call, Mosaic, the default. A
    tile with a chunk shorter than the padded row walks the row twice with the L1 hints (the heuristic's two-pass
    forward: a persistent grid of one program per row block)."""
    from pallas_norm import l1_hints
    from pallas_norm.pallas_config import Config

    out, n_pad = {}, next_pow2(n)
    for rows, warps, *chunk in tiles:
        cols = min(chunk[0], n_pad) if chunk else n_pad
        resident = cols == n_pad
        hints = l1_hints.resident(cols) if resident else True
        programs = None if resident else 1 << 30  # fit() clamps it to the row blocks
        tile = f"({rows}, {warps})" if resident else f"({rows}, {warps}, {cols})"
        for ffi in (False, True):
            cfg = Config(rows, cols, warps, programs=programs, ffi_launch=ffi, l1_hints=hints)
            out[f"{tile} {'jaxlib' if ffi else 'XLA'}"] = dict(impl="pallas", config=cfg)
    return {**out, "mosaic": dict(impl="mosaic"), "impl=None": dict(impl=None)}


def _torch_route_bits(m: int, n: int, x, w, offset: float, casting: str) -> bool:
    """Whether the torch launch route's forward (what ``backend="pallas"`` runs on CUDA tensors) gives JAX's bits."""
    import jax

    import pallas_norm
    from torch_bridge import launch_route

    y_jax = pallas_norm.rms_norm(x, w, eps=timing.EPS, offset=offset, casting=casting)
    y_jax = torch.from_dlpack(jax.block_until_ready(y_jax))
    xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
    launcher = launch_route.forward_launcher(m, n, xt.dtype, wt.dtype, timing.EPS, offset, casting, xt.get_device())
    return bool(torch.equal(launcher(xt, wt)[0], y_jax))


def _timer(route: str, kw: dict, m: int, n: int, sets: list, tsets: list, offset: float, casting: str):
    """A zero-argument callable timing ``route`` of one variant over the rotated sets (seconds per call)."""
    import jax

    import pallas_norm
    from pallas_norm import mosaic_config
    from torch_bridge import launch_route

    args = dict(eps=timing.EPS, offset=offset, casting=casting, **kw)
    if route == "torch":
        x, w = tsets[0][:2]
        config = kw.get("config")
        if kw["impl"] == "mosaic":  # a MosaicConfig makes the route's lowering Mosaic GPU's (auto.lowering)
            config = mosaic_config.heuristic(m, n, backward=False, itemsize=x.element_size())
        launcher = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, offset, casting, x.get_device(),
                                                 config)
        return lambda: timing.time_sets(lambda a, b, _: launcher(a, b), tsets)
    if route == "fused":
        f = jax.jit(lambda ss: [pallas_norm.rms_norm_add(x, r, w, **args) for x, w, r in ss])
    else:
        f = jax.jit(lambda ss: [pallas_norm.rms_norm(x, w, **args) for x, w, _ in ss])
    fn = lambda: f(sets)  # noqa: E731
    fn.reps = len(sets)
    return lambda: timing.time_kernels(fn, timing.sync_any)


def run(shapes=SHAPES, tiles=TILES, casting: str = "llama", dtype: str = "bfloat16", routes=("plain",)) -> dict:
    from bench.providers import jax_owned

    offset = timing.casting_offset(casting)
    tdtype = getattr(torch, dtype)
    size = torch.finfo(tdtype).bits // 8
    rows, bits = [], {}
    for m, n in shapes:
        reps = timing.rotations(m * n * size * max(BYTES[r] for r in routes))
        tsets = [timing.inputs(m, n, tdtype, offset, seed=i) for i in range(reps)]  # x, w, dy (the residual)
        sets = [tuple(jax_owned(t) for t in s) for s in tsets]
        variants = _variants(n, tiles)
        for rnd, order in enumerate((list(variants), list(variants)[::-1])):
            for name in order:
                for route in routes:
                    try:
                        timer = _timer(route, variants[name], m, n, sets, tsets, offset, casting)
                        tbps = BYTES[route] * m * n * size / timer() / 1e12
                    except Exception as err:  # noqa: BLE001 - a variant that cannot run here is recorded, not fatal
                        tbps = None
                        print(m, n, name, route, "failed:", type(err).__name__, str(err)[:200], flush=True)
                    rows.append(dict(m=m, n=n, variant=name, route=route, round=rnd, tbps=tbps))
                    print(m, n, name, route, rnd, tbps, flush=True)
        bits[f"{m}x{n}"] = _torch_route_bits(m, n, *sets[0][:2], offset, casting)
        del sets, tsets
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype=dtype, casting=casting), rows=rows, torch_route_bits=bits)


def markdown(result: dict) -> str:
    env, rows = result["env"], result["rows"]
    groups: dict = {}
    for r in rows:  # runs before the routes were added timed the plain forward alone
        groups.setdefault(r.get("route", "plain"), {}).setdefault((r["m"], r["n"]), {}).setdefault(
            r["variant"], []).append(r["tbps"])
    fmt = lambda vs: "err" if None in vs else " / ".join(f"{v:.3f}" for v in vs)  # noqa: E731
    out = [f"# The resident forward launched by XLA or by jaxlib's Triton call: {env['gpu']}, {env['dtype']}, "
           f"casting={env['casting']}", "",
           f"{timing.versions(env)}. Made by "
           "`python -m bench.ffi_launch`: TB/s (round 1 / round 2) by the kernels' own durations over rotated inputs. "
           "A tile is (rows per program, warps); `XLA`: the `pallas_call` launched by XLA (which asks the "
           "most shared memory, the least L1, of every kernel using any); `jaxlib`: the same Triton IR compiled by "
           "the triton package and launched by jaxlib's Triton call (`Config.ffi_launch`). `torch route = JAX`: the "
           "torch launch route's forward gives `impl=None`'s bits. Routes: `plain` rms_norm from JAX (2·M·N·s bytes), "
           "`fused` rms_norm_add's forward from JAX (4·M·N·s), `torch` the plain forward by the torch launch route "
           "(Mosaic GPU's on its heuristic's config; `err`: it failed there)."]
    for route in [r for r in ROUTES if r in groups]:
        shapes = groups[route]
        names = list(dict.fromkeys(k for by in shapes.values() for k in by))  # a chunk ≥ a row is another name
        out += ["", f"## {route}", "", "| M×N | " + " | ".join(names) + " | torch route = JAX |",
                "|---|" + "---|" * (len(names) + 1)]
        for (m, n), by in shapes.items():
            same = result["torch_route_bits"].get(f"{m}x{n}")
            out.append(f"| {m}×{n} | " + " | ".join(fmt(by[k]) if k in by else "–" for k in names)
                       + f" | {'yes' if same else 'NO'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ffi_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="?", type=timing.parse_shapes, default=SHAPES, help="comma-separated MxN")
    parser.add_argument("--tiles", type=parse_tiles, default=TILES, help="comma-separated ROWS:WARPS[:CHUNK]")
    parser.add_argument("--casting", choices=("llama", "gemma"), default="llama")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--routes", type=lambda t: tuple(t.split(",")), default=("plain",), help=", ".join(ROUTES))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if unknown := set(args.routes) - set(ROUTES):
        parser.error(f"--routes takes {', '.join(ROUTES)}, got {sorted(unknown)}")
    if (code := timing.gpu_or_exit_code(parser.prog)) is not None:
        return code
    result = run(args.shapes, args.tiles, args.casting, args.dtype, args.routes)
    print(report.save_table(result, args.out, "ffi_launch", markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
