"""The parity matrix (``torch_bridge.parity``): every casting × offset × dtype × shape through both stacks.

Each case checks every implementation against the float64 reference (accuracy rule and rounding points), HF's
module where the mode is one, JAX-Pallas ≡ bridge-Pallas bit for bit, and Triton within the bound of Pallas.
CPU: small shapes, interpreted kernels; CUDA (device): LLM-sized shapes, compiled kernels and the launch route.
"""

from __future__ import annotations

import pytest
import torch

from test_triton import DEVICE
from torch_bridge import parity, rms_norm


@pytest.mark.parametrize("case", parity.cases(DEVICE), ids=lambda c: c.name)
def test_parity_matrix(case):
    result = parity.run_case(case, DEVICE)
    assert result.passed, "\n".join(result.failures)
    assert set(result.errors) >= {"pallas_jax", "xla_jax", "pallas_bridge", "triton"}
    assert ("hf" in result.errors) == (parity.hf_module_class(case) is not None)


def test_matrix_is_the_full_product():
    matrix = parity.cases("cpu")
    assert len(matrix) == 3 * 2 * 3 * len(parity.SHAPES["cpu"]) == len({c.name for c in matrix})
    assert len(parity.cases("cpu", quick=True)) == 18


def llama_rounding_in_a_gemma_case(x, w, dy, case):
    """Deliberately wrong: Llama's rounding point (n rounded to x's dtype before × weight) in a Gemma case."""
    return parity.torch_grads(lambda a, b: rms_norm(a, b, case.eps, offset=case.offset, casting="llama",
                                                    backend="triton"), x, w, dy)


def one_ulp_off(x, w, dy, case):
    """Deliberately not JAX's bits: the bridge's results with one element of ``y`` moved by one ulp."""
    y, dx, dw = parity.bridge("pallas")(x, w, dy, case)
    y = y.clone()
    y.view(torch.int16 if y.element_size() == 2 else torch.int32).view(-1)[0] ^= 1  # flip the last mantissa bit
    return y, dx, dw


def test_matrix_catches_a_casting_mixup_and_a_bridge_that_is_not_jax():
    case = parity.Case("gemma", 1.0, "bfloat16", (7, 1000))
    impls = {"pallas_jax": parity.jax_impl(None), "pallas_bridge": one_ulp_off,
             "mixup": llama_rounding_in_a_gemma_case}
    failures = parity.run_case(case, DEVICE, impls).failures
    assert any(f.startswith("mixup y vs naive") for f in failures), failures
    assert "pallas_bridge y: not bit-identical to pallas_jax" in failures, failures
    assert not any(f.startswith("pallas_jax") for f in failures), failures
