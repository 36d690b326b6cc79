"""PyTorch entry point ``rms_norm``: argument checks, then the backend the registry names (``custom_ops.apply``)."""

from __future__ import annotations

import torch

from pallas_norm import registry
from pallas_norm.semantics import check_scalars
from torch_bridge import custom_ops, fused_ops, pallas_backends, triton_backend  # noqa: F401  (backends register ops)

BACKENDS: tuple[str, ...] = registry.TORCH_BACKENDS
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensors(x: object, weight: object) -> None:
    """Raise TypeError/ValueError naming the argument when x or weight is unusable."""
    if not isinstance(x, torch.Tensor):
        hint = "; for JAX arrays use pallas_norm.rms_norm" if type(x).__module__.startswith("jax") else ""
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__}{hint}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must have a floating dtype in {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (rows are the last axis), got a 0-d tensor")
    if x.shape[-1] == 0:
        raise ValueError(f"x's last dimension (N) must be >= 1, got shape {tuple(x.shape)}")
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__module__}.{type(weight).__name__}")
    if weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"weight must have a floating dtype in {FLOAT_DTYPES}, got {weight.dtype}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},) (x's last dimension), got {tuple(weight.shape)}")
    # same CUDA device by ordinal (cheap), else compare the devices themselves
    if not (x.is_cuda and weight.is_cuda and x.get_device() == weight.get_device()) and weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")


def check_backend(impl: registry.Implementation, backend: str, x: torch.Tensor, weight: torch.Tensor | None) -> None:
    """Refuse tensors that ``impl`` (the registry's entry for the user's ``backend``) cannot run."""
    for name, t in (("x", x), ("weight", weight)):
        if t is not None and t.dtype == torch.float64 and not impl.float64:
            raise TypeError(f"{name} must be float32, bfloat16 or float16 for backend={backend!r} (the Pallas "
                            "kernels), got torch.float64; use backend='triton' for float64")
    if impl.cuda_only and not x.is_cuda:
        raise ValueError(f"backend {backend!r} needs CUDA tensors, got x on {x.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting: str = "llama", backend: str = "pallas") -> torch.Tensor:
    """RMSNorm over the last axis, ``y = r(n * (weight + offset))`` per docs/semantics.md; autograd-aware.

    ``casting`` in ("llama", "gemma", "none"); ``offset=1.0`` with zero-initialised weights gives Gemma.
    ``backend`` (names in ``pallas_norm.registry``):

    - ``"pallas"`` (the default): ``"pallas_launch"`` for CUDA tensors, ``"pallas_dlpack"`` for others;
    - ``"pallas_launch"``: CUDA only: the binaries XLA compiled for ``pallas_norm.rms_norm``'s kernels, launched on
      torch's current stream into torch-allocated outputs: JAX's bits, a few µs of host time per kernel, and
      capturable in CUDA graphs (see ``torch_bridge.launch_route``);
    - ``"pallas_dlpack"``: the same JAX functions run by JAX on the tensors handed over through DLPack
      (zero-copy, ordered on torch's current stream): JAX's bits on any device JAX sees; CPU tensors run the
      kernels under Pallas's interpreter. Not capturable (JAX launches on its own stream);
    - ``"triton"``: the Triton reference kernel (Triton's interpreter on CPU under ``TRITON_INTERPRET=1``).

    Output has x's dtype and shape; non-contiguous x (and weight) are copied to contiguous memory first.
    Never writes into its inputs (nor into the cotangent in the backward). The Pallas backends take
    float32/bfloat16/float16; ``"triton"`` also float64.
    """
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    check_tensors(x, weight)
    impl = registry.torch_backend(backend, x.is_cuda)
    check_backend(impl, backend, x, weight)
    return custom_ops.apply(x, weight, eps, offset, casting, impl.name)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                 offset: float = 0.0, casting: str = "llama", residual_dtype: torch.dtype | None = None,
                 backend: str = "pallas") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with RMSNorm: ``(y, h)`` with ``h = r(x + residual)`` in ``residual_dtype``
    (default x's dtype; float32 for an fp32 residual stream) and ``y = rms_norm(h, weight, eps, ...)`` in h's
    dtype, bit for bit; one kernel per direction (``pallas_norm.rms_norm_add`` in JAX, same bits on the Pallas
    backends). Backward: ``dh = r(dx_norm + dh_out)`` with ``dh_out`` h's own gradient; ``x`` and ``residual`` both
    get ``dh`` (in their dtypes). ``backend`` as for :func:`rms_norm`. Never writes into its inputs or cotangents.
    """
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    check_tensors(x, weight)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__module__}.{type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype not in FLOAT_DTYPES:
        raise TypeError(f"residual must have a floating dtype in {FLOAT_DTYPES}, got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"residual must be on x's device {x.device}, got {residual.device}")
    h_dtype = x.dtype if residual_dtype is None else residual_dtype
    if h_dtype not in FLOAT_DTYPES:
        raise TypeError(f"residual_dtype must be None or a torch dtype in {FLOAT_DTYPES}, got {residual_dtype!r}")
    impl = registry.torch_backend(backend, x.is_cuda)
    check_backend(impl, backend, x, weight)
    for name, dtype in (("residual", residual.dtype), ("residual_dtype", h_dtype)):
        if dtype == torch.float64 and not impl.float64:
            raise TypeError(f"{name} must be float32, bfloat16 or float16 for backend={backend!r} (the Pallas "
                            "kernels), got torch.float64; use backend='triton' for float64")
    return fused_ops.apply(x, residual, weight, eps, offset, casting, h_dtype, impl.name)
