"""``python -m bench overhead``: what a torch call of our kernels costs beyond the kernel.

Small call (8×4096 bf16, host-bound) and large call (32768×4096 bf16, GPU-bound), forward and fwd+bwd, for torch
``F.rms_norm``, every torch backend of the registry and JAX native, all timed by ``timing.per_call`` (back-to-back
loop, one sync); then the host time of each layer of one small forward, launch route and DLPack route, so the
differences between rows are each layer's cost. fwd+bwd is ``torch.autograd.grad`` of a fresh forward with a
random cotangent, and one jitted ``jax.vjp`` in JAX.
"""

from __future__ import annotations

import jax
import torch

import pallas_norm
import torch_bridge
from bench import timing
from pallas_norm import registry
from pallas_norm.semantics import check_scalars
from torch_bridge import custom_ops, dlpack_route, jax_device, launch_route, ops, pallas_backends

SMALL, LARGE = (8, 4096), (32768, 4096)
TORCH_BACKENDS = tuple(b for b in registry.TORCH_BACKENDS if b != registry.DEFAULT_TORCH_BACKEND)


def _bridge(backend: str):
    return lambda a, b: torch_bridge.rms_norm(a, b, timing.EPS, backend=backend)


def entries(x, w, dy) -> dict[str, tuple]:
    """name -> (fwd, fwd+bwd, sync) over the same tensors."""
    n = x.shape[-1]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    fns = {"torch F.rms_norm": lambda a, b: torch.nn.functional.rms_norm(a, (n,), b, timing.EPS)}
    fns.update({f"backend={be}": _bridge(be) for be in TORCH_BACKENDS})
    out = {k: (lambda f=f: f(x, w), lambda f=f: torch.autograd.grad(f(xg, wg), (xg, wg), dy), timing.torch_sync)
           for k, f in fns.items()}
    xj, wj, dyj = (dlpack_route.to_jax(t, jax_device.jax_device_for(t)) for t in (x, w, dy))
    f = lambda a, b: pallas_norm.rms_norm(a, b, eps=timing.EPS, impl="pallas")  # noqa: E731
    fwd, fwd_bwd = jax.jit(f), jax.jit(lambda a, b, c: jax.vjp(f, a, b)[1](c))
    out["JAX native (jit)"] = (lambda: fwd(xj, wj), lambda: fwd_bwd(xj, wj, dyj), jax.block_until_ready)
    return out


def measure(shape, calls: int) -> dict[str, dict[str, float]]:
    x, w, dy = timing.inputs(*shape, torch.bfloat16, 0.0, seed=0)
    return {name: {"fwd": timing.per_call(fwd, sync, calls), "fwd+bwd": timing.per_call(both, sync, calls)}
            for name, (fwd, both, sync) in entries(x, w, dy).items()}


def layers(calls: int) -> dict[str, float]:
    """Host µs per call of each layer of one small forward."""
    x, w, _ = timing.inputs(*SMALL, torch.bfloat16, 0.0, seed=0)
    key = (*SMALL, x.dtype, w.dtype, timing.EPS, 0.0, "llama")
    launcher = launch_route.forward_launcher(*key, x.device.index)
    go = launcher.launches[0]
    y, rstd = torch.empty_like(x), torch.empty(SMALL[0], device="cuda")
    device = jax_device.jax_device_for(x)
    xj, wj = dlpack_route.to_jax(x, device), dlpack_route.to_jax(w, device)
    jitted = dlpack_route._forward_jit(timing.EPS, 0.0, "llama", "pallas")
    yj, _ = jitted(xj, wj)
    steps = {
        "torch F.rms_norm (reference)": lambda: torch.nn.functional.rms_norm(x, (SMALL[1],), w, timing.EPS),
        "rms_norm(backend='pallas_launch')": lambda: torch_bridge.rms_norm(x, w, timing.EPS, backend="pallas_launch"),
        "argument checks (check_scalars + check_tensors)": lambda: (check_scalars(timing.EPS, 0.0, "llama",
                                                                                  has_weight=True),
                                                                    ops.check_tensors(x, w)),
        "custom_ops.forward (kernel_ready, device guard)": lambda: custom_ops.forward(x, w, timing.EPS, 0.0, "llama",
                                                                                     "pallas_launch"),
        "launch backend's forward": lambda: pallas_backends._launch_forward(x, w, timing.EPS, 0.0, "llama"),
        "forward_launcher lru_cache lookup": lambda: launch_route.forward_launcher(*key, x.device.index),
        "Launcher call (2 torch.empty + launch)": lambda: launcher(x, w, out_shapes=(SMALL, SMALL[:1])),
        "C launch alone (preallocated outputs)": lambda: go(torch._C._cuda_getCurrentRawStream(x.device.index), x, w, y,
                                                            rstd),
        "rms_norm(backend='pallas_dlpack')": lambda: torch_bridge.rms_norm(x, w, timing.EPS, backend="pallas_dlpack"),
        "dlpack_route.forward": lambda: dlpack_route.forward(x, w, timing.EPS, 0.0, "llama"),
        "to_jax (one tensor)": lambda: dlpack_route.to_jax(x, device),
        "jitted JAX call": lambda: jitted(xj, wj),
        "to_torch (one array)": lambda: dlpack_route.to_torch(yj),
    }
    return {name: 1e6 * timing.per_call(fn, timing.torch_sync, calls) for name, fn in steps.items()}


def run(calls: int) -> dict:
    small, large = measure(SMALL, calls), measure(LARGE, 30)
    return dict(env=timing.environment(copy_tbps=timing.copy_tbps()), calls=calls, small=small, large=large,
                layers_us=layers(calls))


def markdown(result: dict) -> str:
    env, small, large = result["env"], result["small"], result["large"]
    ref, jref = small["torch F.rms_norm"], large["JAX native (jit)"]
    m, n = LARGE
    nbytes = {"fwd": 2 * m * n * 2, "fwd+bwd": 5 * m * n * 2}
    out = [f"# Torch bridge: small- and large-call cost on {env['gpu']}", "",
           f"{env['date']} · jax {env['jax']} · torch {env['torch']} · triton {env['triton']}. Made by "
           f"`python -m bench overhead` ({result['calls']} back-to-back calls per loop for the small call, median "
           "of 7 loops).", "", f"## Small call, {SMALL[0]}×{SMALL[1]} bf16: µs per call (× torch F.rms_norm)", "",
           "| provider | fwd µs | × torch | fwd+bwd µs | × torch |", "|---|---|---|---|---|"]
    for name, r in small.items():
        out.append(f"| {name} | {1e6 * r['fwd']:.1f} | {r['fwd'] / ref['fwd']:.2f} | {1e6 * r['fwd+bwd']:.1f} | "
                   f"{r['fwd+bwd'] / ref['fwd+bwd']:.2f} |")
    out += ["", f"## Large call, {m}×{n} bf16 (vs the same kernel from JAX); copy {env['copy_tbps']:.2f} TB/s", "",
            "| provider | fwd µs | fwd TB/s | vs JAX | fwd+bwd µs | fwd+bwd TB/s | vs JAX |",
            "|---|---|---|---|---|---|---|"]
    for name, r in large.items():
        cells = []
        for k in ("fwd", "fwd+bwd"):
            cells += [f"{1e6 * r[k]:.1f}", f"{nbytes[k] / r[k] / 1e12:.2f}", f"{100 * (r[k] / jref[k] - 1):+.1f}%"]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", f"## Host µs per layer of one small forward ({SMALL[0]}×{SMALL[1]} bf16)", "", "| µs | layer |",
            "|---|---|"]
    out += [f"| {v:.1f} | {k} |" for k, v in result["layers_us"].items()]
    return "\n".join(out) + "\n"


def plot(result: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, shape in ((axes[0], "small", SMALL), (axes[1], "large", LARGE)):
        data = result[key]
        names = list(data)
        for i, mode in enumerate(("fwd", "fwd+bwd")):
            ax.barh([j + 0.4 * i for j in range(len(names))], [1e6 * data[k][mode] for k in names], 0.4, label=mode)
        ax.set_yticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
        ax.set_title(f"{shape[0]}×{shape[1]} bf16: µs per call")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
