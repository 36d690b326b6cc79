"""The parity matrix: every implementation of both stacks, case by case, against the float64 reference and
each other.

One table of cases (casting × offset × dtype × shape, :func:`cases`) and one runner (:func:`run_case`), shared by
the tests (``tests/test_parity.py``) and ``pallas-norm check``. Each case draws its inputs with
``pallas_norm.accuracy.make_inputs`` and computes ``y``, ``dx`` and ``dweight`` with every implementation of
``pallas_norm.registry`` that runs on the device — on CPU ``interpret``, ``mosaic_interpret``, ``xla``,
``pallas_dlpack``, ``triton``; on CUDA ``auto`` (what ``impl=None`` runs) and ``pallas`` (compiled) instead of
``interpret``, ``mosaic`` instead of ``mosaic_interpret`` (Hopper GPUs; shapes it cannot stage are left out), and
``pallas_launch`` — plus ``hf``, the Hugging Face module,
where the mode is one (Llama: casting "llama", offset 0, weight in x's dtype; Gemma: casting "gemma", offset 1).
It checks:

* every implementation meets ``pallas_norm.accuracy``'s rule (error bound and rounding points); ``hf`` (a
  peer, not ours) must keep the rounding points only, which ties the modes to HF's formulas;
* an implementation with ``same_bits_as`` in the registry (``pallas_dlpack``, ``pallas_launch``) is bit-identical to the
  JAX kernel ``impl=None`` runs on the device (``auto``; ``interpret`` on CPU);
* ``triton`` is within the accuracy bound of that JAX kernel: different kernels with the same rounding points,
  whose float32 row sums and ``dweight`` reduction add in another order.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

import pallas_norm
from pallas_norm import accuracy, backend, mosaic_config, registry
from torch_bridge import rms_norm
from torch_bridge.numpy_io import autograd_outputs, from_numpy, to_numpy

OUTPUTS = accuracy.OUTPUTS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = {
    "cpu": ((3, 5, 160), (7, 1000), (2, 20000)),  # resident rows, a non-power-of-two N, column chunks
    "cuda": ((4, 1024, 4096), (4096, 2304), (64, 65536)),
}
QUICK_SHAPES = {"cpu": ((3, 5, 160),), "cuda": ((4096, 4096),)}
PEERS = ("hf",)  # implementations that are not ours: held to rounding points only

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Case"], Outputs]


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the matrix: ``y = rms_norm(x, weight, eps, offset=offset, casting=casting)`` of ``shape``, with
    ``x`` of magnitude about ``scale``."""

    casting: str
    offset: float
    dtype: str
    shape: tuple[int, ...]
    eps: float = 1e-6
    scale: float = 1.0

    @property
    def name(self) -> str:
        extra = "".join(f"/{k}={v:g}" for k, v, d in (("eps", self.eps, 1e-6), ("scale", self.scale, 1.0)) if v != d)
        return f"{self.casting}/offset={self.offset:g}/{self.dtype}/{'x'.join(map(str, self.shape))}{extra}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    @property
    def mode(self) -> dict:
        return dict(eps=self.eps, offset=self.offset, casting=self.casting)


def cases(device: str = "cpu", quick: bool = False) -> list[Case]:
    """The matrix: every casting × offset {0, 1} × dtype × the device's shapes (one shape when ``quick``)."""
    shapes = (QUICK_SHAPES if quick else SHAPES)["cuda" if device.startswith("cuda") else "cpu"]
    return [Case(c, o, d, s) for c, o, d, s in itertools.product(pallas_norm.CASTINGS, (0.0, 1.0), DTYPES, shapes)]


def kernel_impl(device: str, family: str = "pallas") -> str:
    """The JAX kernel implementation of ``family`` (``pallas``, ``mosaic``) that runs on ``device``: compiled on
    CUDA, interpreted on CPU."""
    compiled, interpreted = registry.KERNEL_FORMS[family]
    return compiled if device.startswith("cuda") else interpreted


def _runs_on(name: str, device: str) -> bool:
    """Whether implementation ``name`` is the one of its kernel family for ``device`` (Mosaic compiled only on
    Hopper GPUs); implementations outside the kernel families run wherever the registry allows."""
    for family, forms in registry.KERNEL_FORMS.items():
        if name in forms:
            if name != kernel_impl(device, family):
                return False
            return family != "mosaic" or not device.startswith("cuda") or backend.mosaic_capable()
    return True


def bridge(backend: str) -> Impl:
    """``torch_bridge.rms_norm`` with ``backend``, through autograd."""
    def run(x, w, dy, case):
        kw = dict(offset=case.offset, casting=case.casting, backend=backend)
        return autograd_outputs(lambda a, b: rms_norm(a, b, case.eps, **kw), x, w, dy)
    return run


@functools.cache
def _jax_fwd_bwd(impl: str, eps: float, offset: float, casting: str):
    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: pallas_norm.rms_norm(a, b, eps=eps, offset=offset, casting=casting, impl=impl),
                         x, w)
        return (y, *vjp(dy))
    return jax.jit(fwd_bwd)


def jax_impl(impl: str) -> Impl:
    """``pallas_norm.rms_norm(..., impl=impl)`` under ``jax.vjp``, on the same values (exact conversions)."""
    def run(x, w, dy, case):
        out = _jax_fwd_bwd(impl, case.eps, case.offset, case.casting)(*(jnp.asarray(to_numpy(t)) for t in (x, w, dy)))
        return tuple(from_numpy(np.asarray(a), x.device) for a in out)
    return run


def hf_module_class(case: Case, weight_dtype: torch.dtype | None = None):
    """The Hugging Face RMSNorm class computing ``case``'s formula, or None."""
    if case.casting == "llama" and case.offset == 0.0 and weight_dtype in (None, case.torch_dtype):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        return LlamaRMSNorm
    if case.casting == "gemma" and case.offset == 1.0:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        return GemmaRMSNorm
    return None


def hf_impl(x, w, dy, case):
    """The HF module, with ``w`` as its weight (a functional call: the module's own parameter is untouched)."""
    module = hf_module_class(case, w.dtype)(x.shape[-1], eps=case.eps).to(device=x.device, dtype=w.dtype)
    return autograd_outputs(lambda a, b: torch.func.functional_call(module, {"weight": b}, (a,)), x, w, dy)


def implementations(device: str) -> dict[str, Impl]:
    """Every registry implementation runnable on ``device`` ("cpu" or "cuda"), in registry order, keyed by its
    name (``hf`` is added per case); of the JAX Pallas kernel only the device's form (:func:`kernel_impl`)."""
    cuda = device.startswith("cuda")
    impls = {}
    for impl in registry.IMPLEMENTATIONS:
        if (impl.cuda_only and not cuda) or not _runs_on(impl.name, device):
            continue
        impls[impl.name] = jax_impl(impl.name) if impl.stack == "jax" else bridge(impl.name)
    return impls


def has_hf() -> bool:
    """Whether the Hugging Face peer can run (``transformers`` is an optional extra)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass
class CaseResult:
    """Max abs errors against the float64 reference per implementation and output, the rule's bounds, and
    every failed check (empty when the case passes)."""

    case: Case
    errors: dict[str, dict[str, float]]
    bounds: dict[str, float]
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


def run_case(case: Case, device: str = "cpu", impls: dict[str, Impl] | None = None) -> CaseResult:
    """Run ``case`` through ``impls`` (default: :func:`implementations` plus ``hf`` where one matches)."""
    impls = dict(implementations(device) if impls is None else impls)
    if hf_module_class(case) is not None and has_hf():
        impls.setdefault("hf", hf_impl)
    inputs = accuracy.make_inputs(case.shape, case.dtype, case.offset, seed=case.seed, scale=case.scale)
    x, w, dy = (from_numpy(a, device) for a in inputs)
    ref = accuracy.reference(*inputs, **case.mode)
    outs = {}
    for name, fn in impls.items():
        try:
            outs[name] = [to_numpy(t) for t in fn(x, w, dy, case)]
        except mosaic_config.Unsupported:  # a row the Mosaic kernels cannot stage: no entry for this case
            continue
    errors, failures = {}, []
    for name, out in outs.items():
        errors[name], found = ref.judge(name, out, bounded=name not in PEERS)
        failures += found
    kernel = next((k for k in ("auto", "interpret") if k in outs), None)  # the bits the torch routes reproduce
    for name, out in outs.items():
        impl = registry.BY_NAME.get(name)
        if impl is not None and impl.same_bits_as and kernel is not None:
            failures += [f"{name} {o}: not bit-identical to {kernel}" for o, a, b in zip(OUTPUTS, out, outs[kernel])
                         if not accuracy.same_bits(a, b)]
    if kernel is not None and "triton" in outs:
        for o, a, b in zip(OUTPUTS, outs[kernel], outs["triton"]):
            if a.shape == b.shape and not accuracy.max_abs_err(b, a) <= ref.bound(o):
                failures.append(f"triton vs {kernel} {o}: {accuracy.max_abs_err(b, a):.3e} > bound {ref.bound(o):.3e}")
    return CaseResult(case, errors, {o: ref.bound(o) for o in OUTPUTS}, failures)
