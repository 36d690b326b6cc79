"""The step-level benchmark tools on CPU, from saved or faked timings: ``bench step``'s fused/unfused pairing,
``bench overhead``'s paired small-call ratio, ``bench contention``'s table, ``bench gaps``' idle time from a profiler
trace, and ``bench kernels``' per-kernel breakdown."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import __main__ as bench_cli
from bench import timing

from helpers import BENCH_ENV as ENV


def test_contention_table_has_a_column_per_sleeper_count():
    """One row per kernel, mode, shape and spare: TB/s alone and beside each count of one-slot kernels."""
    from bench import contention

    env = dict(gpu="H100", date="2026-11-26", jax="0.11.2", torch="2.11", triton="3.6", copy_tbps=3.02)
    rows = [dict(kernel="triton", mode="bwd", m=32768, n=16384, spare=0, programs=1056,
                 tbps={"0": 2.54, "1": 1.72, "4": 1.72})]
    text = contention.markdown(dict(env=env, rows=rows, spare=32, sleepers=[0, 1, 4]))
    assert "| kernel | mode | M×N | spare | programs | alone | beside 1 | beside 4 |" in text
    assert "|---|---|---|---|---|---|---|---|" in text
    assert "| triton | bwd | 32768×16384 | 0 | 1056 | 2.54 | 1.72 | 1.72 |" in text


def test_step_pairs_fused_with_unfused_by_round():
    """A drift between rounds (round 2 twice as slow for everyone) cancels in the paired ratio, not in medians of
    each provider; the step table shows the paired column for fused providers only."""
    from bench import step

    samples = {"pallas": [1.0, 2.0, 1.0], "pallas+fused": [0.99, 1.98, 0.99]}
    assert timing.paired_ratio(samples, "pallas+fused", "pallas") == pytest.approx(0.99)
    result = dict(env=ENV, shape=step.SHAPE, ms={"llama": {"hf": 80.0, "pallas": 66.0, "pallas+fused": 65.0}},
                  fused_vs_unfused={"llama": {"pallas+fused": 0.985}})
    table = step.markdown(result)
    assert "| llama | pallas+fused | 65.0 | 0.812 | 0.9850 |" in table
    assert "| llama | pallas | 66.0 | 0.825 |  |" in table
    assert "norm + add µs" not in table
    result["kernel_us"] = {"llama": {"pallas": dict(norm=1169.0, add=3556.0, all=63167.0)}}
    assert "| llama | pallas | 1169 | 3556 | 4725 | 63.2 |" in step.markdown(result)


def test_step_fused_vs_unfused_counts_the_rounds_fused_wins(monkeypatch):
    """The dedicated pairing times the two providers alone and reports the median ratio and the rounds in which
    the fused loop was faster (round 2 slower for both: drift; round 2's fused loop lost)."""
    from bench import step

    timed = {}

    def fake(fns, sync, calls, repeats):
        timed.update(names=tuple(fns), calls=calls, repeats=repeats)
        return {"pallas": [1.0, 2.0, 1.0], "pallas+fused": [0.99, 2.02, 0.98]}

    monkeypatch.setattr(timing, "interleaved_samples", fake)
    paired = step.fused_vs_unfused({"hf": None, "pallas": None, "pallas+fused": None}, "pallas+fused", rounds=3)
    assert timed == dict(names=("pallas", "pallas+fused"), calls=step.PAIR_STEPS, repeats=3)
    assert paired == dict(ratio=pytest.approx(0.99), faster=2, rounds=3)
    result = dict(env=ENV, shape=step.SHAPE, ms={"llama": {"hf": 80.0, "pallas": 66.0, "pallas+fused": 65.0}},
                  fused_vs_unfused={"llama": {"pallas+fused": paired}})
    assert "| llama | pallas+fused | 65.0 | 0.812 | 0.9900 (faster in 2/3 rounds) |" in step.markdown(result)


def test_overhead_small_call_ratio_is_paired_by_round():
    """The small call's × torch is the paired ratio when the run has one (drift cancels), the ratio of medians
    for older runs; the backward layer table is shown when present."""
    from bench import overhead

    small = {overhead.REFERENCE: {"fwd": 10e-6, "fwd+bwd": 100e-6},
             "backend=pallas_launch": {"fwd": 20e-6, "fwd+bwd": 250e-6}}
    result = dict(env=ENV, calls=10, small=small, large={}, layers_us={"launch": 9.0})
    assert "| backend=pallas_launch | 20.0 | 2.00 | 250.0 | 2.50 |" in overhead.markdown(result)
    small["backend=pallas_launch"].update({"fwd paired": 1.8, "fwd+bwd paired": 1.9})
    small[overhead.REFERENCE].update({"fwd paired": 1.0, "fwd+bwd paired": 1.0})
    result["bwd_layers_us"] = {"identity": 99.7}
    text = overhead.markdown(result)
    assert "| backend=pallas_launch | 20.0 | 1.80 | 250.0 | 1.90 |" in text and "| 99.7 | identity |" in text
    large = {overhead.REFERENCE: {"fwd": 300e-6, "fwd+bwd": 900e-6}, overhead.JAX: {"fwd": 200e-6, "fwd+bwd": 500e-6},
             "backend=pallas_launch": {"fwd": 202e-6, "fwd+bwd": 520e-6}}
    result["large"] = {"32768x4096": large}
    assert "| backend=pallas_launch | 202.0 | 2.66 | +1.0% | 520.0 | 2.58 | +4.0% |" in overhead.markdown(result)
    large["backend=pallas_launch"].update({"fwd vs JAX paired": 1.005, "fwd+bwd vs JAX paired": 1.02})
    assert "| backend=pallas_launch | 202.0 | 2.66 | +0.5% | 520.0 | 2.58 | +2.0% |" in overhead.markdown(result)


def test_gaps_finds_idle_time_and_the_op_that_launched_the_next_kernel(tmp_path):
    """Two overlapping kernels, then a 50 µs gap before a third launched inside ``my_norm`` (nested in
    ``aten::linear``), then a memset 2 µs later; the big gap falls early in the span and goes to the innermost op."""
    from bench import gaps

    events = [dict(cat="kernel", name="k1", ts=0.0, dur=10.0), dict(cat="kernel", name="k2", ts=5.0, dur=15.0),
              dict(cat="kernel", name="k3", ts=70.0, dur=300.0, args=dict(correlation=7)),
              dict(cat="gpu_memset", name="Memset", ts=372.0, dur=28.0),
              dict(cat="cpu_op", name="aten::linear", ts=40.0, dur=100.0),
              dict(cat="cpu_op", name="my_norm", ts=60.0, dur=20.0),
              dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=65.0, dur=3.0, args=dict(correlation=7))]
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(dict(traceEvents=events)).encode()))
    s = gaps.idle(gaps.load(path))
    assert (s["gpu_events"], s["span_ms"], s["busy_ms"], s["idle_ms"]) == (4, 0.4, 0.348, pytest.approx(0.052))
    assert s["idle_first_tenth_ms"] == pytest.approx(0.05)  # the 50 µs gap starts at 20 of 400 µs, the 2 µs at 370
    assert s["idle_by_size_us"] == {"< 5 µs": 2.0, "5–20 µs": 0.0, "20–100 µs": 50.0, "≥ 100 µs": 0.0}
    assert s["gaps"][0] == gaps.Gap(50.0, 0.02, "k3", "my_norm") and s["gaps"][1].launched_in == "?"
    text = gaps.report([path], ENV)
    assert "| 50.0 | 0.02 | `k3` | my_norm |" in text and "busy 0.35 ms, idle 0.05 ms" in text


def test_kernels_breakdown_lists_each_kernel_per_op_slowest_first():
    """``bench kernels`` keeps each kernel's µs per op (a call of ``reps`` ops divided by ``reps``), slowest first,
    and the table shows them beside the TB/s of their sum; ``--modes`` refuses an unknown mode. Broken variant: a
    breakdown that forgets the division by ``reps`` (a rotated call runs the op ``reps`` times)."""
    from bench import kernels

    per_call = {"_bwd_kernel": 80.0, "_dweight_reduce_kernel": 20.0, "fill": 4.0}
    got = kernels.breakdown(per_call, reps=4)
    assert list(got.items()) == [("_bwd_kernel", 20.0), ("_dweight_reduce_kernel", 5.0), ("fill", 1.0)]
    assert dict(per_call) != got  # the broken variant: per-call µs
    row = dict(provider="triton", mode="bwd", m=32768, n=16384, kernels=got, us=26.0, tbps=2.5)
    text = kernels.markdown(dict(env=dict(ENV, date="2026-11-27"), rows=[row]))
    assert ("| Triton (ours) | 32768×16384 | bwd | 2.500 | 26.00 | `_bwd_kernel` 20.00; "
            "`_dweight_reduce_kernel` 5.00; `fill` 1.00 |") in text
    with pytest.raises(SystemExit):
        bench_cli.parser().parse_args(["kernels", "--providers", "triton", "--shapes", "8x256", "--modes", "fwd,bw"])
    args = bench_cli.parser().parse_args(["kernels", "--providers", "triton,liger", "--shapes", "8x256,4x512",
                                          "--modes", "bwd"])
    assert (args.providers, args.shapes, args.modes) == (("triton", "liger"), [(8, 256), (4, 512)], ("bwd",))
