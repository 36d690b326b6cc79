"""``patch_hf_model`` / ``unpatch_hf_model`` on tiny random-init models of every known family (no downloads).

Each family: every HF RMSNorm (and nothing else) is replaced by ``torch_bridge.RMSNorm`` in the family's mode,
keeping the same ``weight`` Parameter objects; the state_dict is unchanged; logits match the unpatched model and
greedy ``generate()`` gives the same tokens (float32); an optimizer made before patching trains the patched
model; ``unpatch_hf_model`` restores the original modules. Unknown ``*RMSNorm`` classes are left alone with one
warning per class; a replacement that disagrees with the module it replaces (a deliberately wrong mode) is caught
by ``verify`` and nothing stays patched.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_bridge
from pallas_norm_tools.tiny_models import FAMILIES, tiny_model, tokens
from torch_bridge import hf

from helpers import DEVICE, rel_err

MODES = {"gemma": ("gemma", 1.0), "gemma2": ("gemma", 1.0), "gemma3": ("gemma", 1.0)}
RTOL = 1e-5  # float32 logits: the norms' sums run in another order (~1e-7 relative), through two small layers


def hf_norms(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {path: m for path, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")
            and type(m).__module__.startswith("transformers.")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_patches_generates_and_unpatches(family):
    model = tiny_model(family, device=DEVICE).eval()
    ids = tokens(batch=2, length=6, device=DEVICE)
    originals = hf_norms(model)
    weights = {path: m.weight for path, m in originals.items()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)

    paths = torch_bridge.patch_hf_model(model)
    assert sorted(paths) == sorted(originals) and len(paths) >= 2 * 2 + 1
    casting, offset = MODES.get(family, ("llama", 0.0))
    for path in paths:
        new = model.get_submodule(path)
        assert isinstance(new, torch_bridge.RMSNorm) and (new.casting, new.offset) == (casting, offset)
        eps_attr = hf.KNOWN_NORMS[type(originals[path]).__name__][2]
        assert new.weight is weights[path] and new.eps == getattr(originals[path], eps_attr)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        assert rel_err(model(ids).logits, logits) <= RTOL
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), generated)

    assert sorted(torch_bridge.unpatch_hf_model(model)) == sorted(paths)
    assert hf_norms(model) == originals and all(m.weight is weights[p] for p, m in originals.items())


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def test_optimizer_made_before_patching_trains_the_patched_model():
    ids = tokens(device=DEVICE)
    reference, model = (tiny_model("llama", device=DEVICE) for _ in range(2))
    norms = [n for n, _ in reference.named_parameters() if "norm" in n]
    before = {n: reference.get_parameter(n).detach().clone() for n in norms}
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    torch_bridge.patch_hf_model(model)
    for _ in range(2):
        for m, opt in zip((reference, model), opts):
            sgd_step(m, opt, ids)
    assert norms and all(not torch.equal(model.get_parameter(n), before[n]) for n in norms)  # the norms trained ...
    for n in norms:  # ... through the patched modules as through HF's
        assert rel_err(model.get_parameter(n).detach(), reference.get_parameter(n).detach()) <= RTOL


class FancyRMSNorm(torch.nn.Module):
    """An RMSNorm class the patcher does not know."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_unknown_norm_classes_are_left_alone_with_one_warning():
    model = tiny_model("llama", device=DEVICE)
    model.model.extra_a, model.model.extra_b = FancyRMSNorm(64), FancyRMSNorm(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = torch_bridge.patch_hf_model(model)
    fancy = [w for w in caught if "FancyRMSNorm" in str(w.message)]
    assert len(fancy) == 1 and "unknown RMSNorm class" in str(fancy[0].message)
    assert isinstance(model.model.extra_a, FancyRMSNorm) and "model.extra_a" not in paths


def test_verify_catches_a_wrong_mode_and_rolls_back(monkeypatch):
    model = tiny_model("qwen2", device=DEVICE)
    originals = hf_norms(model)
    monkeypatch.setitem(hf.KNOWN_NORMS, "Qwen2RMSNorm", ("gemma", 1.0, "variance_epsilon"))  # deliberately wrong
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.input_layernorm .*casting='gemma'.*disagrees"):
        torch_bridge.patch_hf_model(model)
    assert hf_norms(model) == originals
    assert torch_bridge.patch_hf_model(model, verify=False)  # without the probe the wrong mode would go in


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        torch_bridge.patch_hf_model("llama")
    with pytest.raises(ValueError, match="backend must be one of"):
        torch_bridge.patch_hf_model(tiny_model("llama"), backend="cuda")
    with pytest.raises(TypeError, match="fuse_residual must be a bool"):
        torch_bridge.patch_hf_model(tiny_model("llama"), fuse_residual="yes")
