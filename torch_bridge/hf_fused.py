"""``patch_hf_model(..., fuse_residual=True)``: a decoder layer's residual add and the norm after it in one call.

Two decoder-layer shapes are known, each recognised by its ``forward``'s statements (so a ``transformers`` release
that changes a layer leaves it unfused, with a warning, instead of silently computing something else):

* pre-norm (Llama, Mistral, Qwen2, Qwen3, Gemma): ``h = residual + attn(input_norm(x))`` then
  ``post_attention_layernorm(h)`` becomes ``rms_norm_add(attn_out, residual)`` with that norm's weight and mode;
* sandwich (Gemma2, Gemma3): ``h = residual + post_attention_layernorm(attn_out)`` then
  ``pre_feedforward_layernorm(h)`` becomes ``rms_norm_add(post_attention_layernorm(attn_out), residual)``.

Across layers, ``link`` fuses each layer's last add (``residual + mlp_out``) with the norm its output goes to next
(the next layer's ``input_layernorm``, the model's final ``norm`` after the last layer): the layer computes that
norm's ``y`` with its ``h``, and the norm returns it when it is called with exactly that ``h`` (the model's own loop
stays as it is). Not under ``torch.compile`` or HF's gradient checkpointing (there each add and norm runs as
written); a checkpoint wrapper of your own around single layers sees different ops when it recomputes a layer and
says so (torch's ``CheckpointError``): patch without ``fuse_residual`` there. Anything else (e.g. Phi3, whose adds
go through dropout) is left unfused with one warning per class. The ``forward`` of fused layers and linked norms is
replaced on the instance (bound, so ``copy.deepcopy`` keeps a copy to itself); ``unfuse`` removes it again.
"""

from __future__ import annotations

import inspect
import textwrap
import types

import torch

from torch_bridge.module import RMSNorm
from torch_bridge.ops import rms_norm_add

_STEPS = {
    "pre-norm": ("residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)",
                 "hidden_states, _ = self.self_attn(", "hidden_states = residual + hidden_states",
                 "residual = hidden_states", "hidden_states = self.post_attention_layernorm(hidden_states)",
                 "hidden_states = self.mlp(hidden_states)", "hidden_states = residual + hidden_states",
                 "return hidden_states"),
    "sandwich": ("residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)",
                 "hidden_states, _ = self.self_attn(", "hidden_states = self.post_attention_layernorm(hidden_states)",
                 "hidden_states = residual + hidden_states", "residual = hidden_states",
                 "hidden_states = self.pre_feedforward_layernorm(hidden_states)",
                 "hidden_states = self.mlp(hidden_states)",
                 "hidden_states = self.post_feedforward_layernorm(hidden_states)",
                 "hidden_states = residual + hidden_states", "return hidden_states"),
}
_FUSED = "_pallas_norm_fused_forward"  # on a fused layer: (kind, forward's parameter names, defaults)
_NEXT = "_pallas_norm_next"  # on a fused layer: the norm its output goes to next (``link``), not a submodule
_AHEAD = "_pallas_norm_ahead"  # on such a norm: (h, h's version, weight's version, y) from the layer before


def layer_kind(cls: type) -> str | None:
    """``"pre-norm"`` or ``"sandwich"`` when ``cls.forward`` is exactly that statement sequence (``hidden_states``
    goes to ``self_attn`` with every other argument passed through by name), else None."""
    if not cls.__name__.endswith("DecoderLayer") or not cls.__module__.startswith("transformers.models."):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    lines = [line.split("#")[0].strip() for line in source.splitlines()]
    steps = tuple(line for line in lines  # statements on the two variables (argument lines end with a comma)
                  if line.startswith(("residual", "hidden_states", "return")) and not line.endswith(","))
    params = [p for p in inspect.signature(cls.forward).parameters.values()
              if p.name not in ("self", "hidden_states") and p.kind != p.VAR_KEYWORD]
    if not all(f"{p.name}={p.name}," in lines for p in params) or "**kwargs," not in lines:
        return None
    return next((kind for kind, expected in _STEPS.items() if steps == expected), None)


def _norm_of(layer: torch.nn.Module, kind: str) -> torch.nn.Module:
    return layer.post_attention_layernorm if kind == "pre-norm" else layer.pre_feedforward_layernorm


def _signature(cls: type) -> tuple[list[str], dict]:
    """The positional-or-keyword parameter names of ``cls.forward`` and their defaults."""
    params = [(n, p) for n, p in inspect.signature(cls.forward).parameters.items()
              if p.kind == p.POSITIONAL_OR_KEYWORD and n != "self"]
    return [n for n, _ in params], {n: p.default for n, p in params if p.default is not p.empty}


def _ahead_allowed(module: torch.nn.Module) -> bool:
    """Whether a norm may be computed one step ahead: not while compiling (the compiler fuses the add itself) and
    not under HF's gradient checkpointing (its recompute must repeat the very ops of the first forward)."""
    return not torch.compiler.is_compiling() and not getattr(module, "gradient_checkpointing", False)


def _add(layer: torch.nn.Module, out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's last ``hidden + out``; when ``link`` gave it the next norm, fused with that norm, whose ``y``
    waits on it for exactly this ``h`` (``_norm_forward``)."""
    norm = layer.__dict__.get(_NEXT)
    if norm is None or not _ahead_allowed(layer):
        return hidden + out
    y, h = _fused_call(norm, out, hidden)
    norm.__dict__[_AHEAD] = (h, _version(h), _version(norm.weight), y)
    return h


def _version(t: torch.Tensor | None) -> int | None:
    return None if t is None else t._version


def _fused_call(norm: RMSNorm, out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + out), residual + out)`` in one ``rms_norm_add`` (h in the add's promoted dtype)."""
    return rms_norm_add(out, residual, norm.weight, norm.eps, offset=norm.offset, casting=norm.casting,
                        residual_dtype=torch.promote_types(out.dtype, residual.dtype), backend=norm.backend)


def _norm_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """A linked norm's ``forward``: the ``y`` the layer before computed, when ``x`` is exactly the ``h`` it returned
    (same tensor, not written since, same weight version, gradient tracked alike); else the norm itself."""
    ahead = self.__dict__.pop(_AHEAD, None) if _ahead_allowed(self) else None
    if ahead is not None:
        h, h_version, w_version, y = ahead
        if h is x and _version(x) == h_version and _version(self.weight) == w_version \
                and y.requires_grad == x.requires_grad:
            return y
    return type(self).forward(self, x)


def _fused_forward(self: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
    """A fused layer's ``forward`` (bound to the layer, so ``copy.deepcopy`` of the model rebinds it)."""
    kind, names, defaults = self.__dict__[_FUSED]
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}.forward takes at most {len(names)} positional arguments")
    bound = {**defaults, **dict(zip(names, args)), **kwargs}  # what the original binds
    attn_kwargs = {k: v for k, v in bound.items() if k != "hidden_states"}
    residual = bound["hidden_states"]
    out, _ = self.self_attn(hidden_states=self.input_layernorm(residual), **attn_kwargs)
    if kind == "sandwich":
        out = self.post_attention_layernorm(out)
    normed, hidden = _fused_call(_norm_of(self, kind), out, residual)
    out = self.mlp(normed)
    if kind == "sandwich":
        out = self.post_feedforward_layernorm(out)
    return _add(self, out, hidden)


def fuse(layer: torch.nn.Module) -> bool:
    """Replace ``layer.forward`` by the fused one; False (nothing changed) when the layer's shape is unknown or its
    norms are not ``torch_bridge.RMSNorm`` (patch them first)."""
    kind = layer_kind(type(layer))
    if kind is None or not isinstance(_norm_of(layer, kind), RMSNorm):
        return False
    layer.__dict__[_FUSED] = (kind, *_signature(type(layer)))  # read once here, not per call (nor traced)
    layer.forward = types.MethodType(_fused_forward, layer)
    return True


def link(model: torch.nn.Module) -> list[str]:
    """Fuse each fused layer's last add with the norm its output goes to next: the next layer's ``input_layernorm``
    and, after the last layer, the model's final ``norm`` (a module with ``layers``, all fused, and ``norm``, a
    ``torch_bridge.RMSNorm``, as every HF decoder stack of the known families has). The model's own loop still
    passes the ``h`` each layer returns; a linked norm given exactly that ``h`` returns the ``y`` computed with
    it, and computes its own otherwise (``_norm_forward``), so a loop that does anything between stays right.
    Returns the linked norms' paths."""
    linked = []
    for path, stack in model.named_modules():
        layers, final = getattr(stack, "layers", None), getattr(stack, "norm", None)
        if not (isinstance(layers, torch.nn.ModuleList) and len(layers) and isinstance(final, RMSNorm)
                and all(_FUSED in vars(layer) for layer in layers)
                and all(isinstance(layer.input_layernorm, RMSNorm) for layer in layers)):
            continue
        nexts = [(f"layers.{i + 1}.input_layernorm", layer.input_layernorm) for i, layer in enumerate(layers[1:])]
        for layer, (name, norm) in zip(layers, nexts + [("norm", final)]):
            layer.__dict__[_NEXT] = norm  # through __dict__: not registered as a submodule
            norm.forward = types.MethodType(_norm_forward, norm)
            linked.append(f"{path}.{name}" if path else name)
    return linked


def unfuse(model: torch.nn.Module) -> list[str]:
    """Give every fused layer (and linked norm) of ``model`` its class's ``forward`` back; returns the layers'
    paths."""
    paths = []
    for path, module in model.named_modules():
        for attr in (_FUSED, _NEXT, _AHEAD):
            module.__dict__.pop(attr, None)
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) in (_fused_forward, _norm_forward):
            if module.forward.__func__ is _fused_forward:
                paths.append(path)
            del module.forward
    return paths
