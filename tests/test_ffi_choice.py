"""Where the heuristics take jaxlib's Triton call (``Config.ffi_launch``, ``pallas_norm.triton_ffi``) instead of
XLA's launch, on CPU: only where ``triton_ffi.available()``, at the tables' widths and row counts, with the register
cap that lets a persistent grid fit, never for rows not held whole (the interpreter ignores it); and the compute
capability it compiles for."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import auto, backend, kernels, pallas_config, triton_ffi
from pallas_norm.pallas_config import Config

from helpers import bits, jax_inputs


def test_heuristic_and_auto_take_the_ffi_launch_only_where_available(monkeypatch):
    """Full rows of the table's padded lengths, the forward (plain and fused add, one tile, with the resident L1
    hints: ``test_two_pass.py``), and the backward of 16-bit rows of exactly 16384 (``BWD_FFI_HELD``: held on one
    program per SM reloading the weight, not on column bands; not ragged rows, float32 or a one-program grid);
    without ``available()`` nothing changes (the XLA-launched tiles, Mosaic GPU for 32768 columns)."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    assert not pallas_config.heuristic(4096, 16384, backward=False).ffi_launch
    assert auto.lowering(False, 32768) == "mosaic"
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    ffi = dict(ffi_launch=True, l1_hints=True)
    assert pallas_config.heuristic(4096, 16384, backward=False) == Config(1, 16384, 32, **ffi)
    assert pallas_config.heuristic(8192, 32768, backward=False) == Config(1, 32768, 16, **ffi)
    assert auto.lowering(False, 32768) == "pallas" and auto.lowering(False, 30000) == "pallas"
    assert auto.lowering(False, 24576) == "mosaic"  # 3/4 of 32768: not a full row
    assert not pallas_config.heuristic(8192, 24576, backward=False).ffi_launch
    assert pallas_config.heuristic(4096, 16384, backward=False, fused=True) == Config(1, 16384, 32, **ffi)
    for n in (8192, 8000):
        for fused in (False, True):
            assert pallas_config.heuristic(4096, n, backward=False, fused=fused) == Config(1, 8192, 16, **ffi)
    for n in (4096, 2304, 2048):  # shorter full rows and padded ones stay XLA-launched (5120: test_two_pass.py)
        assert not pallas_config.heuristic(4096, n, backward=False).ffi_launch
    held = Config(1, 16384, 16, programs=128, reload_weight=True, ffi_launch=True)  # BWD_FFI_HELD
    assert pallas_config.heuristic(4096, 16384, backward=True) == held
    assert pallas_config.heuristic(4096, 16384, backward=True, fused=True) == held
    for m, n, itemsize in ((4096, 16000, 2), (4096, 16384, 4), (4, 16384, 2)):  # ragged, float32, one program
        assert not pallas_config.heuristic(m, n, backward=True, itemsize=itemsize).ffi_launch


def test_few_rows_of_1024_columns_take_the_ffi_launch_on_their_xla_tiles(monkeypatch):
    """``FWD_FFI_FEW_ROWS``: full rows of 1024 columns (1000 fills more than 3/4 of 1024, 700 does not) at most 32
    rows per SM take jaxlib's launch on the tiles XLA launches otherwise, the plain forward and the fused add's
    alike (both or neither: one compiler, the same bits); more rows, and nothing without ``available()``, do not."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    limit = 32 * 132
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    xla = {(m, n, f): pallas_config.heuristic(m, n, backward=False, fused=f)
           for m in (1, 2048, limit, limit + 1, 32768) for n in (1024, 1000, 700) for f in (False, True)}
    assert not any(c.ffi_launch for c in xla.values())
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    for (m, n, fused), config in xla.items():
        jaxlib = pallas_config.heuristic(m, n, backward=False, fused=fused)
        assert jaxlib == dataclasses.replace(config, ffi_launch=m <= limit and n != 700), (m, n, fused)
    assert pallas_config.heuristic(limit, 1024, backward=False) == Config(2, 1024, 4, ffi_launch=True, l1_hints=True)
    assert pallas_config.heuristic(limit, 1024, backward=False, fused=True) == Config(4, 1024, 4, ffi_launch=True,
                                                                                     l1_hints=True)
    monkeypatch.setattr(backend, "num_sms", lambda: 66)  # the rows follow the GPU's size
    assert not pallas_config.heuristic(limit, 1024, backward=False).ffi_launch
    assert pallas_config.heuristic(limit // 2, 1024, backward=False).ffi_launch


def test_the_per_model_table_is_keyed_by_the_device_name_s_slug(monkeypatch):
    """``backend.gpu_model()`` is ``model_slug`` of the device kind JAX reports ("" off a GPU), and the H200 table's
    key is what an H200 reports ("NVIDIA H200", as nvidia-smi and JAX name it): a key spelt otherwise never
    applies."""
    monkeypatch.undo()  # the real gpu_model (conftest pins it to "" for tests not marked gpu)
    device = jax.devices()[0]
    assert backend.gpu_model() == (backend.model_slug(device.device_kind) if device.platform == "gpu" else "")
    assert backend.model_slug("NVIDIA H200") in pallas_config.FWD_FFI_ALL_ROWS
    assert backend.model_slug("NVIDIA H100 80GB HBM3") not in pallas_config.FWD_FFI_ALL_ROWS
    assert backend.model_slug("NVIDIA H200") in pallas_config.FWD_FFI_RESIDENT_BY_MODEL
    assert backend.model_slug("NVIDIA H200") in pallas_config.BWD_FFI_PIECES_PLAIN_BY_MODEL


def test_backward_takes_the_ffi_launch_at_the_table_s_full_rows(monkeypatch):
    """The resident backward of full rows of ``BWD_FFI_RESIDENT``'s padded lengths (1024, 2048, 4096, 8192: 3584 fills
    7/8 of 4096; 64, 128 and 512 from ``BWD_FFI_MIN_ROWS_PER_SM``'s rows) keeps BWD_RESIDENT's tile and is launched by
    jaxlib, and rows of 16384 leave their bands for it (``BWD_FFI_HELD``); so are the pieces of ``BWD_FFI_PIECES``
    (2304, 2560, 5120), on that table's grid (the plain backward's 5120 on ``BWD_FFI_PIECES_PLAIN``'s 4 warps,
    prefetching; ``test_pieces.py``); padded rows (3000 of 4096) and column bands stay XLA-launched; nothing without
    ``available()``, where ``auto`` keeps Mosaic GPU's backward at 2560 and 5120."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)
    widths = (2048, 3584, 4096, 8192, 1024, 2304, 2560, 5120, 3000, 16384, 96)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    xla = {n: pallas_config.heuristic(32768, n, backward=True) for n in widths}
    assert not any(c.ffi_launch for c in xla.values())
    assert [auto.lowering(True, n) for n in (2304, 2560, 5120)] == ["pallas", "mosaic", "mosaic"]
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    jaxlib = {n: pallas_config.heuristic(32768, n, backward=True) for n in widths}
    assert {n for n, c in jaxlib.items() if c.ffi_launch} == {1024, 2048, 3584, 4096, 8192, 2304, 2560, 5120,
                                                               16384}
    for n, per_sm in ((64, 300), (128, 384), (512, 384)):  # from BWD_FFI_MIN_ROWS_PER_SM's rows per SM, one tile
        few, many = (pallas_config.heuristic(m, n, backward=True) for m in (per_sm * 132 - 1, per_sm * 132))
        assert (few.ffi_launch, many.ffi_launch) == (False, True)
        assert (few.block_rows, few.num_warps, few.programs) == (many.block_rows, many.num_warps, many.programs)
    assert all(dataclasses.replace(jaxlib[n], ffi_launch=False) == xla[n] for n in widths
               if n not in (2560, 5120, 16384))
    assert xla[16384].lag and jaxlib[16384].reload_weight  # BWD_FFI_HELD: bands without jaxlib
    tiles = {n: (c.block_rows, c.num_warps, c.programs, c.prefetch, c.pieces) for n in (2304, 2560, 5120)
             for c in [jaxlib[n]]}
    assert tiles == {2304: (1, 4, 528, False, True), 2560: (1, 4, 528, False, True), 5120: (1, 4, 264, True, True)}
    assert [auto.lowering(True, n) for n in (2304, 2560, 5120)] == ["pallas", "pallas", "pallas"]
    assert auto.lowering(True, 6144) == "mosaic"  # a half of a power of two: not held as pieces


def test_auto_takes_the_held_backward_at_few_rows(monkeypatch):
    """``impl=None``'s backward of 16-bit rows of 16384 leaves Mosaic GPU for the held tile (``pallas_config.ffi_held``)
    up to ``auto.HELD_BWD_MAX_ROWS_PER_SM`` rows per SM: not beyond, not for float32 rows (column bands), not where
    the row width or jaxlib's launch is missing; the API hands ``lowering`` the rows' itemsize (the forward's too).
    Broken variant: the bound at 0 keeps Mosaic GPU at 4096 rows."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    bound = auto.HELD_BWD_MAX_ROWS_PER_SM * 132
    assert [auto.lowering(True, 16384, m=m, itemsize=2) for m in (4096, bound, bound + 1, 32768)] == [
        "pallas", "pallas", "mosaic", "mosaic"]
    assert auto.lowering(True, 16384, m=4096, itemsize=4) == "mosaic" and auto.lowering(True, 16384, m=4096) == "mosaic"
    assert auto.lowering(True, 32768, m=1024, itemsize=2) == "mosaic"  # not BWD_FFI_HELD's width
    with monkeypatch.context() as patch:
        patch.setattr(auto, "HELD_BWD_MAX_ROWS_PER_SM", 0)
        assert auto.lowering(True, 16384, m=4096, itemsize=2) == "mosaic"
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    assert auto.lowering(True, 16384, m=4096, itemsize=2) == "mosaic"
    seen = []  # impl=None as on a GPU, each lowering answered "xla" (which runs here)
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    record = lambda backward, *a, **kw: seen.append((backward, kw.get("itemsize"))) or "xla"  # noqa: E731
    monkeypatch.setattr(auto, "lowering", record)
    x, w, dy = jax_inputs((4, 256), jnp.bfloat16, seed=5)
    jax.vjp(lambda a, b: pn.rms_norm(a, b), x, w)[1](dy)
    assert {(True, 2), (False, 2)} <= set(seen)


def test_h200_backward_of_wide_16_bit_rows_takes_the_triton_lowering(monkeypatch):
    """``auto.TRITON_BWD_BY_MODEL``: on an H200 ``impl=None``'s backward of 16-bit rows of 16384-131072 columns takes
    the Triton lowering at every row count (16384 held whole where jaxlib launches it, else Mosaic GPU; column bands
    beyond, 20480 and 24576 too), and (``TRITON_FWD_BY_MODEL``) its forward at 65536 and 131072; float32 rows and
    unlisted widths keep Mosaic GPU. Broken variant: the H100's rules (``gpu_model() == ""``), which keep Mosaic GPU
    from 33 rows per SM of 16384 and at every row count beyond, and for those forwards."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    cases = [(m, n) for m in (8192, 32768) for n in (16384, 20480, 24576, 32768, 65536, 131072)]
    h100 = {c: auto.lowering(True, c[1], m=c[0], itemsize=2) for c in cases}
    assert set(h100.values()) == {"mosaic"}
    assert [auto.lowering(False, n, itemsize=2) for n in (32768, 65536, 131072)] == ["pallas", "mosaic", "mosaic"]
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    assert [auto.lowering(False, n, itemsize=2) for n in (32768, 65536, 131072)] == ["pallas"] * 3
    assert [auto.lowering(False, n, itemsize=k) for n, k in ((65536, 4), (65536, None), (24576, 2))] == [
        "mosaic"] * 3
    assert {c: auto.lowering(True, c[1], m=c[0], itemsize=2) for c in cases} == dict.fromkeys(cases, "pallas")
    assert [auto.lowering(True, n, m=32768, itemsize=4) for n in (16384, 32768)] == ["mosaic", "mosaic"]
    assert [auto.lowering(True, n, m=32768, itemsize=2) for n in (12288, 28672, 40960)] == ["mosaic"] * 3
    assert auto.lowering(True, 32768, m=32768, itemsize=2) == auto.lowering(True, 32768, m=1, itemsize=2)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    assert [auto.lowering(True, n, m=32768, itemsize=2) for n in (16384, 32768)] == ["mosaic", "pallas"]


def test_register_cap_lets_the_persistent_grid_fit(monkeypatch):
    """65536 registers per SM shared by the programs an SM gets, in steps of 8, at most 255; none for a grid of row
    blocks (the resident forward) and none where an SM's programs exceed its 2048 threads (one row per program at
    32768 rows: a cap of 0 would fail in ptxas, ``maxnreg`` must be positive)."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    caps = [pallas_config.register_cap(Config(1, 4096, w, programs=p)) for w, p in
            ((4, 528), (8, 264), (16, 132), (4, 396), (4, 264), (4, 1), (4, 529), (4, 2112), (4, 2113), (8, 32768))]
    assert caps == [128, 128, 128, 168, 255, 255, 96, 32, None, None]
    assert pallas_config.register_cap(pallas_config.heuristic(4096, 8192, backward=False)) is None


def test_the_jaxlib_launch_gets_the_config_s_register_cap(monkeypatch):
    """``kernels._run`` hands ``register_cap(config)`` to the jaxlib launch; with the cap dropped (the broken
    variant), the 2304-column fused add's pieces took 135 registers on 4 warps and its grid ran a second wave."""
    seen = []
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "launch", lambda call, args, out, *, maxnreg=None: seen.append(maxnreg) or ())
    for cfg in (Config(1, 4096, 4, programs=528, pieces=True, ffi_launch=True), Config(1, 8192, 16, ffi_launch=True)):
        kernels._run(None, (), (), cfg, interpret=False)
    assert seen == [128, None]
    monkeypatch.setattr(kernels, "register_cap", lambda config: None)
    kernels._run(None, (), (), Config(1, 4096, 4, programs=528, pieces=True, ffi_launch=True), interpret=False)
    assert seen[-1] != 128


def test_ffi_launch_needs_rows_held_whole_and_the_interpreter_ignores_it():
    """Refused for a backward walking column chunks and for column bands; under the interpreter the forward's and
    the backward's results are the XLA-launched config's bits."""
    for bad, backward in ((Config(1, 1024, 4, ffi_launch=True), True),
                          (Config(1, 1024, 1, lag=2, ffi_launch=True), False)):
        with pytest.raises(ValueError, match="ffi_launch"):
            pallas_config.fit(bad, 8, 4096, backward=backward)
    with pytest.raises(ValueError, match="ffi_launch"):
        Config(1, 1024, 4, ffi_launch=1)
    x, w, dy = jax_inputs((5, 384), jnp.bfloat16, seed=3)
    runs = [jax.vjp(lambda a, b, f=f: pn.rms_norm(a, b, impl="interpret", config=Config(8, 512, 4, ffi_launch=f),
                                                  bwd_config=Config(2, 512, 4, programs=2, ffi_launch=f)), x, w)
            for f in (False, True)]
    for a, b in zip((runs[0][0], *runs[0][1](dy)), (runs[1][0], *runs[1][1](dy))):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_launch_refuses_without_the_pieces(monkeypatch):
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    with pytest.raises(RuntimeError, match="ffi_launch needs"):
        triton_ffi.launch(None, (), ())


def test_compute_capability_reads_the_default_device(monkeypatch):
    """``backend.compute_capability`` (which ``mosaic_capable`` and ``triton_ffi.available`` ask): 10·major + minor on
    a GPU, 0 off one or where the device reports none."""
    class Device:
        def __init__(self, platform, cc):
            self.platform, self.compute_capability = platform, cc

    for platform, cc, want in (("gpu", "9.0", 90), ("gpu", "8.6", 86), ("gpu", "10.0", 100), ("gpu", "", 0),
                               ("gpu", "gfx90a", 0), ("cpu", "9.0", 0)):
        monkeypatch.setattr(backend.jax, "devices", lambda d=Device(platform, cc): [d])
        assert backend.compute_capability() == want, (platform, cc)
        assert backend.mosaic_capable() == (want >= 90)
