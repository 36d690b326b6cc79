"""``patch_hf_model(..., fuse_residual=True)`` (``torch_bridge.hf_fused``) on tiny random-init models.

Every decoder layer's residual adds run fused with the norm after them (inside the layer, and across layers into
the next layer's input norm and the final norm); logits and every gradient match the unpatched model, also under
HF's gradient checkpointing; a norm computed ahead is only used for exactly the tensor it was computed from; a
deep copy of a fused model runs its own modules; ``unpatch_hf_model`` restores the layers.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_bridge
from pallas_norm_tools.tiny_models import FAMILIES, tiny_model, tokens
from torch_bridge import hf_fused, module

from helpers import DEVICE, rel_err
from test_patch_hf import RTOL, hf_norms


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def grads_close(got: dict, want: dict) -> bool:
    return all(rel_err(got[n], want[n]) <= RTOL for n in want)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"phi3"}))

def test_fuse_residual_matches_the_unpatched_model(family):
    """Every decoder layer's residual add + next norm becomes one ``rms_norm_add`` call; logits and every gradient
    match the unpatched HF model (float32; Gemma2/3's sandwich layers send the residual gradient to two norms).
    Qwen3's and Gemma3's per-head q/k norms are patched too."""
    reference, model = tiny_model(family, device=DEVICE), tiny_model(family, device=DEVICE)
    ids = tokens(device=DEVICE)
    logits, grads = loss_and_grads(reference, ids)
    paths = torch_bridge.patch_hf_model(model, fuse_residual=True)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert layers and all("forward" in vars(m) for m in layers)
    if family in ("qwen3", "gemma3"):
        assert {p.rsplit(".", 1)[-1] for p in paths} >= {"q_norm", "k_norm"}
    got_logits, got = loss_and_grads(model, ids)
    assert rel_err(got_logits, logits) <= RTOL and grads_close(got, grads)
    torch_bridge.unpatch_hf_model(model)
    assert not any("forward" in vars(m) for m in layers) and hf_norms(model).keys() == hf_norms(reference).keys()


def test_fuse_residual_checks_catch_a_backward_that_drops_the_residual_gradient(monkeypatch):
    """The broken variant: the fused backward ignores h's own gradient (dh = dx_norm), on Gemma2."""
    from torch_bridge import fused_ops

    reference, model = tiny_model("gemma2", device=DEVICE), tiny_model("gemma2", device=DEVICE)
    ids = tokens(device=DEVICE)
    _, grads = loss_and_grads(reference, ids)
    torch_bridge.patch_hf_model(model, backend="triton", fuse_residual=True)
    good = fused_ops._KERNELS["triton"]
    monkeypatch.setitem(fused_ops._KERNELS, "triton", fused_ops.AddKernels(
        good.forward, lambda dy, dh_out, *rest: good.backward(dy, torch.zeros_like(dh_out), *rest)))
    assert not grads_close(loss_and_grads(model, ids)[1], grads)


def test_fuse_residual_leaves_unknown_layers_unfused_with_a_warning():
    model = tiny_model("phi3", device=DEVICE)
    with pytest.warns(UserWarning, match=r"left transformers\.models\.phi3\.modeling_phi3\.Phi3DecoderLayer unfused"):
        torch_bridge.patch_hf_model(model, fuse_residual=True)
    assert not any("forward" in vars(m) for m in model.modules())


def count_calls(monkeypatch) -> dict[str, int]:
    """Counts of the standalone norm (``RMSNorm.forward``'s ``rms_norm``) and of the fused add calls."""
    counts = {"rms_norm": 0, "rms_norm_add": 0}
    for owner, name in ((module, "rms_norm"), (hf_fused, "rms_norm_add")):
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    return counts


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_every_add_before_a_norm_is_fused(family, monkeypatch):
    """Two fused calls per layer (the layer's middle add; its last add with the next layer's input norm or the
    final norm): the only standalone decoder norm left is layer 0's input norm (plus Gemma2's two sandwich norms
    per layer, which follow no add)."""
    model = tiny_model(family, layers=3, device=DEVICE)
    torch_bridge.patch_hf_model(model, fuse_residual=True)
    counts = count_calls(monkeypatch)
    model(input_ids=tokens(device=DEVICE))
    assert counts == {"rms_norm_add": 6, "rms_norm": 1 + (6 if family == "gemma2" else 0)}


def shift_between_layers(model: torch.nn.Module) -> None:
    """A pre-hook on layer 1 that shifts its input in place (what a loop doing something between layers is)."""
    def hook(layer, args, kwargs):
        with torch.no_grad():
            (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).add_(0.5)
    model.model.layers[1].register_forward_pre_hook(hook, with_kwargs=True)


def test_a_norm_computed_ahead_is_only_used_for_its_own_tensor(monkeypatch):
    """A hook writes the hidden state in place between layers: the linked norm sees the tensor's version move and
    normalises what it gets. The broken variant (version not checked) returns the stale y: logits differ."""
    reference, model = tiny_model("llama", layers=3, device=DEVICE).eval(), tiny_model("llama", layers=3,
                                                                                     device=DEVICE).eval()
    torch_bridge.patch_hf_model(model, fuse_residual=True)
    for m in (reference, model):
        shift_between_layers(m)
    ids = tokens(device=DEVICE)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        assert rel_err(model(input_ids=ids).logits, want) <= RTOL
        monkeypatch.setattr(hf_fused, "_version", lambda t: 0)
        assert rel_err(model(input_ids=ids).logits, want) > 1e-3


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_matches_the_unpatched_model(reentrant, monkeypatch):
    """Under HF's gradient checkpointing no norm is computed ahead (a recompute must repeat the first forward's
    ops): logits and gradients match. The broken variant (ahead regardless) fails loudly without reentrancy."""
    reference, model = tiny_model("gemma2", device=DEVICE), tiny_model("gemma2", device=DEVICE)
    for m in (reference, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = tokens(device=DEVICE)
    logits, grads = loss_and_grads(reference, ids)
    torch_bridge.patch_hf_model(model, fuse_residual=True)
    got_logits, got = loss_and_grads(model, ids)
    assert rel_err(got_logits, logits) <= RTOL and grads_close(got, grads)
    if not reentrant:
        monkeypatch.setattr(hf_fused, "_ahead_allowed", lambda m: True)
        with pytest.raises(torch.utils.checkpoint.CheckpointError):
            loss_and_grads(model, ids)


def test_a_deep_copy_of_a_fused_model_runs_its_own_modules():
    """The fused forwards are bound methods: the copy's rebind to the copy (a closure over the original's layer
    would run the original's weights)."""
    model = tiny_model("llama", device=DEVICE).eval()
    torch_bridge.patch_hf_model(model, fuse_residual=True)
    twin = copy.deepcopy(model)
    ids = tokens(device=DEVICE)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert torch.equal(twin(input_ids=ids).logits, before)
        for layer in twin.model.layers:
            layer.post_attention_layernorm.weight.mul_(3)
        twin.model.norm.weight.mul_(3)
        assert rel_err(twin(input_ids=ids).logits, before) > 1e-3
        assert torch.equal(model(input_ids=ids).logits, before)


def test_torch_compile_fullgraph_of_a_fused_model():
    """Compiled, the fused layers run as written (no norm ahead, no graph break) and give the eager logits."""
    model = tiny_model("llama", device=DEVICE).eval()
    torch_bridge.patch_hf_model(model, backend="triton", fuse_residual=True)
    ids = tokens(device=DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert rel_err(compiled(input_ids=ids).logits, model(input_ids=ids).logits) <= RTOL
