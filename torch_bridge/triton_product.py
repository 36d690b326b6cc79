"""Where the Triton reference multiplies in the row dtype: y = r(n·w_eff) in the forward (``output_in_dtype``) and
g = r(dy·w_eff) in the backward (``grad_in_dtype``), each one correctly rounded multiply of two values of that dtype,
so the float32 product's bits (``rowmath.output_in_dtype``); with the H100 measurements behind the backward's
choices. ``triton_kernels`` reads them at launch (tests patch the tables here).
"""

from __future__ import annotations

import torch

from pallas_norm import rowmath
from torch_bridge import triton_config
from torch_bridge.triton_rowmath import INTERPRET


def output_in_dtype(weight: torch.Tensor | None, dtype: torch.dtype, offset: float, casting: str) -> bool:
    """``rowmath.output_in_dtype`` for a forward of rows of ``dtype``; not where the interpreter would have to
    multiply bfloat16 (it rounds to bfloat16 by truncation: ``EMULATE_BF16``)."""
    if weight is None or (INTERPRET and dtype == torch.bfloat16):
        return False
    return rowmath.output_in_dtype(casting, offset, weight.dtype == dtype, dtype.itemsize < 4)


# The backward's g = r(dy·w_eff) is one multiply in the row dtype (``output_in_dtype``; ``triton_kernels._bwd_kernel``'s
# LOW) for these dtypes. Thirty-third session (H100, launched by torch, kernels timed;
# probes_h100_2026-11-27_thirtythird.md §5-6): bf16 gained at every width measured (4096×1024 +1.6-1.9%, 32768×1024
# +0.9-1.0%, 16384 columns on the resident tile it lets fit, ``triton_config.BWD_RESIDENT_LOW``, +11-14%; 2048-8192
# -0.4% to +0.2%). The fused add's backward keeps the float32 product (not measured with the 16-bit one).
BWD_LOW_DTYPES = (torch.bfloat16,)
# These dtypes take it only on rows it lets be held whole (``triton_config.resident_low``). Thirty-fourth session
# (H100, ``bench kernels``-timed, off/on alternating twice in one process; probes_h100_2026-11-27_thirtyfourth.md §1),
# float16 TB/s off → on: 4096×1024 2.01-2.03 → 1.97, 32768×1024 2.80 → 2.66 (the same ``_bwd_kernel`` tile, 5% slower:
# unexplained, bf16 gains there), 4096×16384 2.46-2.48 → 2.63, 32768×16384 2.58 → 2.76 (bands → the resident tile).
BWD_LOW_RESIDENT_DTYPES = (torch.float16,)
# Rows of these lengths take it up to this many rows only. Thirty-fifth session (H100, bf16, kernels timed, three
# rounds alternating in one process, under BWD_N_CONST; probes_h100_2026-11-27_thirtyfifth.md §4), TB/s off → on:
# 32768×2048 2.90 → 2.81 (-3.1%: the suite's 2.91 → 2.81 since the thirty-third session), 16384×2048 +0.4%, 4096×2048
# +0.6%; 1024 columns +1.1-2.1% and 32768×4096 -0.3% keep it at every row count. Thirty-ninth session (the same
# method; probes_h100_2026-11-28_thirtyninth.md §1-3), 256 columns (the (16, 8) tile), on → off: 1048576×256 2.57
# → 2.93, 65536×256 2.13 → 2.36, but 4096×256 0.62 → 0.59 (with it since the thirty-third session, `bench fused`'s
# 1048576×256 had read 2.57 against 2.93 before). 64 and 128 columns keep it (-0.5% to +8% on BWD_HEADS' tiles).
BWD_LOW_MAX_ROWS = {2048: 16384, 256: 4096}


def grad_in_dtype(weight: torch.Tensor | None, dtype: torch.dtype, offset: float, casting: str, n: int,
                   m: int = 0) -> bool:
    """Whether the backward of ``m`` rows (0: few) of ``n`` columns of ``dtype`` multiplies g = r(dy·w_eff) in that
    dtype (``BWD_LOW_DTYPES``, ``BWD_LOW_RESIDENT_DTYPES``, ``BWD_LOW_MAX_ROWS``; ``output_in_dtype``: the same
    bits)."""
    taken = dtype in BWD_LOW_DTYPES or (dtype in BWD_LOW_RESIDENT_DTYPES and triton_config.resident_low(n))
    return taken and m <= BWD_LOW_MAX_ROWS.get(n, m) and output_in_dtype(weight, dtype, offset, casting)
