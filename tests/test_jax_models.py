"""The JAX side of the field's failures, on small models: the Pallas norm against the reference norm.

* A bf16 residual model under ``jax.checkpoint`` (the Qwen2 lost-gradient failure): every parameter gets a
  non-zero, finite gradient, as accurate against the float32 model as with the reference norm (a norm that
  stops the weight's gradient is caught);
* a Flax NNX decoder with Gemma2's four norms per block: two SGD steps with the Pallas norm match the reference
  norm's (a Gemma ``(1 + w)`` / ``w`` mix-up is caught).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import pallas_norm as pn
from pallas_norm_tools.tiny_lm import TinyDecoder

from helpers import KERNEL, ON_GPU, rel_err

SIZE = dict(d=256, vocab=512, batch=4, length=128) if ON_GPU else dict(d=64, vocab=128, batch=2, length=16)
RTOL_F32 = 1e-4  # as in test_hf_models: float32 sum-order differences (~1e-7) amplified by a few layers and steps


def token_ids(seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (SIZE["batch"], SIZE["length"]), 0, SIZE["vocab"])


# --- bf16 under jax.checkpoint --------------------------------------------------------------------------------------

def init_params(layers: int = 2) -> dict:
    d, v = SIZE["d"], SIZE["vocab"]
    keys = iter(jax.random.split(jax.random.key(1), 4 * layers + 2))
    normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape, jnp.float32)
    blocks = [dict(norm=1.0 + normal((d,), 0.2), up=normal((d, 2 * d), d**-0.5), down=normal((2 * d, d), (2 * d)**-0.5))
              for _ in range(layers)]
    return dict(embed=normal((v, d), 1.0), blocks=blocks, final=1.0 + normal((d,), 0.2))


def lm_loss(params: dict, ids: jax.Array, norm) -> jax.Array:
    """A Qwen2-shaped residual LM: each block ``h + down(silu(up(norm(h))))`` under ``jax.checkpoint``."""
    @jax.checkpoint
    def block(h, p):
        return h + jax.nn.silu(norm(h, p["norm"]) @ p["up"]) @ p["down"]

    h = params["embed"][ids]
    for p in params["blocks"]:
        h = block(h, p)
    logits = (norm(h, params["final"]) @ params["embed"].T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def norm_with(impl: str, lose_weight_grad: bool = False):
    def norm(h, w):
        return pn.rms_norm(h, jax.lax.stop_gradient(w) if lose_weight_grad else w, casting="llama", impl=impl)
    return norm


def checkpoint_grads(norm, dtype):
    params = jax.tree.map(lambda p: p.astype(dtype), init_params())
    return jax.jit(jax.grad(lambda p: lm_loss(p, token_ids(), norm)))(params)


def checkpoint_failures(grads, with_reference_norm, reference) -> list[str]:
    """Every gradient non-zero and finite, and (relative Frobenius error against the float32 model) at most 2x
    the reference norm's bf16 error + 2^-8."""
    bad = []
    flat = jax.tree_util.tree_flatten_with_path
    for (path, g), (_, h), (_, r) in zip(flat(grads)[0], flat(with_reference_norm)[0], flat(reference)[0]):
        name = jax.tree_util.keystr(path)
        g32, h32 = g.astype(jnp.float32), h.astype(jnp.float32)
        if not bool(jnp.all(jnp.isfinite(g32))) or not bool(jnp.any(g32 != 0)):
            bad.append(f"{name}: gradient zero or not finite")
            continue
        err, err_ref = (float(jnp.linalg.norm(t - r) / jnp.linalg.norm(r)) for t in (g32, h32))
        if not err <= 2 * err_ref + 2.0**-8:
            bad.append(f"{name}: relative error {err:.2e} > 2 x the reference norm's {err_ref:.2e} + 2^-8")
    return bad


@pytest.fixture(scope="module")
def bf16_reference_grads():
    return checkpoint_grads(norm_with("xla"), jnp.bfloat16), checkpoint_grads(norm_with("xla"), jnp.float32)


def test_checkpoint_bf16_every_gradient_arrives(bf16_reference_grads):
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: lm_loss(p, token_ids(), norm_with(KERNEL))))(init_params()))
    assert jaxpr.count("remat") == 2 and "pallas_norm_bwd" in jaxpr  # both blocks rematerialised
    assert checkpoint_failures(checkpoint_grads(norm_with(KERNEL), jnp.bfloat16), *bf16_reference_grads) == []


def test_checkpoint_check_catches_a_lost_weight_gradient(bf16_reference_grads):
    failures = checkpoint_failures(checkpoint_grads(norm_with(KERNEL, lose_weight_grad=True), jnp.bfloat16),
                                   *bf16_reference_grads)
    assert len(failures) == 3 and all("'norm'" in f or "'final'" in f for f in failures), failures


# --- Flax NNX decoder with Gemma2's four norms --------------------------------------------------------------------

def train_gemma2(impl: str, offset: float = 1.0, steps: int = 2, fused: bool = False):
    """Losses and final parameters of ``steps`` SGD steps (fixed seeds; norm scales perturbed around zero);
    ``fused``: each block's middle residual add and norm as one ``RMSNorm.add`` call."""
    rngs = nnx.Rngs(0)
    model = TinyDecoder(lambda d: pn.nnx.RMSNorm(d, offset=offset, casting="gemma", impl=impl, rngs=rngs), rngs,
                        d=SIZE["d"], vocab=SIZE["vocab"], fused=fused)
    for i, (_, norm) in enumerate(nnx.iter_modules(model)):
        if isinstance(norm, pn.nnx.RMSNorm):
            norm.scale[...] = 0.1 * jax.random.normal(jax.random.key(100 + i), norm.scale.shape)
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    ids = token_ids(seed=2)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(m):
            logits = m(ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with jax.default_matmul_precision("highest"):  # no TF32 on GPU: its rounding would magnify sum-order noise
        losses = [step(model, optimizer) for _ in range(steps)]
    return losses, nnx.state(model, nnx.Param)


def training_mismatches(ours, theirs) -> list[str]:
    (losses, params), (losses_ref, params_ref) = ours, theirs
    bad = [f"step {i} loss: relative error {rel_err(a, b):.2e}" for i, (a, b) in enumerate(zip(losses, losses_ref))
           if not rel_err(a, b) <= RTOL_F32]
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                 jax.tree_util.tree_flatten_with_path(params_ref)[0]):
        if not rel_err(a, b) <= RTOL_F32:
            bad.append(f"{jax.tree_util.keystr(path)}: relative error {rel_err(a, b):.2e}")
    return bad


@pytest.fixture(scope="module")
def gemma2_reference():
    return train_gemma2("xla")


def test_nnx_gemma2_block_trains_like_the_reference_norm(gemma2_reference):
    assert training_mismatches(train_gemma2(KERNEL), gemma2_reference) == []


def test_nnx_gemma2_block_with_the_fused_residual_add_trains_like_the_reference_norm(gemma2_reference):
    assert training_mismatches(train_gemma2(KERNEL, fused=True), gemma2_reference) == []


def test_nnx_check_catches_the_gemma_offset_mixup(gemma2_reference):
    assert training_mismatches(train_gemma2(KERNEL, offset=0.0), gemma2_reference)
