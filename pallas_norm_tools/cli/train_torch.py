"""``pallas-norm train --framework torch``: a tiny HF model, unpatched ("reference") or ``patch_hf_model``-ed."""

from __future__ import annotations

import re
from collections.abc import Iterator

from pallas_norm_tools.cli.training import VOCAB, batches, sizes

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def group(name: str) -> str:
    """Parameter name → "layer i" for decoder block i, else the name's leading part ("embed_tokens", "norm")."""
    m = _LAYER.search(name)
    return f"layer {m.group(1)}" if m else name.removeprefix("model.").split(".")[0]


def make_trainer(model: str, dtype: str, *, hidden: int | None, lr: float, seed: int, backend: str,
                 steps: int | None):
    import torch

    import torch_bridge
    from pallas_norm_tools.tiny_models import tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, steps = sizes(device == "cuda", hidden, steps)
    data = batches(seed, steps)
    torch_dtype = getattr(torch, dtype)

    def trainer(layers: int, variant: str) -> Iterator[tuple[float, dict[str, float]]]:
        net = tiny_model(model, layers=layers, hidden=hidden, vocab=VOCAB, seed=seed, dtype=torch_dtype,
                         device=device)
        if variant == "pallas":
            torch_bridge.patch_hf_model(net, backend=backend)
        if variant == "perturbed":  # the noise floor: every norm weight one ulp up
            with torch.no_grad():
                for name, p in net.named_parameters():
                    if "norm" in name:
                        p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
        for ids in data:
            ids = torch.tensor(ids, device=device)
            loss = net(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            groups: dict[str, float] = {}
            for name, p in net.named_parameters():
                if p.grad is not None:
                    key = group(name)
                    groups[key] = groups.get(key, 0.0) + float(p.grad.float().square().sum())
            yield float(loss.detach()), groups
            opt.step()

    return trainer, dict(where=device, hidden=hidden, steps=steps, backend=backend)
