"""Pallas RMSNorm (JAX) vs XLA, in TB/s and as a fraction of the copy bandwidth measured in the same run.

    PYTHONPATH=. python -m bench.pallas_bench [--shapes 32768x4096,...] [--sweep] [--out FILE]

Bytes: forward 2·M·N·s (read x, write y), backward 3·M·N·s (read x and dy, write dx). JAX timing: a
pipelined loop of jit'd calls ending in ``block_until_ready``, after warm-up, median of several repeats.
Inputs are far larger than L2 (50 MB on H100), so no buffer rotation is needed at these sizes.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_norm import kernels, reference
from pallas_norm.plan import make_plan


def time_jax(fn, *args, iters: int = 20, repeats: int = 5) -> float:
    """Median seconds per call of ``fn(*args)`` (pipelined, synchronised once per repeat)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def copy_tbps(nbytes: int) -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written): torch ``copy_`` and a JAX elementwise op."""
    out = {}
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    out["jax negate"] = 2 * nbytes / time_jax(jax.jit(lambda a: -a), x) / 1e12
    try:
        import torch
        import triton.testing

        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
        out["torch copy_"] = 2 * nbytes / (ms * 1e-3) / 1e12
    except Exception as exc:  # torch or a CUDA build of it may be absent
        out["torch copy_ unavailable"] = float("nan")
        print("torch copy skipped:", exc)
    return out


def providers(m: int, n: int, casting: str, plan_overrides: dict):
    plan = make_plan(m, n, **plan_overrides)
    plan_bwd = make_plan(m, n, backward=True, **plan_overrides)
    kw = dict(offset=0.0, casting=casting)
    fwd = jax.jit(lambda x, w: kernels.forward(x, w, eps=1e-6, plan=plan, interpret=False, **kw))
    bwd = jax.jit(lambda x, w, dy, r: kernels.backward(x, w, dy, r, plan=plan_bwd, interpret=False, **kw))
    xla_fwd = jax.jit(lambda x, w: reference.forward_2d(x, w, eps=1e-6, **kw))
    xla_bwd = jax.jit(lambda x, w, dy, r: reference.backward_2d(x, w, dy, r, **kw))

    def jnp_formula(x, w):  # what a user writes in plain JAX (HF Llama's formula)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
        return w * h.astype(x.dtype)

    return (plan, plan_bwd), fwd, bwd, xla_fwd, xla_bwd, jax.jit(jnp_formula)


def run_shape(m: int, n: int, dtype, casting: str, plan_overrides: dict) -> list[dict]:
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, n), jnp.float32).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (n,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    plans, fwd, bwd, xla_fwd, xla_bwd, formula = providers(m, n, casting, plan_overrides)
    _, rstd = fwd(x, w)
    s = jnp.dtype(dtype).itemsize
    rows = []
    for name, mode, fn, args, nbytes in [
        ("pallas", "fwd", fwd, (x, w), 2 * m * n * s),
        ("pallas", "bwd", bwd, (x, w, dy, rstd), 3 * m * n * s),
        ("xla (our reference)", "fwd", xla_fwd, (x, w), 2 * m * n * s),
        ("xla (our reference)", "bwd", xla_bwd, (x, w, dy, rstd), 3 * m * n * s),
        ("xla (jnp HF formula)", "fwd", formula, (x, w), 2 * m * n * s),
    ]:
        sec = time_jax(fn, *args)
        rows.append(dict(provider=name, mode=mode, m=m, n=n, us=sec * 1e6, tbps=nbytes / sec / 1e12,
                         plan=str(plans[mode == "bwd"]) if name == "pallas" else ""))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32768x4096,65536x2304,4096x65536,1024x262144")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--casting", default="llama")
    p.add_argument("--sweep", action="store_true", help="also try other tilings at the first shape")
    p.add_argument("--out", default=None, help="write the Markdown table here")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("pallas_bench: no GPU visible to JAX; nothing to measure.")
        return
    dtype = jnp.dtype(args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    copy = copy_tbps(1 << 30)
    ceiling = copy.get("torch copy_", copy["jax negate"])
    rows = []
    for m, n in shapes:
        rows += run_shape(m, n, dtype, args.casting, {})
    if args.sweep:
        m, n = shapes[0]
        for br, nw, pr in itertools.product((1, 2), (8, 16), (132, 264, 396)):
            rows += [r | dict(provider=f"pallas br={br} nw={nw} progs={pr}") for r in
                     run_shape(m, n, dtype, args.casting, dict(block_rows=br, num_warps=nw, programs=pr))
                     if r["provider"] == "pallas"]
    dev = jax.devices()[0]
    lines = [f"# Pallas RMSNorm on {dev.device_kind} ({args.dtype}, casting={args.casting})", "",
             f"{datetime.date.today()} · jax {jax.__version__} · copy bandwidth: "
             + ", ".join(f"{k} {v:.2f} TB/s" for k, v in copy.items()), "",
             "| provider | mode | M×N | µs | TB/s | % of copy | plan |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['provider']} | {r['mode']} | {r['m']}×{r['n']} | {r['us']:.1f} | {r['tbps']:.2f} | "
                     f"{100 * r['tbps'] / ceiling:.0f}% | {r['plan']} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
