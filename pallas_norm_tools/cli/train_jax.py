"""``pallas-norm train --framework jax``: the Flax decoder with the reference norm or the Pallas kernel.

gemma2: Gemma2's sandwich blocks, ``casting="gemma"``, ``offset=1``; llama/qwen2: pre-norm blocks,
``casting="llama"``, offset 0. Parameters float32, activations (and the norm's input) in ``--dtype``.
"""

from __future__ import annotations

from collections.abc import Iterator

from pallas_norm_tools.cli.training import VOCAB, batches, sizes

MODES = {"gemma2": dict(sandwich=True, casting="gemma", offset=1.0),
         "llama": dict(sandwich=False, casting="llama", offset=0.0),
         "qwen2": dict(sandwich=False, casting="llama", offset=0.0)}


def make_trainer(model: str, dtype: str, *, hidden: int | None, lr: float, seed: int, backend: str,
                 steps: int | None):
    del backend  # torch only
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pallas_norm as pn
    from pallas_norm_tools.tiny_lm import TinyDecoder

    gpu = pn.api.backend.on_gpu()
    hidden, steps = sizes(gpu, hidden, steps)
    data = batches(seed, steps)
    mode = MODES[model]
    kernel = "pallas" if gpu else "interpret"

    def trainer(layers: int, variant: str) -> Iterator[tuple[float, dict[str, float]]]:
        impl = kernel if variant == "pallas" else "xla"
        rngs = nnx.Rngs(seed)
        norm = lambda d: pn.nnx.RMSNorm(d, offset=mode["offset"], casting=mode["casting"], impl=impl,  # noqa: E731
                                        rngs=rngs)
        net = TinyDecoder(norm, rngs, d=hidden, vocab=VOCAB, layers=layers, sandwich=mode["sandwich"],
                          dtype=jnp.dtype(dtype))
        for i, (_, m) in enumerate(nnx.iter_modules(net)):  # norm scales away from their init, as in HF's tests
            if isinstance(m, pn.nnx.RMSNorm):
                m.scale[...] = m.scale[...] + 0.1 * jax.random.normal(jax.random.key(seed + 100 + i), m.scale.shape)
                if variant == "perturbed":  # the noise floor: every norm weight one ulp up
                    m.scale[...] = jnp.nextafter(m.scale[...], jnp.inf)
        opt = nnx.Optimizer(net, optax.adamw(lr), wrt=nnx.Param)

        @nnx.jit
        def step(net, opt, ids):
            def loss_fn(m):
                logits = m(ids)
                return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
            loss, grads = nnx.value_and_grad(loss_fn)(net)
            sq = {}
            for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
                keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
                name = f"layer {keys[1]}" if keys[0] == "blocks" else str(keys[0])
                sq[name] = sq.get(name, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
            opt.update(net, grads)
            return loss, sq

        with jax.default_matmul_precision("highest"):  # no TF32 on GPU: compare the norms, not matmul rounding
            for ids in data:
                loss, sq = step(net, opt, jnp.asarray(ids))
                yield float(loss), {k: float(v) for k, v in sq.items()}

    return trainer, dict(where=jax.default_backend(), hidden=hidden, steps=steps, kernel=kernel)
