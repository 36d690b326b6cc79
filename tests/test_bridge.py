"""The Pallas kernels in PyTorch (``torch_bridge``, ``backend="pallas"``): the same bits as ``pallas_norm`` in JAX,
zero-copy, never writing inputs, autograd (incl. checkpointing), ``torch.compile``, the ``RMSNorm`` module.

On CPU the bridge hands torch tensors to JAX through DLPack and the kernels run under Pallas's interpreter; on
a GPU (device run) the same tests cover the CUDA routes. GPU-only checks live in ``test_bridge_gpu.py``; the launch
route's readers and launch plan, without a GPU, in ``test_launch_route.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from torch_bridge import RMSNorm, custom_ops, dlpack_route, jax_device, rms_norm

from helpers import DEVICE, HAS_CUDA, assert_same_bits, bits, jax_results, torch_inputs, torch_results

PALLAS_BACKENDS = ("pallas", "pallas_launch", "pallas_dlpack") if HAS_CUDA else ("pallas",)  # every route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("casting,offset,with_weight", [("llama", 0.0, True), ("gemma", 1.0, True),
                                                         ("none", 0.0, True), ("llama", 0.0, False)])
def test_bit_identical_to_jax(dtype, casting, offset, with_weight):
    x, w, dy = torch_inputs((3, 5, 160), dtype, offset, seed=1)
    w = w if with_weight else None
    kw = dict(eps=1e-5, offset=offset, casting=casting)
    assert_same_bits(torch_results(x, w, dy, backend="pallas", **kw), jax_results(x, w, dy, **kw))


@pytest.mark.parametrize("shape", [(2, 20000), (1, 7, 33)], ids=str)
def test_bit_identical_to_jax_chunked_rows_and_mixed_weight(shape):
    """Rows longer than the resident limit (column chunks) and a float32 weight on bfloat16 x."""
    x, w, dy = torch_inputs(shape, torch.bfloat16, 0.0, weight_dtype=torch.float32, seed=2)
    assert_same_bits(torch_results(x, w, dy), jax_results(x, w, dy))


def test_new_shapes_never_hit_a_stale_cache():
    for seed, shape in enumerate([(5, 64), (7, 64), (5, 128), (2, 3, 64), (5, 64)]):
        x, w, dy = torch_inputs(shape, torch.bfloat16, 0.0, seed=seed)
        assert_same_bits(torch_results(x, w, dy), jax_results(x, w, dy))


def test_dlpack_is_zero_copy_both_ways():
    x, _, _ = torch_inputs((4, 64), torch.bfloat16, 0.0)
    a = dlpack_route.to_jax(x, jax_device.jax_device_for(x))
    assert a.unsafe_buffer_pointer() == x.data_ptr()
    assert dlpack_route.to_torch(a).data_ptr() == x.data_ptr()


class _InPlaceDxNorm(torch.autograd.Function):
    """Deliberately broken bridge (the Liger/Gemma2 bug): returns dx written into the incoming dy."""

    @staticmethod
    def forward(ctx, x, w):
        y, rstd = custom_ops.forward(x, w, 1e-6, 0.0, "llama", "pallas_dlpack")
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = custom_ops.backward(dy, x, w, rstd, 0.0, "llama", "pallas_dlpack")
        return dy.copy_(dx), dw


def inputs_survive(fn) -> bool:
    """Whether x, weight and the cotangent hold the same bits after a forward + backward through ``fn``."""
    x, w, dy = torch_inputs((17, 64), torch.bfloat16, 0.0)
    x.requires_grad_(), w.requires_grad_()
    saved = [t.detach().clone() for t in (x, w, dy)]
    fn(x, w).backward(dy)
    return all((bits(a) == bits(b)).all() for a, b in zip((x, w, dy), saved))


def test_never_writes_inputs_or_dy():
    for backend in PALLAS_BACKENDS:
        assert inputs_survive(lambda x, w: rms_norm(x, w, backend=backend))
    assert not inputs_survive(_InPlaceDxNorm.apply)


def test_custom_ops_match_eager_path_and_pass_opcheck():
    x, w, dy = torch_inputs((4, 96), torch.float32, 1.0)
    fwd = torch.ops.pallas_norm.pallas_rms_norm_fwd.default
    y, rstd = fwd(x, w, 1e-6, 1.0, "gemma", "pallas_dlpack")
    assert rstd.dtype == torch.float32 and rstd.shape == (4,)
    assert_same_bits((y,), (rms_norm(x, w, offset=1.0, casting="gemma"),))
    torch.library.opcheck(fwd, (x.clone().requires_grad_(), w.clone().requires_grad_(), 1e-6, 1.0, "gemma",
                                "pallas_dlpack"))
    torch.library.opcheck(fwd, (x, None, 1e-6, 0.0, "llama", "pallas_dlpack"))
    bwd = torch.ops.pallas_norm.pallas_rms_norm_bwd.default
    torch.library.opcheck(bwd, (dy, x, w, rstd, 1.0, "gemma", "pallas_dlpack", True, True))
    torch.library.opcheck(bwd, (dy, x, None, rstd, 0.0, "none", "pallas_dlpack", True, False))
    torch.library.opcheck(bwd, (dy, x, w, rstd, 0.0, "llama", "pallas_dlpack", False, True))


@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_torch_compile_fullgraph_same_bits_as_eager(backend):
    x, w, dy = torch_inputs((2, 5, 48), torch.bfloat16, 1.0)

    def fn(x, w):
        return rms_norm(x * 2.0, w, 1e-5, offset=1.0, casting="gemma", backend=backend) + 1.0

    compiled = torch.compile(fn, fullgraph=True, backend="inductor" if HAS_CUDA else "aot_eager")
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn(xe, we).backward(dy)
    compiled(xc, wc).backward(dy)
    assert_same_bits((xc.grad, wc.grad), (xe.grad, we.grad))


class _Block(torch.nn.Module):
    """Linear → norm → Linear, the shape of a Qwen2 sub-layer."""

    def __init__(self, norm: torch.nn.Module, n: int):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(n, n), norm, torch.nn.Linear(n, n)

    def forward(self, h):
        return self.down(self.norm(self.up(h)))


class _DetachedWeightNorm(Qwen2RMSNorm):
    """Deliberately broken norm: its weight never gets a gradient (the lost-gradient failure class)."""

    def forward(self, h):
        return rms_norm(h, self.weight.detach(), self.variance_epsilon)


def checkpoint_grads(norm: torch.nn.Module, n: int = 64, reentrant: bool | None = None):
    """Parameter gradients of a bf16 ``_Block`` (fixed seed) run under ``torch.utils.checkpoint`` (or plainly)."""
    torch.manual_seed(0)
    block = _Block(norm, n).to(device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        block.norm.weight.normal_(1.0, 0.2)
    x, _, dy = torch_inputs((6, n), torch.bfloat16, 0.0, seed=3)
    h = x.requires_grad_()
    if reentrant is None:
        out = block(h)
    else:
        out = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant)
    out.backward(dy)
    return {k: p.grad for k, p in block.named_parameters()}


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_bf16_every_parameter_gets_its_gradient(reentrant):
    """The Qwen2 failure: under checkpointing every parameter's gradient must equal the plain run's, and be
    within bf16 rounding of the Hugging Face module's."""
    n = 64
    ours = checkpoint_grads(RMSNorm(n, casting="llama"), n, reentrant)
    assert all(g is not None for g in ours.values()) and len(ours) == 5
    plain = checkpoint_grads(RMSNorm(n, casting="llama"), n)
    hf = checkpoint_grads(Qwen2RMSNorm(n, eps=1e-6), n)
    for k in ours:
        assert_same_bits((ours[k],), (plain[k],))
        torch.testing.assert_close(ours[k].float(), hf[k].float(), rtol=0.05, atol=0.05 * hf[k].float().abs().max().item())
    broken = checkpoint_grads(_DetachedWeightNorm(n, eps=1e-6), n, reentrant)
    assert broken["norm.weight"] is None


@pytest.mark.parametrize("hf_cls,kw", [(LlamaRMSNorm, dict()), (GemmaRMSNorm, dict(offset=1.0, casting="gemma")),
                                       (torch.nn.RMSNorm, dict(eps=1e-6))], ids=["llama", "gemma", "torch"])
def test_state_dict_round_trip_with_hf_modules(hf_cls, kw):
    n = 96
    theirs = hf_cls(n, eps=1e-6)
    ours = RMSNorm(n, **kw)
    assert torch.equal(ours.weight, theirs.weight)  # the same initial value (ones; zeros for Gemma)
    with torch.no_grad():
        theirs.weight.normal_(ours.weight.mean().item(), 0.2)
    ours.load_state_dict(theirs.state_dict())
    back = hf_cls(n, eps=1e-6)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.weight, theirs.weight)
    x, _, _ = torch_inputs((4, n), torch.float32, 0.0, device="cpu")
    torch.testing.assert_close(ours.to(DEVICE)(x.to(DEVICE)).cpu(), theirs(x), rtol=1e-5, atol=1e-5)


def test_module_is_a_torch_rmsnorm_and_says_its_mode():
    m = RMSNorm(32, 1e-5, offset=1.0, casting="gemma", backend="pallas_dlpack")
    assert isinstance(m, torch.nn.RMSNorm) and list(dict(m.named_parameters())) == ["weight"]
    assert torch.equal(m.weight, torch.zeros(32))
    assert "offset=1.0, casting='gemma', backend='pallas_dlpack'" in repr(m)
    assert RMSNorm(8, elementwise_affine=False).weight is None
    x, _, _ = torch_inputs((3, 32), torch.float32, 0.0)
    assert torch.equal(m.to(DEVICE)(x), rms_norm(x, m.weight, 1e-5, offset=1.0, casting="gemma"))


def test_bad_backends_for_the_ops():  # the public entry points' errors: test_error_inputs.py
    with pytest.raises(ValueError, match=r"backend must be one of \('pallas_launch', 'pallas_dlpack'\)"):
        torch.ops.pallas_norm.pallas_rms_norm_fwd(torch.ones(2, 8), None, 1e-6, 0.0, "llama", "triton")
    with pytest.raises(ValueError, match=r"backend must be one of \('triton',\)"):
        torch.ops.pallas_norm.triton_rms_norm_fwd(torch.ones(2, 8), None, 1e-6, 0.0, "llama", "pallas_dlpack")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            rms_norm(torch.ones(2, 8), None, backend="pallas_launch")


def test_clear_errors_for_gpus_jax_does_not_see(monkeypatch):
    fake = types.SimpleNamespace(device=torch.device("cuda", 1))
    monkeypatch.setattr(jax_device, "_gpu_devices", lambda: {})
    with pytest.raises(ValueError, match="JAX sees no GPU"):
        jax_device.jax_device_for(fake)
    monkeypatch.setattr(jax_device, "_gpu_devices", lambda: {0: object()})
    with pytest.raises(ValueError, match=r"cuda:1 but JAX only sees GPUs \[0\]"):
        jax_device.jax_device_for(fake)
