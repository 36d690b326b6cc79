"""The suite's fwd+bwd runs in a model's order in both frameworks: every input set's forward, then the backwards in
the sets' order, so no backward reads its x from L2 right after its forward (``bench.providers``' docstring). The
torch providers had run each set's backward right after its forward while XLA ran JAX's forwards first."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from bench import timing
from bench.providers import fwd_bwd_in_order, torch_modes


def in_model_order(log: list[tuple[str, int]], reps: int) -> bool:
    """Whether ``log`` (("f" or "b", set index) in the order they ran) holds every set's forward before any backward
    and the backwards in the sets' order. The forwards' own order is free (XLA may run them in any order)."""
    tags = [t for t, _ in log]
    return (sorted(i for t, i in log if t == "f") == list(range(reps)) and tags == ["f"] * reps + ["b"] * reps
            and [i for t, i in log if t == "b"] == list(range(reps)))


def test_the_order_check_fails_an_interleaved_run():
    assert in_model_order([("f", 1), ("f", 0), ("b", 0), ("b", 1)], 2)
    assert not in_model_order([("f", 0), ("b", 0), ("f", 1), ("b", 1)], 2)
    assert not in_model_order([("f", 0), ("f", 1), ("b", 1), ("b", 0)], 2)


def test_torch_fwd_bwd_runs_every_forward_before_the_backwards():
    log, index = [], {}

    class Logged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            index.setdefault(a.data_ptr(), len(index))  # torch_modes builds each set's graph once, in order
            log.append(("f", index[a.data_ptr()]))
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, c):
            a, b = ctx.saved_tensors
            log.append(("b", index[a.data_ptr()]))
            return c * b, (c * a).sum(0)

    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(4, 8, generator=g), 1 + 0.1 * torch.randn(8, generator=g), torch.randn(4, 8, generator=g)
    fns = torch_modes(Logged.apply, x, w, dy)
    reps = timing.rotations(x.numel() * x.element_size())
    log.clear()
    grads = fns["fwd+bwd"]()
    assert reps == 8 and in_model_order(log, reps)
    for dx, dw in grads:
        torch.testing.assert_close(dx, dy * w, rtol=0, atol=0)
        torch.testing.assert_close(dw, (dy * x).sum(0), rtol=0, atol=0)


def _logged_jax(log: list) -> Callable:
    """``a * b`` whose forward and backward each record ("f"/"b", set index) when they run: the index is the set's
    value of ``a[0, 0]`` (pure callbacks that the results depend on, the backward's on the cotangent too, so XLA runs
    them where a forward and a backward can run)."""

    def record(tag):
        def cb(a, *_):
            log.append((tag, int(a[0, 0])))
            return a
        return lambda a, *deps: jax.pure_callback(cb, jax.ShapeDtypeStruct(a.shape, a.dtype), a, *deps)

    @jax.custom_vjp
    def f(a, b):
        return a * b

    def f_fwd(a, b):
        return record("f")(a) * b, (a, b)

    def f_bwd(res, c):
        a, b = res
        seen = record("b")(a, c)  # takes the cotangent: it runs where the backward can start
        return c * b + 0 * seen, (c * seen).sum(0)

    f.defvjp(f_fwd, f_bwd)
    return f


def _sets(reps: int) -> list[tuple]:
    k = jax.random.split(jax.random.key(0), 2)
    w, dy = 1 + 0.1 * jax.random.normal(k[0], (8,)), jax.random.normal(k[1], (4, 8))
    return [(jnp.full((4, 8), float(i)).at[1:].add(0.5), w, dy + i) for i in range(reps)]


def test_jax_fwd_bwd_runs_every_forward_before_the_backwards():
    log = []
    sets = _sets(4)
    ys, grads = jax.jit(lambda ss: fwd_bwd_in_order(_logged_jax(log), ss))(sets)
    jax.block_until_ready((ys, grads))
    assert in_model_order(log, 4)
    for (a, b, c), y, (dx, dw) in zip(sets, ys, grads):
        assert jnp.array_equal(y, a * b) and jnp.array_equal(dx, c * b) and jnp.allclose(dw, (c * a).sum(0))


def test_the_jax_order_check_catches_an_interleaved_schedule():
    """The broken variant pins each set's forward after the previous set's backward (as the torch providers ran):
    the same check fails it."""
    log = []
    f = _logged_jax(log)

    def interleaved(ss):
        out, prev = [], None
        for a, b, c in ss:
            if prev is not None:
                a, b, c, _ = jax.lax.optimization_barrier((a, b, c, prev))
            y, vjp = jax.vjp(f, a, b)
            prev = vjp(c)
            out.append((y, prev))
        return out

    jax.block_until_ready(jax.jit(interleaved)(_sets(4)))
    assert len(log) == 8 and not in_model_order(log, 4)
