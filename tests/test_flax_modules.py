"""Flax users: ``pallas_norm.linen.RMSNorm`` is ``flax.linen.RMSNorm`` computed by our kernel (signature, ``scale``,
dtypes, formula), under ``jit``/``grad``/``remat`` in a Linen model; ``pallas_norm.nnx.patch_model`` swaps our
module into an existing NNX model (same ``scale`` objects, same results) and its probe catches a wrong mode."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import pallas_norm as pn
from pallas_norm import accuracy
from pallas_norm import linen as pl
from pallas_norm import nnx as pnnx
from pallas_norm_tools.tiny_lm import TinyDecoder

from helpers import KERNEL, jax_inputs, judge, rel_err


def vjp_outputs(module, variables, x, dy):
    """``(y, dx, dscale)`` of a Linen module's ``apply``."""
    y, vjp = jax.vjp(lambda a, v: module.apply(v, a), x, variables)
    dx, dv = vjp(dy.astype(y.dtype))
    return y, dx, dv["params"]["scale"]


@pytest.mark.parametrize("x_dtype,param_dtype,dtype", [
    (jnp.bfloat16, jnp.float32, None),  # Flax promotes: float32 out, nothing rounded
    (jnp.bfloat16, jnp.bfloat16, None), (jnp.float16, jnp.float32, jnp.float16), (jnp.float32, jnp.float32, None),
    (jnp.float32, jnp.float32, jnp.bfloat16)])
def test_linen_matches_flax_linen(x_dtype, param_dtype, dtype):
    x, w, dy = jax_inputs((6, 5, 96), x_dtype, 0.0, seed=1)
    ours, theirs = pl.RMSNorm(dtype=dtype, param_dtype=param_dtype, impl=KERNEL), nn.RMSNorm(dtype=dtype,
                                                                                             param_dtype=param_dtype)
    variables = ours.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, theirs.init(jax.random.key(0), x))
    variables = {"params": {"scale": w.astype(param_dtype)}}  # a non-trivial scale, loaded into both
    got, want = vjp_outputs(ours, variables, x, dy), vjp_outputs(theirs, variables, x, dy)
    assert [a.dtype for a in got] == [a.dtype for a in want]
    out, x_size = jnp.dtype(got[0].dtype), jnp.dtype(x_dtype).itemsize
    if out.itemsize < x_size:  # float32 math rounded once to the narrower dtype, by both: the same roundings
        assert accuracy.rounding_point_failure("y", np.asarray(got[0]), np.asarray(want[0]), 0.0) is None
        return
    args = [a.astype(out) for a in (x, dy)]  # promoted to a wider dtype: exact
    # Flax's module is the baseline: ours within 2× its error against float64 and on its rounding points
    assert judge(args[0], variables["params"]["scale"], args[1], [got[0]], baseline=[want[0]], only=("y",),
                 casting="gemma") == []


def test_linen_check_sees_another_casting():
    x, w, dy = jax_inputs((64, 256), jnp.bfloat16, 0.0, seed=2)
    variables = {"params": {"scale": w}}
    llama = pl.RMSNorm(casting="llama", impl=KERNEL).apply(variables, x)
    flax_y = nn.RMSNorm().apply(variables, x)
    assert judge(x, w, dy, [llama], baseline=[flax_y], only=("y",), casting="gemma") != []


class MLP(nn.Module):
    """Dense → norm → Dense, twice, each block rematerialised."""

    norm: type

    @nn.compact
    def __call__(self, h):
        for _ in range(2):
            h = h + nn.remat(Block)(self.norm)(h)
        return h


class Block(nn.Module):
    norm: type

    @nn.compact
    def __call__(self, h):
        return nn.Dense(h.shape[-1])(self.norm()(nn.Dense(h.shape[-1])(h)))


def test_linen_model_under_jit_grad_remat():
    x = jax.random.normal(jax.random.key(3), (8, 64))
    target = jax.random.normal(jax.random.key(4), (8, 64))
    ours, theirs = MLP(lambda: pl.RMSNorm(impl=KERNEL)), MLP(nn.RMSNorm)
    params = ours.init(jax.random.key(5), x)
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(6), a.shape), params)

    def grads(model):
        return jax.jit(jax.grad(lambda p: jnp.mean((model.apply(p, x) - target) ** 2)))(params)

    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(ours.apply(p, x))))(params))
    assert "remat" in jaxpr and "pallas_norm" in jaxpr  # our kernel, rematerialised
    with jax.default_matmul_precision("highest"):
        g_ours, g_flax = grads(ours), grads(theirs)
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(g_ours)[0],
                                 jax.tree_util.tree_flatten_with_path(g_flax)[0]):
        assert rel_err(a, b) <= 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("kw,match", [(dict(reduction_axes=0), "reduction_axes must be the last axis"),
                                       (dict(feature_axes=(0, 1)), "feature_axes must be the last axis"),
                                       (dict(axis_name="batch"), "axis_name must be None"),
                                       (dict(force_float32_reductions=False), "always reduces in float32"),
                                       (dict(casting="qwen"), "casting must be one of")])
def test_linen_refuses_what_it_does_not_implement(kw, match):
    with pytest.raises(ValueError, match=match):
        pl.RMSNorm(**kw).init(jax.random.key(0), jnp.ones((2, 8)))


def flax_decoder(dtype=jnp.float32, **norm_kw):
    rngs = nnx.Rngs(0)
    model = TinyDecoder(lambda d: nnx.RMSNorm(d, rngs=rngs, param_dtype=dtype, **norm_kw), rngs, d=64, layers=2,
                        dtype=dtype)
    for i, (_, m) in enumerate(nnx.iter_modules(model)):
        if isinstance(m, nnx.RMSNorm):
            m.scale[...] = (m.scale[...] + 0.2 * jax.random.normal(jax.random.key(i), m.scale.shape)).astype(dtype)
    return model


def logits_and_grads(model, ids):
    def loss(m):
        logits = m(ids)
        return jnp.mean(logits * jnp.linspace(-1, 1, logits.shape[-1])), logits
    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, jax.tree.leaves(grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_patch_model_swaps_every_flax_rmsnorm(dtype):
    ids = jax.random.randint(jax.random.key(7), (2, 12), 0, 128)
    model, reference = flax_decoder(dtype), flax_decoder(dtype)
    scales = {p: m.scale for p, m in nnx.iter_modules(model) if isinstance(m, nnx.RMSNorm)}
    paths = pnnx.patch_model(model, impl=KERNEL)
    assert sorted(paths) == sorted(".".join(map(str, p)) for p in scales) and len(paths) == 2 * 4 + 1
    for path, scale in scales.items():
        new = model
        for key in path:
            new = getattr(new, key) if isinstance(key, str) else new[key]
        assert isinstance(new, pnnx.RMSNorm) and new.scale is scale  # the same Param objects
    with jax.default_matmul_precision("highest"):
        (logits, grads), (logits_ref, grads_ref) = logits_and_grads(model, ids), logits_and_grads(reference, ids)
    tol = 1e-5 if dtype == jnp.float32 else 2.0**-6  # float32 sum order; bf16: a few roundings through 2 layers
    assert rel_err(logits, logits_ref) <= tol
    assert all(rel_err(a, b) <= tol for a, b in zip(grads, grads_ref))


def test_patch_model_leaves_other_axes_alone_with_a_warning():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.RMSNorm(8, rngs=rngs), nnx.RMSNorm(8, rngs=rngs, reduction_axes=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pnnx.patch_model(model, impl=KERNEL) == ["layers.0"]
    assert any("layers.1 (normalises other axes than the last)" in str(w.message) for w in caught)
    assert type(model.layers[1]) is nnx.RMSNorm


def test_patch_model_verify_catches_a_wrong_mode_and_rolls_back(monkeypatch):
    model = flax_decoder(jnp.bfloat16)
    originals = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.RMSNorm)]
    right = pnnx._replacement

    def llama_mode(module, impl):  # deliberately wrong: Llama's rounding points for Flax's formula
        new = right(module, impl)
        new.casting = "llama"
        return new

    monkeypatch.setattr(pnnx, "_replacement", llama_mode)
    with pytest.raises(RuntimeError, match=r"patch_model: .* disagrees with the original: .*vs naive"):
        pnnx.patch_model(model, impl=KERNEL)
    assert [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.RMSNorm)] == originals
    assert pnnx.patch_model(model, impl=KERNEL, verify=False)  # without the probe the wrong mode would go in


def test_patch_model_bad_arguments():
    with pytest.raises(TypeError, match="model must be a flax.nnx.Module"):
        pnnx.patch_model("model")
    with pytest.raises(TypeError, match="verify must be a bool"):
        pnnx.patch_model(nnx.Sequential(), verify="yes")
    with pytest.raises(ValueError, match="impl must be None or one of"):
        pnnx.patch_model(nnx.Sequential(), impl="triton")
    np.testing.assert_array_equal(pn.nnx.RMSNorm(4, rngs=nnx.Rngs(0)).scale[...], np.ones(4))
