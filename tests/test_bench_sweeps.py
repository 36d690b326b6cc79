"""The benchmark's sweep tools on CPU: the sweeps' timer over rotated input sets, the candidate tiles and configs of
``bench.fwd_tiles``, ``bench.sweep`` (``bench.sweep_configs``) and ``bench.bwd_candidates``, their tables, and the
ptxas report the Mosaic sweep reads."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import timing
from pallas_norm.mosaic_config import MosaicConfig

from test_bench import ENV


def test_sweeps_time_every_input_set_per_op(monkeypatch):
    """``timing.time_sets`` (the sweeps' timer): one call runs ``fn`` once per set of ``input_sets`` (the caller's
    tensors first, then distinct clones with equal values) and the kernels' time is divided by the sets. The broken
    variant (the caller's set alone, read L2-hot) fails."""
    seen, timed = [], {}

    def fake_time_kernels(run, sync, iters=20):
        seen.clear()
        run()
        timed["reps"] = getattr(run, "reps", 1)
        return 8e-6 / timed["reps"]

    monkeypatch.setattr(timing, "time_kernels", fake_time_kernels)
    x, w = torch.randn(4, 8), torch.randn(8)
    sets = timing.input_sets((x, w))
    reps = timing.rotations(x.numel() * x.element_size())
    assert len(sets) == reps == 8 and sets[0][0] is x and sets[0][1] is w
    assert all(torch.equal(s[0], x) and torch.equal(s[1], w) for s in sets)

    def op(a, b):
        seen.append(a.data_ptr())
        return a * b

    def honest(fn, sets):
        return timing.time_sets(fn, sets) == 8e-6 / reps and len(set(seen)) == reps == timed["reps"]

    assert honest(op, sets)
    assert not honest(op, sets[:1])


def test_fwd_tiles_picks_the_tile_fastest_in_both_rounds():
    """``bench.fwd_tiles`` ranks a tile by the slower of its two rounds (one lucky round does not win) and shows the
    heuristic's tile beside it; candidates hold 8-64 elements per thread and at most 16384 elements."""
    from bench import fwd_tiles

    assert fwd_tiles.candidates(16384) == [(1, 8), (1, 16), (1, 32)]
    assert all(8 <= r * 1024 // (32 * w) <= 64 and r * 1024 <= 16384 for r, w in fwd_tiles.candidates(1000))
    speeds = {(2, 4): (2.30, 2.31), (4, 4): (2.50, 2.10), (1, 1): (2.35, 2.34)}
    rows = [dict(kernel="pallas", m=4096, n=1024, rows=t[0], warps=t[1], round=k, tbps=v)
            for t, vs in speeds.items() for k, v in enumerate(vs)]
    text = fwd_tiles.markdown(dict(env=ENV, rows=rows))
    assert "| pallas | 4096×1024 | (2, 4) | 2.300 | (1, 1) | 2.340 | (2, 4): 2.30 / 2.31; (4, 4): 2.50 / 2.10;" in text


def test_save_table_writes_json_and_markdown_named_by_gpu(tmp_path):
    from bench import report

    text = report.save_table(dict(env=ENV, rows=[1]), tmp_path / "x", "tool", lambda r: f"rows {len(r['rows'])}\n")
    stem = tmp_path / "x" / f"tool_{timing.gpu_slug(ENV['gpu'])}"
    assert text == stem.with_suffix(".md").read_text() == "rows 1\n"
    assert json.loads(stem.with_suffix(".json").read_text())["rows"] == [1]


def test_ffi_launch_table_shows_both_launches_per_tile_and_the_torch_route_s_bits():
    """``bench.ffi_launch``: one column per (tile, launch), the default and Mosaic GPU beside them, both rounds, a
    failed variant as "err", and whether the torch route gave JAX's bits (a "NO" is shown, not hidden)."""
    from bench import ffi_launch

    assert ffi_launch.parse_tiles("2:8,1:16:2048") == ((2, 8), (1, 16, 2048))
    with pytest.raises(argparse.ArgumentTypeError, match="ROWS:WARPS"):
        ffi_launch.parse_tiles("1:16:2048:4")
    chunked = ffi_launch._variants(5120, ((1, 16, 2048), (1, 8, 8192)))  # a chunk of the padded row is resident
    assert list(chunked)[:4] == ["(1, 16, 2048) XLA", "(1, 16, 2048) jaxlib", "(1, 8) XLA", "(1, 8) jaxlib"]
    two_pass = chunked["(1, 16, 2048) jaxlib"]["config"]
    assert (two_pass.block_cols, two_pass.l1_hints, two_pass.programs) == (2048, True, 1 << 30)
    assert chunked["(1, 8) XLA"]["config"].programs is None
    names = list(ffi_launch._variants(16384))
    assert names[:2] == ["(1, 8) XLA", "(1, 8) jaxlib"] and names[-2:] == ["mosaic", "impl=None"]
    assert all(kw["config"].ffi_launch == name.endswith("jaxlib") for name, kw in ffi_launch._variants(16384).items()
               if "config" in kw)
    rows = [dict(m=8, n=16384, variant=v, round=r, tbps=None if v == "mosaic" else 2.5 + r / 100)
            for r in (0, 1) for v in names]
    text = ffi_launch.markdown(dict(env=ENV, rows=rows, torch_route_bits={"8x16384": False}))
    assert "| 8×16384 | 2.500 / 2.510 |" in text and "| err | 2.500 / 2.510 | NO |" in text
    # a tile whose chunk holds one shape's whole row is named as resident there: a column of its own, "–" elsewhere
    both = [dict(m=8, n=n, variant=v, round=0, tbps=3.0)
            for n, v in ((8192, "(1, 32) XLA"), (16384, "(1, 32, 8192) XLA"))]
    text = ffi_launch.markdown(dict(env=ENV, rows=both, torch_route_bits={}))
    assert "| (1, 32) XLA | (1, 32, 8192) XLA |" in text
    assert "| 8×8192 | 3.000 | – | NO |" in text and "| 8×16384 | – | 3.000 | NO |" in text


def test_ffi_launch_routes_time_each_forward_with_its_bytes(monkeypatch):
    """``bench.ffi_launch``'s routes: ``plain`` and ``fused`` run ``rms_norm`` / ``rms_norm_add`` from JAX (here on
    CPU, Gemma's casting) and ``torch`` the launch route's forward of the variant's config, each over every rotated
    set; the torch route runs Mosaic GPU's variant on the heuristic's ``MosaicConfig``. TB/s count 2 and 4 elements
    moved per element. The broken variant (the fused add counted with the plain forward's bytes) fails the check."""
    import jax.numpy as jnp

    from bench import ffi_launch, providers
    from torch_bridge import launch_route

    seen = []

    def fake_time_kernels(fn, sync, iters=20):
        seen.append(len(fn()))
        return 1e-3

    def fake_inputs(m, n, dtype, offset, seed=None):
        g = torch.Generator().manual_seed(seed or 0)
        return torch.randn(m, n, generator=g), 0.1 * torch.randn(n, generator=g), torch.randn(m, n, generator=g)

    monkeypatch.setattr(timing, "time_kernels", fake_time_kernels)
    monkeypatch.setattr(timing, "inputs", fake_inputs)
    monkeypatch.setattr(timing, "environment", lambda **kw: {**ENV, **kw})
    monkeypatch.setattr(providers, "jax_owned", lambda t: jnp.asarray(t.numpy()))
    configs = []
    monkeypatch.setattr(launch_route, "forward_launcher",
                        lambda *a: configs.append(a[8]) or (lambda x, w: (x * w, None)))
    monkeypatch.setattr(ffi_launch, "_torch_route_bits", lambda *a: True)
    variants = ffi_launch._variants  # the Pallas configs through the interpreter on CPU
    monkeypatch.setattr(ffi_launch, "_variants", lambda n, tiles: {
        k: dict(kw, impl="interpret") if kw["impl"] == "pallas" else kw for k, kw in variants(n, tiles).items()})

    def consistent(result) -> bool:
        tbps = {(r["variant"], r["route"], r["round"]): r["tbps"] for r in result["rows"]}
        mib = 8 * 256 * 4 / 1e-3 / 1e12  # one element of each row moved once, float32, per 1 ms
        return (tbps["mosaic", "torch", 0] == 2 * mib and tbps["(1, 1) jaxlib", "plain", 1] == 2 * mib
                and tbps["(1, 1) XLA", "fused", 0] == 4 * mib and tbps["impl=None", "torch", 1] == 2 * mib)

    run = lambda: ffi_launch.run(((8, 256),), ((1, 1), (1, 1, 128)), "gemma", "float32",  # noqa: E731
                                 ffi_launch.ROUTES)
    result = run()
    assert len(result["rows"]) == 6 * 3 * 2 and consistent(result)
    assert all(r["tbps"] for r in result["rows"] if r["variant"].startswith("(1, 1, 128)"))  # two passes ran
    assert sum(isinstance(c, MosaicConfig) for c in configs) == 2 and None in configs  # Mosaic's, impl=None's
    assert set(seen) == {timing.rotations(8 * 256 * 4 * 4)}
    text = ffi_launch.markdown(result)
    assert all(f"## {route}" in text for route in ffi_launch.ROUTES) and "casting=gemma" in text
    assert "err" not in text.split("## torch")[1]  # every variant by torch, Mosaic GPU's too
    monkeypatch.setitem(ffi_launch.BYTES, "fused", 2)
    assert not consistent(run())


def test_fwd_tiles_times_the_heuristic_s_tile_outside_the_candidates(monkeypatch):
    """Narrow rows get candidates of up to 16384 elements (256 rows of 64), and a heuristic tile outside the
    candidates is timed beside them, so its TB/s is in the table. The broken variant (candidates alone) shows "–"."""
    from bench import fwd_tiles

    assert max(r for r, _ in fwd_tiles.candidates(64)) == 256
    monkeypatch.setattr(fwd_tiles, "_heuristic", lambda kernel, m, n, casting: (3, 3))
    monkeypatch.setattr(fwd_tiles, "_callables", lambda kernel, m, n, casting: (lambda tile: lambda: None, 1))
    monkeypatch.setattr(timing, "time_kernels", lambda fn, sync: 1e-3)
    monkeypatch.setattr(timing, "environment", lambda **kw: ENV)
    result = fwd_tiles.run(shapes=((4096, 1024),), kernels=("pallas",))
    assert "| pallas | 4096×1024 | (3, 3) | 0.017 |" in fwd_tiles.markdown(result)
    broken = dict(result, rows=[r for r in result["rows"] if (r["rows"], r["warps"]) != (3, 3)])
    assert "| pallas | 4096×1024 | (3, 3) | – |" in fwd_tiles.markdown(broken)


def test_fwd_tiles_times_the_triton_reference_with_n_constant_and_its_fused_add(monkeypatch):
    """The Triton reference's tiles come with run-time N and N constant (its plain forward and its fused add's), its
    heuristic's tile names the choice (the rule's on CPU: no GPU model), and the table keeps the two apart: N
    constant wins here. The broken variant (rows without their ``n_const``) merges them into one tile."""
    from bench import fwd_tiles

    assert fwd_tiles.kernel_tiles("triton_add", 2304)[:2] == [(1, 2, False), (1, 2, True)]
    assert set(fwd_tiles.kernel_tiles("triton", 2304)) == {(*t, c) for t in fwd_tiles.candidates(2304)
                                                           for c in (False, True)}
    assert fwd_tiles._heuristic("triton", 32768, 2304, "gemma") == (1, 4, False)
    assert fwd_tiles._heuristic("triton_add", 4096, 1024) == (4, 4, False)
    monkeypatch.setattr(fwd_tiles, "_callables", lambda kernel, m, n, casting: (lambda tile: lambda: tile, 1))
    monkeypatch.setattr(timing, "time_kernels", lambda fn, sync: 1e-3 / (2 if fn()[-1] else 1))
    monkeypatch.setattr(timing, "environment", lambda **kw: dict(ENV, **kw))
    result = fwd_tiles.run(shapes=((4096, 2304),), kernels=("triton",), casting="gemma")
    text = fwd_tiles.markdown(result)
    assert "casting=gemma" in text and "| triton | 4096×2304 | (1, 4, False) | 0.038 | (1, 2, True) | 0.075 |" in text
    broken = dict(result, rows=[{k: v for k, v in r.items() if k != "n_const"} for r in result["rows"]])
    assert "| (1, 2, True) |" not in fwd_tiles.markdown(broken)


def test_triton_sweep_offers_bands_where_its_heuristic_does_not(monkeypatch):
    """Beyond 8192 columns the Triton reference's sweep adds band configs (one-warp bands at 4, 8 and 16 programs
    per SM, 4-warp bands on 2048 columns) to rows its heuristic does not band: the 16384-column forward."""
    from bench import sweep_configs
    from pallas_norm import backend

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    configs = sweep_configs.triton_configs(16384, False, quick=False)
    bands = [c for c in configs[1:] if c.lag]
    assert configs[0] is None and len(bands) == 7 and {c.num_warps for c in bands} == {1, 4}
    assert sweep_configs.triton_configs(16384, False, quick=False, bands_only=True) == [None] + bands
    assert not any(c and c.lag for c in sweep_configs.triton_configs(8192, False, quick=False))


def test_band_sweeps_cover_bands_and_the_chunked_path(monkeypatch):
    """At 262144 columns both stacks' sweeps (for an H100's 132 SMs) start from the heuristic (bands), vary them (the
    Pallas ones also in row groups: more programs than bands; one and four warps; carried blocks), and time the
    chunked path they replace."""
    from bench import sweep_configs
    from pallas_norm import backend, band_slots, pallas_config
    from torch_bridge import triton_config

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    for backward, chunked in ((True, 2), (False, 1)):
        pallas = sweep_configs.pallas_configs(1024, 262144, backward, quick=False)
        assert pallas[0] is None and all(c.lag for c in pallas[1:-chunked])
        assert not any(c.lag for c in pallas[-chunked:])
        assert len({(c.block_cols, c.block_rows, c.num_warps, c.lag, c.prefetch) for c in pallas[1:-chunked]}) > 8
        fitted = [pallas_config.fit(c, 1024, 262144, backward=backward) for c in pallas[1:-chunked]]
        assert {1, 2, 4, 8} <= {band_slots.groups(c, 262144) for c in fitted}
        assert {c.num_warps for c in fitted} >= {1, 4} and any(c.carry for c in fitted)
    triton = sweep_configs.triton_configs(262144, True, quick=False)
    assert triton[0] is None and triton[-1] == triton_config.chunked_backward_config()
    assert {c.lag for c in triton[1:-1]} == {1, 2, 3} and {c.groups for c in triton[1:-1]} >= {1, 2, 4}
    assert {c.num_warps for c in triton[1:-1]} == {1, 4}
    triton = sweep_configs.triton_configs(262144, False, quick=False)
    assert triton[-1] == triton_config.chunked_forward_config() and all(c.lag for c in triton[1:-1])


def test_mosaic_sweep_configs_start_from_the_heuristic_and_differ_in_plan():
    from bench import sweep_configs
    from pallas_norm import mosaic_config

    for m, n, backward in ((32768, 2304, False), (32768, 4096, True), (8192, 32768, False), (4096, 65536, True)):
        configs = sweep_configs.mosaic_configs(m, n, 2, backward, quick=False)
        assert configs[0] is None and len(configs) > 2
        plans = [mosaic_config.fit(c, m, n, row_bytes=2 * (1 + backward), weight_bytes=2, widest=2,
                                   backward=backward) for c in configs]
        assert len(set(plans)) == len(plans)
        assert (n > 16384) == all(p.cluster > 1 for p in plans)
    longest = [mosaic_config.fit(c, 1024, 262144, row_bytes=4, weight_bytes=2, widest=2, backward=True)
               for c in sweep_configs.mosaic_configs(1024, 262144, 2, True, quick=False)]
    assert len(longest) > 1 and {(p.cluster, p.dw_spill) for p in longest} == {(16, 8192)}  # only 16 holds the row


PTXAS_REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mosaic_norm_bwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_norm_bwd_mosaic_gpu_kernel
    72 bytes stack frame, 76 bytes spill stores, 76 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 72 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compiling entry function 'mosaic_norm_dweight_reduce_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_norm_dweight_reduce_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 87 registers, used 2 barriers
"""


@pytest.mark.parametrize("variant", ["kernel", "broken"])
def test_ptxas_report_is_read_off_the_c_level_stderr(monkeypatch, capfd, variant):
    """Mosaic's runtime prints ptxas's report on the process's file descriptors (standard output on the H100),
    past Python's streams: ``capture`` redirects descriptors 1 and 2, parses each entry function and passes other
    lines on. A capture that left the descriptors alone (the broken variant) reads nothing."""
    import os

    from bench import ptxas

    monkeypatch.delenv(ptxas.ENV, raising=False)
    if variant == "broken":
        monkeypatch.setattr(ptxas.os, "dup2", lambda *a: None)
    with ptxas.capture() as report:
        os.write(1, PTXAS_REPORT.encode())
        os.write(2, b"unrelated warning\n")
    assert os.environ[ptxas.ENV] == "1"
    if variant == "kernel":
        assert report == {"mosaic_norm_bwd_mosaic_gpu_kernel": dict(registers=255, spill_stores=76, stack=72),
                          "mosaic_norm_dweight_reduce_mosaic_gpu_kernel": dict(registers=87, spill_stores=0, stack=0)}
        assert capfd.readouterr().err.strip() == "unrelated warning"
    else:
        assert report == {}


def test_registers_decide_how_many_ctas_an_sm_holds():
    """Registers are allocated per warp in units of 256: 255 per thread leave room for 2 CTAs of one warpgroup
    (what the Mosaic backward gets from 8192 columns per CTA), 168 for 3, and the sweep's column says both."""
    from bench import ptxas
    from pallas_norm import backend, mosaic_config

    assert [ptxas.resident_ctas(r, 128) for r in (255, 168, 169, 32, 0)] == [2, 3, 2, 16, 0]
    assert ptxas.resident_ctas(255, 256) == 1
    plan = mosaic_config.fit(None, 2048, 131072, row_bytes=4, weight_bytes=2, widest=2, backward=True)
    text = ptxas.mosaic_resources(ptxas.parse(PTXAS_REPORT), "bwd", plan)
    asked = -(-plan.programs * plan.cluster // backend.num_sms())
    assert text == f"255 regs, 76 B spilled, 2 CTAs/SM by registers (asks {asked})"
    assert ptxas.mosaic_resources({}, "bwd", plan) == ""


def test_bwd_candidates_for_the_triton_reference_s_pieces(monkeypatch):
    """``bench.bwd_candidates --triton --pieces``: the heuristic first (at 2304 held as pieces; the fused add's for
    the fused add's backward), then the padded tile it replaced (one row of 4096 lanes, 8 warps, prefetching), then
    every pieces tile of both lists, one row per program; without ``--pieces`` no candidate is held as pieces."""
    from bench import bwd_candidates
    from pallas_norm import backend
    from torch_bridge import triton_config

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    configs = bwd_candidates._triton_candidates(2304, pieces=True)
    assert configs[0] == triton_config.backward_config(2304, 132) and configs[0].pieces
    assert configs[1] == triton_config.Config(1, 4096, 8, programs_per_sm=2, prefetch=True)
    assert [(c.num_warps, c.programs_per_sm, c.prefetch) for c in configs[2:]] == (
        bwd_candidates.PIECE_CANDIDATES + bwd_candidates.PIECES_MORE)
    assert all(c.pieces and c.block_m == 1 and c.block_n == 4096 for c in configs[2:])
    assert not any(c.pieces for c in bwd_candidates._triton_candidates(2304, pieces=False)[1:])
    fused = bwd_candidates._triton_candidates(2304, pieces=True, fused=True)
    assert fused[0] == triton_config.backward_config(2304, 132, fused=True) != configs[0] and fused[1:] == configs[1:]


def test_bwd_candidates_pieces_launched_both_ways(monkeypatch):
    """``bench.bwd_candidates --jax --pieces --ffi``: the heuristic, then every pieces tile launched by XLA and then by
    jaxlib's Triton call (``pallas_config.BWD_FFI_PIECES``' sweep); without ``--ffi`` only by XLA."""
    from bench import bwd_candidates
    from pallas_norm import backend

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    tiles = bwd_candidates.PIECE_CANDIDATES + bwd_candidates.PIECES_MORE
    both = bwd_candidates._piece_candidates(5120, 132, ffi=True)
    assert both[0] is None and len(both) == 1 + 2 * len(tiles)
    assert [(c.num_warps, c.programs // 132, c.prefetch, c.ffi_launch) for c in both[1:]] == [
        (*t, f) for t in tiles for f in (False, True)]
    assert all(c.pieces and c.block_cols == 8192 for c in both[1:])
    assert not any(c.ffi_launch for c in bwd_candidates._piece_candidates(5120, 132)[1:])
