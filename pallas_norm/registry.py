"""One registry of implementation names, read by both APIs, the parity matrix, the benchmark and the CLI.

Every implementation has one ``name``, used everywhere: as the JAX ``impl=``/torch ``backend=`` value (the
two stacks' arguments), as the parity matrix's and the benchmark's key, and as the CLI's choice. ``label`` is
for tables and plots only. Framework-free (no JAX, no torch): the PyTorch side reads it too.

=================  =====  ======================================================================================
name               stack  what runs
=================  =====  ======================================================================================
``auto``           jax    per direction and shape the faster compiled lowering (``auto.py``): ``impl=None`` on a GPU
``pallas``         jax    the Pallas kernels, compiled (GPU)
``interpret``      jax    the Pallas kernels run by Pallas's interpreter (any backend; CPU tests)
``xla``            jax    the same row math as plain ``jax.numpy`` compiled by XLA
``mosaic``         jax    the Mosaic GPU kernels (rows staged in shared memory by TMA), compiled (Hopper GPUs)
``mosaic_interpret`` jax  the Mosaic GPU kernels run by Mosaic GPU's interpreter (any backend; CPU tests)
``pallas_launch``  torch  the kernels JAX compiled for ``auto`` (JAX's bits), launched on torch's stream
``pallas_dlpack``  torch  the JAX functions of ``auto``/``interpret`` on torch tensors through DLPack: JAX's bits
``triton``         torch  the Triton reference kernel (also float64)
=================  =====  ======================================================================================

``torch_bridge``'s ``backend="pallas"`` (the default) is an alias: ``pallas_launch`` for CUDA tensors,
``pallas_dlpack`` for the rest (:func:`resolve_torch`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute ``rms_norm``. ``same_bits_as``: the implementation whose bits it must reproduce
    (``"auto"`` stands for ``"interpret"`` where the kernels run interpreted)."""

    name: str
    stack: str  # "jax" or "torch"
    label: str
    cuda_only: bool = False
    float64: bool = False
    same_bits_as: str | None = None


IMPLEMENTATIONS: tuple[Implementation, ...] = (
    Implementation("auto", "jax", "Pallas in JAX (faster lowering)", cuda_only=True),
    Implementation("pallas", "jax", "Pallas in JAX", cuda_only=True),
    Implementation("interpret", "jax", "Pallas in JAX (interpreter)"),
    Implementation("xla", "jax", "XLA in JAX"),
    Implementation("mosaic", "jax", "Mosaic GPU in JAX", cuda_only=True),
    Implementation("mosaic_interpret", "jax", "Mosaic GPU in JAX (interpreter)"),
    Implementation("pallas_launch", "torch", "Pallas binaries launched by torch", cuda_only=True,
                   same_bits_as="auto"),
    Implementation("pallas_dlpack", "torch", "Pallas via DLPack", same_bits_as="auto"),
    Implementation("triton", "torch", "Triton (ours)", float64=True),
)
BY_NAME: dict[str, Implementation] = {i.name: i for i in IMPLEMENTATIONS}
TORCH_ALIASES: dict[str, tuple[str, str]] = {"pallas": ("pallas_launch", "pallas_dlpack")}  # (CUDA, elsewhere)
DEFAULT_TORCH_BACKEND = "pallas"

JAX_IMPLS: tuple[str, ...] = tuple(i.name for i in IMPLEMENTATIONS if i.stack == "jax")
TORCH_BACKENDS: tuple[str, ...] = (DEFAULT_TORCH_BACKEND,) + tuple(i.name for i in IMPLEMENTATIONS
                                                                  if i.stack == "torch")


def jax_impl(impl: object) -> str:
    """Validate a JAX ``impl`` name (``None`` is resolved by the API)."""
    if not isinstance(impl, str) or impl not in JAX_IMPLS:
        raise ValueError(f"impl must be None or one of {JAX_IMPLS}, got {impl!r}")
    return impl


def torch_backend(backend: object, cuda: bool = False) -> Implementation:
    """The torch implementation a ``backend`` name (or alias) selects for CUDA tensors (``cuda``) or others;
    ``ValueError`` listing the choices."""
    if not isinstance(backend, str) or backend not in TORCH_BACKENDS:
        raise ValueError(f"backend must be one of {TORCH_BACKENDS}, got {backend!r}")
    return BY_NAME[resolve_torch(backend, cuda)]


def resolve_torch(backend: str, cuda: bool) -> str:
    """The implementation name that runs for ``backend`` (an alias or a name) on CUDA tensors or others."""
    choices = TORCH_ALIASES.get(backend)
    return backend if choices is None else choices[0 if cuda else 1]


KERNEL_FORMS: dict[str, tuple[str, str]] = {"pallas": ("pallas", "interpret"), "mosaic": ("mosaic", "mosaic_interpret")}
"""Each JAX kernel family's (compiled, interpreted) implementation names."""


def label(name: str) -> str:
    """Display label of an implementation name (the name itself for names not in the registry)."""
    return BY_NAME[name].label if name in BY_NAME else name
