"""The ``pallas-norm`` command line: check (table, JSON, exit code), train (CSV/PNG, NaN report), bench, errors."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import math
import pathlib
import subprocess
import sys

import pytest

import pallas_norm
from pallas_norm_tools import cli, parity
from pallas_norm_tools.cli import check, training

from helpers import DEFAULT_KERNEL, DEVICE, KERNEL, one_ulp_off

SMALL = [parity.Case("llama", 0.0, "bfloat16", (3, 5, 160)), parity.Case("gemma", 1.0, "float16", (7, 1000))]


def run_check(monkeypatch, tmp_path, capsys, impls=None, *flags):
    monkeypatch.setattr(parity, "cases", lambda device, quick=False: SMALL)
    if impls is not None:
        monkeypatch.setattr(parity, "implementations", lambda device: impls)
    out = tmp_path / "check.json"
    code = cli.main(["check", "--device", DEVICE, "--json", str(out), *flags])
    return code, capsys.readouterr().out, json.loads(out.read_text())


def test_check_prints_one_line_per_implementation_and_passes(monkeypatch, tmp_path, capsys):
    code, text, report = run_check(monkeypatch, tmp_path, capsys)
    assert code == 0 and "2 cases, 2 passed, 0 failed" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "2/2" in lines[KERNEL] and "2/2" in lines["triton"] and "≡ JAX kernel in 2/2" in lines["pallas_dlpack"]
    assert "not bounded (a peer)" in lines["hf"] and "llama +0 bf16 3x5x160" not in text


def test_check_verbose_prints_every_case(monkeypatch, tmp_path, capsys):
    code, text, report = run_check(monkeypatch, tmp_path, capsys, None, "--verbose")
    assert code == 0 and "2 cases, 2 passed, 0 failed" in text
    assert "llama +0 bf16 3x5x160" in text and "gemma +1 f16 7x1000" in text and "tolerance" in text
    assert report["summary"]["failed"] == 0 and {KERNEL, "pallas_dlpack", "triton", "hf"} <= set(
        report["summary"]["implementations"])
    first = report["results"][0]
    assert first["passed"] and set(first["errors"][KERNEL]) == {"y", "dx", "dweight"}
    assert all(first["errors"][KERNEL][o] <= first["bounds"][o] for o in ("y", "dx", "dweight"))


def test_check_fails_with_exit_1_and_names_the_failure(monkeypatch, tmp_path, capsys):
    impls = dict(parity.implementations(DEVICE), pallas_dlpack=one_ulp_off)
    code, text, report = run_check(monkeypatch, tmp_path, capsys, impls)
    assert code == 1 and "2 failed" in text and "FAILED" in text
    assert f"pallas_dlpack y: not bit-identical to {DEFAULT_KERNEL}" in text
    assert "≡ JAX kernel in 0/2" in text and "0/2" in next(x for x in text.splitlines() if x.startswith(" pallas_dlpack"))
    assert report["summary"]["failed"] == 2 and not report["results"][0]["passed"]


def test_train_writes_csv_json_and_png(tmp_path, capsys):
    code = cli.main(["train", "--model", "qwen2", "--layers", "1,2", "--steps", "2", "--dtype", "fp32",
                     "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "train_qwen2_torch.csv").open()))
    assert len(rows) == 3 * 2 * 2  # variants × depths × steps
    assert {r["variant"] for r in rows} == set(training.VARIANTS) and all(math.isfinite(float(r["loss"])) for r in rows)
    first = [float(r["loss"]) for r in rows if r["step"] == "0" and r["layers"] == "2"]
    assert abs(first[1] - first[0]) <= 1e-5 * first[0]  # same model, same batch: the same step-0 loss
    summary = json.loads((tmp_path / "train_qwen2_torch.json").read_text())["summary"]
    assert [r["layers"] for r in summary] == [1, 2] and summary[1]["max_rel_loss_diff_pallas"] < 1e-4
    assert (tmp_path / "train_qwen2_torch.png").read_bytes()[:4] == b"\x89PNG"


def nan_at_step_2_in_layer_1(layers, variant):
    """A fake trainer: finite steps, then an Inf gradient in layer 1 at step 2 for the pallas variant."""
    for step in range(5):
        bad = variant == "pallas" and step == 2
        yield 1.0, {"embed": 1.0, **{f"layer {k}": math.inf if bad and k == 1 else 1.0 for k in range(layers)}}


def test_train_stops_at_the_first_nan_and_reports_step_and_layer():
    logs = [s for v in training.VARIANTS for s in training.run_variant(nan_at_step_2_in_layer_1, 3, v, 5)]
    ours = [s for s in logs if s.variant == "pallas"]
    assert len(ours) == 3 and ours[-1].nonfinite == "layer 1"
    summary = training.summarize(logs, [3])[0]
    assert summary["first_nonfinite"] == {"reference": None, "pallas": "step 2: layer 1", "perturbed": None}


def test_bench_without_a_gpu_exits_2(capfd):
    if DEVICE == "cuda":
        pytest.skip("there is a GPU here")
    assert cli.main(["bench", "--quick"]) == 2  # `python -m bench`'s own exit code, run in the source checkout
    assert "no CUDA GPU" in capfd.readouterr().err


def test_usage_errors_list_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--model", "gpt2"])
    assert e.value.code == 2 and "choose from 'llama', 'gemma2', 'qwen2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "--layers", "2,x"])
    assert "--layers must be comma-separated positive ints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([])
    assert "check,bench,train" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pallas-norm {pallas_norm.__version__}"


def test_one_version_string():
    """pyproject.toml reads ``pallas_norm.__version__``; an installed distribution reports it."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'version = { attr = "pallas_norm.__version__" }' in text
    try:
        installed = importlib.metadata.version("pallas-norm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree (the GPU device): nothing installed
        return
    assert installed == pallas_norm.__version__
    assert check.resolve_device("cuda" if DEVICE == "cpu" else "cpu") in (None, "cpu")


def test_checking_for_extras_imports_nothing():
    """``pallas-norm check`` sets ``TRITON_INTERPRET`` for a CPU run after checking its extras; a check that
    imported triton fixed the interpreter off first, and the README's main job died in the Triton kernels."""
    probe = ("import importlib, sys; from pallas_norm_tools.cli import NEEDS; from pallas_norm_tools.cli.common "
             "import require; require('check', NEEDS['check']); {then}print('triton' in sys.modules)")

    def triton_imported(then: str = "") -> str:
        done = subprocess.run([sys.executable, "-c", probe.format(then=then)], capture_output=True, text=True,
                              check=True)
        return done.stdout.strip()

    assert triton_imported() == "False"
    assert triton_imported("importlib.import_module('triton'); ") == "True"  # a check that imports is seen
