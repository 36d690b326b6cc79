"""``python -m bench fused``: the fused residual add + RMSNorm against its peers, and per-head (q/k) norms.

Fused add (``(y, h) = rms_norm_add(x, residual)``; bf16, llama casting): ours (JAX, the torch default route, the
Triton reference; in JAX both ``"auto"``, the default, and ``"pallas"``, the Triton lowering), Liger's
``LigerFusedAddRMSNormFunction`` (``in_place=False``) when installed, and the unfused ``h = x + residual`` then a
norm (``F.rms_norm``; ``torch.compile`` of HF's formula; ours). Bytes per call, by the op's own count: forward reads
x and residual and writes y and h, backward reads h, dy and dh_out and writes dh (4·M·N·s each; the weight and
dweight are negligible). Per-head norms: ``rms_norm`` on (rows, D) with D in {64, 128, 256} and millions of rows
(the usual byte counts: 2 and 3 · M·N·s). Every provider is timed by its kernels' durations (``_time``; the committed
``fused_h100.md`` of 2026-11-24 predates this: its torch rows are CUDA events around one call).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

from bench import timing

FUSED_SHAPES = [(32768, 4096), (65536, 2304), (16384, 8192), (4096, 16384), (8192, 2048)]  # the last: bench step's
HEAD_SHAPES = [(1 << 22, 64), (1 << 21, 128), (1 << 20, 256)]
QUICK = dict(fused=[(32768, 4096)], heads=[(1 << 21, 128)])
EPS = timing.EPS
JAX_IMPLS = ("auto", "pallas")  # ours timed in JAX: the default and the Triton lowering


def _torch_fused(fn: Callable, x, r, w, dy, dh) -> dict[str, Callable]:
    """fwd (no autograd) and bwd (from a retained graph: grads of x, residual, weight) of ``fn(x, r, w) -> (y, h)``."""
    xr, rr, wr = (t.detach().clone().requires_grad_() for t in (x, r, w))
    y, h = fn(xr, rr, wr)

    def fwd():
        with torch.no_grad():
            return fn(x, r, w)

    return {"fwd": fwd, "bwd": lambda: torch.autograd.grad((y, h), (xr, rr, wr), (dy, dh), retain_graph=True)}


def _jax_fused(x, r, w, dy, dh, *, impl: str) -> dict[str, Callable]:
    import jax

    import pallas_norm
    from bench.providers import jax_owned

    a = [jax_owned(t) for t in (x, r, w, dy, dh)]
    f = lambda x, r, w: pallas_norm.rms_norm_add(x, r, w, eps=EPS, impl=impl)  # noqa: E731
    _, vjp = jax.vjp(f, *a[:3])
    # dx and dresidual are the same values: a jitted function returning both would copy one; in a model each
    # feeds its own branch of one graph, so dx and dweight are what is kept here
    fwd, bwd = jax.jit(f), jax.jit(lambda v, c: v(c)[::2])
    return {"fwd": lambda: fwd(*a[:3]), "bwd": lambda: bwd(vjp, (a[3], a[4]))}


def fused_providers() -> dict[str, Callable]:
    """name -> build(x, r, w, dy, dh) -> {mode: callable}."""
    import torch_bridge

    def ours(backend):
        return lambda *t: _torch_fused(lambda x, r, w: torch_bridge.rms_norm_add(x, r, w, EPS, backend=backend), *t)

    def unfused(norm):
        def build(*t):
            f = norm()
            return _torch_fused(lambda x, r, w: (f(x + r, w), x + r), *t)
        return build

    def compiled():
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False  # the "bwd" mode re-runs a retained graph
        torch._dynamo.reset()  # one static-shape graph per shape
        hf = timing.hf_formula(0.0, "llama")
        return torch.compile(lambda x, r, w: (hf(x + r, w), x + r), dynamic=False)

    out = {**{impl: functools.partial(_jax_fused, impl=impl) for impl in JAX_IMPLS},
           "pallas_launch": ours("pallas_launch"), "triton": ours("triton"),
           "unfused pallas_launch": unfused(lambda: lambda h, w: torch_bridge.rms_norm(h, w, EPS,
                                                                                      backend="pallas_launch")),
           "unfused torch": unfused(lambda: lambda h, w: torch.nn.functional.rms_norm(h, h.shape[-1:], w, EPS)),
           "unfused torch.compile": lambda *t: _torch_fused(compiled(), *t)}
    if importlib.util.find_spec("liger_kernel"):
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        out["liger"] = lambda *t: _torch_fused(
            lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False), *t)
    return out


def _time(fn: Callable) -> float:
    """Seconds per call by the kernels' durations, torch's and JAX's alike (``timing.time_kernels``: the suite's
    method; every shape here moves at least 128 MB per call, past the L2, so one input set serves)."""
    return timing.time_kernels(fn, timing.sync_any)


def run(quick: bool = False) -> dict:
    from bench.providers import providers  # the plain-norm providers for the per-head table

    head_names = ("auto", "pallas", "pallas_launch", "triton", "torch_native", "hf_compile") + (
        ("liger",) if importlib.util.find_spec("liger_kernel") else ())
    copy = timing.copy_tbps()
    rows = []
    for m, n in QUICK["fused"] if quick else FUSED_SHAPES:
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        r, _, dh = timing.inputs(m, n, torch.bfloat16, 0.0, seed=m + n)
        for name, build in fused_providers().items():
            fns = build(x, r, w, dy, dh)
            for mode, fn in fns.items():
                tb = 4 * m * n * 2 / _time(fn) / 1e12
                rows.append(dict(table="fused", shape=f"{m}x{n}", provider=name, mode=mode, tbps=tb, pct=tb / copy))
            del fns
        del x, r, w, dy, dh
        torch.cuda.empty_cache()
    for m, n in QUICK["heads"] if quick else HEAD_SHAPES:
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        for p in providers(only=head_names):
            fns = p.build(x, w, dy, 0.0, "llama")
            for mode in ("fwd", "bwd"):
                t = _time(fns[mode])
                tb = timing.tbps(mode, m, n, 2, t)
                rows.append(dict(table="heads", shape=f"{m}x{n}", provider=p.name, mode=mode, tbps=tb, pct=tb / copy))
            del fns
        del x, w, dy
        torch.cuda.empty_cache()
    return dict(env=timing.environment(copy_tbps=copy, dtype="bfloat16", casting="llama"), rows=rows)


def markdown(result: dict) -> str:
    env = result["env"]
    out = [f"# Fused residual add + RMSNorm, and per-head norms, on {env['gpu']}", "",
           f"{timing.versions(env)} · bf16, llama casting; "
           f"copy {env['copy_tbps']:.2f} TB/s. Made by `python -m bench fused`. TB/s (% of copy); fused bytes "
           "4·M·N·2 per direction, per-head 2 (fwd) and 3 (bwd) · M·N·2.", ""]
    for table, title in (("fused", "Fused add: (y, h) = norm(x + residual)"), ("heads", "Per-head norms (rows × D)")):
        rows = [r for r in result["rows"] if r["table"] == table]
        if not rows:
            continue
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        out += [f"## {title}", "", "| shape | mode | " + " | ".join(providers) + " |",
                "|---|---|" + "---|" * len(providers)]
        for shape in dict.fromkeys(r["shape"] for r in rows):
            for mode in ("fwd", "bwd"):
                cells = {r["provider"]: r for r in rows if r["shape"] == shape and r["mode"] == mode}
                out.append(f"| {shape} | {mode} | " + " | ".join(
                    f"{cells[p]['tbps']:.2f} ({100 * cells[p]['pct']:.0f}%)" if p in cells else "–"
                    for p in providers) + " |")
        out.append("")
    return "\n".join(out)


def plot(result: dict, path) -> None:
    """Bars of % of copy per provider, one panel per table and mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, m) for t in ("fused", "heads") for m in ("fwd", "bwd")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True)
    for ax, (table, mode) in zip(axes, panels):
        rows = [r for r in result["rows"] if r["table"] == table and r["mode"] == mode]
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        width = 0.8 / max(1, len(providers))
        for i, p in enumerate(providers):
            vals = [next((100 * r["pct"] for r in rows if r["shape"] == s and r["provider"] == p), 0) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=p)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=20, fontsize=7)
        ax.set_title(f"{table} {mode}: % of copy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
