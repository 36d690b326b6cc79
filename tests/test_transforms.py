"""``rms_norm`` under JAX transformations, and the Flax NNX module trained with optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pallas_norm as pn

from helpers import KERNEL, jax_inputs


def loss_fn(impl, **kw):
    return lambda x, w, dy: jnp.sum(pn.rms_norm(x, w, impl=impl, **kw).astype(jnp.float32) * dy)


def test_jit_and_grad_match_vjp():
    x, w, dy = jax_inputs((4, 6, 96), jnp.float32, 0.0, seed=10)
    f = loss_fn(KERNEL, casting="gemma", offset=0.5)
    gx, gw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w, dy)
    _, vjp = jax.vjp(lambda x, w: pn.rms_norm(x, w, impl=KERNEL, casting="gemma", offset=0.5), x, w)
    rx, rw = vjp(dy)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(rx))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(rw))


def test_vmap_forward_and_backward():
    x, w, dy = jax_inputs((3, 5, 64), jnp.bfloat16, 0.0, seed=11)
    f = lambda x, w: pn.rms_norm(x, w, impl=KERNEL)
    np.testing.assert_array_equal(np.asarray(jax.vmap(f, (0, None))(x, w)), np.asarray(f(x, w)))
    # Per-example weight gradients under vmap equal one gradient per example computed alone.
    per_example = jax.vmap(jax.grad(lambda w, x, dy: jnp.sum(f(x, w).astype(jnp.float32) * dy)),
                           (None, 0, 0))(w, x, dy)
    alone = [jax.grad(lambda w: jnp.sum(f(x[i], w).astype(jnp.float32) * dy[i]))(w) for i in range(3)]
    np.testing.assert_array_equal(np.asarray(per_example), np.asarray(jnp.stack(alone)))
    # No weight: batches fold into rows; per-example weights: one launch each.
    g = jax.vmap(jax.grad(lambda x, dy: jnp.sum(pn.rms_norm(x, impl=KERNEL) * dy)))(x, dy)
    g_ref = jax.grad(lambda x: jnp.sum(pn.rms_norm(x, impl=KERNEL) * dy))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))
    ws = jnp.stack([w, 2 * w, -w])
    y = jax.vmap(f)(x, ws)
    np.testing.assert_array_equal(np.asarray(y[1]), np.asarray(f(x[1], ws[1])))


def test_checkpoint_recomputes_with_the_named_kernel():
    x, w, dy = jax_inputs((8, 128), jnp.float32, 0.0, seed=12)
    f = lambda x, w: jnp.sum(jax.checkpoint(lambda x, w: pn.rms_norm(x, w, impl=KERNEL))(x, w) * dy)
    jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
    assert jaxpr.count("pallas_norm_fwd") >= 1 and "pallas_norm_bwd" in jaxpr
    assert "pallas_norm_dweight_reduce" not in jaxpr  # 1024 elements: one program stores dweight itself
    g = jax.grad(f, argnums=(0, 1))(x, w)
    g_ref = jax.grad(loss_fn(KERNEL), argnums=(0, 1))(x, w, dy)
    for a, b in zip(g, g_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cotangent_is_not_modified():
    x, w, dy = jax_inputs((16, 200), jnp.bfloat16, 0.0, seed=13)
    dy_host = np.asarray(dy).copy()
    _, vjp = jax.vjp(lambda x, w: pn.rms_norm(x, w, impl=KERNEL), x, w)
    jax.block_until_ready(vjp(dy))
    np.testing.assert_array_equal(np.asarray(dy), dy_host)


class Block(nnx.Module):
    """Two norms in sequence with a linear layer between them (Gemma-style offset on the second)."""

    def __init__(self, d: int, impl: str | None, rngs: nnx.Rngs):
        self.norm1 = pn.nnx.RMSNorm(d, impl=impl, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.norm2 = pn.nnx.RMSNorm(d, offset=1.0, casting="gemma", impl=impl, rngs=rngs)

    def __call__(self, x):
        return self.norm2(self.proj(self.norm1(x)))


def train(impl: str, steps: int = 3):
    model = Block(64, impl, nnx.Rngs(0))
    model.norm1.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(1), (64,))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(2), (32, 64))
    target = jax.random.normal(jax.random.key(3), (32, 64))

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(steps)]
    return losses, model


def test_nnx_module_init_and_training_matches_reference():
    m = pn.nnx.RMSNorm(8, offset=1.0, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(m.scale[...]), np.zeros(8, np.float32))
    np.testing.assert_array_equal(np.asarray(pn.nnx.RMSNorm(8, rngs=nnx.Rngs(0)).scale[...]), np.ones(8))
    losses, model = train(KERNEL)
    losses_ref, model_ref = train("xla")
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(np.asarray(model.norm2.scale[...]), np.asarray(model_ref.norm2.scale[...]),
                               rtol=1e-4, atol=1e-5)
