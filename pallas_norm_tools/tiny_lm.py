"""A tiny Flax NNX decoder for the JAX model tests and ``pallas-norm train --framework jax``.

Blocks are Gemma2's sandwich (``sandwich=True``: four norms per block) or Llama's pre-norm (two norms per block);
``norm(d)`` builds every norm, so the same model runs with the Pallas norm or the reference norm; ``fused=True``
(norms of ``pallas_norm.nnx.RMSNorm``) makes each block's middle residual add and ``pre_ff_norm`` one fused call.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

Norm = Callable[[int], nnx.Module]


class Block(nnx.Module):
    """Gemma2: ``h + post_attn(attn(input(h)))``, then ``h + post_ff(mlp(pre_ff(h)))``; Llama drops the two
    post-norms."""

    def __init__(self, d: int, norm: Norm, rngs: nnx.Rngs, *, heads: int = 4, sandwich: bool = True,
                 dtype: jnp.dtype = jnp.float32, fused: bool = False):
        self.input_norm, self.pre_ff_norm = norm(d), norm(d)
        self.post_attn_norm, self.post_ff_norm = (norm(d), norm(d)) if sandwich else (None, None)
        linear = lambda a, b: nnx.Linear(a, b, dtype=dtype, rngs=rngs)  # noqa: E731  (float32 params, dtype math)
        self.qkv, self.out, self.up, self.down = linear(d, 3 * d), linear(d, d), linear(d, 2 * d), linear(2 * d, d)
        self.heads, self.fused = heads, fused

    def attention(self, h: jax.Array) -> jax.Array:
        b, t, d = h.shape
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in jnp.split(self.qkv(h), 3, axis=-1))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // self.heads).astype(q.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
        return self.out(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v).reshape(b, t, d))

    def __call__(self, h: jax.Array) -> jax.Array:
        a = self.attention(self.input_norm(h))
        a = a if self.post_attn_norm is None else self.post_attn_norm(a)
        if self.fused:  # the residual add and pre_ff_norm in one call (pallas_norm.nnx.RMSNorm.add)
            normed, h = self.pre_ff_norm.add(a, h)
        else:
            h = h + a
            normed = self.pre_ff_norm(h)
        f = self.down(jax.nn.gelu(self.up(normed)))
        return h + (f if self.post_ff_norm is None else self.post_ff_norm(f))


class TinyDecoder(nnx.Module):
    """Embedding, ``layers`` blocks, a final norm, tied output projection; ``__call__(ids) -> logits``. ``fused``:
    see the module docstring."""

    def __init__(self, norm: Norm, rngs: nnx.Rngs, *, d: int = 64, vocab: int = 128, layers: int = 2,
                 sandwich: bool = True, dtype: jnp.dtype = jnp.float32, fused: bool = False):
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d, norm, rngs, sandwich=sandwich, dtype=dtype, fused=fused)
                                for _ in range(layers)])
        self.final_norm = norm(d)
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed(ids).astype(self.dtype)
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(self.final_norm(h)).astype(jnp.float32)
