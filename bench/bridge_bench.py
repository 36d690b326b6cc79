"""The torch bridge's cost: small-call latency and large-call speed, against torch native and JAX native.

    PYTHONPATH=. python -m bench.bridge_bench [--out DIR] [--calls 2000]

Every entry is timed the same way: a loop of calls issued back to back, one synchronisation at the end, per-call
time = wall time / calls, median of 7 repeats after warm-up (``torch.cuda.synchronize`` for torch,
``block_until_ready`` for JAX). For the small call this is the host-bound rate a training loop sees; for the large
one the GPU is the bottleneck and the loop measures it (launch gaps hidden by the queue). fwd+bwd means
``torch.autograd.grad`` of the forward with a random cotangent (no grad accumulation), and one jitted
``jax.vjp`` in JAX. Large-call bytes: forward 2·M·N·s, fwd+bwd 5·M·N·s (the backward reads x and dy, writes dx);
copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import pallas_norm
import torch_bridge
from torch_bridge import dlpack_route, jax_device

EPS = 1e-6


def per_call(fn, sync, calls: int, repeats: int = 7) -> float:
    """Median seconds per call of ``fn()`` over ``repeats`` back-to-back loops of ``calls`` calls."""
    for _ in range(max(10, calls // 10)):
        out = fn()
    sync(out)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def torch_sync(_):
    torch.cuda.synchronize()


def torch_entries(x, w, dy):
    n = x.shape[-1]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(xg, wg), (xg, wg), dy)

    def custom_op(a, b):
        return torch.ops.pallas_norm.pallas_rms_norm_fwd(a, b, EPS, 0.0, "llama", "launch")[0]

    fns = {
        "torch F.rms_norm": lambda a, b: torch.nn.functional.rms_norm(a, (n,), b, EPS),
        "bridge backend=pallas_launch": lambda a, b: torch_bridge.rms_norm(a, b, EPS, backend="pallas_launch"),
        "bridge backend=pallas (DLPack)": lambda a, b: torch_bridge.rms_norm(a, b, EPS, backend="pallas_dlpack"),
        "pallas_launch via the custom op": custom_op,
        "bridge backend=triton (reference kernel)": lambda a, b: torch_bridge.rms_norm(a, b, EPS, backend="triton"),
    }
    return {name: (lambda f=f: f(x, w), fwd_bwd(f)) for name, f in fns.items()}


def jax_entries(x, w, dy):
    xj, wj, dyj = (dlpack_route.to_jax(t, jax_device.jax_device_for(t)) for t in (x, w, dy))

    def f(a, b):
        return pallas_norm.rms_norm(a, b, eps=EPS, impl="pallas")

    fwd = jax.jit(f)
    fwd_bwd = jax.jit(lambda a, b, c: jax.vjp(f, a, b)[1](c))
    return {"JAX native: jit(pallas_norm.rms_norm)": (lambda: fwd(xj, wj), lambda: fwd_bwd(xj, wj, dyj))}


def measure(shape, calls: int) -> dict[str, dict[str, float]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g, device="cuda")).to(torch.bfloat16)
    dy = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    rows = {}
    for name, (fwd, fwd_bwd) in torch_entries(x, w, dy).items():
        rows[name] = {"fwd": per_call(fwd, torch_sync, calls), "fwd+bwd": per_call(fwd_bwd, torch_sync, calls)}
    for name, (fwd, fwd_bwd) in jax_entries(x, w, dy).items():
        rows[name] = {"fwd": per_call(fwd, jax.block_until_ready, calls),
                      "fwd+bwd": per_call(fwd_bwd, jax.block_until_ready, calls)}
    return rows


def dlpack_breakdown(calls: int) -> dict[str, float]:
    """Host µs per step of one DLPack-route forward on 8×4096 bf16."""
    x = torch.randn(8, 4096, device="cuda").to(torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    device = jax_device.jax_device_for(x)
    exe = dlpack_route._forward_jit(EPS, 0.0, "llama", "pallas")
    xj, wj = dlpack_route.to_jax(x, device), dlpack_route.to_jax(w, device)
    y, _ = exe(xj, wj)
    steps = {
        "torch → JAX import (jax.dlpack.from_dlpack), per tensor": lambda: dlpack_route.to_jax(x, device),
        "jitted JAX function call": lambda: exe(xj, wj),
        "JAX → torch export (torch.from_dlpack), per tensor": lambda: dlpack_route.to_torch(y),
    }
    return {k: 1e6 * per_call(f, torch_sync, calls) for k, f in steps.items()}


def copy_tbps(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / per_call(lambda: dst.copy_(src), torch_sync, 20) / 1e12


def versions() -> str:
    import triton
    return (f"{torch.cuda.get_device_name()}; torch {torch.__version__}, jax {jax.__version__}, "
            f"triton {triton.__version__}; {datetime.date.today().isoformat()}")


def report(small, large, breakdown, copy, calls) -> str:
    ref = small["torch F.rms_norm"]
    jref = large["JAX native: jit(pallas_norm.rms_norm)"]
    m, n = 32768, 4096
    nbytes = {"fwd": 2 * m * n * 2, "fwd+bwd": 5 * m * n * 2}
    out = [f"# Torch bridge: small- and large-call cost\n\n{versions()}. Method: `bench/bridge_bench.py` "
           f"(back-to-back loop, one sync, median of 7; {calls} calls per loop for the small call).\n",
           "## Small call, 8×4096 bf16 (target: ≤ 2× torch F.rms_norm)\n",
           "| provider | fwd µs | × torch | fwd+bwd µs | × torch |", "|---|---|---|---|---|"]
    for name, r in small.items():
        out.append(f"| {name} | {1e6 * r['fwd']:.1f} | {r['fwd'] / ref['fwd']:.2f} | "
                   f"{1e6 * r['fwd+bwd']:.1f} | {r['fwd+bwd'] / ref['fwd+bwd']:.2f} |")
    out += ["", f"## Large call, 32768×4096 bf16 (target: ≤ 3% slower than JAX native); copy {copy:.2f} TB/s\n",
            "| provider | fwd µs | fwd TB/s | vs JAX | fwd+bwd µs | fwd+bwd TB/s | vs JAX |", "|---|---|---|---|---|---|---|"]
    for name, r in large.items():
        cells = []
        for k in ("fwd", "fwd+bwd"):
            cells += [f"{1e6 * r[k]:.1f}", f"{nbytes[k] / r[k] / 1e12:.2f}", f"{100 * (r[k] / jref[k] - 1):+.1f}%"]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "## Where a DLPack-route forward's host time goes (8×4096 bf16)\n", "| step | µs |", "|---|---|"]
    out += [f"| {k} | {v:.1f} |" for k, v in breakdown.items()]
    return "\n".join(out) + "\n"


def plot(small, large, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, data, title, scale in ((axes[0], small, "8×4096 bf16: µs per call", 1e6),
                                   (axes[1], large, "32768×4096 bf16: µs per call", 1e6)):
        names = list(data)
        for i, k in enumerate(("fwd", "fwd+bwd")):
            ax.barh([j + 0.4 * i for j in range(len(names))], [scale * data[nm][k] for nm in names], 0.4, label=k)
        ax.set_yticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    small = measure((8, 4096), args.calls)
    breakdown = dlpack_breakdown(args.calls)
    large = measure((32768, 4096), 30)
    copy = copy_tbps()
    text = report(small, large, breakdown, copy, args.calls)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bridge_h100.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "bridge_h100.json"), "w") as f:
        json.dump({"small": small, "large": large, "dlpack_breakdown_us": breakdown, "copy_tbps": copy}, f, indent=1)
    plot(small, large, os.path.join(args.out, "bridge_h100.png"))
    print(text)


if __name__ == "__main__":
    main()
