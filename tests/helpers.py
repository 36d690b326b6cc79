"""Helpers shared by the test files: the test device, inputs for either stack, forward + backward through either
API, bit comparisons, and the accuracy check (``pallas_norm.accuracy``) of one case. Fixtures: conftest.py."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm
from bench import report
from bench.offline import abstract_h100  # noqa: F401 (the tests' too)
from pallas_norm import accuracy, backend
from pallas_norm_tools import parity
from torch_bridge import rms_norm
from torch_bridge.numpy_io import autograd_outputs, from_numpy, numpy_dtype, to_numpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels run under the interpreters
HAS_CUDA = DEVICE == "cuda"
ON_GPU = jax.default_backend() == "gpu"
KERNEL = "pallas" if ON_GPU else "interpret"  # the Pallas kernel in JAX: compiled, or interpreted on CPU
DEFAULT_KERNEL = "auto" if ON_GPU else "interpret"  # the kernels impl=None runs on a GPU: the torch routes' bits
ON_HOPPER = ON_GPU and backend.mosaic_capable()
MOSAIC = "mosaic" if ON_HOPPER else "mosaic_interpret"  # the Mosaic GPU kernels: compiled on Hopper, else interpreted
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compute capability >= 9.0)")
# A saved bench run's environment, for the bench tests' renders.
BENCH_ENV = dict(gpu="NVIDIA H100 80GB HBM3", driver="580", jax="0.11.2", torch="2.11", triton="3.6",
                 date="2026-11-22", dtype="bfloat16", casting="llama", copy_tbps=3.0, timer=report.KERNEL_TIMER)
GPU_KERNELS = ("pallas", "mosaic")  # the compiled kernels of both lowerings (GPU tests skip mosaic off Hopper)
TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
JAX_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _np_dtype(dtype) -> np.dtype:
    return numpy_dtype(dtype) if isinstance(dtype, torch.dtype) else np.dtype(jnp.dtype(dtype).name)


def torch_inputs(shape, dtype, offset=0.0, *, weight_dtype=None, seed=0, device=DEVICE, scale=1.0):
    """``accuracy.make_inputs`` as torch tensors on ``device`` (``x``, ``weight``, ``dy``)."""
    wdt = None if weight_dtype is None else _np_dtype(weight_dtype)
    arrays = accuracy.make_inputs(shape, _np_dtype(dtype), offset, seed=seed, weight_dtype=wdt, scale=scale)
    return tuple(from_numpy(a, device) for a in arrays)


def jax_inputs(shape, dtype, offset=0.0, *, weight_dtype=None, seed=0, scale=1.0):
    """``accuracy.make_inputs`` as JAX arrays on JAX's default device."""
    wdt = None if weight_dtype is None else _np_dtype(weight_dtype)
    arrays = accuracy.make_inputs(shape, _np_dtype(dtype), offset, seed=seed, weight_dtype=wdt, scale=scale)
    return tuple(jnp.asarray(a) for a in arrays)


def jax_vjp(impl, x, w, dy, **kw):
    """``(y, dx, dweight)`` of ``pallas_norm.rms_norm(x, w, impl=impl, **kw)`` under ``jax.vjp`` (dweight None
    without weight)."""
    args = (x,) if w is None else (x, w)
    y, vjp = jax.vjp(lambda *a: pallas_norm.rms_norm(*a, impl=impl, **kw), *args)
    grads = vjp(dy)
    return y, grads[0], (grads[1] if w is not None else None)


def to_jnp(t: torch.Tensor) -> jax.Array:
    """Same values as a JAX array on JAX's default device (exact)."""
    return jnp.asarray(to_numpy(t))


def jax_results(x, w, dy, impl=DEFAULT_KERNEL, **kw):
    """``(y, dx, dweight)`` of ``pallas_norm.rms_norm`` in JAX on torch inputs' values."""
    return jax_vjp(impl, to_jnp(x), None if w is None else to_jnp(w), to_jnp(dy), **kw)


def torch_results(x, w, dy, **kw):
    """``(y, dx, dweight)`` through ``torch_bridge.rms_norm`` and torch autograd (dweight None without weight)."""
    if w is not None:
        return autograd_outputs(lambda a, b: rms_norm(a, b, **kw), x, w, dy)
    xr = x.detach().clone().requires_grad_()
    y = rms_norm(xr, None, **kw)
    return y.detach(), torch.autograd.grad(y, xr, dy)[0], None


def bits(a) -> np.ndarray:
    """Raw bit patterns (torch or JAX or NumPy), so NaNs and signed zeros compare exactly."""
    a = to_numpy(a) if isinstance(a, torch.Tensor) else np.asarray(a)
    return a.view({2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize])


def assert_same_bits(ours, theirs) -> None:
    for name, a, b in zip(("y", "dx", "dweight"), ours, theirs):
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)


def as_numpy(t):
    """A torch tensor, JAX array or NumPy array (or None) as NumPy, dtype kept."""
    return None if t is None else (to_numpy(t) if isinstance(t, torch.Tensor) else np.asarray(t))


def wrong_row_length_constant(monkeypatch, value: int = 1000) -> None:
    """A broken variant of the Triton reference's ``Config.n_const``: every launch that sets ``N_CONST`` gets
    ``value`` instead (rows read at the wrong length, their tails dropped)."""
    from torch_bridge import triton_launch

    launch = triton_launch.launch

    def wrong(key, kernel, grid, args, meta, **kw):
        def broken():
            m = meta()
            return {**m, "N_CONST": value} if m.get("N_CONST") else m
        launch(("broken", *key), kernel, grid, args, broken, **kw)

    monkeypatch.setattr(triton_launch, "launch", wrong)


def judge(x, w, dy, outputs, *, eps=1e-6, offset=0.0, casting="llama", baseline=None, dh_out=None,
          **failures_kw) -> list[str]:
    """``accuracy.reference(...).failures`` of ``outputs`` (torch, JAX or NumPy) for inputs of either stack (with
    ``dh_out``: the fused add's backward, dx = r(dx_norm + dh_out))."""
    ref = accuracy.reference(as_numpy(x), as_numpy(w), as_numpy(dy), eps=eps, offset=offset, casting=casting,
                             dh_out=as_numpy(dh_out))
    baseline = None if baseline is None else [as_numpy(t) for t in baseline]
    return ref.failures("", [as_numpy(o) for o in outputs], baseline=baseline, **failures_kw)


def check_case(shape, dtype, casting, offset, *, weight_dtype=None, with_weight=True, seed=0, backend="triton",
               rounding_points=True) -> None:
    """One torch case through ``backend`` and autograd, held to the accuracy rule."""
    x, w, dy = torch_inputs(shape, dtype, offset, weight_dtype=weight_dtype, seed=seed)
    w = w if with_weight else None
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    failures = judge(x, w, dy, torch_results(x, w, dy, backend=backend, **kw), rounding_points=rounding_points, **kw)
    assert not failures, "\n".join(failures)


def check_jax(x, w, dy, impl=KERNEL, **kw) -> None:
    """``pallas_norm.rms_norm`` under ``jax.vjp``, held to the accuracy rule (dtypes and shapes included)."""
    mode = {k: kw[k] for k in ("eps", "offset", "casting") if k in kw}
    failures = judge(x, w, dy, jax_vjp(impl, x, w, dy, **kw), **mode)
    assert not failures, "\n".join(failures)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (torch or JAX)."""
    a, b = (np.asarray(to_numpy(t) if isinstance(t, torch.Tensor) else t, np.float64) for t in (a, b))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def one_ulp_off(x, w, dy, case):
    """A deliberately broken parity implementation: the DLPack bridge's results with one element of ``y`` moved
    by one ulp (not JAX's bits)."""
    y, dx, dw = parity.bridge("pallas_dlpack")(x, w, dy, case)
    y = y.clone()
    y.view(torch.int16 if y.element_size() == 2 else torch.int32).view(-1)[0] ^= 1  # flip the last mantissa bit
    return y, dx, dw


triton_rms_norm = functools.partial(rms_norm, backend="triton")  # the Triton reference kernel


def check_reduction_order(reduce, partials: np.ndarray, one_lane) -> None:
    """A dweight reduction (``reduce``: float32 partial rows (numpy) → their sum (numpy)) adds the rows in one fixed
    order: the same bits on every call, within float32 rounding of the float64 sum, a row left out caught (off by more
    than the bound); after ``one_lane()`` (one-row tiles) the bits of adding the rows one after another, p = 0, 1, ...,
    the rows reversed caught (other bits). Both stacks' reduction tests."""
    parts = len(partials)
    wide = partials.astype(np.float64)
    exact, bound = wide.sum(axis=0), parts * np.finfo(np.float32).eps * np.abs(wide).sum(axis=0)
    got = reduce(partials)
    np.testing.assert_array_equal(reduce(partials), got)
    assert np.all(np.abs(got - exact) <= bound)
    if parts > 1:
        assert not np.all(np.abs(reduce(partials[:-1]) - exact) <= bound)
    one_lane()
    want = np.zeros(partials.shape[1], np.float32)
    for row in partials:
        want = want + row
    np.testing.assert_array_equal(reduce(partials), want)
    if parts > 1:
        assert not np.array_equal(reduce(partials[::-1]), want)


def kernel_jaxpr(fn, *args) -> str:
    """The jaxpr text of the one ``pallas_call`` kernel under ``fn(*args)``, traced afresh (JAX's caches and the
    API's cached kernel functions cleared), so that a test patching a kernel module's threshold sees its effect."""
    from pallas_norm import api

    jax.clear_caches()
    api.forward_fn.cache_clear()
    api.backward_fn.cache_clear()

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn.params["jaxpr"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                if (found := find(sub)) is not None:
                    return found
        return None

    return str(find(jax.make_jaxpr(fn)(*args).jaxpr))


def h100_forward_ttir(monkeypatch, m: int, n: int, config) -> str:
    """The Pallas forward's Triton IR for ``m`` × ``n`` bf16 rows (llama) on ``config``, lowered for an (abstract)
    H100 (``backend.num_sms`` pinned to its 132)."""
    from torch_bridge import launch_route

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    with abstract_h100():
        lowered = launch_route._lower_forward(m, n, torch.bfloat16, torch.bfloat16, 1e-6, 0.0, "llama", config)
        return launch_route.parse_program(lowered.compiler_ir("stablehlo")).calls[0].ttir
