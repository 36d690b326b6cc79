"""The benchmark's CLI and report on CPU: it refuses to measure without a GPU (exit 2), and it renders saved runs
(table with the targets, CSV with the environment, PNG) from rows whose numbers decide each target's mark."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from bench import __main__ as bench_cli
from bench import names, report, timing

from helpers import BENCH_ENV as ENV


def fake_run(pallas_fwd_tbps: float) -> dict:
    rows = []
    for m, n in ((32768, 1024), (32768, 4096), (1024, 262144)):
        for p, tbps in (("pallas", pallas_fwd_tbps), ("torch_native", 2.0), ("xla_formula", 1.0)):
            for mode in ("fwd", "bwd", "fwd+bwd"):
                t = tbps if mode == "fwd" else 2.8
                rows.append(dict(provider=p, mode=mode, m=m, n=n, us=1.0, tbps=t, pct_copy=100 * t / 3.0,
                                 peak_mb=64.0))
    rows.append(dict(provider="pallas_launch", mode="fwd", m=8, n=4096, us=30.0, small=True))
    rows.append(dict(provider="torch_native", mode="fwd", m=8, n=4096, us=20.0, small=True))
    rows.append(dict(provider="hf_eager", mode="fwd", m=32768, n=4096, error="OutOfMemoryError: ..."))
    return dict(env=ENV, rows=rows)


def test_small_call_ratio_is_the_paired_one_when_the_run_has_it(tmp_path):
    """The suite's small calls take turns and store the per-round ratio ``x_torch``; the table and the target use
    it (here 2.3×, where the ratio of the two medians would say 1.5× and pass)."""
    run = fake_run(2.95)
    next(r for r in run["rows"] if r["provider"] == "pallas_launch" and r.get("small"))["x_torch"] = 2.3
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    text = bench_cli.render([str(path)], tmp_path / "out")[0].read_text()
    assert "| Pallas binaries launched by torch: small call ≤ 2× torch F.rms_norm | 2.3× – 2.3× | ✗ |" in text
    assert "| 30 (2.3×) |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("argv", [[], ["sweep", "--quick"], ["overhead"], ["carveout"], ["ceiling"], ["contention"],
                                  ["ties"], ["kernels", "--providers", "triton", "--shapes", "8x256"]])
def test_measuring_without_gpu_says_so_and_exits_2(argv, capsys):
    assert bench_cli.main(argv) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_carveout_table_says_what_xla_s_launch_costs():
    """One row per kernel config: the three launches' TB/s and JAX against torch's default launch, signed (a JAX
    launch slower than torch's reads negative)."""
    from bench import carveout

    env = dict(gpu="H100", date="2026-11-24", jax="0.11.2", torch="2.11", triton="3.6", copy_tbps=3.02)
    rows = [dict(mode="fwd", m=8192, n=32768, torch_default=2.74, torch_max_shared=2.48, jax=2.48),
            dict(mode="bwd", m=32768, n=4096, torch_default=2.70, torch_max_shared=2.70, jax=2.73)]
    text = carveout.markdown(dict(env=env, rows=rows))
    assert "| fwd | 8192×32768 | 2.74 | 2.48 | 2.48 | -9% |" in text
    assert "| bwd | 32768×4096 | 2.70 | 2.70 | 2.73 | +1% |" in text


def test_ceiling_table_divides_by_the_same_size_copy():
    """Each shape: the same-size copy (and XLA's add of the backward's streams) and ours as TB/s (% of the 2 GiB
    copy) and ours over each; a table that divided by the 2 GiB copy in the `of copy` or `of add` columns (2.36 /
    3.02 = 78%) would fail. Rows of runs before the add was measured show none."""
    from bench import ceiling

    env = dict(gpu="H100", date="2026-11-26", jax="0.11.2", torch="2.11", triton="3.6", copy_tbps=3.02)
    rows = [dict(m=4096, n=1024, copy_fwd=2.40, copy_bwd=2.50, add=2.60, fwd=2.36, bwd=1.56),
            dict(m=4096, n=2048, copy_fwd=2.40, copy_bwd=2.50, fwd=2.36, bwd=1.52)]
    text = ceiling.markdown(dict(env=env, rows=rows))
    row = "| 4096×1024 | 17 | 2.40 (79%) | 2.36 (78%) | 98% | 2.50 (83%) | 2.60 (86%) | 1.56 (52%) | 62% | 60% |"
    assert row in text
    assert "| 4096×2048 | 34 | 2.40 (79%) | 2.36 (78%) | 98% | 2.50 (83%) | – | 1.52 (50%) | 61% | – |" in text


def test_render_writes_table_csv_and_plot(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(fake_run(2.95)))
    md, csv_path, png = bench_cli.render([str(path)], tmp_path / "out")
    assert md.name == "bench_h100_bfloat16_llama.md"  # named by the GPU of the run
    text = md.read_text()
    assert "| fwd ≥ 95% of copy, N ≤ 16384 | worst 2.95 TB/s (98%) at 32768×1024 | ✓ |" in text
    assert "| Pallas binaries launched by torch: small call ≤ 2× torch F.rms_norm | 1.5× – 1.5× | ✓ |" in text
    assert "| 32768×4096 | 2.95 (98%) | 1.00 (33%) | 2.00 (67%) | err |" in text
    assert "| M×N | Pallas in JAX | XLA (jit of jnp formula) | torch F.rms_norm | HF formula, eager |" in text
    rows = list(csv.DictReader(csv_path.open()))
    assert {"gpu", "driver", "jax", "torch", "triton", "date", "copy_tbps"} <= set(rows[0])
    assert rows[0]["gpu"] == ENV["gpu"] and rows[0]["provider"] == "pallas" and png.stat().st_size > 10_000
    later = tmp_path / "later.json"  # a later run (e.g. --small-only) re-measures one row, adds another
    run = fake_run(2.95)
    run["rows"] = [dict(provider="pallas_launch", mode="fwd", m=8, n=4096, us=25.0, small=True, x_torch=1.25),
                   dict(provider="pallas_launch", mode="fwd", m=1, n=4096, us=22.0, small=True, x_torch=1.1)]
    later.write_text(json.dumps(run))
    *_, merged = bench_cli.render([str(path), str(later)], tmp_path / "twice")  # several runs: the merged JSON too
    rows = json.loads(merged.read_text())["rows"]
    assert len(rows) == len(fake_run(2.95)["rows"]) + 1
    assert [r["us"] for r in rows if r["provider"] == "pallas_launch" and r["m"] == 8] == [25.0]
    text = (tmp_path / "twice" / md.name).read_text()
    assert "| Pallas binaries launched by torch: small call ≤ 2× torch F.rms_norm | 1.1× – 1.2× | ✓ |" in text
    assert [p.suffix for p in bench_cli.render([str(later)], tmp_path / "small")] == [".md", ".csv"]  # no plot


def test_torch_rows_timed_by_events_are_marked_and_stay_marked_when_merged(tmp_path):
    """Runs before the kernel timer timed torch providers by CUDA events around one call (their host launch
    included): those rows carry a †, also after a kernel-timed run is merged over some of them. The broken variant
    (merging without tagging the older rows) would show them unmarked under the newer run's env."""
    old = fake_run(2.95)
    old["env"] = {k: v for k, v in ENV.items() if k != "timer"}  # a run before the kernel timer
    assert "| 32768×4096 | 2.95 (98%) | 1.00 (33%) | 2.00 (67%)† | err |" in report.markdown(old)
    new = dict(env=ENV,
               rows=[dict(r, tbps=2.6, pct_copy=2.6 / 3 * 100) for r in old["rows"]
                     if r["provider"] == "torch_native" and (r["m"], r["n"]) == (32768, 4096)])
    assert "Every provider is timed by its kernels' own durations" in report.markdown(new)
    assert "†" not in report.markdown(new)
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    md, *_ = bench_cli.render([str(tmp_path / "old.json"), str(tmp_path / "new.json")], tmp_path / "out")
    text = md.read_text()
    assert "| 32768×4096 | 2.95 (98%) | 1.00 (33%) | 2.60 (87%) | err |" in text
    assert "| 32768×1024 | 2.95 (98%) | 1.00 (33%) | 2.00 (67%)† |" in text
    assert "but the 6 rows marked †: torch providers timed by CUDA events" in text
    untagged = dict(env=new["env"], rows=old["rows"])
    assert "†" not in report.markdown(untagged)


def test_torch_providers_rotate_their_inputs_and_never_write_them():
    """``torch_modes`` (the suite's torch providers): small inputs give ``reps`` distinct sets (past L2, as the JAX
    providers'), each call runs the op once per set (the timer divides by ``.reps``), every set gives the right
    values, and the caller's tensors stay as they were. The broken variant (one set, read L2-hot) fails."""
    from bench.providers import torch_modes

    seen = []

    def norm(a, b):
        seen.append(a.data_ptr())
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * b

    def rotates(fns, reps):
        seen.clear()
        return len(fns["fwd"]()) == reps and len(set(seen)) == reps and all(getattr(f, "reps", 1) == reps
                                                                            for f in fns.values())

    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(4, 8, generator=g), 1 + 0.1 * torch.randn(8, generator=g), torch.randn(4, 8, generator=g)
    before = [t.clone() for t in (x, w, dy)]
    fns = torch_modes(norm, x, w, dy)
    reps = timing.rotations(x.numel() * x.element_size())
    assert reps == 8 and rotates(fns, reps)
    assert all(torch.equal(y, norm(x, w)) for y in fns["fwd"]())
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(norm(xr, wr), (xr, wr), dy)
    for grads in fns["bwd"]() + fns["fwd+bwd"]():
        for got, ref in zip(grads, want):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip((x, w, dy), before))
    def one_set():
        return [norm(x, w)]
    assert not rotates(dict.fromkeys(("fwd", "bwd", "fwd+bwd"), one_set), reps)


def test_targets_mark_a_miss():
    lines = "\n".join(report.targets(fake_run(2.5)))
    assert "| fwd ≥ 95% of copy, N ≤ 16384 | worst 2.50 TB/s (83%) at 32768×1024 | ✗ |" in lines
    assert "| fwd ≥ 80% of copy, every shape | worst 2.50 TB/s (83%) at 32768×1024 | ✓ |" in lines
    assert "| fwd: at least the best peer at every shape | behind at 0/3 | ✓ |" in lines
    behind = "\n".join(report.targets(fake_run(1.5)))
    assert "| fwd: at least the best peer at every shape | behind at 3/3: 32768×1024 (torch F.rms_norm 2.00 vs " \
           "1.50, -25.0%)" in behind


def test_time_kernels_settles_l2_between_the_warm_up_and_the_timed_calls(monkeypatch):
    """``time_kernels``: one warm-up call, ``settle`` (a 1 GB copy clearing lines an ``evict_last`` load left in L2),
    then the profiled calls, whatever ran before. Broken variant: a timer that profiles right after its warm-up."""
    events = []

    def order(timer) -> list[str]:
        events.clear()
        timer(lambda: events.append("call"), lambda _: None)
        return events[:]

    def profiled(fn, calls, sync):
        events.append("profile")
        return {"kernel": 10.0}

    monkeypatch.setattr(timing, "settle", lambda: events.append("settle"))
    monkeypatch.setattr(timing, "kernel_us", profiled)
    assert order(timing.time_kernels) == ["call", "settle", "profile"]

    def unsettled(fn, sync):
        sync(fn())
        return sum(timing.kernel_us(fn, 20, sync).values())

    assert order(unsettled) != ["call", "settle", "profile"]
    monkeypatch.undo()
    assert timing.SETTLE_BYTES == 1 << 30
    if not torch.cuda.is_available():
        assert timing.settle() is None  # off a GPU: nothing to clear


def test_targets_quote_a_copy_of_the_worst_shape_s_bytes(tmp_path):
    """With ``bench ceiling``'s rows (``render`` attaches ``ceiling_<gpu>.json`` from its output folder), each
    %-of-copy target's worst shape shows what a copy of its bytes reaches there; the mark still judges the run's
    copy. Broken variant: the ceiling file absent (or for other shapes): no such note."""
    run = fake_run(2.5)
    ceiling = dict(env=ENV, rows=[dict(m=32768, n=1024, copy_fwd=2.4, copy_bwd=2.7, add=2.8, fwd=2.5, bwd=2.8)])
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "ceiling_h100.json").write_text(json.dumps(ceiling))
    bench_cli.render([str(tmp_path / "run.json")], tmp_path)
    text = (tmp_path / "bench_h100_bfloat16_llama.md").read_text()
    assert ("| fwd ≥ 95% of copy, N ≤ 16384 | worst 2.50 TB/s (83%) at 32768×1024; a copy of its bytes 2.40 (80%) "
            "| ✗ |") in text
    assert ("| bwd ≥ 90% of copy, N ≤ 16384 | worst 2.80 TB/s (93%) at 32768×1024; a copy of its bytes 2.70 (90%) "
            "| ✓ |") in text
    assert "| fwd ≥ 85% of copy, N ≥ 32768 | worst 2.50 TB/s (83%) at 1024×262144 | ✗ |" in text  # no row there
    (tmp_path / "ceiling_h100.json").unlink()
    bench_cli.render([str(tmp_path / "run.json")], tmp_path)
    assert "a copy of its bytes" not in (tmp_path / "bench_h100_bfloat16_llama.md").read_text()


def test_table_columns_follow_one_order_whatever_order_the_rows_come_in():
    """Ours first (JAX, then torch), then the peers, the same in every table: merged runs had put the three suite
    tables' columns in three orders, and a reader compared the wrong ones. Broken variant: the rows' first-seen
    order, which differs between the two runs."""
    run = fake_run(2.5)
    header = next(line for line in report.markdown(run).splitlines() if line.startswith("| M×N"))
    shuffled = dict(env=run["env"], rows=run["rows"][::-1])
    assert next(line for line in report.markdown(shuffled).splitlines() if line.startswith("| M×N")) == header
    assert header.index(names.label("pallas")) < header.index(names.label("xla_formula")) < \
        header.index(names.label("torch_native"))
    assert names.ordered(["liger", "mine", "triton", "auto", "liger"]) == ["auto", "triton", "liger", "mine"]
    first_seen = [list(dict.fromkeys(r["provider"] for r in rows)) for rows in (run["rows"], shuffled["rows"])]
    assert first_seen[0] != first_seen[1]


def test_names_and_file_names():
    assert names.label("pallas_dlpack") == "Pallas via DLPack" and names.label("liger") == "Liger"
    assert [timing.gpu_slug(g) for g in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "Tesla V100-SXM2-16GB")] == [
        "h100", "h200", "tesla"]


def test_targets_judge_the_jax_default_when_the_run_has_it():
    """Runs with ``auto`` (impl=None) are judged on it; older runs on ``pallas``."""
    run = fake_run(2.95)
    run["rows"] += [dict(r, provider="auto", tbps=2.5, pct_copy=2.5 / 3.0 * 100) for r in run["rows"]
                    if r["provider"] == "pallas" and r["mode"] == "fwd"]
    lines = "\n".join(report.targets(run))
    assert "## Targets (Pallas in JAX (faster lowering), `impl=None`, unless named)" in lines
    assert "| fwd ≥ 95% of copy, N ≤ 16384 | worst 2.50 TB/s (83%) at 32768×1024 | ✗ |" in lines
    assert "`impl='pallas'`" in "\n".join(report.targets(fake_run(2.95)))


def test_a_mode_that_cannot_run_fails_alone(monkeypatch):
    """A provider whose backward refuses a shape (Mosaic GPU past 262144 columns) keeps its forward row; the
    broken variant (one error for the whole provider) would give three error rows."""
    from bench import suite
    from bench.providers import Provider

    def refuse():
        raise ValueError("cannot hold a row")
    fns = {"fwd": lambda: None, "bwd": refuse, "fwd+bwd": refuse}
    provider = Provider("fake", "Fake", "torch", lambda *args: fns)
    ones = lambda m, n, dtype, offset: (torch.ones(m, n), torch.ones(n), torch.ones(m, n))  # noqa: E731
    monkeypatch.setattr(timing, "inputs", ones)
    monkeypatch.setattr(timing, "time_kernels", lambda fn, sync: (fn(), 1e-3)[1])
    monkeypatch.setattr(suite, "peak_mb", lambda p, fn: fn())
    rows = suite.measure_shape(provider, 4, 8, torch.float32, "llama", 0.0, copy=3.0)
    assert [("error" in r, r["mode"]) for r in rows] == [(False, "fwd"), (True, "bwd"), (True, "fwd+bwd")]
    assert "cannot hold a row" in rows[1]["error"] and "peak_mb" not in rows[0]


def test_ties_pair_the_shapes_the_suite_has_behind_and_judge_them_by_overlap():
    """``bench ties`` re-times, as a pair, exactly the shapes and modes the suite has ours behind, against that
    shape's best peer; its verdict is "level" wherever the rounds overlap. Broken variant: a verdict from the means
    alone calls the overlapping rounds below "behind"."""
    from bench import ties

    run = fake_run(1.5)
    run["rows"] += [dict(provider="hf_compile", mode="bwd", m=32768, n=4096, us=1.0, tbps=2.9, pct_copy=96.7)]
    got = [(p["mode"], p["m"], p["n"], p["peer"]) for p in ties.pairs(run)]
    assert got == [("fwd", 32768, 1024, "torch_native"), ("fwd", 32768, 4096, "torch_native"),
                   ("fwd", 1024, 262144, "torch_native"), ("bwd", 32768, 4096, "hf_compile")]
    assert not ties.pairs(fake_run(2.95))
    slow = fake_run(2.95)
    slow["rows"] += [dict(r, provider="pallas_launch", tbps=1.9) for r in slow["rows"]
                     if r["provider"] == "pallas" and r["mode"] == "bwd" and r["n"] == 1024]
    assert [(p["ours_name"], p["mode"], p["m"], p["n"]) for p in ties.pairs(slow, ("pallas", "pallas_launch"))] == [
        ("pallas_launch", "bwd", 32768, 1024)]
    ours, theirs = [2.95, 2.97, 2.96], [2.96, 2.99, 2.97]
    assert ties.verdict(ours, theirs) == "level"
    assert ties.verdict([2.90, 2.91], theirs) == "behind" and ties.verdict([3.0, 3.01], theirs) == "ahead"

    def by_means(a, b):
        return "behind" if sum(a) / len(a) < sum(b) / len(b) else "level"

    assert by_means(ours, theirs) != ties.verdict(ours, theirs)


def test_ties_merge_keeps_the_rows_of_providers_not_re_run():
    """A ``bench ties`` run of some of ours (``--ours triton``) replaces the earlier file's rows of those providers,
    all of them (a gap closed since leaves no stale row), keeps the others' rows and notes where they came from.
    Broken variant: a merge that keeps every earlier row, which leaves triton's stale one beside its re-run."""
    from bench import ties

    row = dict(mode="fwd", m=4096, n=1024, peer="hf_compile", suite_gap=-1.0, ours=[2.0], theirs=[2.1], gap=-4.0,
               verdict="behind")
    earlier = dict(env=dict(ENV, rounds=6, copy_tbps=3.01, date="2026-11-26"),
                   rows=[dict(row, ours_name="auto"), dict(row, ours_name="triton"),
                         dict(row, ours_name="triton", n=16384, mode="bwd")])
    result = dict(env=dict(ENV, rounds=6, copy_tbps=3.02, date="2026-11-27", ours=["triton"]),
                  rows=[dict(row, ours_name="triton", gap=-1.0, verdict="level")])
    merged = ties.merge(earlier, result)
    assert [(r["ours_name"], r["n"], r["verdict"]) for r in merged["rows"]] == [("auto", 1024, "behind"),
                                                                                  ("triton", 1024, "level")]
    assert merged["env"]["note"] == "The rows of `auto` come from an earlier run (2026-11-26, copy 3.01 TB/s)."
    assert merged["env"]["note"] in ties.markdown(merged)
    assert ties.merge(None, result) == result == ties.merge(dict(earlier, rows=earlier["rows"][1:]), result)

    def keep_all(earlier, result):
        return dict(result, rows=earlier["rows"] + result["rows"])

    assert [r["ours_name"] for r in keep_all(earlier, result)["rows"]].count("triton") != 1


def test_targets_quote_the_paired_rerun_of_each_shape_behind(tmp_path):
    """``render`` attaches ``ties_<gpu>_<dtype>_<casting>.json`` from its output folder; each shape the targets find
    behind then quotes its paired re-run (rounds, gap, verdict), and the line counts the verdicts; the mark still
    judges the suite's numbers. Broken variant: a re-run against another peer than the suite's best is not quoted."""
    from bench import ties

    run = fake_run(1.5)
    (tmp_path / "run.json").write_text(json.dumps(run))
    tie = dict(mode="fwd", m=32768, n=1024, ours_name="pallas", peer="torch_native", suite_gap=-25.0,
               ours=[1.99, 2.01, 2.0], theirs=[2.0, 2.02, 1.98], gap=-0.2, verdict="level")
    other = dict(tie, ours_name="pallas_launch", m=32768, n=4096, gap=-5.0, verdict="behind")
    result = dict(env=dict(ENV, rounds=3), rows=[tie, other])  # the targets judge "pallas" here, not pallas_launch
    (tmp_path / "ties_h100_bfloat16_llama.json").write_text(json.dumps(result))
    bench_cli.render([str(tmp_path / "run.json")], tmp_path)
    text = (tmp_path / "bench_h100_bfloat16_llama.md").read_text()
    assert ("| fwd: at least the best peer at every shape | behind at 3/3 (paired again: 0 behind, 1 level, 0 ahead): "
            "32768×1024 (torch F.rms_norm 2.00 vs 1.50, -25.0%; paired over 3 rounds -0.2%, level); 32768×4096 "
            "(torch F.rms_norm 2.00 vs 1.50, -25.0%)") in text
    assert "| Pallas in JAX | 32768×1024 | fwd | torch F.rms_norm | -25.0% | 2.000 (1.990–2.010) | 2.000 " \
           "(1.980–2.020) | -0.20% | level |" in ties.markdown(result)
    (tmp_path / "ties_h100_bfloat16_llama.json").write_text(json.dumps(dict(result, rows=[dict(tie, peer="liger")])))
    bench_cli.render([str(tmp_path / "run.json")], tmp_path)
    assert "paired" not in (tmp_path / "bench_h100_bfloat16_llama.md").read_text()
