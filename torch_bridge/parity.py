"""The parity matrix: both stacks' implementations, case by case, against the float64 reference and each other.

One table of cases (casting × offset × dtype × shape, :func:`cases`) and one runner (:func:`run_case`), shared by
the tests (``tests/test_parity.py``) and ``pallas-norm check``. For each case it computes ``y``, ``dx`` and
``dweight`` with every implementation present:

* ``pallas_jax`` — ``pallas_norm.rms_norm`` in JAX (the kernel; Pallas's interpreter on CPU);
* ``xla_jax`` — the same function as plain ``jax.numpy`` (``impl="xla"``);
* ``pallas_bridge`` — the Pallas kernels from PyTorch (``torch_bridge.rms_norm``, DLPack route);
* ``pallas_launch`` — the same kernels' IR compiled by torch's Triton (CUDA only);
* ``triton`` — the Triton reference kernel (``TRITON_INTERPRET=1`` on CPU: set it before importing triton);
* ``hf`` — the Hugging Face module, where the mode is one (Llama: casting "llama", offset 0, weight in x's
  dtype; Gemma: casting "gemma", offset 1);

and checks:

* every implementation except ``hf`` meets the accuracy rule of :mod:`torch_bridge.tolerance` against the
  float64 reference (``naive`` = the same formula in float32 with the same rounding points), and for 16-bit
  dtypes keeps the naive formula's rounding points; ``hf`` (a peer, not ours) must keep them too, which ties
  the modes to HF's formulas;
* ``pallas_jax`` and ``pallas_bridge`` are bit-identical (the bridge runs the same XLA executables);
* ``triton`` is within the accuracy bound of ``pallas_jax``: they are different kernels with the same
  rounding points, but their float32 row sums (``rstd``, ``sum(g·x)``) and the ``dweight`` reduction add in
  another order and tree shape, which can move a rounding by one ulp.
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
from torch_bridge.ops import rms_norm
from torch_bridge.reference import rms_norm_ref_outputs
from torch_bridge.tolerance import accuracy_bound, atol_for, max_abs_err, rounding_point_failure, term_scales

OUTPUTS = ("y", "dx", "dweight")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = {
    "cpu": ((3, 5, 160), (7, 1000), (2, 20000)),  # resident rows, a non-power-of-two N, column chunks
    "cuda": ((4, 1024, 4096), (4096, 2304), (64, 65536)),
}
QUICK_SHAPES = {"cpu": ((3, 5, 160),), "cuda": ((4096, 4096),)}

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


def cases(device: str = "cpu", quick: bool = False) -> list[Case]:
    """The matrix: every casting × offset {0, 1} × dtype × the device's shapes (one shape when ``quick``)."""
    shapes = (QUICK_SHAPES if quick else SHAPES)["cuda" if device.startswith("cuda") else "cpu"]
    return [Case(c, o, d, s) for c, o, d, s in itertools.product(pallas_norm.CASTINGS, (0.0, 1.0), DTYPES, shapes)]


def make_inputs(shape, dtype, offset, weight_dtype=None, seed=0, device="cpu", scale=1.0):
    """``x`` of magnitude ``scale`` with row scales spread over ~e^{±2}, a non-trivial weight around its init
    (ones; zeros for offset 1), a random cotangent ``dy``."""
    g = torch.Generator(device=device).manual_seed(seed)
    f = dict(generator=g, dtype=torch.float32, device=device)
    n = shape[-1]
    x = scale * torch.randn(shape, **f) * torch.exp(torch.randn(*shape[:-1], 1, **f))
    base = 0.0 if offset else 1.0
    w = base + (0.1 if offset else 0.3) * torch.randn(n, **f)
    dy = torch.randn(shape, **f)
    return x.to(dtype), w.to(weight_dtype or dtype), dy.to(dtype)


def torch_grads(fn: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> Outputs:
    """``(y, dx, dweight)`` of ``fn(x, w)`` by torch autograd, on copies of the inputs."""
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(xr, wr)
    dx, dw = torch.autograd.grad(y, (xr, wr), dy)
    return y.detach(), dx, dw


def bridge(backend: str) -> Impl:
    """``torch_bridge.rms_norm`` with ``backend``, through autograd."""
    def run(x, w, dy, case):
        kw = dict(offset=case.offset, casting=case.casting, backend=backend)
        return torch_grads(lambda a, b: rms_norm(a, b, case.eps, **kw), x, w, dy)
    return run


@functools.cache
def _jax_fwd_bwd(impl: str, eps: float, offset: float, casting: str):
    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: pallas_norm.rms_norm(a, b, eps=eps, offset=offset, casting=casting, impl=impl),
                         x, w)
        return (y, *vjp(dy))
    return jax.jit(fwd_bwd)


def _to_jax(t: torch.Tensor) -> jax.Array:
    """Same values on JAX's default device (float32 holds every 16-bit value exactly)."""
    return jnp.asarray(t.detach().float().cpu().numpy()).astype(str(t.dtype).removeprefix("torch."))


def _from_jax(a: jax.Array, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(jnp.float32))).to(dtype=like.dtype, device=like.device)


def jax_impl(impl: str | None) -> Impl:
    """``pallas_norm.rms_norm(..., impl=impl)`` under ``jax.vjp``; ``None``: the Pallas kernel (interpreted on
    CPU)."""
    def run(x, w, dy, case):
        chosen = impl or ("pallas" if x.is_cuda else "interpret")
        out = _jax_fwd_bwd(chosen, case.eps, case.offset, case.casting)(_to_jax(x), _to_jax(w), _to_jax(dy))
        return tuple(_from_jax(a, t) for a, t in zip(out, (x, x, w)))
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
    return torch_grads(lambda a, b: torch.func.functional_call(module, {"weight": b}, (a,)), x, w, dy)


def implementations(device: str) -> dict[str, Impl]:
    """Every implementation runnable on ``device`` ("cpu" or "cuda"), in report order (``hf`` is added per case)."""
    impls = {"pallas_jax": jax_impl(None), "xla_jax": jax_impl("xla"), "pallas_bridge": bridge("pallas")}
    if device.startswith("cuda"):
        impls["pallas_launch"] = bridge("pallas_launch")
    impls["triton"] = bridge("triton")
    return impls


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


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.cpu().view(view), b.cpu().view(view))


def run_case(case: Case, device: str = "cpu", impls: dict[str, Impl] | None = None) -> CaseResult:
    """Run ``case`` through ``impls`` (default: :func:`implementations` plus ``hf`` where one matches)."""
    impls = dict(implementations(device) if impls is None else impls)
    if hf_module_class(case) is not None:
        impls.setdefault("hf", hf_impl)
    x, w, dy = make_inputs(case.shape, case.torch_dtype, case.offset, seed=case.seed, device=device, scale=case.scale)
    kw = dict(eps=case.eps, offset=case.offset, casting=case.casting)
    ref = rms_norm_ref_outputs(x, w, dy, **kw)
    naive = rms_norm_ref_outputs(x, w, dy, compute_dtype=torch.float32, **kw)
    n, m = case.shape[-1], x.numel() // case.shape[-1]
    reduce, scales = (n, n, m), term_scales(x, w, dy, case.offset, case.eps)
    bounds = {o: accuracy_bound(nv, r, k, s) for o, nv, r, k, s in zip(OUTPUTS, naive, ref, reduce, scales)}
    atols = {o: atol_for(k, s) for o, k, s in zip(OUTPUTS, reduce, scales)}
    outs = {name: fn(x, w, dy, case) for name, fn in impls.items()}
    errors, failures = {}, []
    for name, out in outs.items():
        errors[name] = {o: max_abs_err(a, r) for o, a, r in zip(OUTPUTS, out, ref)}
        for o, a, nv, want in zip(OUTPUTS, out, naive, (x.dtype, x.dtype, w.dtype)):
            if a.dtype != want or tuple(a.shape) != tuple(nv.shape):
                failures.append(f"{name} {o}: {a.dtype} {tuple(a.shape)}, expected {want} {tuple(nv.shape)}")
            elif name != "hf" and not errors[name][o] <= bounds[o]:
                failures.append(f"{name} {o}: error {errors[name][o]:.3e} > bound {bounds[o]:.3e}")
            if o != "dweight":
                failures.append(rounding_point_failure(f"{name} {o} vs naive", a, nv, atols[o]))
    if "pallas_jax" in outs and "pallas_bridge" in outs:
        for o, a, b in zip(OUTPUTS, outs["pallas_jax"], outs["pallas_bridge"]):
            if not _same_bits(a, b):
                failures.append(f"pallas_bridge {o}: not bit-identical to pallas_jax")
    if "pallas_jax" in outs and "triton" in outs:
        for o, a, b in zip(OUTPUTS, outs["pallas_jax"], outs["triton"]):
            if not max_abs_err(b, a) <= bounds[o]:
                failures.append(f"triton vs pallas_jax {o}: {max_abs_err(b, a):.3e} > bound {bounds[o]:.3e}")
    return CaseResult(case, errors, bounds, [f for f in failures if f])
