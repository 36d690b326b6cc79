"""``pallas-norm train``: does the kernel change training? Tiny random-init models, trained twice per depth.

``--framework torch``: a Hugging Face model (``pallas_norm_tools.tiny_models``) as is ("reference") and with
``patch_hf_model`` ("pallas"); ``--framework jax``: the Flax decoder (``pallas_norm_tools.tiny_lm``) with
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
import json
import pathlib


def main(args: argparse.Namespace) -> int:
    from rich.table import Table

    from pallas_norm_tools.cli.common import DTYPES, console as make_console
    from pallas_norm_tools.cli.training import BATCH, SEQ_LEN, VARIANTS, plot, run_variant, summarize, write_csv

    dtype = DTYPES[args.dtype]
    if args.framework == "torch":
        from pallas_norm_tools.cli.train_torch import make_trainer
    else:
        from pallas_norm_tools.cli.train_jax import make_trainer
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
