"""``pallas-norm check --model DIR``: is pallas-norm safe on *this* Hugging Face model?

The model is loaded from a local directory (``save_pretrained`` output; nothing is downloaded) and used three
ways: as saved (HF's norms), patched by ``patch_hf_model(verify=True)`` (ours), and widened to float64 (the
truth). On a few random batches, logits, loss and every parameter's gradient of both are compared with the
float64 model by relative Frobenius error ``e = ‖T − T64‖ / ‖T64‖``; ours passes where
``e_ours ≤ 2 · e_hf + eps/2`` (``eps`` of the model's dtype: one extra rounding; the rule of the model tests).
Prints the norms replaced and those left alone, one line per quantity, the verdict; exit code 1 on a mismatch
or a failed ``verify``.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import warnings

import torch


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖a − ref‖ / ‖ref‖`` in float64 (``‖a‖`` when ``ref`` is zero; inf when anything is not finite)."""
    a, ref = a.double(), ref.double()
    if not (torch.isfinite(a).all() and torch.isfinite(ref).all()):
        return math.inf
    norm = ref.norm().item()
    return (a - ref).norm().item() / norm if norm > 0 else a.norm().item()


def load(model_dir: str, device: str) -> tuple[torch.nn.Module, bool]:
    """The saved causal LM (else the bare model, and False), from local files only, in its saved dtype."""
    import transformers

    kw = dict(local_files_only=True, dtype="auto")
    try:
        model, causal = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kw), True
    except ValueError:  # not a causal LM: the bare model (its first output is compared)
        model, causal = transformers.AutoModel.from_pretrained(model_dir, **kw), False
    return model.to(device).eval(), causal


def patch(model: torch.nn.Module, backend: str) -> tuple[list[str], list[str]]:
    """``patch_hf_model(verify=True)``: the replaced paths, and the warnings about norms left alone."""
    from torch_bridge import patch_hf_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = patch_hf_model(model, backend=backend, verify=True)
    return paths, [str(w.message) for w in caught if "patch_hf_model" in str(w.message)]


def run(model: torch.nn.Module, ids: torch.Tensor, causal: bool) -> dict[str, torch.Tensor]:
    """Logits (a bare model's first output), loss (its mean square) and every parameter's gradient of one forward
    and backward, as float64 on the CPU."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids) if causal else model(input_ids=ids)
    logits = out.logits if causal else out[0]
    loss = out.loss if causal else logits.float().square().mean()
    loss.backward()
    values = {"logits": logits.detach(), "loss": loss.detach()}
    values.update({f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    return {k: v.double().cpu() for k, v in values.items()}


def compare(models: dict[str, torch.nn.Module], causal: bool, batches: int, seq: int, eps: float) -> list[dict]:
    """Per quantity, the worst ``e_ours``, ``e_hf`` and bound over ``batches`` random batches."""
    vocab = models["hf"].config.vocab_size
    device = next(models["hf"].parameters()).device
    rows: dict[str, dict] = {}
    for b in range(batches):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(0, vocab, (2, seq), generator=g).to(device)
        outs = {name: run(m, ids, causal) for name, m in models.items()}
        for key, truth in outs["float64"].items():
            ours, hf = rel_err(outs["ours"][key], truth), rel_err(outs["hf"][key], truth)
            row = rows.setdefault(key, dict(quantity=key, ours=0.0, hf=0.0, bound=0.0, ok=True))
            bound = 2 * hf + eps / 2
            row.update(ours=max(row["ours"], ours), hf=max(row["hf"], hf), bound=max(row["bound"], bound),
                       ok=row["ok"] and ours <= bound)
    return list(rows.values())


def main(model_dir: str, *, device: str, backend: str, batches: int = 3, seq: int = 32,
         json_path: str | None = None) -> int:
    from rich.table import Table

    from pallas_norm_tools.cli.common import console as make_console

    console = make_console()
    hf, causal = load(model_dir, device)
    dtype = next(hf.parameters()).dtype
    ours, truth = copy.deepcopy(hf), copy.deepcopy(hf).to(torch.float64)
    console.print(f"pallas-norm check --model {model_dir}: {type(hf).__name__}, {dtype}, on {device}, backend "
                  f"{backend!r}, {batches} random batches of 2×{seq} tokens")
    try:
        paths, left = patch(ours, backend)
    except RuntimeError as err:
        console.print(f"[red]FAILED[/red] verify refused a replacement: {err}", highlight=False)
        return 1
    classes = collections.Counter(type(m).__name__ for p, m in hf.named_modules() if p in set(paths))
    console.print(f"replaced {len(paths)} norms: " + (", ".join(f"{n} × {c}" for c, n in classes.items()) or "none"))
    for message in left:
        console.print(f"left alone: {message.removeprefix('patch_hf_model: ')}", highlight=False)
    eps = torch.finfo(dtype).eps
    rows = compare(dict(hf=hf, ours=ours, float64=truth), causal, batches, seq, eps)
    t = Table(title="relative error against the float64 model (worst over batches)")
    for col in ("quantity", "ours", "HF's norms", "bound: 2 × HF + eps/2", ""):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    grads = [r for r in rows if r["quantity"].startswith("grad ")]
    shown = [r for r in rows if not r["quantity"].startswith("grad ")]
    shown += [r for r in grads if not r["ok"]] or sorted(grads, key=lambda r: r["ours"] / r["bound"])[-3:]
    for r in shown:
        t.add_row(r["quantity"], f"{r['ours']:.2e}", f"{r['hf']:.2e}", f"{r['bound']:.2e}",
                  "[green]ok[/green]" if r["ok"] else "[red]FAIL[/red]")
    console.print(t)
    failed = [r for r in rows if not r["ok"]]
    console.print(f"{len(grads)} parameter gradients, logits and loss compared; "
                  + (f"[red]FAILED[/red]: {len(failed)} beyond the bound" if failed else
                     "[green]all within the bound[/green]: pallas-norm keeps this model's numbers"))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(model=model_dir, dtype=str(dtype), replaced=paths, left_alone=left, rows=rows), f, indent=1)
    return 1 if failed else 0
