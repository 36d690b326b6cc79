"""One-line Hugging Face patching: every known RMSNorm of a ``transformers`` model becomes ``torch_bridge.RMSNorm``.

Known classes and the mode each computes (``docs/semantics.md``):

* Llama, Mistral, Qwen2, Qwen3, Phi3 — ``r(x·rstd)`` then ``× weight``: casting "llama", offset 0;
* Gemma, Gemma2, Gemma3 — ``x·rstd·(1 + weight)`` in float32: casting "gemma", offset 1.

Anything else whose class name ends in ``RMSNorm`` is left alone with one warning per class: its semantics are
never guessed. The replacement keeps the original ``weight`` Parameter object, so optimizers and state_dicts
made before or after patching keep working. HF's Llama-style modules return float32 when their weight is
float32 and the input 16-bit (type promotion); ours return the input's dtype.
"""

from __future__ import annotations

import warnings

import torch

from pallas_norm import accuracy, registry
from torch_bridge import hf_fused
from torch_bridge.module import RMSNorm
from torch_bridge.numpy_io import autograd_outputs, from_numpy, numpy_dtype, to_numpy

# class name -> (casting, offset, attribute holding eps)
KNOWN_NORMS: dict[str, tuple[str, float, str]] = {
    **{f"{family}RMSNorm": ("llama", 0.0, "variance_epsilon") for family in ("Llama", "Mistral", "Qwen2", "Qwen3",
                                                                              "Phi3")},
    **{f"{family}RMSNorm": ("gemma", 1.0, "eps") for family in ("Gemma", "Gemma2", "Gemma3")},
}
_ORIGINAL = "_pallas_norm_hf_original"  # attribute of a patched module holding the HF module it replaced


def _known(module: torch.nn.Module) -> tuple[str, float, str] | None:
    cls = type(module)
    if cls.__module__.startswith("transformers.models.") and cls.__name__ in KNOWN_NORMS:
        return KNOWN_NORMS[cls.__name__]
    return None


def _replacement(module: torch.nn.Module, backend: str) -> RMSNorm:
    casting, offset, eps_attr = _known(module)
    weight = module.weight
    new = RMSNorm(weight.shape[0], float(getattr(module, eps_attr)), offset=offset, casting=casting, backend=backend,
                  device="meta", dtype=weight.dtype)
    new.weight = weight  # the same Parameter object
    new.train(module.training)
    object.__setattr__(new, _ORIGINAL, module)  # not a submodule: invisible to state_dict and parameters()
    return new


def _probe_failure(original: torch.nn.Module, patched: RMSNorm) -> str | None:
    """Forward and backward of both modules on a random probe (``pallas_norm.accuracy.make_inputs`` with a
    perturbed copy of the weight), each held to the accuracy rule of the mode the patch assumes: ours (y, dx,
    dweight) to the bound, the original (y, dx) to the bound and the naive formula's rounding points (HF's bf16
    Llama dweight rounds every product: not held). A wrong mode fails the original's check."""
    weight = patched.weight
    n, dev = weight.shape[0], weight.device
    x, _, dy = (from_numpy(a, dev) for a in accuracy.make_inputs((8, n), numpy_dtype(weight.dtype), scale=2.0))
    g = torch.Generator(device=dev).manual_seed(0)
    w = (weight.detach().float() + 0.1 * torch.randn(n, generator=g, device=dev)).to(weight.dtype)
    with torch.enable_grad():
        ours, theirs = ([to_numpy(t) for t in autograd_outputs(
            lambda a, b, m=m: torch.func.functional_call(m, {"weight": b}, (a,)), x, w, dy)]
            for m in (patched, original))
    ref = accuracy.reference(to_numpy(x), to_numpy(w), to_numpy(dy), eps=patched.eps, offset=patched.offset,
                             casting=patched.casting)
    failures = (ref.failures("", ours, rounding_points=False)
                + ref.failures("original", theirs, only=("y", "dx")))
    return failures[0] if failures else None


def _set(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def unpatch_hf_model(model: torch.nn.Module) -> list[str]:
    """Put back every HF module ``patch_hf_model`` replaced (with the current ``weight`` Parameter) and every fused
    decoder layer's own ``forward``; returns the replaced modules' paths."""
    hf_fused.unfuse(model)
    restored = []
    for path, module in list(model.named_modules()):
        original = getattr(module, _ORIGINAL, None)
        if original is not None:
            original.weight = module.weight
            original.train(module.training)
            _set(model, path, original)
            restored.append(path)
    return restored


def patch_hf_model(model: torch.nn.Module, *, backend: str = "pallas", verify: bool = True,
                   fuse_residual: bool = False) -> list[str]:
    """Replace every known HF RMSNorm in ``model`` by ``torch_bridge.RMSNorm`` of the same mode; returns the
    replaced modules' paths.

    ``verify``: each replacement is first checked against the module it replaces on a random probe, forward and
    backward; on a mismatch nothing stays patched and a RuntimeError names the module and the error.
    ``fuse_residual``: each decoder layer's residual add and the norm after it also become one
    ``torch_bridge.rms_norm_add`` call (``torch_bridge.hf_fused``: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2,
    Gemma3), and so does each layer's last add with the next layer's input norm (the final norm after the last
    layer); layers of another shape stay unfused, with one warning per class.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    registry.torch_backend(backend)
    for name, flag in (("verify", verify), ("fuse_residual", fuse_residual)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    patched, unknown = [], set()
    for path, module in list(model.named_modules()):
        cls = type(module)
        if _known(module) is None:
            if cls.__name__.lower().endswith("rmsnorm") and not isinstance(module, RMSNorm):
                unknown.add(f"{cls.__module__}.{cls.__name__}")
            continue
        new = _replacement(module, backend)
        failure = _probe_failure(module, new) if verify and new.weight.device.type != "meta" else None
        if failure:
            unpatch_hf_model(model)
            raise RuntimeError(f"patch_hf_model: {path} ({cls.__name__} -> casting={new.casting!r}, "
                               f"offset={new.offset}, backend={backend!r}) disagrees with the original: {failure}")
        _set(model, path, new)
        patched.append(path)
    for name in sorted(unknown):
        warnings.warn(f"patch_hf_model: left {name} unpatched (unknown RMSNorm class; its semantics are not "
                      "guessed)", UserWarning, stacklevel=2)
    if fuse_residual:
        unfused = {f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()
                   if type(m).__name__.endswith("DecoderLayer") and not hf_fused.fuse(m)}
        for name in sorted(unfused):
            warnings.warn(f"patch_hf_model: left {name} unfused (fuse_residual=True knows the Llama-style pre-norm and "
                          "the Gemma2-style sandwich decoder layers as transformers writes them; this one differs)",
                          UserWarning, stacklevel=2)
        hf_fused.link(model)
    return patched
