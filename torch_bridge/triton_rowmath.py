"""The Triton kernels' row math, written once for the reference kernels (``triton_kernels``, ``triton_two_pass``,
``triton_pieces``) and the bands (``triton_bands``), implementing ``docs/semantics.md``:

    rstd = rsqrt(mean(x32 * x32) + eps)
    n    = normalised value, rounded per casting (llama: r(x32*rstd); gemma: x32*rstd; none: r(x32*r(rstd)))
    g    = dy * w_eff (rounded to dt for llama/none)
    dx   = r(rstd * (g - x32 * rstd^2 * mean(g * x32)))

Compute is float32 (float64 when x is float64, where every r(.) is the identity). On CPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``); its float32->bfloat16 cast truncates, so there bfloat16 rounding is
done with integer bit arithmetic (RNE).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

CASTING_CODES: dict[str, int] = {"llama": 0, "gemma": 1, "none": 2}


def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns loop bounds into ints with ``int(ndarray)``, which NumPy >= 2.5 refuses
    for 1-element arrays (so ``range(0, N)`` over a kernel argument fails); convert through ``reshape(-1)[0]``."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pallas_norm_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pallas_norm_fixed = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter_loop_bounds()

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
              torch.float64: tl.float64}


# ----------------------------------------------------------------------------------------------
# Row math (shared by forward and backward)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile(rows, row_mask, cols, col_mask, N):
    """The element offsets (int64) and the mask of the tile ``rows`` × ``cols`` of a row-major (M, N) array."""
    return rows.to(tl.int64)[:, None] * N + cols[None, :], row_mask[:, None] & col_mask[None, :]


@triton.jit
def _to_dt(v, DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """r(v) stored as dtype DT, round-to-nearest-even."""
    if EMULATE_BF16 and DT == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(DT)


@triton.jit
def _r(v, DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """r(v) widened back to the compute dtype CT; the identity when DT is float32/float64."""
    if DT == tl.float32 or DT == tl.float64:
        return v
    else:
        return _to_dt(v, DT, EMULATE_BF16).to(CT)


@triton.jit
def _rstd(sumsq, n_f, eps, CT: tl.constexpr):
    """rsqrt(sumsq / N + eps) (n_f = float(N)): the Pallas kernels' formula (``rowmath.rstd_from_sumsq`` with
    ``lax.rsqrt``: the hardware's reciprocal square root, ``/`` as Triton divides), 1 / sqrt in float64.

    It was ``1 / sqrt`` with correctly rounded division and square root (``div_rn``, ``sqrt_rn``) until the
    thirty-second session: those took 44 registers against 32 on the (2, 1024, 4) tile (fewer blocks per SM)
    and cost the forward 1-3% at most shapes. H100, bf16, the heuristic's tiles, launched by torch, TB/s (plain):
    gemma 4096×4096 2.70 → 2.76, 4096×3584 2.66 → 2.74, 4096×2048 2.52 → 2.56, 32768×5120 3.00 → 3.03, llama
    4096×1024 2.40 → 2.44, 32768×1024 2.88 → 2.90 (probes_h100_2026-11-27_thirtysecond.md §3)."""
    if CT == tl.float64:
        return 1.0 / tl.sqrt(sumsq / n_f + eps)
    else:
        return tl.math.rsqrt(sumsq / n_f + eps)


@triton.jit
def _w_eff(w, offset, CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """f32(w) + offset; for casting "none" f32(r(f32(r(w)) + offset))."""
    w = w.to(CT)
    if CASTING == 2:
        return _r(_r(w, DT, CT, EMULATE_BF16) + offset, DT, CT, EMULATE_BF16)
    else:
        return w + offset


@triton.jit
def _normalize(x, rstd, CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """n: llama r(x*rstd); gemma x*rstd; none r(x*r(rstd)). x is [BM, BN], rstd [BM]."""
    if CASTING == 0:
        return _r(x * rstd[:, None], DT, CT, EMULATE_BF16)
    elif CASTING == 1:
        return x * rstd[:, None]
    else:
        return _r(x * _r(rstd, DT, CT, EMULATE_BF16)[:, None], DT, CT, EMULATE_BF16)


@triton.jit
def _grad_n(dy, w_eff, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr,
            EMULATE_BF16: tl.constexpr):
    """g = dy * w_eff, rounded to dt for llama/none (dy alone without weight)."""
    if HAS_WEIGHT:
        g = dy * w_eff[None, :]
        if CASTING != 1:
            g = _r(g, DT, CT, EMULATE_BF16)
        return g
    else:
        return dy


@triton.jit
def _dx(x, g, rstd, c):
    """rstd * (g - x * rstd^2 * c), c = mean(g * x) per row."""
    r = rstd[:, None]
    return r * (g - x * (r * r) * c[:, None])


@triton.jit
def _bwd_weight(W, cols, col_mask, N, offset, HAS_WEIGHT: tl.constexpr, LOW: tl.constexpr, CASTING: tl.constexpr,
                DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """The backward's w_eff[cols] (the resident and band kernels): with LOW a value of DT (``_weight_low``), else CT
    (zeros without a weight)."""
    if LOW:
        return _weight_low(W, cols, N, offset, CASTING, DT, CT, EMULATE_BF16, "")
    elif HAS_WEIGHT:
        return _w_eff(tl.load(W + cols, mask=col_mask, other=0.0), offset, CASTING, DT, CT, EMULATE_BF16)
    else:
        return tl.zeros(cols.shape, dtype=CT)


# ----------------------------------------------------------------------------------------------
# The forward's row helpers (the resident and chunked walks of triton_kernels, triton_two_pass)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _weight_low(W, cols, N, offset, CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr,
                EMULATE_BF16: tl.constexpr, EVICT: tl.constexpr):
    """w_eff[cols] as a value of DT (``rowmath.output_in_dtype``): llama's w as stored, none's r(r(w) + offset);
    loaded with the L1 eviction hint EVICT ("" for none)."""
    w = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy=EVICT)
    if CASTING == 0:
        return w
    else:
        return _to_dt(_w_eff(w, offset, CASTING, DT, CT, EMULATE_BF16), DT, EMULATE_BF16)


@triton.jit
def _store_y(Y, W, base, cols, mask, N, x, rstd, offset, w_low, HAS_WEIGHT: tl.constexpr, LOW: tl.constexpr,
             CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr,
             EVICT: tl.constexpr):
    """y[rows, cols] = r(n(x, rstd) · w_eff[cols]) (n alone without a weight); LOW: n and ``w_low`` (w_eff as a
    value of DT) multiplied in DT, the same bits (``rowmath.output_in_dtype``); the weight loaded here with the L1
    eviction hint EVICT."""
    n = _normalize(x, rstd, CASTING, DT, CT, EMULATE_BF16)
    if LOW:
        y = _to_dt(n, DT, EMULATE_BF16) * w_low[None, :]
    else:
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy=EVICT)
            n = n * _w_eff(w, offset, CASTING, DT, CT, EMULATE_BF16)[None, :]
        y = _to_dt(n, DT, EMULATE_BF16)
    tl.store(Y + base + cols[None, :], y, mask=mask)


@triton.jit
def _row(X, R, H, offs, mask, HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr,
         EMULATE_BF16: tl.constexpr, EVICT: tl.constexpr):
    """The row values normalised, in CT: x, or (the fused add) h = r(x + residual), stored to H with STORE_H; both
    loaded with the L1 eviction hint EVICT ("" for none)."""
    x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(CT)
    if HAS_RESIDUAL:
        h = _to_dt(x + tl.load(R + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(CT), DT, EMULATE_BF16)
        if STORE_H:
            tl.store(H + offs, h, mask=mask)
        x = h.to(CT)
    return x
