"""The field's failures, reproduced on tiny random-initialised Hugging Face models, with our norms patched in.

* Gemma2's sandwich norms: one residual gradient feeds two norms, so a backward that writes into dy breaks the
  other branch (a test-only norm that does so is caught);
* Qwen2 in bf16 under gradient checkpointing: every parameter gets its gradient (a norm that loses the weight's
  gradient is caught), as accurate against the float64 model as HF's own norms;
* depth: per-layer gradient norms of Llama at depth 2..16 equal the unpatched model's (a norm with a silent
  rounding slip is caught).

CPU: tiny sizes, the kernels interpreted; CUDA (device): wider, longer models, every backend compiled.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from pallas_norm_tools.tiny_models import tiny_model, tokens
from torch_bridge import patch_hf_model, rms_norm, rms_norm_ref_backward

from helpers import DEVICE, HAS_CUDA, rel_err

SIZE = dict(hidden=256, batch=4, length=128) if HAS_CUDA else dict(hidden=64, batch=2, length=16)
BACKENDS = ("pallas", "pallas_launch", "triton") if HAS_CUDA else ("pallas", "triton")
# float32 models: ours and HF's norms differ only in the order of float32 sums (~1e-7 relative per norm); three
# SGD steps through a few layers amplify that to a few 1e-6 (measured). 1e-4 leaves that a 20x margin while a
# semantic slip (eps misread, offset or rounding point moved) shows at >= 1e-3.
RTOL_F32 = 1e-4


def swap_norms(model: torch.nn.Module, cls_name: str, factory) -> None:
    """Replace every submodule of class ``cls_name`` by ``factory(module)`` (test-only broken variants)."""
    for path, module in list(model.named_modules()):
        if type(module).__name__ == cls_name:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, factory(module))


def install_norms(model: torch.nn.Module, variant: str, hf_cls_name: str, broken: str, broken_factory) -> list[str]:
    """``variant``: "hf" (leave the model), ``broken`` (the test-only broken norm), else a backend to patch in."""
    if variant == broken:
        swap_norms(model, hf_cls_name, broken_factory)
        return []
    return [] if variant == "hf" else patch_hf_model(model, backend=variant)


# --- Gemma2 sandwich norms -----------------------------------------------------------------------------------------

class _WritesDxIntoDy(torch.autograd.Function):
    """Deliberately broken Gemma norm (the fused-backward bug): returns dx written into the incoming dy."""

    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return rms_norm(x, w, eps, offset=1.0, casting="gemma", backend="triton")

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = rms_norm_ref_backward(dy, x, w, ctx.eps, offset=1.0, casting="gemma")
        return dy.copy_(dx), dw, None


class _InPlaceGemmaNorm(torch.nn.Module):
    def __init__(self, hf_norm: torch.nn.Module):
        super().__init__()
        self.weight, self.eps = hf_norm.weight, hf_norm.eps

    def forward(self, x):
        return _WritesDxIntoDy.apply(x, self.weight, self.eps)


def train_gemma2(variant: str, steps: int = 3) -> list[tuple]:
    """(loss, logits, {name: grad}) at each of ``steps`` SGD steps of a 2-layer Gemma2 from a fixed seed."""
    model = tiny_model("gemma2", hidden=SIZE["hidden"], device=DEVICE)
    patched = install_norms(model, variant, "Gemma2RMSNorm", "in_place_dy", _InPlaceGemmaNorm)
    if variant in BACKENDS:
        assert len(patched) == 9  # 4 per layer + the final norm
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = tokens(SIZE["batch"], SIZE["length"], device=DEVICE)
    history = []
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        history.append((out.loss.detach(), out.logits.detach(),
                        {k: p.grad.clone() for k, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return history


def training_mismatches(ours: list[tuple], theirs: list[tuple]) -> list[str]:
    bad = []
    for step, ((loss, logits, grads), (loss_h, logits_h, grads_h)) in enumerate(zip(ours, theirs)):
        for name, a, b in [("loss", loss, loss_h), ("logits", logits, logits_h),
                           *((f"grad {k}", grads[k], grads_h[k]) for k in grads_h)]:
            if not rel_err(a, b) <= RTOL_F32:
                bad.append(f"step {step} {name}: relative error {rel_err(a, b):.2e}")
    return bad


@pytest.fixture(scope="module")
def gemma2_hf():
    return train_gemma2("hf")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma2_sandwich_norms_train_like_hf(gemma2_hf, backend):
    assert training_mismatches(train_gemma2(backend), gemma2_hf) == []


def test_gemma2_check_catches_a_norm_writing_into_dy(gemma2_hf):
    assert training_mismatches(train_gemma2("in_place_dy"), gemma2_hf)


# --- Qwen2, bf16, gradient checkpointing ---------------------------------------------------------------------------

class _SwappedNorm(Qwen2RMSNorm):
    """Base of the test-only broken Llama-style norms: takes over an HF norm's weight Parameter and eps."""

    def __init__(self, hf_norm):
        super().__init__(hf_norm.weight.shape[0], hf_norm.variance_epsilon)
        self.weight = hf_norm.weight


class _DetachedWeightNorm(_SwappedNorm):
    """Deliberately broken norm: its weight never gets a gradient (the lost-gradient failure class)."""

    def forward(self, h):
        return rms_norm(h, self.weight.detach(), self.variance_epsilon)


def qwen2_grads(variant: str, dtype: torch.dtype, reentrant: bool | None) -> dict[str, torch.Tensor | None]:
    """Parameter gradients of one loss.backward() of a 2-layer Qwen2 (``reentrant`` None: no checkpointing)."""
    model = tiny_model("qwen2", hidden=SIZE["hidden"], dtype=dtype, device=DEVICE)
    model.train()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    install_norms(model, variant, "Qwen2RMSNorm", "detached_weight", _DetachedWeightNorm)
    ids = tokens(SIZE["batch"], SIZE["length"], device=DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def checkpoint_failures(grads, hf, ref) -> list[str]:
    """Every gradient present and finite, and (relative Frobenius error against the float64 model) at most
    2x HF's bf16 error + 2^-8 (half a bf16 ulp: one extra rounding of the result)."""
    bad = []
    for k, r in ref.items():
        g = grads[k]
        if g is None or not torch.isfinite(g).all():
            bad.append(f"{k}: gradient {'missing' if g is None else 'not finite'}")
            continue
        err, err_hf = ((t.double() - r).norm().item() / r.norm().item() for t in (g, hf[k]))
        if not err <= 2 * err_hf + 2.0**-8:
            bad.append(f"{k}: relative error {err:.2e} > 2 x HF's {err_hf:.2e} + 2^-8")
    return bad


@pytest.fixture(scope="module")
def qwen2_reference():
    """Float64 gradients (no checkpointing) of the same model: the reference both bf16 runs are judged by."""
    return {k: g.double() for k, g in qwen2_grads("hf", torch.float64, None).items()}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen2_bf16_checkpointing_every_gradient_arrives(qwen2_reference, backend, reentrant):
    hf = qwen2_grads("hf", torch.bfloat16, reentrant)
    assert checkpoint_failures(qwen2_grads(backend, torch.bfloat16, reentrant), hf, qwen2_reference) == []


def test_qwen2_check_catches_a_lost_weight_gradient(qwen2_reference):
    hf = qwen2_grads("hf", torch.bfloat16, False)
    failures = checkpoint_failures(qwen2_grads("detached_weight", torch.bfloat16, False), hf, qwen2_reference)
    assert failures and all("layernorm" in f or "norm.weight" in f for f in failures)


# --- Depth -----------------------------------------------------------------------------------------------------------

class _WeightRoundedNorm(_SwappedNorm):
    """Deliberately slipped norm: rounds its weight to bf16 (a silent mixed-precision mix-up)."""

    def forward(self, h):
        return rms_norm(h, self.weight.bfloat16().float(), self.variance_epsilon)


@functools.cache
def layer_grad_norms(depth: int, variant: str) -> torch.Tensor:
    """Gradient norm of each decoder layer's parameters after one backward of a float32 Llama of ``depth``."""
    model = tiny_model("llama", layers=depth, hidden=SIZE["hidden"], device=DEVICE)
    install_norms(model, variant, "LlamaRMSNorm", "weight_rounded", _WeightRoundedNorm)
    ids = tokens(SIZE["batch"], SIZE["length"], device=DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    return torch.stack([torch.cat([p.grad.flatten() for p in layer.parameters()]).double().norm()
                        for layer in model.model.layers])


def depth_report(variant: str) -> tuple[bool, str]:
    """Whether every layer's gradient norm is within RTOL_F32 of HF's at every depth, and the largest relative
    difference per depth."""
    worst = {}
    for depth in (2, 4, 8, 16):
        ours, hf = layer_grad_norms(depth, variant), layer_grad_norms(depth, "hf")
        worst[depth] = ((ours - hf).abs() / hf).max().item()
    report = ", ".join(f"depth {d}: {w:.2e}" for d, w in worst.items())
    return all(w <= RTOL_F32 for w in worst.values()), f"largest relative per-layer grad-norm difference: {report}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_grad_norms_match_hf_at_every_depth(backend):
    ok, report = depth_report(backend)
    assert ok, report


def test_depth_check_catches_a_rounding_slip():
    ok, report = depth_report("weight_rounded")
    assert not ok, report
