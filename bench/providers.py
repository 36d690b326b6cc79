"""The benchmark's providers: ours (named as in ``pallas_norm.registry``) and every peer that imports, each as
``{mode: callable}`` over shared inputs.

Modes: ``fwd`` (no autograd), ``bwd`` (the backward alone, from saved activations: a retained torch graph or a JAX
``vjp`` closure passed to a jitted function), ``fwd+bwd`` (a fresh forward and its backward, dx and dweight).
Peers compute their own formula for the mode (HF Llama's or HF Gemma's; ``F.rms_norm`` is Llama-like). JAX
providers get JAX-owned copies of the inputs (DLPack from torch, then copied); both frameworks' providers rotate
through several input sets when one is small (past L2, ``timing.rotations``), and each call runs every set.

``fwd+bwd`` runs every set's forward, then the sets' backwards in the same order, in both frameworks: each backward then
reads its x and dy from memory, as in a model, where other layers run between a norm's forward and its backward. Until
2026-11-27 the torch providers ran each set's backward right after its forward (x still in L2) while XLA scheduled JAX's
forwards first: at 4096×1024 bf16 the torch route's fwd+bwd read 2.53 TB/s the first way and 2.26 the model's way, JAX's
2.24 (``bench/results/probes_h100_2026-11-27_thirtysixth.md`` §1).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

import pallas_norm
import torch_bridge
from bench.names import JAX_OURS, JAX_PEERS, TORCH_OURS, label
from bench.timing import EPS, hf_formula, input_sets, rotations
from torch_bridge import dlpack_route, jax_device


@dataclasses.dataclass
class Provider:
    name: str  # the key in results: a registry name for ours, a peer name otherwise
    label: str
    framework: str  # "torch" or "jax": how to time it
    build: Callable  # (x, w, dy, offset, casting) -> {mode: zero-argument callable}


def torch_modes(fn: Callable, x, w, dy) -> dict[str, Callable]:
    """``reps`` sets of the inputs when one set is small (rotation past L2, as ``jax_modes``; the first set is the
    caller's tensors, never written), each with its own retained graph for ``bwd``. Each callable runs the op
    once per set and returns the outputs; the timer divides by ``.reps``."""
    sets = input_sets((x, w, dy))
    reps = len(sets)
    leaves = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b, _ in sets]
    saved = [fn(a, b) for a, b in leaves]

    def fwd():
        with torch.no_grad():
            return [fn(a, b) for a, b, _ in sets]

    def fwd_bwd():  # every forward, then the backwards in order (the module's docstring says why)
        ys = [fn(*ab) for ab in leaves]
        return [torch.autograd.grad(y, ab, c) for y, ab, (_, _, c) in zip(ys, leaves, sets)]

    fns = {"fwd": fwd,
           "bwd": lambda: [torch.autograd.grad(y, ab, c, retain_graph=True)
                           for y, ab, (_, _, c) in zip(saved, leaves, sets)],
           "fwd+bwd": fwd_bwd}
    for f in fns.values():
        f.reps = reps
    return fns


def jax_owned(t: torch.Tensor) -> jax.Array:
    """A JAX-owned copy of a torch CUDA tensor (DLPack onto its JAX device, then copied: JAX's allocator, as a JAX
    model's arrays)."""
    return jnp.copy(dlpack_route.to_jax(t, jax_device.jax_device_for(t)))


def jax_modes(f: Callable, x, w, dy) -> dict[str, Callable]:
    """JAX-owned copies of the inputs, ``reps`` of them when one set is small (rotation past L2, and one jitted
    call runs the op ``reps`` times back to back, so per-call dispatch is not what is timed: inside a model the
    norm is part of one large jit). Each callable returns its outputs; the timer divides by ``.reps``."""
    reps = rotations(x.numel() * x.element_size())
    sets = [tuple(jax_owned(t) for t in (x, w, dy)) for _ in range(reps)]
    vjps = functools.cache(lambda: [jax.vjp(f, a, b)[1] for a, b, _ in sets])  # first "bwd" call: a backward
    # that cannot run there (e.g. Mosaic GPU past 262144 columns) fails that mode only

    fwd = jax.jit(lambda ss: [f(a, b) for a, b, _ in ss])
    bwd = jax.jit(lambda vs, ss: [v(c) for v, (_, _, c) in zip(vs, ss)])
    both = jax.jit(functools.partial(fwd_bwd_in_order, f))
    fns = {"fwd": lambda: fwd(sets), "bwd": lambda: bwd(vjps(), sets), "fwd+bwd": lambda: both(sets)}
    for fn in fns.values():
        fn.reps = reps
    return fns


def fwd_bwd_in_order(f: Callable, sets: list[tuple]) -> tuple[list, list]:
    """``(ys, grads)`` of ``f`` over ``sets``: every forward, then the backwards in the sets' order (the module's
    docstring says why), pinned by optimization barriers, since XLA may order independent sets as it likes: no
    cotangent reaches a backward before every forward's output exists, and each backward's cotangent waits for the
    previous backward's grads. The ys stay outputs, so XLA cannot drop the forwards."""
    outs = [jax.vjp(f, a, b) for a, b, _ in sets]
    cs, ys = jax.lax.optimization_barrier(([c for *_, c in sets], [y for y, _ in outs]))
    grads = []
    for (_, vjp), c in zip(outs, cs):
        if grads:
            c, _ = jax.lax.optimization_barrier((c, grads[-1]))
        grads.append(vjp(c))
    return ys, grads


def _bridge(backend: str) -> Callable:
    def build(x, w, dy, offset, casting):
        return torch_modes(lambda a, b: torch_bridge.rms_norm(a, b, EPS, offset=offset, casting=casting,
                                                              backend=backend), x, w, dy)
    return build


def _jax_kernel(impl: str) -> Callable:
    def build(x, w, dy, offset, casting):
        return jax_modes(lambda a, b: pallas_norm.rms_norm(a, b, eps=EPS, offset=offset, casting=casting, impl=impl),
                         x, w, dy)
    return build


def _xla_formula(x, w, dy, offset, casting):
    def f(a, b):  # the jnp formula a JAX user writes (HF's, as in hf_formula)
        h = a.astype(jnp.float32)
        n = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + EPS)
        if casting == "gemma":
            return (n * (offset + b.astype(jnp.float32))).astype(a.dtype)
        return b * n.astype(a.dtype)
    return jax_modes(f, x, w, dy)


def _torch_native(x, w, dy, offset, casting):
    n = x.shape[-1]
    return torch_modes(lambda a, b: torch.nn.functional.rms_norm(a, (n,), b + offset if offset else b, EPS), x, w, dy)


def _hf_eager(x, w, dy, offset, casting):
    return torch_modes(hf_formula(offset, casting), x, w, dy)


def _hf_compiled(x, w, dy, offset, casting):
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False  # the "bwd" mode re-runs a retained graph
    torch._dynamo.reset()  # one specialised (static-shape) graph per shape, never a cache-limit fallback to eager
    return torch_modes(torch.compile(hf_formula(offset, casting), dynamic=False), x, w, dy)


def _liger(x, w, dy, offset, casting):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    return torch_modes(lambda a, b: LigerRMSNormFunction.apply(a, b, EPS, offset, casting), x, w, dy)


def _tokamax(x, w, dy, offset, casting):
    import tokamax
    return jax_modes(lambda a, b: tokamax.layer_norm(a, b + offset if offset else b, None, epsilon=EPS,
                                                     subtract_mean=False), x, w, dy)


def providers(only: tuple[str, ...] | None = None) -> list[Provider]:
    """Ours first (``OURS``; ``mosaic`` on Hopper GPUs; ``auto`` everywhere, the Triton lowering off Hopper), then
    the peers that import here; ``only`` keeps those names."""
    ours = [i for i in JAX_OURS if i != "mosaic" or pallas_norm.backend.mosaic_capable()]
    builds = {**{i: _jax_kernel(i) for i in ours}, **{b: _bridge(b) for b in TORCH_OURS}, "torch_native": _torch_native,
              "hf_eager": _hf_eager, "hf_compile": _hf_compiled, "xla_formula": _xla_formula}
    if importlib.util.find_spec("liger_kernel") is not None:
        builds["liger"] = _liger
    if importlib.util.find_spec("tokamax") is not None:
        builds["tokamax"] = _tokamax
    if only is not None:
        unknown = set(only) - set(builds)
        if unknown:
            raise ValueError(f"--providers: unknown or not importable here: {sorted(unknown)}; choose from "
                             f"{list(builds)}")
        builds = {n: b for n, b in builds.items() if n in only}
    return [Provider(n, label(n), "jax" if n in JAX_OURS + JAX_PEERS else "torch", b) for n, b in builds.items()]
