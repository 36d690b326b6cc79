"""``python -m bench overhead``: what a torch call of our kernels costs beyond the kernel.

Small call (8×4096 bf16, host-bound) and large calls (32768×4096, 65536×2304, 4096×65536 bf16, GPU-bound), forward
and fwd+bwd, for torch ``F.rms_norm``, every torch backend of the registry, Liger (if installed) and JAX native,
timed by ``timing.interleaved_samples`` (back-to-back loops taking turns, one sync each; ratios to torch and to
JAX paired by round); whether a CUDA graph captures each torch provider (``bench.capture``); then the host time of
each layer of one small forward (launch route and DLPack route) and of one small fwd+bwd (launch route, beside an
identity ``autograd.Function``: the floor of any Python autograd path), so the differences between rows are each
layer's cost. fwd is a call without gradient; fwd+bwd is ``torch.autograd.grad`` of a fresh forward with a random
cotangent, and one jitted ``jax.vjp`` in JAX.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable

import jax
import torch

import pallas_norm
import torch_bridge
from bench import capture, timing
from pallas_norm import registry
from pallas_norm.semantics import check_scalars
from torch_bridge import custom_ops, dlpack_route, jax_device, launch_route, ops, pallas_backends

SMALL, LARGE = (8, 4096), ((32768, 4096), (65536, 2304), (4096, 65536))
REFERENCE = "torch F.rms_norm"
JAX = "JAX native (jit)"
TORCH_BACKENDS = tuple(b for b in registry.TORCH_BACKENDS if b != registry.DEFAULT_TORCH_BACKEND)


def _bridge(backend: str):
    return lambda a, b: torch_bridge.rms_norm(a, b, timing.EPS, backend=backend)


def torch_fns(n: int) -> dict[str, Callable]:
    """name -> ``f(x, weight) -> y`` for torch ``F.rms_norm``, each torch backend of ours, and Liger if installed."""
    fns = {REFERENCE: lambda a, b: torch.nn.functional.rms_norm(a, (n,), b, timing.EPS)}
    fns.update({f"backend={be}": _bridge(be) for be in TORCH_BACKENDS})
    if importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        fns["Liger"] = lambda a, b: LigerRMSNormFunction.apply(a, b, timing.EPS, 0.0, "llama", False)
    return fns


def entries(x, w, dy) -> dict[str, tuple]:
    """name -> (fwd, fwd+bwd) over the same tensors."""
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    fns = torch_fns(x.shape[-1])
    out = {k: (lambda f=f: f(x, w), lambda f=f: torch.autograd.grad(f(xg, wg), (xg, wg), dy)) for k, f in fns.items()}
    xj, wj, dyj = (dlpack_route.to_jax(t, jax_device.jax_device_for(t)) for t in (x, w, dy))
    f = lambda a, b: pallas_norm.rms_norm(a, b, eps=timing.EPS)  # noqa: E731  (the default, as pallas_launch runs)
    fwd, fwd_bwd = jax.jit(f), jax.jit(lambda a, b, c: jax.vjp(f, a, b)[1](c))
    out[JAX] = (lambda: fwd(xj, wj), lambda: fwd_bwd(xj, wj, dyj))
    return out


def measure(shape, calls: int) -> dict[str, dict[str, float]]:
    """Seconds per call, fwd and fwd+bwd, every provider's loop taking turns with the others'
    (``timing.interleaved_samples``, one ``timing.sync_any`` per loop), so the ratios to torch ``F.rms_norm`` and
    to JAX are from the same moments of the run (``"<mode> paired"``, ``"<mode> vs JAX paired"``)."""
    x, w, dy = timing.inputs(*shape, torch.bfloat16, 0.0, seed=0)
    runs = entries(x, w, dy)
    out = {}
    for i, mode in enumerate(("fwd", "fwd+bwd")):
        samples = timing.interleaved_samples({name: r[i] for name, r in runs.items()}, timing.sync_any, calls)
        for name, s in samples.items():
            out.setdefault(name, {})[mode] = statistics.median(s)
            out[name][f"{mode} paired"] = timing.paired_ratio(samples, name, REFERENCE)
            out[name][f"{mode} vs JAX paired"] = timing.paired_ratio(samples, name, JAX)
    return out


def layers(calls: int) -> dict[str, float]:
    """Host µs per call of each layer of one small forward without gradient (rstd goes to a scratch buffer)."""
    x, w, _ = timing.inputs(*SMALL, torch.bfloat16, 0.0, seed=0)
    key = (*SMALL, x.dtype, w.dtype, timing.EPS, 0.0, "llama")
    launcher = launch_route.forward_launcher(*key, x.device.index)
    kernel, call = launcher.kernels[0], launcher.program.calls[0]
    y, rstd = torch.empty_like(x), torch.empty(SMALL[0], device="cuda")
    go = kernel.bind(call.grid, 32 * call.num_warps)
    device = jax_device.jax_device_for(x)
    xj, wj = dlpack_route.to_jax(x, device), dlpack_route.to_jax(w, device)
    jitted = dlpack_route._forward_jit(timing.EPS, 0.0, "llama", "auto")
    yj, _ = jitted(xj, wj)
    steps = {
        "torch F.rms_norm (reference)": lambda: torch.nn.functional.rms_norm(x, (SMALL[1],), w, timing.EPS),
        "rms_norm(backend='pallas_launch')": lambda: torch_bridge.rms_norm(x, w, timing.EPS, backend="pallas_launch"),
        "argument checks (check_scalars + check_tensors)": lambda: (check_scalars(timing.EPS, 0.0, "llama",
                                                                                  has_weight=True),
                                                                    ops.check_tensors(x, w)),
        "custom_ops.forward_y (device guard, kernel_ready)": lambda: custom_ops.forward_y(
            x, w, timing.EPS, 0.0, "llama", "pallas_launch"),
        "launch backend's forward_y (launcher lookup, rstd scratch)": lambda: pallas_backends._launch_forward_y(
            x, w, timing.EPS, 0.0, "llama"),
        "Launcher call (torch.empty_like for y + launch)": lambda: launcher(x, w, out=(None, rstd)),
        "driver launch alone (bound, preallocated outputs)": lambda: go(
            torch._C._cuda_getCurrentRawStream(x.device.index), [x.data_ptr(), w.data_ptr(), y.data_ptr(),
                                                                  rstd.data_ptr()]),
        "rms_norm(backend='pallas_dlpack')": lambda: torch_bridge.rms_norm(x, w, timing.EPS, backend="pallas_dlpack"),
        "dlpack_route.forward": lambda: dlpack_route.forward(x, w, timing.EPS, 0.0, "llama"),
        "to_jax (one tensor)": lambda: dlpack_route.to_jax(x, device),
        "jitted JAX call": lambda: jitted(xj, wj),
        "to_torch (one array)": lambda: dlpack_route.to_torch(yj),
    }
    return {name: 1e6 * timing.per_call(fn, timing.torch_sync, calls) for name, fn in steps.items()}


class _Identity(torch.autograd.Function):
    """Saves two tensors and passes the gradient through: what any Python-level autograd path costs at least."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def backward_layers(calls: int) -> dict[str, float]:
    """Host µs per call of each layer of one small fwd+bwd (``torch.autograd.grad`` of a fresh forward)."""
    x, w, dy = timing.inputs(*SMALL, torch.bfloat16, 0.0, seed=0)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    _, rstd = custom_ops.forward(x, w, timing.EPS, 0.0, "llama", "pallas_launch")
    launcher = pallas_backends._launcher(launch_route.backward_launcher, (*SMALL, x.dtype, w.dtype, 0.0, "llama"), x)
    steps = {
        "torch F.rms_norm fwd+bwd (reference)": lambda: torch.autograd.grad(
            torch.nn.functional.rms_norm(xg, (SMALL[1],), wg, timing.EPS), (xg, wg), dy),
        "rms_norm(backend='pallas_launch') fwd+bwd": lambda: torch.autograd.grad(
            torch_bridge.rms_norm(xg, wg, timing.EPS, backend="pallas_launch"), (xg, wg), dy),
        "an identity autograd.Function fwd+bwd (the floor of a Python autograd path)": lambda: torch.autograd.grad(
            _Identity.apply(xg, wg), (xg,), dy),
        "rms_norm(backend='pallas_launch') forward recording the graph": lambda: torch_bridge.rms_norm(
            xg, wg, timing.EPS, backend="pallas_launch"),
        "custom_ops.backward (device guard, kernel_ready)": lambda: custom_ops.backward(
            dy, x, w, rstd, 0.0, "llama", "pallas_launch"),
        "backward Launcher call (dx, dweight allocated; one launch at this size)": lambda: launcher(x, w, dy, rstd),
    }
    return {name: 1e6 * timing.per_call(fn, timing.torch_sync, calls) for name, fn in steps.items()}


def run(calls: int) -> dict:
    small = measure(SMALL, calls)
    large = {f"{m}x{n}": measure((m, n), 30) for m, n in LARGE}
    return dict(env=timing.environment(copy_tbps=timing.copy_tbps()), calls=calls, small=small, large=large,
                layers_us=layers(calls), bwd_layers_us=backward_layers(calls),
                capture=capture.run(torch_fns(SMALL[1])))


def markdown(result: dict) -> str:
    env, small, large = result["env"], result["small"], result["large"]
    ref = small[REFERENCE]
    out = [f"# Torch bridge: small- and large-call cost on {env['gpu']}", "",
           f"{timing.versions(env)}. Made by "
           f"`python -m bench overhead` ({result['calls']} back-to-back calls per loop for the small call; the torch "
           "providers' loops take turns, median of 9 rounds"
           + ("; × torch: the median over rounds of the ratio within a round" if "fwd paired" in ref else "")
           + "). `backend=pallas` (the default) runs `pallas_launch` on "
           "CUDA tensors.", "", f"## Small call, {SMALL[0]}×{SMALL[1]} bf16: µs per call (× torch F.rms_norm)", "",
           "| provider | fwd µs | × torch | fwd+bwd µs | × torch |", "|---|---|---|---|---|"]
    for name, r in small.items():  # × torch: paired by round when the run has it (drift cancels), else medians
        ratio = {k: r.get(f"{k} paired", r[k] / ref[k]) for k in ("fwd", "fwd+bwd")}
        out.append(f"| {name} | {1e6 * r['fwd']:.1f} | {ratio['fwd']:.2f} | {1e6 * r['fwd+bwd']:.1f} | "
                   f"{ratio['fwd+bwd']:.2f} |")
    for shape, rows in large.items():
        m, n = map(int, shape.split("x"))
        nbytes = {"fwd": 2 * m * n * 2, "fwd+bwd": 5 * m * n * 2}
        jref = rows[JAX]
        out += ["", f"## Large call, {m}×{n} bf16 (vs the same kernel from JAX); copy {env['copy_tbps']:.2f} TB/s",
                "", "| provider | fwd µs | fwd TB/s | vs JAX | fwd+bwd µs | fwd+bwd TB/s | vs JAX |",
                "|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            cells = []
            for k in ("fwd", "fwd+bwd"):  # vs JAX: paired by round when the run has it, else medians
                vs_jax = r.get(f"{k} vs JAX paired", r[k] / jref[k])
                cells += [f"{1e6 * r[k]:.1f}", f"{nbytes[k] / r[k] / 1e12:.2f}", f"{100 * (vs_jax - 1):+.1f}%"]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    if "capture" in result:
        out += ["", f"## CUDA-graph capture, {SMALL[0]}×{SMALL[1]} bf16 (✓: replay on new inputs = eager bits)", "",
                "| provider | fwd | fwd+bwd |", "|---|---|---|"]
        out += [f"| {name} | {r['fwd']} | {r['fwd+bwd']} |" for name, r in result["capture"].items()]
    out += ["", f"## Host µs per layer of one small forward without gradient ({SMALL[0]}×{SMALL[1]} bf16)", "",
            "| µs | layer |", "|---|---|"]
    out += [f"| {v:.1f} | {k} |" for k, v in result["layers_us"].items()]
    if "bwd_layers_us" in result:
        out += ["", f"## Host µs per layer of one small fwd+bwd ({SMALL[0]}×{SMALL[1]} bf16)", "", "| µs | layer |",
                "|---|---|"]
        out += [f"| {v:.1f} | {k} |" for k, v in result["bwd_layers_us"].items()]
    return "\n".join(out) + "\n"


def plot(result: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("small", SMALL, result["small"])] + [("large", tuple(map(int, k.split("x"))), v)
                                                     for k, v in result["large"].items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5))
    for ax, (key, shape, data) in zip(axes, panels):
        names = list(data)
        for i, mode in enumerate(("fwd", "fwd+bwd")):
            ax.barh([j + 0.4 * i for j in range(len(names))], [1e6 * data[k][mode] for k in names], 0.4, label=mode)
        ax.set_yticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
        ax.set_title(f"{shape[0]}×{shape[1]} bf16: µs per call")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
