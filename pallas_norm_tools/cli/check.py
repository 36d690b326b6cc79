"""``pallas-norm check``: the parity matrix (``pallas_norm_tools.parity``) with a progress bar, a table and a verdict.

Each case (casting × offset × dtype × shape) runs every implementation of ``pallas_norm.registry`` that runs on
the device — Pallas in JAX (compiled, or interpreted on CPU), XLA in JAX, Pallas through the torch bridge (DLPack,
and the launch route on CUDA), the Triton reference kernel — and the Hugging Face module where the mode is one,
and prints, per output (y, dx, dweight), each implementation's max abs error against the float64 reference next
to the tolerance of ``pallas_norm.accuracy`` (2× the naive float32 formula's error + a float32 summation atol).
HF is a peer, held to rounding points only: its errors are shown, not bounded. By default one line per
implementation sums the matrix up (cases passed, worst error as a fraction of its bound, bit-identity where the
registry promises it); ``--verbose`` prints every case and output.
"""

from __future__ import annotations

import json
import os
import sys


def resolve_device(device: str) -> str | None:
    """``auto`` → ``cuda`` if torch sees a GPU, else ``cpu``; None when ``cuda`` was asked for and there is none."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        return None
    return device


def result_record(result) -> dict:
    """One case's result as plain JSON data."""
    return dict(case=result.case.name, passed=result.passed, errors=result.errors, bounds=result.bounds,
                failures=result.failures)


def label(case) -> str:
    """``llama +0 bf16 3x5x160``."""
    dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[case.dtype]
    return f"{case.casting} +{case.offset:g} {dtype} {'x'.join(map(str, case.shape))}"


def table(results, impls: list[str]):
    """A rich Table: a row per case and output; each implementation's error, the tolerance, the verdict."""
    from rich import box
    from rich.table import Table

    from pallas_norm.accuracy import OUTPUTS

    t = Table(title="max |error| vs the float64 reference", box=box.SIMPLE_HEAD, pad_edge=False,
              caption="tolerance: 2x the naive float32 formula's error + a float32 summation atol; hf (a peer) is "
                      "held to the naive formula's rounding points only")
    t.add_column("case (casting offset dtype shape)")
    t.add_column("out")
    for name in impls:
        t.add_column(name, justify="right")
    t.add_column("tolerance", justify="right")
    t.add_column("", justify="center")
    for result in results:
        for i, out in enumerate(OUTPUTS):
            bad = [f for f in result.failures if out in f.split(":")[0].split()]
            cells = [f"{result.errors[n][out]:.1e}" if n in result.errors else "–" for n in impls]
            verdict = "[red]FAIL[/red]" if bad else "[green]ok[/green]"
            t.add_row(label(result.case) if i == 0 else "", out, *cells, f"{result.bounds[out]:.1e}", verdict,
                      end_section=i == len(OUTPUTS) - 1)
    return t


def failed_for(result, name: str) -> bool:
    """Whether one of the case's failed checks is about implementation ``name``."""
    return any(f.split()[0] == name for f in result.failures)


def per_implementation(results, impls: list[str]):
    """A rich Table: one line per implementation over the whole matrix."""
    from rich import box
    from rich.table import Table

    from pallas_norm import registry
    from pallas_norm.accuracy import OUTPUTS

    t = Table(title="parity matrix, per implementation", box=box.SIMPLE_HEAD, pad_edge=False,
              caption="worst error: max over cases and outputs of |error vs float64| / the rule's bound (≤ 1 passes)")
    for col in ("implementation", "what", "cases passed", "worst error / bound", "bits"):
        t.add_column(col, justify="left" if col in ("implementation", "what") else "right")
    for name in impls:
        ran = [r for r in results if name in r.errors]
        passed = sum(not failed_for(r, name) for r in ran)
        impl = registry.BY_NAME.get(name)
        if impl is None:  # a peer (HF): rounding points only
            worst, what = "not bounded (a peer)", "Hugging Face module"
        else:
            worst = f"{max((r.errors[name][o] / r.bounds[o] for r in ran for o in OUTPUTS if r.bounds[o] > 0),
                           default=0.0):.2f}"
            what = impl.label
        bits = "–"
        if impl is not None and impl.same_bits_as:
            same = sum(not any(f.startswith(f"{name} ") and "not bit-identical" in f for f in r.failures) for r in ran)
            bits = f"≡ JAX kernel in {same}/{len(ran)}"
        style = "green" if passed == len(ran) else "red"
        t.add_row(name, what, f"[{style}]{passed}/{len(ran)}[/{style}]", worst, bits)
    return t


def main(*, device: str = "auto", quick: bool = False, json_path: str | None = None, verbose: bool = False) -> int:
    resolved = resolve_device(device)
    if resolved is None:
        print("pallas-norm check: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    if resolved == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run its kernels interpreted
    import jax
    from rich.progress import track

    from pallas_norm_tools import parity
    from pallas_norm_tools.cli.common import console as make_console

    console = make_console()
    matrix = parity.cases(resolved, quick=quick)
    impls = parity.implementations(resolved)
    console.print(f"pallas-norm check: {len(matrix)} cases on {resolved} (JAX on {jax.default_backend()}; "
                  f"{'compiled kernels' if resolved == 'cuda' else 'kernels run by the Pallas/Triton interpreters'})")
    results = [parity.run_case(case, resolved, impls)
               for case in track(matrix, description="parity matrix", console=console, transient=True)]
    names = list(impls) + (["hf"] if any("hf" in r.errors for r in results) else [])
    console.print(table(results, names) if verbose else per_implementation(results, names))
    failed = [r for r in results if not r.passed]
    for r in failed:
        console.print(f"[red]FAIL[/red] {r.case.name}:\n  " + "\n  ".join(r.failures), highlight=False)
    verdict = "[red]FAILED[/red]" if failed else "[green]all passed[/green]"
    console.print(f"{len(results)} cases, {len(results) - len(failed)} passed, {len(failed)} failed on {resolved} "
                  f"({len(names)} implementations: {', '.join(names)}) — {verdict}")
    if json_path:
        totals = dict(device=resolved, cases=len(results), failed=len(failed), implementations=names)
        with open(json_path, "w") as f:
            json.dump(dict(summary=totals, results=[result_record(r) for r in results]), f, indent=1)
    return 1 if failed else 0
