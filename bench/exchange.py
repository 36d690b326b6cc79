"""``python -m bench exchange``: long rows split over co-resident programs (``Config(exchange=True)``,
``pallas_norm/split_rows.py``) against what ``impl=None`` runs today, each config's kernels timed by their own
durations in one process (``timing.time_jax``), JAX side. Each row also says how far its outputs are from the
baseline's (y, dx: max |Δ|; dweight: max |Δ| / max |dweight|) and whether a second call gave the same bits.
"""

from __future__ import annotations

import sys

from bench import timing

SHAPES = ((1024, 262144), (2048, 131072), (4096, 65536), (8192, 32768))


def candidates(n: int, backward: bool) -> list:
    """Exchange configs worth timing for rows of ``n`` columns, each grid co-resident by the registers ptxas gives
    it (H100; a grid that is not makes programs give up waiting): backward shares of 4096 columns on 16 or 8 warps
    (124 / 210 registers, one program per SM), 2048 on 4 (204, two per SM), 8192 on 16 or 32 (128 / 64, a little
    spilled), the weight reloaded; forward shares of 8192 on 16 or 32 warps (100 / 59), 4096 on 16 or 8 (64 / 109,
    two per SM), 2048 on 4 (96, four per SM), 16384 on 16 (128, spilled), the weight reloaded, no prefetch."""
    from pallas_norm import backend
    from pallas_norm.pallas_config import Config

    sms = backend.num_sms()
    if backward:
        out = [Config(1, 4096, 16, exchange=True, prefetch=True), Config(1, 8192, 16, exchange=True, prefetch=True),
               Config(1, 2048, 4, exchange=True, prefetch=True, programs=2 * sms)]
        if n >= 262144:
            out += [Config(1, 4096, 8, exchange=True, prefetch=True), Config(1, 8192, 32, exchange=True, prefetch=True),
                    Config(1, 8192, 16, exchange=True, prefetch=True, reload_weight=True),
                    Config(1, 4096, 16, exchange=True)]
        return out
    out = [Config(1, 8192, 16, exchange=True, prefetch=True),
           Config(1, 4096, 16, exchange=True, prefetch=True, programs=2 * sms),
           Config(1, 16384, 16, exchange=True, prefetch=True)]
    if n >= 262144:
        out += [Config(1, 4096, 8, exchange=True, prefetch=True, programs=2 * sms),
                Config(1, 2048, 4, exchange=True, prefetch=True, programs=4 * sms),
                Config(1, 8192, 32, exchange=True, prefetch=True),
                Config(1, 8192, 16, exchange=True, prefetch=True, reload_weight=True),
                Config(1, 8192, 16, exchange=True)]
    return out


def label(cfg) -> str:
    """A config by the fields that differ from ``Config``'s defaults."""
    import dataclasses

    if cfg is None:
        return "impl=None today"
    shown = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
             if f.default is dataclasses.MISSING or getattr(cfg, f.name) != f.default]
    return "Config(" + ", ".join(shown) + ")"


def run(shapes=SHAPES, dtype: str = "bfloat16", casting: str = "llama") -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_norm import api

    offset = 1.0 if casting == "gemma" else 0.0
    rows = []
    for m, n in shapes:
        key = jax.random.split(jax.random.PRNGKey(m + n), 3)
        jdt = jnp.dtype(dtype)
        x = jax.random.normal(key[0], (m, n), jnp.float32).astype(jdt)
        w = ((0.0 if offset else 1.0) + 0.1 * jax.random.normal(key[1], (n,), jnp.float32)).astype(jdt)
        dy = jax.random.normal(key[2], (m, n), jnp.float32).astype(jdt)
        rstd = jax.jit(api.forward_fn(timing.EPS, offset, casting, "auto"))(x, w)[1]
        base = {}
        for backward in (False, True):
            mode = "bwd" if backward else "fwd"
            for cfg in [None] + candidates(n, backward):
                if backward:
                    fn = jax.jit(api.backward_fn(offset, casting, "auto", True, cfg))
                    call = lambda fn=fn: fn(x, w, dy, rstd)  # noqa: E731
                else:
                    fn = jax.jit(api.forward_fn(timing.EPS, offset, casting, "auto", cfg))
                    call = lambda fn=fn: fn(x, w)  # noqa: E731
                row = dict(mode=mode, m=m, n=n, config=label(cfg))
                try:
                    out = jax.block_until_ready(call())
                    again = jax.block_until_ready(call())
                    row["repeat_bits"] = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                                             for a, b in zip(out, again))
                    if cfg is None:
                        base[mode] = out
                    ref = base[mode]
                    errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in
                            zip(out, ref)]
                    if backward:
                        errs[1] /= max(float(jnp.max(jnp.abs(ref[1].astype(jnp.float32)))), 1e-30)
                    row["err"] = errs
                    sec = timing.time_jax(call)
                    row.update(us=sec * 1e6, tbps=timing.tbps(mode, m, n, jdt.itemsize, sec))
                except Exception as err:  # noqa: BLE001  (a config that fails is recorded; the run goes on)
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print("exchange:", row, file=sys.stderr, flush=True)
                rows.append(row)
    return dict(env=timing.environment(dtype=dtype, casting=casting, copy_tbps=timing.copy_tbps()), rows=rows)


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# Long rows split over programs that exchange row sums ({env['gpu']}, {env['date']})", "",
             f"{env['dtype']}, casting {env['casting']}, copy {env['copy_tbps']:.2f} TB/s (this run); jax "
             f"{env.get('jax', '?')}. Made by `python -m bench exchange`: every config's kernels timed by their own "
             "durations (CUPTI, 20 calls, one process); errors against the `impl=None` row (y and dx max |Δ|, "
             "dweight max |Δ| relative to its max); `same bits`: a second call gave the same bits. Fastest per "
             "shape and mode in bold.", "",
             "| M×N | mode | config | µs | TB/s | % of copy | error (fwd: y / rstd; bwd: dx / dweight) | same bits |",
             "|---|---|---|---|---|---|---|---|"]
    best = {}
    for r in result["rows"]:
        if "tbps" in r:
            k = (r["m"], r["n"], r["mode"])
            best[k] = max(best.get(k, 0.0), r["tbps"])
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['m']}×{r['n']} | {r['mode']} | `{r['config']}` | – | – | – | {r['error'][:120]} | – |")
            continue
        tb = f"{r['tbps']:.2f}"
        if r["tbps"] == best[(r["m"], r["n"], r["mode"])]:
            tb = f"**{tb}**"
        err = " / ".join(f"{e:.2g}" for e in r["err"])
        lines.append(f"| {r['m']}×{r['n']} | {r['mode']} | `{r['config']}` | {r['us']:.0f} | {tb} | "
                     f"{100 * r['tbps'] / env['copy_tbps']:.0f}% | {err} | {'yes' if r['repeat_bits'] else 'NO'} |")
    return "\n".join(lines) + "\n"
