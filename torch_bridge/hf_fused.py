"""``patch_hf_model(..., fuse_residual=True)``: a decoder layer's residual add and the norm after it in one call.

Two decoder-layer shapes are known, each recognised by its ``forward``'s statements (so a ``transformers`` release
that changes a layer leaves it unfused, with a warning, instead of silently computing something else):

* pre-norm (Llama, Mistral, Qwen2, Qwen3, Gemma): ``h = residual + attn(input_norm(x))`` then
  ``post_attention_layernorm(h)`` becomes ``rms_norm_add(attn_out, residual)`` with that norm's weight and mode;
* sandwich (Gemma2, Gemma3): ``h = residual + post_attention_layernorm(attn_out)`` then
  ``pre_feedforward_layernorm(h)`` becomes ``rms_norm_add(post_attention_layernorm(attn_out), residual)``.

The add across layers (one layer's ``residual + mlp_out`` and the next layer's ``input_layernorm``) stays unfused:
it crosses the model's own layer loop. Anything else (e.g. Phi3, whose adds go through dropout) is left unfused
with one warning per class. The layer's ``forward`` is replaced on the instance; ``unfuse`` removes it again.
"""

from __future__ import annotations

import inspect
import textwrap

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
_FUSED = "_pallas_norm_fused_forward"  # instance attribute marking a fused layer


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


def fuse(layer: torch.nn.Module) -> bool:
    """Replace ``layer.forward`` by the fused one; False (nothing changed) when the layer's shape is unknown or its
    norms are not ``torch_bridge.RMSNorm`` (patch them first)."""
    kind = layer_kind(type(layer))
    if kind is None or not isinstance(_norm_of(layer, kind), RMSNorm):
        return False
    signature = inspect.signature(layer.forward)
    names = [n for n, p in signature.parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    defaults = {n: p.default for n, p in signature.parameters.items()
                if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is not p.empty}

    def forward(*args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{type(layer).__name__}.forward takes at most {len(names)} positional arguments")
        bound = {**defaults, **dict(zip(names, args)), **kwargs}  # what the original binds (host cost: ~1 µs)
        attn_kwargs = {k: v for k, v in bound.items() if k != "hidden_states"}
        residual = bound["hidden_states"]
        out, _ = layer.self_attn(hidden_states=layer.input_layernorm(residual), **attn_kwargs)
        if kind == "sandwich":
            out = layer.post_attention_layernorm(out)
        norm = _norm_of(layer, kind)
        normed, hidden = rms_norm_add(out, residual, norm.weight, norm.eps, offset=norm.offset, casting=norm.casting,
                                      backend=norm.backend)
        out = layer.mlp(normed)
        if kind == "sandwich":
            out = layer.post_feedforward_layernorm(out)
        return hidden + out

    layer.forward = forward
    setattr(layer, _FUSED, kind)
    return True


def unfuse(model: torch.nn.Module) -> list[str]:
    """Give every fused layer of ``model`` its class's ``forward`` back; returns their paths."""
    paths = []
    for path, module in model.named_modules():
        if getattr(module, _FUSED, None) is not None:
            del module.forward
            delattr(module, _FUSED)
            paths.append(path)
    return paths
