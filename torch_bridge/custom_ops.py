"""One custom-op factory for every kernel family, and the one autograd path they share.

:func:`define` turns a family's backends (``Kernels``: a forward and a backward function each) into two
``torch.library`` custom ops with fake kernels and autograd:

* ``pallas_norm::<family>_rms_norm_fwd(x, weight?, eps, offset, casting, backend) -> (y, rstd)``
* ``pallas_norm::<family>_rms_norm_bwd(dy, x, weight?, rstd, offset, casting, backend, need_dx, need_dweight)
  -> (dx, dweight)``; an output not asked for (or ``dweight`` without weight) is an empty (0,) tensor.

:func:`apply` is the entry every torch API calls. Under ``torch.compile`` it uses the custom ops (opaque
through their fakes: no graph break); eager calls skip the dispatcher, which costs more than a small kernel:
an ``autograd.Function`` over the same implementation when a gradient is needed, else the forward alone.

Shapes and empty inputs are handled here, once: kernels get contiguous, 32-byte-aligned tensors with at least
one row, of any leading shape (they address memory by pointer, so nothing is reshaped), with ``x``'s GPU
current; an input without rows never reaches them. ``rstd`` is float32 (float64 for float64 ``x``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from torch_bridge.jax_device import current_device_of


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One backend. ``forward(x, weight, eps, offset, casting) -> (y, rstd)`` with ``y`` in x's shape and dtype
    and ``rstd`` of shape ``x.shape[:-1]``; ``backward(dy, x, weight, rstd, offset, casting, need_dx,
    need_dweight) -> (dx, dweight)``, each None when not asked for; ``dy`` is only read. ``forward_y``, when
    given, returns ``y`` alone, for calls that will not ask for a gradient (cheaper than dropping rstd)."""

    forward: Callable
    backward: Callable
    forward_y: Callable | None = None


_KERNELS: dict[str, Kernels] = {}
_FAMILY: dict[str, str] = {}  # backend -> family (the ops' name prefix)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' compute (and rstd) dtype for rows of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rstd_dtype(x: torch.Tensor) -> torch.dtype:
    return compute_dtype(x.dtype)


def dtype_of(t: torch.Tensor | None) -> torch.dtype | None:
    """``t``'s dtype, None for no tensor (launch keys of an optional weight)."""
    return None if t is None else t.dtype


_SCRATCH: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (device, dtype) -> the largest rstd scratch so far
_RETIRED: list[torch.Tensor] = []  # smaller scratches: kernels may still be writing them, so they stay allocated
_SCRATCH_LOCK = threading.Lock()


def rstd_scratch(x: torch.Tensor, m: int) -> torch.Tensor:
    """A buffer of >= m elements of x's rstd dtype on x's GPU, for an rstd nobody reads (``forward_y``). It is
    shared by every stream: a write-write race on it is harmless, and it is never freed (a kernel queued on
    another stream may still write it), so sizes grow by powers of two and all of them stay under twice the
    largest."""
    key = (x.get_device(), rstd_dtype(x))
    scratch = _SCRATCH.get(key)
    if scratch is None or scratch.numel() < m:
        with _SCRATCH_LOCK:  # growing is rare; one thread at a time, so no retired buffer is lost
            scratch = _SCRATCH.get(key)
            if scratch is None or scratch.numel() < m:
                if scratch is not None:
                    _RETIRED.append(scratch)
                scratch = _SCRATCH[key] = x.new_empty(1 << (m - 1).bit_length(), dtype=key[1])
    return scratch


def rows(x: torch.Tensor) -> tuple[int, int]:
    """``(M, N)``: the rows and the row length of ``x`` of any leading shape (what kernels address by pointer)."""
    n = x.shape[-1]
    return x.numel() // n, n


def kernel_ready(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous and 32-byte aligned (the kernels' pointer contract); copies only when it is not."""
    if t is None:
        return None
    if not t.is_contiguous():
        t = t.contiguous()
    return t if t.data_ptr() % 32 == 0 else t.clone()


def lookup(table: dict, backend: str):
    """``table[backend]``; ``ValueError`` listing the table's backends otherwise (the custom ops' check)."""
    if backend not in table:
        raise ValueError(f"backend must be one of {tuple(table)}, got {backend!r}")
    return table[backend]


def _kernels(backend: str) -> Kernels:
    return lookup(_KERNELS, backend)


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` by ``backend``'s forward."""
    kernels = _kernels(backend)
    with current_device_of(x):
        if x.numel() == 0:
            return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=rstd_dtype(x))
        return kernels.forward(kernel_ready(x), kernel_ready(weight), eps, offset, casting)


def forward_y(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
              backend: str) -> torch.Tensor:
    """``y`` alone by ``backend``'s ``forward_y`` (its forward's y when it has none): no gradient will follow."""
    kernels = _kernels(backend)
    if kernels.forward_y is None or x.numel() == 0:
        return forward(x, weight, eps, offset, casting, backend)[0]
    with current_device_of(x):
        return kernels.forward_y(kernel_ready(x), kernel_ready(weight), eps, offset, casting)


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
             casting: str, backend: str, need_dx: bool = True, need_dweight: bool = True
             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight)`` by ``backend``'s backward (dx in a new buffer; None for what is not asked for)."""
    kernels = _kernels(backend)
    need_dweight = need_dweight and weight is not None
    with current_device_of(x):
        if x.numel() == 0 or not (need_dx or need_dweight):
            return (x.new_empty(x.shape) if need_dx else None), (torch.zeros_like(weight) if need_dweight else None)
        return kernels.backward(kernel_ready(dy), kernel_ready(x), kernel_ready(weight), kernel_ready(rstd), offset,
                                casting, need_dx, need_dweight)


def _needs(ctx, weight: torch.Tensor | None) -> tuple[bool, bool]:
    return ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]


class _Function(torch.autograd.Function):
    """The eager autograd path, over the same ``forward``/``backward`` as the custom ops."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting, backend):
        y, rstd = forward(x, weight, eps, offset, casting, backend)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting, ctx.backend = offset, casting, backend
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = backward(dy, x, weight, rstd, ctx.offset, ctx.casting, ctx.backend, *_needs(ctx, weight))
        return dx, dweight, None, None, None, None


def define(family: str, backends: dict[str, Kernels]) -> None:
    """Register ``backends`` and the custom ops ``pallas_norm::<family>_rms_norm_fwd/bwd`` that run them."""
    _KERNELS.update(backends)
    _FAMILY.update(dict.fromkeys(backends, family))

    def _check(backend: str) -> None:
        lookup(backends, backend)

    @torch.library.custom_op(f"pallas_norm::{family}_rms_norm_fwd", mutates_args=())
    def fwd_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
               backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        _check(backend)
        return forward(x, weight, eps, offset, casting, backend)

    @fwd_op.register_fake
    def _(x, weight, eps, offset, casting, backend):
        return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=rstd_dtype(x))

    @torch.library.custom_op(f"pallas_norm::{family}_rms_norm_bwd", mutates_args=())
    def bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
               casting: str, backend: str, need_dx: bool, need_dweight: bool) -> tuple[torch.Tensor, torch.Tensor]:
        _check(backend)
        dx, dweight = backward(dy, x, weight, rstd, offset, casting, backend, need_dx, need_dweight)
        empty = x.new_empty((0,))
        return (empty if dx is None else dx), (empty.clone() if dweight is None else dweight)

    @bwd_op.register_fake
    def _(dy, x, weight, rstd, offset, casting, backend, need_dx, need_dweight):
        dx = torch.empty_like(x) if need_dx else x.new_empty((0,))
        return dx, (torch.empty_like(weight) if need_dweight and weight is not None else x.new_empty((0,)))

    def setup_context(ctx, inputs, output) -> None:
        x, weight, eps, offset, casting, backend = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.offset, ctx.casting, ctx.backend = offset, casting, backend
        ctx.mark_non_differentiable(output[1])

    def op_backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dweight = _needs(ctx, weight)
        dx, dweight = bwd_op(dy, x, weight, rstd, ctx.offset, ctx.casting, ctx.backend, need_dx, need_dweight)
        return (dx if need_dx else None), (dweight if need_dweight else None), None, None, None, None

    fwd_op.register_autograd(op_backward, setup_context=setup_context)


# ``Function.apply``'s own Python layer (routing under functorch transforms, unwrapping dead functorch wrappers)
# costs ~10 µs per call; with no transform active and no functorch-wrapped input it ends in this C entry anyway.
_function_apply = super(torch.autograd.Function, _Function).apply
_functorch_active = torch._C._are_functorch_transforms_active
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def apply(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
          backend: str) -> torch.Tensor:
    """``y`` by ``backend``, autograd-aware: the custom op under ``torch.compile``, else the eager path."""
    if torch.compiler.is_compiling():
        op = getattr(torch.ops.pallas_norm, f"{_FAMILY[backend]}_rms_norm_fwd")
        return op(x, weight, eps, offset, casting, backend)[0]
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        if _functorch_active() or _is_wrapped(x) or (weight is not None and _is_wrapped(weight)):
            return _Function.apply(x, weight, eps, offset, casting, backend)
        return _function_apply(x, weight, eps, offset, casting, backend)
    return forward_y(x, weight, eps, offset, casting, backend)
