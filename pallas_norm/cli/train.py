"""``pallas-norm train``: does the kernel change training? Tiny random-init models, trained twice per depth.

``--framework torch``: a Hugging Face model (``torch_bridge.tiny_models``) as is ("reference") and with
``patch_hf_model`` ("pallas"); ``--framework jax``: the Flax decoder (``pallas_norm.tiny_lm``) with
``pallas_norm.nnx.RMSNorm`` running the reference formula (``impl="xla"``) or the Pallas kernel. A third run,
"perturbed", is the reference with every norm weight moved by one ulp: the noise floor. Training is chaotic
(Adam divides by running gradient magnitudes), so any last-bit difference — a float32 sum in another order —
grows over the steps; the kernel changes nothing that matters when its distance from the reference stays
within the perturbed run's. Same seed, same synthetic batches, AdamW. Every step logs the loss, the global
gradient norm and each layer's gradient norm; a run stops at the first NaN/Inf (loss or gradient), which is
reported with its step and layer. Writes ``train_<model>_<framework>.csv`` (one row per variant × depth × step),
``.json`` (the summary) and ``.png`` (loss, global grad norm, per-layer grad norm vs layer index, and each run's
distance from the reference per step). Exit code 1 when any run hit a NaN/Inf.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
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


def main(args: argparse.Namespace) -> int:
    from rich.table import Table

    from pallas_norm.cli import DTYPES, console as make_console

    dtype = DTYPES[args.dtype]
    if args.framework == "torch":
        from pallas_norm.cli.train_torch import make_trainer
    else:
        from pallas_norm.cli.train_jax import make_trainer
    trainer, setting = make_trainer(args.model, dtype, hidden=args.hidden, lr=args.lr, seed=args.seed,
                                    backend=args.backend, steps=args.steps)
    steps = setting["steps"]
    console = make_console()
    console.print(f"pallas-norm train: {args.model} ({args.framework}, {setting['where']}), {dtype}, hidden "
                  f"{setting['hidden']}, depths {args.layers}, {steps} AdamW steps, batch {BATCH}×{SEQ_LEN}")
    logs = []
    for depth in args.layers:
        for variant in VARIANTS:
            with console.status(f"{depth} layers, {variant}"):
                logs += run_variant(trainer, depth, variant, steps)
    summary = summarize(logs, args.layers)
    t = Table(title=f"{args.model} / {args.framework} / {dtype}: distance from the reference run, max over steps "
                    "(pallas | perturbed = noise floor)")
    for col in ("layers", "final loss ref", "final loss pallas", "rel Δloss", "rel Δ layer grad norm",
                "first NaN/Inf"):
        t.add_column(col, justify="right")
    for r in summary:
        t.add_row(str(r["layers"]), f"{r['final_loss']['reference']:.4f}", f"{r['final_loss']['pallas']:.4f}",
                  *[" | ".join(f"{r[f'{key}_{v}']:.1e}" for v in VARIANTS[1:])
                    for key in ("max_rel_loss_diff", "max_rel_layer_grad_diff")],
                  ", ".join(f"{v} {r['first_nonfinite'][v]}" for v in VARIANTS if r["first_nonfinite"][v]) or "none")
    console.print(t)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"train_{args.model}_{args.framework}"
    write_csv(logs, stem.with_suffix(".csv"))
    stem.with_suffix(".json").write_text(json.dumps(dict(setting=dict(setting, model=args.model, dtype=dtype,
                                                                      framework=args.framework), summary=summary),
                                                    indent=1))
    plot(logs, args.layers, f"{args.model} ({args.framework}, {dtype}, {setting['where']})", stem.with_suffix(".png"))
    console.print(f"wrote {stem}.csv, {stem}.json, {stem}.png")
    return 1 if any(any(r["first_nonfinite"].values()) for r in summary) else 0
