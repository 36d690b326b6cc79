"""The ``pallas-norm`` command line (also ``python -m pallas_norm_tools`` and ``python -m pallas_norm``).

    pallas-norm check  [--quick] [--device auto|cpu|cuda] [--json FILE] [--verbose]   # the parity matrix
    pallas-norm check  --model DIR [--backend B] [--batches N]   # is it safe on the HF model saved in DIR?
    pallas-norm bench  [python -m bench's options]                          # the benchmark suite (GPU)
    pallas-norm train  [--model llama|gemma2|qwen2] [--layers 2,4,8,16] [--steps N] [--dtype bf16]
                       [--framework torch|jax] [--out DIR]                  # patched vs unpatched training

``check`` needs the ``torch`` extra (``check --model`` the ``hf`` extra); ``train`` the ``hf`` and ``plot``
extras (``--framework jax`` only ``plot``); ``bench`` a CUDA GPU and a source checkout (``bench/`` is not part of
the wheel). A command whose extra is missing says which ``pip install`` brings it. Exit codes: 0 ok, 1 a check
failed (or training hit a NaN/Inf), 2 usage errors (no GPU for ``bench``, unknown names, a missing extra).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import pallas_norm
from pallas_norm import registry
from pallas_norm_tools.cli.common import DTYPES, MissingExtra, fail, require

MODELS = ("llama", "gemma2", "qwen2")
NEEDS = {
    "check": {"torch": "torch", "triton": "torch"},
    "check --model": {"torch": "hf", "triton": "hf", "transformers": "hf"},
    "train torch": {"torch": "hf", "transformers": "hf", "matplotlib": "plot"},
    "train jax": {"matplotlib": "plot"},
}


def _layers(text: str) -> list[int]:
    try:
        layers = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers must be comma-separated positive ints, got {text!r}") from None
    if not layers or min(layers) < 1:
        raise argparse.ArgumentTypeError(f"--layers must be comma-separated positive ints, got {text!r}")
    return layers


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pallas-norm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pallas-norm {pallas_norm.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{check,bench,train}")
    c = sub.add_parser("check", help="parity matrix: every implementation vs the float64 reference, and each other")
    c.add_argument("--quick", action="store_true", help="one shape per device instead of three")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU if torch sees one, else CPU through the interpreters")
    c.add_argument("--json", metavar="FILE", help="also write every case's errors, bounds and failures as JSON")
    c.add_argument("--verbose", action="store_true", help="every case and output, not one line per implementation")
    c.add_argument("--model", metavar="DIR", help="instead of the matrix: patch the Hugging Face model saved in DIR "
                   "(save_pretrained output, no downloads) and compare its logits, loss and gradients with the "
                   "unpatched model against float64")
    c.add_argument("--backend", choices=registry.TORCH_BACKENDS, default=registry.DEFAULT_TORCH_BACKEND,
                   help="torch_bridge backend of the patched model (--model)")
    c.add_argument("--batches", type=_positive, default=3, help="random batches compared (--model)")
    sub.add_parser("bench", help="the benchmark suite (GPU): table, CSV and PNG; see `pallas-norm bench -h`",
                   add_help=False)
    t = sub.add_parser("train", help="tiny models trained with and without the kernel; loss/grad-norm CSV and PNG")
    t.add_argument("--model", choices=MODELS, default="gemma2")
    t.add_argument("--layers", type=_layers, default=[2, 4, 8, 16], help="model depths, comma-separated")
    t.add_argument("--steps", type=_positive, default=None, help="optimizer steps (default 20 on CPU, 50 on GPU)")
    t.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    t.add_argument("--framework", choices=("torch", "jax"), default="torch",
                   help="torch: HF model, patch_hf_model vs unpatched; jax: Flax model, Pallas vs reference norm")
    t.add_argument("--backend", choices=registry.TORCH_BACKENDS, default=registry.DEFAULT_TORCH_BACKEND,
                   help="torch_bridge backend of the patched model (--framework torch)")
    t.add_argument("--hidden", type=_positive, default=None, help="hidden size (default 64 on CPU, 512 on GPU)")
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="train_out", help="directory for train_<model>_<framework>.{csv,png,json}")
    return p


def _bench(argv: list[str]) -> int:
    """``python -m bench`` (its exit code) in the source checkout this package lives in; bench/ is not part of
    the wheel and is never imported from here."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / "bench" / "__main__.py").is_file():
        return fail(f"pallas-norm bench: needs a source checkout (bench/ is not in the wheel); not found under {root}")
    return subprocess.run([sys.executable, "-m", "bench", *argv], cwd=root).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.command == "check" and args.model:
            require("check --model", NEEDS["check --model"])
            from pallas_norm_tools.cli import check, check_model

            device = check.resolve_device(args.device)
            if device is None:
                return fail("pallas-norm check: --device cuda, but torch sees no CUDA GPU")
            if not (pathlib.Path(args.model) / "config.json").is_file():
                return fail(f"pallas-norm check --model: {args.model} holds no config.json (a directory written by "
                            "save_pretrained is expected; nothing is downloaded)")
            return check_model.main(args.model, device=device, backend=args.backend, batches=args.batches,
                                    json_path=args.json)
        if args.command == "check":
            require("check", NEEDS["check"])
            from pallas_norm_tools.cli import check

            return check.main(device=args.device, quick=args.quick, json_path=args.json, verbose=args.verbose)
        require(f"train --framework {args.framework}", NEEDS[f"train {args.framework}"])
        from pallas_norm_tools.cli import train

        return train.main(args)
    except MissingExtra as err:
        return fail(str(err))
