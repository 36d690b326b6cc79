"""The Triton reference's forward in two passes over column chunks with L1 hints (``triton_config.Config.l1_hints``;
the Pallas kernels' ``pallas_config.FWD_FFI_TWO_PASS`` design, itself torch.compile's looped reduction), one row per
program, the row length a compile-time constant:

    pass 1: ss   = Σ over chunks of x32²  (x, and the fused add's residual, loaded ``evict_last``: kept in L1)
            rstd = rsqrt(ss / N + eps)
    pass 2: y    = r(n · w_eff) per chunk (x loaded again ``evict_first``: read from L1; the fused add's h stored here)

``N`` is a ``tl.constexpr``: the chunk loop is unrolled and full chunks carry no column mask. The same walk with
``N`` known only at run time (``triton_kernels._fwd_kernel``'s long-row loop) lost 3-10% to the resident tile
(probes_h100_2026-11-27_twentyninth.md §9). The row math is ``triton_rowmath``'s (``_row``, ``_store_y``), as in
``triton_kernels``' walks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from torch_bridge import custom_ops, triton_launch
from torch_bridge.triton_config import Config
from torch_bridge.triton_rowmath import CASTING_CODES, INTERPRET, _row, _rstd, _store_y, _weight_low


@triton.jit
def _chunk_mask(START: tl.constexpr, BLOCK_N: tl.constexpr, N: tl.constexpr):
    """Columns START … START + BLOCK_N of the row and their mask (a constant true one for a full chunk)."""
    cols = START + tl.arange(0, BLOCK_N)
    if START + BLOCK_N <= N:
        mask = tl.full([1, BLOCK_N], True, tl.int1)
    else:
        mask = cols[None, :] < N
    return cols, mask


@triton.jit
def _fwd_two_pass_kernel(X, R, W, Y, H, RSTD, n_f, eps, offset, N: tl.constexpr, BLOCK_N: tl.constexpr,
                         ROW_I64: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LOW: tl.constexpr,
                         CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Row ``program_id`` (int64 offsets with ROW_I64) in two passes over chunks of BLOCK_N columns."""
    rows = tl.program_id(0) + tl.arange(0, 1)
    if ROW_I64:
        rows = rows.to(tl.int64)
    base = rows[:, None] * N
    acc = tl.zeros([1, BLOCK_N], dtype=CT)
    for start in tl.static_range(0, N, BLOCK_N):
        cols, mask = _chunk_mask(start, BLOCK_N, N)
        x = _row(X, R, H, base + cols[None, :], mask, HAS_RESIDUAL, False, DT, CT, EMULATE_BF16, "evict_last")
        acc += x * x
    rstd = _rstd(tl.sum(acc, axis=1), n_f, eps, CT)
    for start in tl.static_range(0, N, BLOCK_N):
        cols, mask = _chunk_mask(start, BLOCK_N, N)
        x = _row(X, R, H, base + cols[None, :], mask, HAS_RESIDUAL, True, DT, CT, EMULATE_BF16, "evict_first")
        w_low = 0.0
        if LOW:
            w_low = _weight_low(W, cols, N, offset, CASTING, DT, CT, EMULATE_BF16, "")
        _store_y(Y, W, base, cols, mask, N, x, rstd, offset, w_low, HAS_WEIGHT, LOW, CASTING, DT, CT, EMULATE_BF16,
                 "")
    tl.store(RSTD + rows, rstd)


def check(cfg: Config, n: int) -> None:
    """A ValueError unless ``cfg`` walks rows of ``n`` one per program in chunks shorter than the padded row
    (``Config`` itself refuses ``l1_hints`` with bands or pieces)."""
    if cfg.block_m != 1 or not cfg.chunked(n):
        raise ValueError(f"l1_hints in column chunks is an option of one row per program (block_m=1, block_n < {n}), "
                         f"got {cfg}")


def forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, y: torch.Tensor,
            h: torch.Tensor | None, rstd: torch.Tensor, eps: float, offset: float, casting: str, cfg: Config,
            key: tuple, meta: Callable[[], dict]) -> None:
    """Launch the two-pass kernel over the M rows of ``x`` into ``y`` (and ``h``) and ``rstd``; ``meta()`` gives the
    launcher's common constexprs (LOW, HAS_WEIGHT, HAS_RESIDUAL, DT, CT, EMULATE_BF16), asked on the first launch of
    ``key`` only (``triton_launch.launch``)."""
    M, N = custom_ops.rows(x)
    check(cfg, N)
    fused = residual is not None
    triton_launch.launch(("two_pass", *key), _fwd_two_pass_kernel, (M,),
                         (x, residual if fused else x, weight if weight is not None else x, y, h if fused else y, rstd,
                          float(N), eps, offset),
                         lambda: dict(N=N, BLOCK_N=cfg.block_n, ROW_I64=M * N >= 2**31,
                                      CASTING=CASTING_CODES[casting], num_warps=cfg.num_warps, **meta()),
                         interpret=INTERPRET)
