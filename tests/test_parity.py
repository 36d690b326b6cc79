"""The parity matrix (``pallas_norm_tools.parity``): every casting × offset × dtype × shape through both stacks.

Each case checks every implementation of the registry against the float64 reference (``pallas_norm.accuracy``:
error bound and rounding points), HF's module where the mode is one, the DLPack bridge ≡ the JAX kernel bit for
bit, and Triton within the bound of the JAX kernel.
CPU: small shapes, interpreted kernels; CUDA (device): LLM-sized shapes, compiled kernels and the launch route.
"""

from __future__ import annotations

import pytest

from pallas_norm import registry
from pallas_norm_tools import parity
from torch_bridge import rms_norm
from torch_bridge.numpy_io import autograd_outputs

from helpers import DEFAULT_KERNEL, DEVICE, KERNEL, one_ulp_off


@pytest.mark.parametrize("case", parity.cases(DEVICE), ids=lambda c: c.name)
def test_parity_matrix(case):
    result = parity.run_case(case, DEVICE)
    assert result.passed, "\n".join(result.failures)
    assert set(result.errors) >= {KERNEL, "xla", "pallas_dlpack", "triton"}
    assert set(result.errors) - {"hf"} <= set(registry.BY_NAME)  # one name per implementation
    assert ("hf" in result.errors) == (parity.hf_module_class(case) is not None)


def test_matrix_is_the_full_product():
    matrix = parity.cases("cpu")
    assert len(matrix) == 3 * 2 * 3 * len(parity.SHAPES["cpu"]) == len({c.name for c in matrix})
    assert len(parity.cases("cpu", quick=True)) == 18


def llama_rounding_in_a_gemma_case(x, w, dy, case):
    """Deliberately wrong: Llama's rounding point (n rounded to x's dtype before × weight) in a Gemma case."""
    def norm(a, b):
        return rms_norm(a, b, case.eps, offset=case.offset, casting="llama", backend="triton")
    return autograd_outputs(norm, x, w, dy)


def test_matrix_catches_a_casting_mixup_and_a_bridge_that_is_not_jax():
    case = parity.Case("gemma", 1.0, "bfloat16", (7, 1000))
    impls = {DEFAULT_KERNEL: parity.jax_impl(DEFAULT_KERNEL), "pallas_dlpack": one_ulp_off,
             "mixup": llama_rounding_in_a_gemma_case}
    failures = parity.run_case(case, DEVICE, impls).failures
    assert any(f.startswith("mixup y vs naive") for f in failures), failures
    assert f"pallas_dlpack y: not bit-identical to {DEFAULT_KERNEL}" in failures, failures
    assert not any(f.startswith(f"{DEFAULT_KERNEL} ") for f in failures), failures
