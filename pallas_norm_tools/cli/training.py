"""The training harness behind ``pallas-norm train``: synthetic batches, per-step logs, the summary and the plot.

A trainer (``train_torch.make_trainer`` or ``train_jax.make_trainer``) yields, per optimizer step, the loss and
the squared gradient norm of each parameter group; :func:`run_variant` turns that into ``Step`` logs and stops
at the first NaN/Inf.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib
from collections.abc import Callable, Iterator

VARIANTS = ("reference", "pallas", "perturbed")
SEQ_LEN, BATCH, VOCAB = 32, 4, 128


def sizes(gpu: bool, hidden: int | None, steps: int | None) -> tuple[int, int]:
    """``(hidden, steps)``: the user's, else 512 and 50 on a GPU, 64 and 20 on CPU (interpreted kernels)."""
    return hidden or (512 if gpu else 64), steps or (50 if gpu else 20)


@dataclasses.dataclass
class Step:
    """One optimizer step: loss and gradient norms before the update (``layer_norms[i]``: block i's parameters)."""

    variant: str
    layers: int
    step: int
    loss: float
    grad_norm: float
    layer_norms: list[float]
    nonfinite: str | None = None  # where the first NaN/Inf appeared ("loss", "layer 3", "embed", ...)


# trainer(layers, variant) yields, per step, the loss and the squared gradient norm of each parameter group
# ("layer i" for block i, other names for the rest), then takes the optimizer step.
Trainer = Callable[[int, str], Iterator[tuple[float, dict[str, float]]]]


def batches(seed: int, steps: int) -> list[list[list[int]]]:
    """Learnable synthetic sequences: ``(start + k·stride) mod vocab`` with a random start and stride per row."""
    import random

    rng = random.Random(seed)
    return [[[(s + k * d) % VOCAB for k in range(SEQ_LEN)]
             for s, d in ((rng.randrange(VOCAB), rng.randrange(1, 8)) for _ in range(BATCH))] for _ in range(steps)]


def first_nonfinite(loss: float, groups: dict[str, float]) -> str | None:
    if not math.isfinite(loss):
        return "loss"
    return next((name for name, sq in groups.items() if not math.isfinite(sq)), None)


def run_variant(trainer: Trainer, layers: int, variant: str, steps: int) -> list[Step]:
    log = []
    for i, (loss, groups) in zip(range(steps), trainer(layers, variant)):
        per_layer = [math.sqrt(groups[f"layer {k}"]) for k in range(layers)]
        bad = first_nonfinite(loss, groups)
        log.append(Step(variant, layers, i, loss, math.sqrt(sum(groups.values())), per_layer, bad))
        if bad:
            break
    return log


def summarize(logs: list[Step], depths: list[int]) -> list[dict]:
    """Per depth: final losses, the largest relative loss and per-layer grad-norm differences, first NaN/Inf."""
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)  # noqa: E731
    rows = []
    for depth in depths:
        ref, *others = ([s for s in logs if s.layers == depth and s.variant == v] for v in VARIANTS)
        runs = (ref, *others)
        row = dict(layers=depth, steps=len(ref), final_loss={v: log[-1].loss for v, log in zip(VARIANTS, runs)},
                   first_nonfinite={v: next((f"step {s.step}: {s.nonfinite}" for s in log if s.nonfinite), None)
                                    for v, log in zip(VARIANTS, runs)})
        for v, log in zip(VARIANTS[1:], others):
            pairs = list(zip(ref, log))
            row[f"max_rel_loss_diff_{v}"] = max((rel(o.loss, r.loss) for r, o in pairs), default=float("nan"))
            row[f"max_rel_layer_grad_diff_{v}"] = max(
                (rel(a, b) for r, o in pairs for a, b in zip(o.layer_norms, r.layer_norms)), default=float("nan"))
        rows.append(row)
    return rows


def write_csv(logs: list[Step], path: pathlib.Path) -> None:
    width = max(s.layers for s in logs)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "layers", "step", "loss", "grad_norm", "nonfinite",
                    *[f"layer{k}_grad_norm" for k in range(width)]])
        for s in logs:
            w.writerow([s.variant, s.layers, s.step, f"{s.loss:.6g}", f"{s.grad_norm:.6g}", s.nonfinite or "",
                        *[f"{v:.6g}" for v in s.layer_norms], *[""] * (width - s.layers)])


def plot(logs: list[Step], depths: list[int], title: str, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(13, 8.5))
    axes = grid.ravel()
    colors = plt.cm.viridis([i / max(len(depths) - 1, 1) * 0.85 for i in range(len(depths))])
    styles = {"reference": dict(ls="-", lw=2.2, alpha=0.55), "pallas": dict(ls="--", lw=1.4, marker="."),
              "perturbed": dict(ls=":", lw=1.0)}
    for depth, color in zip(depths, colors):
        runs = {v: [s for s in logs if s.layers == depth and s.variant == v] for v in VARIANTS}
        for variant, log in runs.items():
            label = f"{depth} layers, {variant}"
            axes[0].plot([s.step for s in log], [s.loss for s in log], color=color, label=label, **styles[variant])
            axes[1].plot([s.step for s in log], [s.grad_norm for s in log], color=color, **styles[variant])
            mean = [sum(s.layer_norms[k] for s in log) / len(log) for k in range(depth)]
            axes[2].plot(range(depth), mean, color=color, **styles[variant])
            for s in log:
                if s.nonfinite:
                    axes[0].axvline(s.step, color="red", ls=":")
            if variant != "reference":
                pairs = list(zip(runs["reference"], log))
                axes[3].plot([o.step for _, o in pairs],
                             [max(abs(o.grad_norm - r.grad_norm) / r.grad_norm, 1e-9) for r, o in pairs],
                             color=color, **styles[variant])
    axes[0].set(title="loss", xlabel="step")
    axes[1].set(title="global gradient norm", xlabel="step", yscale="log")
    axes[2].set(title="gradient norm per layer (mean over steps)", xlabel="layer index", yscale="log")
    axes[3].set(title="global grad norm: relative distance from the reference (0 drawn at 1e-9)", xlabel="step",
                yscale="log")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{title}\nsolid: reference, dashed: pallas, dotted: reference with norm weights 1 ulp off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


