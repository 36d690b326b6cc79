"""``python -m pallas_norm``: normalise and differentiate a random batch with the Pallas kernel and print
its error against the float32 XLA reference, for every casting mode (interpreter on CPU, kernel on GPU)."""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from . import CASTINGS, backend, rms_norm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_norm", description=__doc__)
    parser.add_argument("--rows", type=int, default=None, help="rows M (default 64 on CPU, 8192 on GPU)")
    parser.add_argument("--cols", type=int, default=None, help="hidden size N (default 1000 on CPU, 4096 on GPU)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    gpu = backend.on_gpu()
    impl = "pallas" if gpu else "interpret"
    m = args.rows or (8192 if gpu else 64)
    n = args.cols or (4096 if gpu else 1000)
    dtype = jnp.dtype(args.dtype)
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = (2.0 * jax.random.normal(kx, (m, n), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    print(f"pallas-norm demo: x {m}x{n} {dtype.name}, kernel impl={impl!r} on {jax.default_backend()}")
    print(f"{'casting':8} {'offset':>6} {'max|y-ref|':>12} {'max|dx-ref|':>12} {'max|dw-ref|':>12}")
    worst = 0.0
    for casting in CASTINGS:
        for offset in (0.0, 1.0):
            w = 0.1 * jax.random.normal(kw, (n,), jnp.float32) + (0.0 if offset else 1.0)
            w = w.astype(dtype)
            errs = []
            outs = [jax.vjp(lambda x, w, i=i: rms_norm(x, w, offset=offset, casting=casting, impl=i), x, w)
                    for i in (impl, "xla")]
            (y, vjp), (y_ref, vjp_ref) = outs
            for a, b in zip((y, *vjp(dy)), (y_ref, *vjp_ref(dy))):
                errs.append(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))))
            rel = max(e / max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30)
                      for e, b in zip(errs, (y_ref, *vjp_ref(dy))))
            worst = max(worst, rel)
            print(f"{casting:8} {offset:6.1f} {errs[0]:12.3e} {errs[1]:12.3e} {errs[2]:12.3e}")
    ok = worst < 5e-2
    print(f"largest error relative to the reference's max: {worst:.3e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
