"""Property-based fuzzing (hypothesis): random shapes, dtypes, casting modes, offsets, eps and magnitudes through
both stacks — Pallas in JAX, XLA in JAX, Pallas through the bridge, the Triton kernel (and HF's module where the
mode is one) — each within the float64-reference rule, bridge ≡ JAX bit for bit (``pallas_norm_tools.parity``).

Bounded and derandomized (a fixed example sequence, no database), so CI time stays small and a failure reproduces.
On CPU the kernels run interpreted; each new hidden size compiles anew, so N is drawn from a small set plus a
random tail.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from pallas_norm_tools import parity

from helpers import DEVICE

EXAMPLES = 30 if DEVICE == "cpu" else 60
MAX_LOG10_SCALE = {"float32": 6, "bfloat16": 6, "float16": 2}  # float16: rows up to ~e²·4σ·10² stay finite


@st.composite
def fuzz_cases(draw) -> parity.Case:
    dtype = draw(st.sampled_from(sorted(MAX_LOG10_SCALE)))
    lead = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
    n = draw(st.one_of(st.sampled_from([1, 2, 7, 64, 160, 1000, 4097]), st.integers(1, 3000)))
    offset = draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-2.0, 2.0, allow_nan=False, width=32)))
    k = MAX_LOG10_SCALE[dtype]
    return parity.Case(
        casting=draw(st.sampled_from(["llama", "gemma", "none"])),
        offset=float(offset),
        dtype=dtype,
        shape=(*lead, n),
        eps=draw(st.sampled_from([1e-6, 1e-5, 1e-8, 1e-3])),
        scale=10.0 ** draw(st.integers(-k, k)),
    )


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=fuzz_cases())
def test_both_stacks_within_tolerance_of_float64(case):
    result = parity.run_case(case, DEVICE)
    assert result.passed, f"{case}\n" + "\n".join(result.failures)
    assert all(math.isfinite(e) for errs in result.errors.values() for e in errs.values())


def eps_dropped(x, w, dy, case):
    """Deliberately wrong: the Triton kernel with eps (almost) dropped — visible only where mean(x²) ~ eps."""
    import dataclasses

    return parity.bridge("triton")(x, w, dy, dataclasses.replace(case, eps=1e-30))


def test_fuzzing_finds_a_kernel_that_drops_eps():
    found = find(fuzz_cases(), lambda case: not parity.run_case(case, DEVICE, {"broken": eps_dropped}).passed,
                 settings=settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None))
    assert parity.run_case(found, DEVICE).passed  # the real kernels pass where the broken one fails
