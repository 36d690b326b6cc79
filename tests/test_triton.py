"""Triton RMSNorm (``torch_bridge.rms_norm(backend="triton")``) against docs/semantics.md, on CPU through Triton's
interpreter, held to the accuracy rule of ``pallas_norm.accuracy`` (error bound against the float64 reference and
the naive formula's rounding points).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pallas_norm import accuracy
from torch_bridge import BACKENDS, rms_norm_ref, rms_norm_ref_backward, triton_kernels
from torch_bridge.numpy_io import to_numpy

from helpers import DEVICE, TORCH_DTYPES as DTYPES, check_case, check_reduction_order, torch_inputs
from helpers import torch_results, triton_rms_norm

CASTINGS = ("llama", "gemma", "none")
rms_norm = triton_rms_norm


def run_kernel(x, w, dy, backend="triton", **kw):
    """Forward + backward through autograd; returns (y, dx, dweight)."""
    return torch_results(x, w, dy, backend=backend, **kw)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_casting_offset_matrix(dtype, casting, offset):
    check_case((129, 123), dtype, casting, offset)


@pytest.mark.parametrize("n", [1, 7, 123, 1000])
@pytest.mark.parametrize("m", [0, 1, 3, 129])
@pytest.mark.parametrize("casting", CASTINGS)
def test_shapes(m, n, casting):
    check_case((m, n), torch.bfloat16, casting, 1.0 if casting == "gemma" else 0.0, seed=m * 7919 + n)


@pytest.mark.parametrize("shape", [(3, 4096), (33, 4096), (2, 5, 1000), (4, 1, 3, 7)], ids=str)
@pytest.mark.parametrize("casting", CASTINGS)
def test_wide_and_nd_shapes(shape, casting):
    check_case(shape, torch.bfloat16, casting, 1.0 if casting == "gemma" else 0.0)


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_weight(dtype, casting):
    check_case((33, 123), dtype, casting, 0.0, with_weight=False)


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_weight_with_16bit_x(dtype, casting):
    check_case((65, 300), dtype, casting, 1.0 if casting == "gemma" else 0.0, weight_dtype=torch.float32)


def test_castings_differ_in_bfloat16():
    """The rounding-point check has teeth: the three naive formulas disagree on many bf16 elements."""
    x, w, dy = (to_numpy(t) for t in torch_inputs((64, 256), torch.bfloat16, 0.0))
    ys = [accuracy.reference(x, w, dy, eps=1e-6, offset=0.0, casting=c).naive["y"] for c in CASTINGS]
    assert (ys[0] != ys[1]).mean() > 0.05 and (ys[0] != ys[2]).mean() > 0.05


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("with_weight,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_gradcheck_float64(casting, with_weight, offset):
    x, w, _ = torch_inputs((3, 7), torch.float32, offset)
    x, w = x.double().requires_grad_(), w.double()
    inputs = (x, w.requires_grad_()) if with_weight else (x,)

    def fn(*args):
        return rms_norm(args[0], args[1] if with_weight else None, 1e-5, offset=offset, casting=casting)

    assert torch.autograd.gradcheck(fn, inputs)


def test_float64_reference_autograd_matches_explicit_backward():
    x, w, dy = (t.double() for t in torch_inputs((5, 33), torch.float32, 1.0))
    x.requires_grad_(), w.requires_grad_()
    y = rms_norm_ref(x, w, offset=1.0, casting="gemma")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_ref, dw_ref = rms_norm_ref_backward(dy, x.detach(), w.detach(), offset=1.0, casting="gemma")
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)


class _InPlaceDxRmsNorm(torch.autograd.Function):
    """Deliberately buggy variant (the Liger/Gemma2 bug): writes dx into the incoming dy."""

    @staticmethod
    def forward(ctx, x, w):
        y, rstd = torch.ops.pallas_norm.triton_rms_norm_fwd(x, w, 1e-6, 0.0, "llama", "triton")
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = torch.ops.pallas_norm.triton_rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", "triton", True, True)
        return dy.copy_(dx), dw


def dy_survives_backward(fn) -> bool:
    x, w, dy = torch_inputs((17, 64), torch.bfloat16, 0.0)
    x.requires_grad_(), w.requires_grad_()
    saved = dy.clone()
    fn(x, w).backward(dy)
    return torch.equal(dy.view(torch.int16), saved.view(torch.int16))


def test_backward_never_writes_into_dy():
    assert dy_survives_backward(lambda x, w: rms_norm(x, w))
    assert not dy_survives_backward(_InPlaceDxRmsNorm.apply)


def test_residual_branch_gradient_is_intact():
    """Gemma2-style residual: h + norm(h); the cotangent reaching both branches must stay correct."""
    x, w, dy = torch_inputs((9, 64), torch.float32, 1.0)
    h = x.clone().requires_grad_()
    (h + rms_norm(h, w, offset=1.0, casting="gemma")).backward(dy)
    dx_ref, _ = rms_norm_ref_backward(dy, x, w, offset=1.0, casting="gemma")
    torch.testing.assert_close(h.grad, dy + dx_ref, rtol=1e-5, atol=1e-5)


def test_inputs_not_mutated_and_noncontiguous_x():
    base, _, _ = torch_inputs((6, 128), torch.bfloat16, 0.0)
    _, w, _ = torch_inputs((6, 64), torch.bfloat16, 0.0)
    x = base[:, ::2]
    saved_x, saved_w = x.clone(), w.clone()
    y = rms_norm(x, w)
    assert torch.equal(x, saved_x) and torch.equal(w, saved_w)
    assert torch.equal(y, rms_norm(x.contiguous(), w))


@pytest.mark.parametrize("x_grad,w_grad", [(True, False), (False, True)])
def test_skips_unneeded_gradients(monkeypatch, x_grad, w_grad):
    calls = []
    real = triton_kernels.rms_norm_bwd
    monkeypatch.setattr(triton_kernels, "rms_norm_bwd", lambda *a: calls.append(a[-2:]) or real(*a))
    x, w, dy = torch_inputs((5, 32), torch.float32, 0.0)
    x.requires_grad_(x_grad), w.requires_grad_(w_grad)
    rms_norm(x, w).backward(dy)
    assert calls == [(x_grad, w_grad)]
    assert (x.grad is not None) == x_grad and (w.grad is not None) == w_grad


def test_empty_rows_give_zero_dweight():
    x, w, dy = torch_inputs((0, 16), torch.bfloat16, 0.0)
    _, dx, dw = run_kernel(x, w, dy)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros_like(w))


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Without TRITON_INTERPRET, CPU tensors take the plain-torch naive formula (same semantics)."""
    monkeypatch.setattr(triton_kernels, "INTERPRET", False)
    x, w, dy = torch_inputs((7, 50), torch.bfloat16, 1.0, device="cpu")
    kw = dict(offset=1.0, casting="none")
    y, dx, dw = run_kernel(x, w, dy, **kw)
    y_n = rms_norm_ref(x, w, **kw)
    dx_n, dw_n = rms_norm_ref_backward(dy, x, w, **kw)
    assert torch.equal(y, y_n) and torch.equal(dx, dx_n) and torch.equal(dw, dw_n)


def test_backends():
    assert BACKENDS == ("pallas", "pallas_launch", "pallas_dlpack", "triton")


def test_custom_ops_opcheck():
    x, w, dy = torch_inputs((4, 32), torch.float32, 1.0)
    fwd = torch.ops.pallas_norm.triton_rms_norm_fwd.default
    torch.library.opcheck(fwd, (x.requires_grad_(), w.requires_grad_(), 1e-6, 1.0, "gemma", "triton"))
    torch.library.opcheck(fwd, (x.detach(), None, 1e-6, 0.0, "llama", "triton"))
    _, rstd = fwd(x.detach(), w.detach(), 1e-6, 1.0, "gemma", "triton")
    bwd = torch.ops.pallas_norm.triton_rms_norm_bwd.default
    torch.library.opcheck(bwd, (dy, x.detach(), w.detach(), rstd, 1.0, "gemma", "triton", True, True))
    torch.library.opcheck(bwd, (dy, x.detach(), None, rstd, 0.0, "none", "triton", True, False))


def test_torch_compile_fullgraph():
    """No graph break: the custom ops are traced through their fake kernels (aot_eager on CPU)."""
    x, w, dy = torch_inputs((2, 5, 48), torch.bfloat16, 0.0)

    def fn(x, w):
        return rms_norm(x * 2.0, w, 1e-5, casting="llama") + 1.0

    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn(xe, we).backward(dy)
    compiled(xc, wc).backward(dy)
    assert torch.equal(xc.grad, xe.grad) and torch.equal(wc.grad, we.grad)


@pytest.mark.parametrize("parts, n", [(1, 1000), (8, 1000), (37, 1000), (300, 1000), (37, 12)])
def test_dweight_reduction_order(parts, n, monkeypatch):
    """The dweight reduction (``triton_dweight.reduce``) adds the float32 partial rows in one fixed order. Default
    tiles: the same bits on every call, within float32 rounding of the float64 sum (37, 300: ragged tiles, a ragged
    last column tile; 12 columns: the narrowest tiles, ``pallas_norm.dweight.reduce_cols``). Tiles of one row: the
    bits of adding the rows one after another, p = 0, 1, .... Broken variants: a row left out (off by more than the
    rounding bound); the rows reversed (one row per tile: other bits)."""
    from torch_bridge import triton_dweight

    def reduce(p):  # the launch key: what the kernel specialises on (rows, columns, tile)
        out = torch.empty(p.shape[1], device=DEVICE)
        triton_dweight.reduce(torch.from_numpy(np.ascontiguousarray(p)).to(DEVICE), out,
                              ("test", p.shape, triton_dweight.REDUCE_BLOCK_G))
        return out.cpu().numpy()

    partials = (torch.randn(parts, n, generator=torch.Generator().manual_seed(parts)) * 1e3).numpy()
    check_reduction_order(reduce, partials, lambda: monkeypatch.setattr(triton_dweight, "REDUCE_BLOCK_G", 1))
