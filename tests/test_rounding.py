"""``round_to`` equals a true cast to the narrow dtype (NumPy/ml_dtypes), under jit too, and XLA keeps it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm.rounding import round_to

SPECIALS = [1e-6, 3e-5, 7e-8, 6.1e-5, 70000.0, 65519.0, 65520.0, np.nan, np.inf, -2e-7, 2.0**-25,
            3 * 2.0**-25, 8.076426e-06, -0.0, 1 / 3]


def values() -> np.ndarray:
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(200_000) * np.logspace(-9, 6, 200_000)
    return np.concatenate([SPECIALS, spread]).astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_round_to_matches_cast(dtype, jit):
    v = values()
    f = (lambda a: round_to(a, dtype))
    got = np.asarray((jax.jit(f) if jit else f)(jnp.asarray(v)))
    with np.errstate(over="ignore"):
        want = v.astype(jnp.dtype(dtype)).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_rounding_survives_fusion_with_arithmetic():
    """Inside a fused computation the rounding still happens (a bare convert pair may be optimised away)."""
    x = jnp.asarray(values()[20:1020])
    got = jax.jit(lambda a: round_to(a * 3.0, jnp.bfloat16) * 7.0)(x)
    want = (np.asarray(x) * np.float32(3.0)).astype(jnp.bfloat16).astype(np.float32) * np.float32(7.0)
    np.testing.assert_array_equal(np.asarray(got), want)
    unrounded = np.asarray(x) * np.float32(21.0)
    assert not np.array_equal(np.asarray(got), unrounded)
