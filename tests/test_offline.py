"""``bench.offline``: the Pallas kernels compiled for an H100 on a machine without one. Barriers are counted inside
loops only; the per-head backward at 256 columns shows the three per-row-block barriers the thirty-ninth session
found, and none where dweight's terms are kept per tile row (``kernels.DW_PER_ROW``): the check fails on the kernel
as it is, so it can fail; the held 16384-column backward assembles pinned and without spills under its register
cap; how many programs an SM holds at once against how many a persistent grid asks."""

from __future__ import annotations

import jax
import pytest

from bench import offline
from pallas_norm import kernels

PTX = """
\tbar.sync \t0;
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
\tbar.sync \t0;
\tbar.sync \t0;
\t@%p6 bra \t$L__BB0_1;
\tbar.sync \t0;
$L__BB0_2:                              // =>This Inner Loop Header: Depth=1
\tbar.sync \t0;
\tbra.uni \t$L__BB0_2;
"""


def test_loop_barriers_counts_only_those_inside_loops():
    assert PTX.count("bar.sync") == 5
    assert offline.loop_barriers(PTX) == 3
    assert offline.loop_barriers(PTX.replace("Loop Header", "Header")) == 0


@pytest.mark.parametrize("per_row", [False, True], ids=["per-block", "per-row"])
def test_per_head_backward_barriers(per_row, monkeypatch):
    monkeypatch.setattr(kernels, "DW_PER_ROW", frozenset({256} if per_row else ()))
    jax.clear_caches()  # the kernel reads DW_PER_ROW when traced: not a trace cached by the other case
    main = offline.reports(65536, 256)[0]
    assert (main.name, main.num_warps, main.spill_stores) == ("pallas_norm_bwd", 8, 0)
    assert main.loop_barriers == (0 if per_row else 3)


def test_held_16384_backward_assembles_pinned_under_its_cap_without_spills(monkeypatch):
    """jaxlib launches the held backward: its PTX is assembled pinned (``triton_ffi.pin_rounding``, no contractible
    op) under ``register_cap``; XLA launches the dweight reduction: unpinned, uncapped. Broken variant: the pin
    skipped, which the count catches."""
    main, reduce = offline.reports(4096, 16384)
    assert main.maxnreg == 128 and main.registers <= 128 and main.spill_stores == 0 and main.contractible == 0
    assert reduce.maxnreg is None and reduce.contractible > 0
    assert (main.per_sm, main.asks, reduce.asks) == (1, 1, None)  # one program per SM, its grid's one
    (fwd,) = offline.reports(32768, 8192, backward=False)  # jaxlib's too, on a grid of row blocks
    assert fwd.maxnreg is None and fwd.contractible == 0 and fwd.asks is None
    monkeypatch.setattr(offline.triton_ffi, "pin_rounding", lambda ptx: ptx)
    assert offline.reports(4096, 16384)[0].contractible > 0


def test_programs_per_sm_counts_registers_per_warp_in_steps_of_8():
    """An SM's 65536 registers go to warps in steps of 256 (8 per thread): 97 registers count as 104, so 19 one-warp
    programs fit where 97 × 32 per warp would give 21 (the broken variant, which the count catches); threads, programs
    and shared memory bound it too."""
    assert offline.programs_per_sm(97, 1, 0) == 19 != 65536 // (97 * 32)
    assert [offline.programs_per_sm(r, 8, 8192) for r in (128, 129, 149)] == [2, 1, 1]
    assert offline.programs_per_sm(32, 16, 64) == 4 and offline.programs_per_sm(16, 1, 0) == 32  # threads, programs
    assert offline.programs_per_sm(32, 4, 100 * 1024) == 2  # shared memory


def test_the_fused_add_s_per_row_backward_at_512_columns_fits_one_program_per_sm_on_xla_s_launch(monkeypatch):
    """The forty-first session's §7: at 8192 rows (XLA's launch, no register cap) the fused add's per-row backward
    takes 149 registers, so one of the two 8-warp programs its persistent grid puts on each SM fits at a time; where
    jaxlib launches it (524288 rows) the cap holds it to 128 and both fit. With dh_out loaded where dx uses it
    (``kernels.DH_LOAD``, §12; the default since the forty-second session) both fit under XLA's launch too."""
    monkeypatch.setattr(kernels, "DH_LOAD", {})
    jax.clear_caches()  # the kernel reads DH_LOAD when traced
    few = offline.reports(8192, 512, fused=True)[0]
    assert (few.maxnreg, few.per_sm, few.asks) == (None, 1, 2) and few.registers > 128
    many = offline.reports(524288, 512, fused=True)[0]
    assert (many.maxnreg, many.per_sm, many.asks) == (128, 2, 2)
    monkeypatch.setattr(kernels, "DH_LOAD", {512: "use"})
    jax.clear_caches()  # the kernel reads DH_LOAD when traced
    late = offline.reports(8192, 512, fused=True)[0]
    assert (late.per_sm, late.asks, late.spill_stores) == (2, 2, 0) and late.registers <= 128


def test_cli_names_a_bad_shape_and_a_bad_dtype(capsys):
    """argparse's exit 2 with the argument named, not a traceback (the hand-read argv's was an IndexError or
    ArgumentTypeError traceback)."""
    for argv, named in ((["8x64x"], "shapes"), (["8x64", "--dtype", "int8"], "--dtype")):
        with pytest.raises(SystemExit) as exit_:
            offline.main(argv)
        assert exit_.value.code == 2 and named in capsys.readouterr().err
    assert offline.parser().parse_args(["8x64,4x128", "--fused"]).shapes == [(8, 64), (4, 128)]


def test_model_names_the_per_model_tables_the_config_comes_from():
    """``model`` ("h200": the same chip and SM count) applies that GPU's entries: the plain backward of 32768×2560
    prefetches on an H200 (``ffi_tables.BWD_FFI_PIECES_PLAIN_BY_MODEL``), not under no model (the broken variant,
    which the check tells apart); ``backend.gpu_model`` is restored after."""
    from pallas_norm import backend

    before = backend.gpu_model
    with offline._on_h100("h200"):
        h200 = offline.gpu_config(32768, 2560, backward=True)
    with offline._on_h100():
        none = offline.gpu_config(32768, 2560, backward=True)
    assert h200.pieces and h200.prefetch and not none.prefetch and backend.gpu_model is before
    assert offline.parser().parse_args(["8x64", "--model", "h200"]).model == "h200"
