"""``torch_bridge.RMSNorm``: a drop-in ``torch.nn.RMSNorm`` running the Pallas (or Triton) kernels."""

from __future__ import annotations

import torch

from pallas_norm.semantics import check_scalars
from pallas_norm import registry
from torch_bridge.ops import rms_norm, rms_norm_add


class RMSNorm(torch.nn.RMSNorm):
    """``y = r(x · rsqrt(mean(x²) + eps) · (weight + offset))`` over the last axis (rounding per ``casting``).

    The parameter is named ``weight`` as in ``torch.nn.RMSNorm`` and the Hugging Face modules, so their
    state_dicts load unchanged. It starts where the effective scale ``weight + offset`` is 1: ones, or zeros
    for Gemma's ``offset=1``. Only the last axis is normalised (``normalized_shape`` an int or 1-tuple).
    """

    def __init__(self, normalized_shape: int | tuple[int] | list[int], eps: float = 1e-6, *, offset: float = 0.0,
                 casting: str = "llama", backend: str = "pallas", elementwise_affine: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
            raise ValueError(f"normalized_shape must be a positive int or a 1-tuple (the last axis), "
                             f"got {normalized_shape!r}")
        eps, offset, casting = check_scalars(eps, offset, casting, has_weight=elementwise_affine)
        registry.torch_backend(backend)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        self.offset, self.casting, self.backend = offset, casting, backend
        super().__init__(shape, eps, elementwise_affine, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """Weight = 1 - offset: ones (Llama), zeros (Gemma, offset=1)."""
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.shape[-1:] != self.normalized_shape:
            raise ValueError(f"x's last dimension must be normalized_shape[0]={self.normalized_shape[0]}, got shape "
                             f"{tuple(x.shape)}")
        return rms_norm(x, self.weight, self.eps, offset=self.offset, casting=self.casting, backend=self.backend)

    def extra_repr(self) -> str:
        """Also names what ``backend`` runs: the default alias picks by device (the weight's, when there is one)."""
        runs = ""
        if self.backend in registry.TORCH_ALIASES:
            if self.weight is not None:
                runs = f" (runs {registry.resolve_torch(self.backend, self.weight.is_cuda)!r})"
            else:
                on_cuda, elsewhere = registry.TORCH_ALIASES[self.backend]
                runs = f" (runs {on_cuda!r} on CUDA, {elsewhere!r} elsewhere)"
        return (f"{super().extra_repr()}, offset={self.offset}, casting={self.casting!r}, "
                f"backend={self.backend!r}{runs}")


class FusedAddRMSNorm(RMSNorm):
    """``forward(x, residual) -> (y, h)``: ``h = r(x + residual)`` (in ``residual_dtype``, default x's) and
    ``y = RMSNorm(h)``, one kernel per direction (``torch_bridge.rms_norm_add``); Liger's ``LigerFusedAddRMSNorm``
    convention. Same parameter, initialisation and options as :class:`RMSNorm`."""

    def __init__(self, normalized_shape: int | tuple[int] | list[int], eps: float = 1e-6, *,
                 residual_dtype: torch.dtype | None = None, **kwargs) -> None:
        if residual_dtype is not None and (not isinstance(residual_dtype, torch.dtype)
                                           or not residual_dtype.is_floating_point):
            raise TypeError(f"residual_dtype must be a floating torch.dtype or None, got {residual_dtype!r}")
        super().__init__(normalized_shape, eps, **kwargs)
        self.residual_dtype = residual_dtype

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, torch.Tensor) and x.shape[-1:] != self.normalized_shape:
            raise ValueError(f"x's last dimension must be normalized_shape[0]={self.normalized_shape[0]}, got shape "
                             f"{tuple(x.shape)}")
        return rms_norm_add(x, residual, self.weight, self.eps, offset=self.offset, casting=self.casting,
                            residual_dtype=self.residual_dtype, backend=self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}")
