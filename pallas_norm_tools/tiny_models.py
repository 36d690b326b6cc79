"""Tiny random-initialised Hugging Face causal LMs (no downloads): the model-level tests and ``pallas-norm train``
run on these (needs the ``hf`` extra)."""

from __future__ import annotations

import torch
import transformers as tf

FAMILIES: dict[str, tuple[type, type, dict]] = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16)),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(head_dim=16)),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(head_dim=16, sliding_window=8)),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(head_dim=16, sliding_window=8)),
}


def tiny_model(family: str, *, layers: int = 2, hidden: int = 64, vocab: int = 128, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str = "cpu", **config_overrides) -> torch.nn.Module:
    """``family``'s causal LM with random weights, its norms' weights perturbed away from their init
    (``config_overrides``: any config field, e.g. ``max_position_embeddings`` for long sequences)."""
    config_cls, model_cls, extra = FAMILIES[family]
    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  attn_implementation="eager", **extra)
    config = config_cls(**{**fields, **config_overrides})
    torch.manual_seed(seed)
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.to(device=device, dtype=dtype)


def tokens(batch: int = 2, length: int = 16, vocab: int = 128, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """Random token ids in ``[3, vocab)`` (above the special ids), shape ``(batch, length)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)
