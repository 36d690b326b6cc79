"""Error inputs (in the style of PyTorch's OpInfo error inputs): one table, one test that walks it.

Every public entry point — ``pallas_norm.rms_norm``, ``pallas_norm.nnx.RMSNorm``, ``torch_bridge.rms_norm``,
``torch_bridge.RMSNorm``, ``torch_bridge.patch_hf_model`` — raises ``TypeError``/``ValueError`` whose message
names the argument and what was expected; the walk also checks that no tensor argument was written and that
nothing was allocated (torch's CUDA allocator, JAX's live arrays) before the error.
"""

from __future__ import annotations

import dataclasses
import gc
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import pallas_norm as pn
import torch_bridge
from pallas_norm_tools.tiny_models import tiny_model

from helpers import DEVICE, KERNEL as JAX_IMPL


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """``entry(**args())`` must raise ``exc`` with a message matching ``match`` (argument name + expectation)."""

    name: str
    entry: Callable
    args: Callable[[], dict]
    exc: type[Exception]
    match: str


def T(*shape, **kw) -> Callable[[], torch.Tensor]:
    """A factory of ``torch.ones(*shape)`` on the test device (tensors are made when a case is walked)."""
    return lambda: torch.ones(*shape, device=DEVICE, **kw)


def jax_call(**override):
    args = lambda: dict(dict(x=jnp.ones((2, 8)), weight=jnp.ones(8), impl=JAX_IMPL), **override)  # noqa: E731
    return pn.rms_norm, args


def nnx_call(**override):
    """Constructor arguments, or (with ``x``) a call of a module built before the walk measures anything."""
    if "x" in override:
        return (lambda module, x: module(x)), lambda: dict(module=pn.nnx.RMSNorm(8, rngs=nnx.Rngs(0)), x=override["x"])
    return (lambda **kw: pn.nnx.RMSNorm(kw.pop("num_features", 8), **kw)), lambda: dict(override, rngs=nnx.Rngs(0))


def torch_call(**override):
    def args():
        return dict(dict(x=T(2, 8)(), weight=T(8)()), **{k: v() if callable(v) else v for k, v in override.items()})
    return torch_bridge.rms_norm, args


def module_call(**override):
    """Constructor arguments, or (with ``x``) a forward of a module built before the walk measures anything."""
    if "x" in override:
        return (lambda module, x: module(x)), lambda: dict(module=torch_bridge.RMSNorm(8, device=DEVICE),
                                                           x=override["x"]())
    def construct(**kw):
        return torch_bridge.RMSNorm(kw.pop("normalized_shape", 8), device=DEVICE, **kw)
    return construct, lambda: dict(override)


def patch_call(**override):
    return torch_bridge.patch_hf_model, lambda: dict(dict(model=tiny_model("llama", layers=1, hidden=16)), **override)


def case(name, call, exc, match):
    entry, args = call
    return ErrorInput(name, entry, args, exc, match)


ERROR_INPUTS = [
    # pallas_norm.rms_norm
    case("jax weight wrong length", jax_call(weight=jnp.ones(7)), ValueError, r"weight must have shape \(8,\)"),
    case("jax weight wrong rank", jax_call(weight=jnp.ones((1, 8))), ValueError, r"weight must have shape \(8,\)"),
    case("jax weight integer", jax_call(weight=jnp.ones(8, jnp.int32)), TypeError, "weight must have a floating dtype"),
    case("jax x integer", jax_call(x=jnp.ones((2, 8), jnp.int32)), TypeError, "x must have a floating dtype"),
    case("jax x complex", jax_call(x=jnp.ones((2, 8), jnp.complex64)), TypeError, "x must have a floating dtype"),
    case("jax x float64 numpy", jax_call(x=np.ones((2, 8))), TypeError, r"x must have a floating dtype in \(float32"),
    case("jax x 0-d", jax_call(x=jnp.float32(1.0), weight=None), ValueError, "x must have at least 1 dimension"),
    case("jax x N=0", jax_call(x=jnp.ones((2, 0)), weight=None), ValueError, r"x's last axis .* must be >= 1"),
    case("jax x list", jax_call(x=[1.0, 2.0]), TypeError, "x must be a jax.Array"),
    case("jax x torch tensor", jax_call(x=torch.ones(2, 8)), TypeError, "x must be a jax.Array.*torch_bridge.rms_norm"),
    case("jax weight torch tensor", jax_call(weight=torch.ones(8)), TypeError, "weight must be a jax.Array"),
    case("jax eps 0", jax_call(eps=0.0), ValueError, "eps must be finite and > 0, got 0.0"),
    case("jax eps negative", jax_call(eps=-1e-6), ValueError, "eps must be finite and > 0"),
    case("jax eps nan", jax_call(eps=float("nan")), ValueError, "eps must be finite and > 0, got nan"),
    case("jax eps string", jax_call(eps="1e-6"), TypeError, "eps must be a real number > 0, got str"),
    case("jax offset inf", jax_call(offset=float("inf")), ValueError, "offset must be finite, got inf"),
    case("jax offset nan", jax_call(offset=float("nan")), ValueError, "offset must be finite, got nan"),
    case("jax offset without weight", jax_call(weight=None, offset=1.0), ValueError, "offset must be 0.0 when weight"),
    case("jax casting unknown", jax_call(casting="mistral"), ValueError, r"casting must be one of \('llama'"),
    case("jax casting not str", jax_call(casting=1), TypeError, "casting must be one of"),
    case("jax impl unknown", jax_call(impl="cuda"), ValueError, r"impl must be None or one of \('auto', 'pallas'"),
    # pallas_norm.nnx.RMSNorm
    case("nnx num_features 0", nnx_call(num_features=0), ValueError, "num_features must be a positive int, got 0"),
    case("nnx num_features bool", nnx_call(num_features=True), ValueError, "num_features must be a positive int"),
    case("nnx eps 0", nnx_call(eps=0.0), ValueError, "eps must be finite and > 0"),
    case("nnx casting unknown", nnx_call(casting="qwen"), ValueError, "casting must be one of"),
    case("nnx impl unknown", nnx_call(impl="triton"), ValueError, "impl must be None or one of"),
    case("nnx param_dtype int", nnx_call(param_dtype=jnp.int32), TypeError, "param_dtype must be float32"),
    case("nnx offset inf", nnx_call(offset=float("inf")), ValueError, "offset must be finite"),
    case("nnx x wrong width", nnx_call(x=jnp.ones((2, 7))), ValueError,
         r"x's last axis must be num_features=8, got shape \(2, 7\)"),
    case("nnx x integer", nnx_call(x=jnp.ones((2, 8), jnp.int8)), TypeError, "x must have a floating dtype"),
    # torch_bridge.rms_norm
    case("torch weight wrong length", torch_call(weight=T(7)), ValueError, r"weight must have shape \(8,\)"),
    case("torch weight wrong rank", torch_call(weight=T(2, 8)), ValueError, r"weight must have shape \(8,\)"),
    case("torch weight integer", torch_call(weight=T(8, dtype=torch.int32)), TypeError,
         "weight must have a floating dtype"),
    case("torch weight wrong device", torch_call(weight=lambda: torch.ones(8, device="meta")), ValueError,
         "weight must be on x's device"),
    case("torch weight list", torch_call(weight=[1.0] * 8), TypeError, "weight must be a torch.Tensor or None"),
    case("torch x integer", torch_call(x=T(2, 8, dtype=torch.int64)), TypeError, "x must have a floating dtype"),
    case("torch x complex", torch_call(x=T(2, 8, dtype=torch.complex64)), TypeError, "x must have a floating dtype"),
    case("torch x 0-d", torch_call(x=lambda: torch.tensor(1.0, device=DEVICE), weight=None), ValueError,
         "x must have at least 1 dimension"),
    case("torch x N=0", torch_call(x=T(2, 0), weight=None), ValueError, r"x's last dimension \(N\) must be >= 1"),
    case("torch x jax array", torch_call(x=lambda: jnp.ones((2, 8))), TypeError,
         "x must be a torch.Tensor, got jax.*pallas_norm.rms_norm"),
    case("torch x meta", torch_call(x=lambda: torch.ones(2, 8, device="meta"), weight=None), ValueError,
         "x is on meta; the Pallas backend runs on CPU or CUDA tensors"),
    case("torch float64 on pallas", torch_call(x=T(2, 8, dtype=torch.float64), weight=None), TypeError,
         "x must be float32, bfloat16 or float16 for backend='pallas'.*use backend='triton' for float64"),
    case("torch eps 0", torch_call(eps=0.0), ValueError, "eps must be finite and > 0"),
    case("torch eps nan", torch_call(eps=float("nan")), ValueError, "eps must be finite and > 0"),
    case("torch offset inf", torch_call(offset=float("-inf")), ValueError, "offset must be finite"),
    case("torch offset without weight", torch_call(weight=None, offset=1.0), ValueError, "offset must be 0.0"),
    case("torch casting unknown", torch_call(casting="phi"), ValueError, "casting must be one of"),
    case("torch backend unknown", torch_call(backend="jax"), ValueError, r"backend must be one of \('pallas'"),
    # torch_bridge.RMSNorm
    case("module shape 2-d", module_call(normalized_shape=(4, 8)), ValueError,
         "normalized_shape must be a positive int or a 1-tuple"),
    case("module shape 0", module_call(normalized_shape=0), ValueError, "normalized_shape must be a positive int"),
    case("module backend unknown", module_call(backend="xla"), ValueError, "backend must be one of"),
    case("module offset without weight", module_call(elementwise_affine=False, offset=1.0), ValueError,
         "offset must be 0.0 when weight is None"),
    case("module eps negative", module_call(eps=-1.0), ValueError, "eps must be finite and > 0"),
    case("module dtype int", module_call(dtype=torch.int32), TypeError, "dtype must be a floating torch.dtype"),
    case("module x wrong width", module_call(x=T(2, 7)), ValueError,
         r"x's last dimension must be normalized_shape\[0\]=8, got shape \(2, 7\)"),
    case("module x jax array", module_call(x=lambda: jnp.ones((2, 8))), TypeError, "x must be a torch.Tensor"),
    # torch_bridge.patch_hf_model
    case("patch model not a module", patch_call(model="llama"), TypeError, "model must be a torch.nn.Module, got str"),
    case("patch backend unknown", patch_call(backend="cuda"), ValueError, r"backend must be one of \('pallas'"),
    case("patch verify not bool", patch_call(verify="yes"), TypeError, "verify must be a bool, got str"),
]


def snapshot(args: dict) -> dict:
    """Copies of every tensor argument (torch tensors and a torch model's parameters), to detect writes."""
    out = {}
    for key, v in args.items():
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            out[key] = v.clone()
        elif isinstance(v, torch.nn.Module):
            out.update({f"{key}.{n}": p.detach().clone() for n, p in v.named_parameters()})
    return out


@pytest.mark.parametrize("error_input", ERROR_INPUTS, ids=lambda e: e.name)
def test_error_inputs(error_input):
    args = error_input.args()
    before = snapshot(args)
    gc.collect()  # earlier tests' garbage would otherwise be freed (or not) during the call
    allocated = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    live = jax.live_arrays()  # held, so their ids stay unique
    with pytest.raises(error_input.exc, match=error_input.match) as info:
        error_input.entry(**args)
    if DEVICE == "cuda":
        assert torch.cuda.memory_allocated() <= allocated  # nothing allocated before the error
    assert re.search(r"\b(x|weight|eps|offset|casting|impl|backend|num_features|param_dtype|normalized_shape|dtype|"
                     r"model|verify)\b", str(info.value).split(" must ")[0]), str(info.value)
    after = snapshot(args)
    assert all(torch.equal(before[k], after[k]) for k in before)
    known = {id(a) for a in live}
    assert [a.shape for a in jax.live_arrays() if id(a) not in known] == []


def test_jax_weight_on_another_device():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("one JAX device")
    x, w = jax.device_put(jnp.ones((2, 8)), devices[0]), jax.device_put(jnp.ones(8), devices[1])
    with pytest.raises(ValueError, match=r"weight must be on x's devices"):
        pn.rms_norm(x, w, impl=JAX_IMPL)


def test_the_walk_catches_a_message_without_the_argument_name():
    """A deliberately poor error ("bad input") fails the walk's message check."""
    def poor(x, weight):
        raise ValueError("bad input")
    with pytest.raises(AssertionError):
        test_error_inputs(ErrorInput("poor", poor, lambda: dict(x=1, weight=2), ValueError, "bad input"))


def test_scalar_checks_remembered_per_exact_arguments():
    """``check_scalars`` looks up plain arguments it has already accepted; the lookup must not accept what the
    checks refuse: the same values with a bool, without weight, or as NaN."""
    from pallas_norm.semantics import check_scalars

    assert check_scalars(1, 1, "gemma", has_weight=True) == (1.0, 1.0, "gemma")
    assert check_scalars(1, 1, "gemma", has_weight=True) == (1.0, 1.0, "gemma")
    with pytest.raises(ValueError, match="offset must be 0.0 when weight is None"):
        check_scalars(1, 1, "gemma", has_weight=False)
    with pytest.raises(TypeError, match="eps must be a real number"):
        check_scalars(True, 1, "gemma", has_weight=True)
    with pytest.raises(TypeError, match="offset must be a real number"):
        check_scalars(1, True, "gemma", has_weight=True)
    for _ in range(2):
        with pytest.raises(ValueError, match="eps must be finite"):
            check_scalars(float("nan"), 0.0, "llama", has_weight=True)
