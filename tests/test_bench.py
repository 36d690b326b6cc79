"""The benchmark's CLI and report on CPU: it refuses to measure without a GPU, and it renders saved runs (table
with the targets, CSV with the environment, PNG) from rows whose numbers decide each target's mark."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from bench import __main__ as bench_cli
from bench import report

ENV = dict(gpu="NVIDIA H100 80GB HBM3", driver="580", jax="0.11.2", torch="2.11", triton="3.6", date="2026-11-22",
           dtype="bfloat16", casting="llama", copy_tbps=3.0)


def fake_run(pallas_fwd_tbps: float) -> dict:
    rows = []
    for n in (1024, 4096):
        for p, tbps in (("pallas (JAX)", pallas_fwd_tbps), ("torch F.rms_norm", 2.0), ("XLA (jit of jnp formula)", 1.0)):
            for mode in ("fwd", "bwd", "fwd+bwd"):
                t = tbps if mode == "fwd" else 2.8
                rows.append(dict(provider=p, mode=mode, m=32768, n=n, us=1.0, tbps=t, pct_copy=100 * t / 3.0,
                                 peak_mb=64.0))
    rows.append(dict(provider="pallas bridge: launch", mode="fwd", m=8, n=4096, us=30.0, small=True))
    rows.append(dict(provider="torch F.rms_norm", mode="fwd", m=8, n=4096, us=20.0, small=True))
    rows.append(dict(provider="HF formula, eager", mode="fwd", m=32768, n=4096, error="OutOfMemoryError: ..."))
    return dict(env=ENV, rows=rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_gpu_says_so_and_exits_cleanly(capsys):
    assert bench_cli.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_render_writes_table_csv_and_plot(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(fake_run(2.95)))
    md, csv_path, png = bench_cli.render([str(path)], tmp_path / "out")
    text = md.read_text()
    assert "fwd ≥ 97% of copy (2.91 TB/s), every N at M=32768 | worst 2.95 TB/s (98%)" in text
    assert "| bridge (launch) small call ≤ 2× torch native latency | 1.5× – 1.5× | ✓ |" in text
    assert "| 32768×4096 | 2.95 (98%) | 2.00 (67%) | 1.00 (33%) |" in text and "err" in text
    rows = list(csv.DictReader(csv_path.open()))
    assert {"gpu", "driver", "jax", "torch", "triton", "date", "copy_tbps"} <= set(rows[0])
    assert rows[0]["gpu"] == ENV["gpu"] and png.stat().st_size > 10_000


def test_targets_mark_a_miss():
    lines = "\n".join(report.targets(fake_run(2.5)))
    assert "worst 2.50 TB/s (83%) at N=1024 | ✗" in lines
    assert "Pallas ≥ 2× XLA (jnp formula), every shape and mode | 1.00× – 2.50× | ✗" in lines  # bwd ties XLA
