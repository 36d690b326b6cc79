"""``python -m bench.bwd_candidates MxN,... [--jax [--heads | --pieces] [--ffi] | --triton [--pieces]]``: the resident
backward's heuristic against candidate tilings, for ``rms_norm`` and for the fused add (``rms_norm_add``), as binaries
launched by torch (``bench sweep``'s method: the kernels' durations over rotated inputs, ``timing.time_sets``), with
each main kernel's registers and spill bytes; ``--jax``: timed through JAX instead (the same timer: XLA's launch and
its shared-memory carveout, the dweight reduction included), with Mosaic GPU's backward beside them; ``--heads``:
per-head candidates; ``--pieces``: rows held as their power-of-two pieces (``Config.pieces``); ``--ffi``: the
heuristic's config launched by XLA and by jaxlib's Triton call (``Config.ffi_launch``; with ``--pieces``: every
pieces candidate launched both ways, ``pallas_config.BWD_FFI_PIECES``); ``--triton``: the
Triton reference's backward instead (with ``--pieces``: its pieces, ``triton_config.Config.pieces``). Prints one line
per (shape, op, config); the committed tables are bench/results/sweep_h100_bwd_2026-11-24.md (timed by CUDA events,
before this timer), sweep_h100_bwd_jax_2026-11-26.md, bwd_heads_h100.md, bwd_pieces_h100.md,
triton_bwd_tiles_h100.md and triton_bwd_pieces_h100.md. Candidates: (elements per program, warps, programs per SM,
prefetch).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from bench import timing
from pallas_norm import backend, pallas_config
from pallas_norm.pallas_config import Config, next_pow2
from torch_bridge import launch_route

CANDIDATES = [(8192, 16, 1, True), (8192, 8, 1, True), (16384, 16, 1, True), (8192, 16, 1, False),
              (4096, 16, 1, True), (16384, 16, 1, False)]
JAX_CANDIDATES = [(8192, 16, 1, True), (4096, 16, 2, True), (4096, 8, 2, True), (2048, 8, 4, True),
                  (2048, 4, 4, True), (1024, 2, 8, True)]
# ``--triton``: the Triton reference's backward, for the tiles at 512-1024 columns (bench/results/
# triton_bwd_tiles_h100.md).
TRITON_CANDIDATES = [(4096, 8, 2, True), (4096, 4, 2, True), (2048, 4, 4, True), (4096, 4, 4, True),
                     (8192, 8, 2, True), (4096, 4, 2, False)]
# ``--heads``: per-head widths (64-512 columns), where the plain and the fused add's backward want different tiles
# but must share one (the fused add's dweight is rms_norm's bits): bench/results/bwd_heads_h100.md.
HEAD_CANDIDATES = [(4096, 4, 4, False), (8192, 8, 2, False), (8192, 8, 4, False), (16384, 16, 1, False),
                   (4096, 8, 2, False), (8192, 4, 2, False), (2048, 4, 4, True), (4096, 8, 2, True)]

# ``--pieces``: one row per program held as its power-of-two pieces, (warps, programs per SM, prefetch)
# (bench/results/bwd_pieces_h100.md).
PIECE_CANDIDATES = [(4, 4, False), (4, 2, True), (4, 2, False), (4, 3, False), (8, 2, True), (8, 1, True)]
# ``--triton --pieces``: the Triton reference's padded tile before it held rows as pieces (its BWD_PREFETCH_N rule: one
# row of the padded length, 8 warps at 4096 columns, 16 at 8192; 2 programs per SM at 4096, 1 at 8192).
TRITON_PADDED = [(4096, 8, 2, True), (8192, 16, 1, True)]
PIECES_MORE = [(4, 4, True), (8, 2, False), (8, 4, False)]  # beside PIECE_CANDIDATES (twenty-second session)


def _candidates(n: int, sms: int, table: list[tuple[int, int, int, bool]]) -> list[Config | None]:
    """The heuristic (None) and the table's tilings that hold at least one row of ``n`` columns."""
    n_pad = next_pow2(n)
    return [None] + [Config(max(1, e // n_pad), n_pad, warps, programs=per_sm * sms, prefetch=pf)
                     for e, warps, per_sm, pf in table if e >= n_pad]


def _piece_candidates(n: int, sms: int, ffi: bool = False) -> list[Config | None]:
    """The heuristic (None), ``PIECE_CANDIDATES`` and ``PIECES_MORE``; ``ffi``: each of those launched by XLA, then
    by jaxlib's Triton call."""
    launches = (False, True) if ffi else (False,)
    return [None] + [Config(1, next_pow2(n), warps, programs=per_sm * sms, prefetch=pf, pieces=True, ffi_launch=f)
                     for warps, per_sm, pf in PIECE_CANDIDATES + PIECES_MORE for f in launches]


def _line(m: int, n: int, fused: bool, seconds: float, cfg: Config | str | None) -> str:
    """``MxN plain|fused TB/s config``: bytes 3·M·N·2 (plain) or 4·M·N·2 (fused); None names the heuristic."""
    name = cfg if cfg == "mosaic" else (f"{cfg or pallas_config.heuristic(m, n, backward=True, fused=fused)}"
                                        f"{' (heuristic)' if cfg is None else ''}")
    return f"{m}x{n} {'fused' if fused else 'plain'} {(4 if fused else 3) * m * n * 2 / seconds / 1e12:.2f} TB/s {name}"


def run(shapes: list[tuple[int, int]]) -> None:
    dev, sms = torch.cuda.current_device(), backend.num_sms()
    for m, n in shapes:
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        r, _, dh = timing.inputs(m, n, torch.bfloat16, 0.0, seed=3)
        y, h, rstd = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, "llama", dev, None,
                                                   x.dtype, x.dtype)(x, r, w)
        configs = _candidates(n, sms, CANDIDATES)
        for fused in (False, True):
            sets = timing.input_sets((h, w, dy, dh, rstd) if fused else (x, w, dy, rstd))
            for cfg in configs:
                launcher = launch_route.backward_launcher(m, n, x.dtype, w.dtype, 0.0, "llama", dev, cfg, fused)
                seconds = timing.time_sets(launcher, sets)
                main = launcher.kernels[-2]  # the last kernel sums dweight
                print(f"{_line(m, n, fused, seconds, cfg)} {main.registers} regs {main.local_bytes} B", flush=True)
        del x, w, dy, r, dh, y, h, rstd
        torch.cuda.empty_cache()


def _triton_candidates(n: int, pieces: bool, fused: bool = False) -> list:
    """The Triton reference's heuristic (first; ``fused``: the fused add's), then ``TRITON_CANDIDATES``; with
    ``pieces`` the padded tile of ``TRITON_PADDED``, then ``PIECE_CANDIDATES`` and ``PIECES_MORE`` held as pieces
    (``triton_config.Config.pieces``)."""
    from torch_bridge import triton_config

    n_pad, heuristic = next_pow2(n), [triton_config.backward_config(n, backend.num_sms(), fused=fused)]
    if not pieces:
        return heuristic + [triton_config.Config(e // n_pad, n_pad, warps, programs_per_sm=per_sm, prefetch=pf)
                            for e, warps, per_sm, pf in TRITON_CANDIDATES if e >= n_pad]
    return heuristic + [triton_config.Config(1, n_pad, warps, programs_per_sm=per_sm, prefetch=pf)
                        for e, warps, per_sm, pf in TRITON_PADDED if e == n_pad] + [
        triton_config.Config(1, n_pad, warps, programs_per_sm=per_sm, prefetch=pf, pieces=True)
        for warps, per_sm, pf in PIECE_CANDIDATES + PIECES_MORE]


def run_triton(shapes: list[tuple[int, int]], pieces: bool = False) -> None:
    """The Triton reference's backward (``triton_kernels.rms_norm_bwd``), plain and fused add (with ``dh_out``), under
    ``_triton_candidates``, launched by torch and timed the same way."""
    from torch_bridge import triton_kernels

    for m, n in shapes:
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        dh = timing.inputs(m, n, torch.bfloat16, 0.0, seed=3)[2]
        rstd = triton_kernels.rms_norm_fwd(x, w, timing.EPS, 0.0, "llama")[1]
        sets = timing.input_sets((x, w, dy, rstd, dh))  # the plain backward ignores dh
        for fused in (False, True):
            for k, cfg in enumerate(_triton_candidates(n, pieces, fused)):
                def call(a, b, g, r, d, cfg=cfg, fused=fused):
                    return triton_kernels.rms_norm_bwd(g, a, b, r, 0.0, "llama", True, True, config=cfg,
                                                       dh_out=d if fused else None)
                tbps = (4 if fused else 3) * m * n * 2 / timing.time_sets(call, sets) / 1e12
                mark = " (heuristic)" if k == 0 else ""
                print(f"{m}x{n} {'fused' if fused else 'plain'} {tbps:.2f} TB/s {cfg}{mark}", flush=True)
        del x, w, dy, dh, rstd, sets
        torch.cuda.empty_cache()


def _jax_configs(m: int, n: int, table: list[tuple[int, int, int, bool]] | None, ffi: bool,
                 fused: bool = False) -> list:
    """One shape's candidates: the ``table``'s tilings (None: ``_piece_candidates``, each launched by XLA and by
    jaxlib's Triton call with ``ffi``); with ``ffi`` and a table, the heuristic's config (``fused``: the fused add's)
    launched both ways instead (``Config.ffi_launch``)."""
    if table is None:
        return _piece_candidates(n, backend.num_sms(), ffi=ffi)
    if ffi:
        heuristic = pallas_config.heuristic(m, n, backward=True, fused=fused)
        return [dataclasses.replace(heuristic, ffi_launch=f) for f in (False, True)]
    return _candidates(n, backend.num_sms(), table)


def run_jax(shapes: list[tuple[int, int]], table: list[tuple[int, int, int, bool]] | None = JAX_CANDIDATES, *,
            ffi: bool = False) -> None:
    """``_jax_configs``' candidates and Mosaic GPU, timed through JAX
    (``timing.time_jax``) from ``timing.rotations`` sets of bf16 inputs: ``rms_norm``'s backward (x, weight → dx,
    dweight) and ``rms_norm_add``'s (h, dy, dh_out → dh, dweight; dx and dresidual are the same values, one is kept
    as in ``bench fused``)."""
    import jax
    import jax.numpy as jnp

    import pallas_norm

    for m, n in shapes:
        reps = timing.rotations(m * n * 2)
        keys = jax.random.split(jax.random.PRNGKey(m ^ n), 4 * reps + 1)
        w = (1 + 0.1 * jax.random.normal(keys[-1], (n,))).astype(jnp.bfloat16)
        sets = [[jax.random.normal(k, (m, n), jnp.bfloat16) for k in keys[4 * i:4 * i + 4]] for i in range(reps)]
        for fused in (False, True):
            for cfg in _jax_configs(m, n, table, ffi, fused) + ["mosaic"]:
                kw = dict(eps=timing.EPS, impl="mosaic") if cfg == "mosaic" else dict(eps=timing.EPS, impl="pallas",
                                                                                       bwd_config=cfg)
                if fused:
                    vjps = [jax.vjp(lambda a, r, b: pallas_norm.rms_norm_add(a, r, b, **kw), s[0], s[1], w)[1]
                            for s in sets]
                    cots = [(s[2], s[3]) for s in sets]
                else:
                    vjps = [jax.vjp(lambda a, b: pallas_norm.rms_norm(a, b, **kw), s[0], w)[1] for s in sets]
                    cots = [s[2] for s in sets]
                keep = slice(None, None, 2 if fused else 1)
                step = jax.jit(lambda vs, cs: [v(c)[keep] for v, c in zip(vs, cs)])
                call = lambda: step(vjps, cots)  # noqa: E731
                call.reps = reps
                seconds = timing.time_jax(call)
                print(_line(m, n, fused, seconds, cfg), flush=True)
        del sets


if __name__ == "__main__":
    parsed = [tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")]
    if "--jax" in sys.argv[2:]:
        flags = sys.argv[2:]
        heads = "--heads" in flags
        run_jax(parsed, HEAD_CANDIDATES if heads else None if "--pieces" in flags else JAX_CANDIDATES,
                ffi="--ffi" in flags and not heads)
    elif "--triton" in sys.argv[2:]:
        run_triton(parsed, "--pieces" in sys.argv[2:])
    else:
        run(parsed)
