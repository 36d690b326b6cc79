"""Throwaway: Mosaic GPU backward, the heuristic (now) vs 3 stages, through JAX (kernel durations, rotated inputs)."""
import sys, dataclasses
import jax, jax.numpy as jnp
import pallas_norm
from pallas_norm import mosaic_config
from bench import timing

for spec in sys.argv[1].split(","):
    m, n, dt = spec.split("x")
    m, n, dtype = int(m), int(n), getattr(jnp, dt)
    reps = timing.rotations(m * n * dtype(0).itemsize)
    keys = jax.random.split(jax.random.PRNGKey(m ^ n), 4 * reps + 1)
    w = (1 + 0.1 * jax.random.normal(keys[-1], (n,))).astype(dtype)
    sets = [[jax.random.normal(k, (m, n), dtype) for k in keys[4 * i:4 * i + 4]] for i in range(reps)]
    base = mosaic_config.heuristic(m, n, backward=True)
    line = []
    for fused in (False, True):
        res = {}
        for name, cfg in (("heur", None), ("s3", dataclasses.replace(base, stages=3)), ("heur2", None)):
            kw = dict(eps=1e-6, impl="mosaic", bwd_config=cfg)
            if fused:
                vjps = [jax.vjp(lambda a, r, b: pallas_norm.rms_norm_add(a, r, b, **kw), s[0], s[1], w)[1] for s in sets]
                cots = [(s[2], s[3]) for s in sets]
            else:
                vjps = [jax.vjp(lambda a, b: pallas_norm.rms_norm(a, b, **kw), s[0], w)[1] for s in sets]
                cots = [s[2] for s in sets]
            keep = slice(None, None, 2 if fused else 1)
            step = jax.jit(lambda vs, cs: [v(c)[keep] for v, c in zip(vs, cs)])
            call = lambda: step(vjps, cots)
            call.reps = reps
            res[name] = (4 if fused else 3) * m * n * dtype(0).itemsize / timing.time_jax(call) / 1e12
        h = (res["heur"] + res["heur2"]) / 2
        line.append(f"{'fused' if fused else 'plain'} 3 stages {res['s3']:.3f} -> heuristic {res['heur']:.3f}/{res['heur2']:.3f} ({100 * (h / res['s3'] - 1):+.1f}%)")
    print(f"{m}x{n} {dt} stages {base.stages} " + " | ".join(line), flush=True)
    del sets
