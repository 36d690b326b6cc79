"""One registry of implementation names (``pallas_norm.registry``): both APIs, the parity matrix, the benchmark and
the CLI read it, so a name means the same everywhere."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

import pallas_norm as pn
import torch_bridge
from bench import names as bench_names
from pallas_norm import backend, registry
from pallas_norm_tools import cli, parity

from helpers import KERNEL, assert_same_bits, torch_inputs, torch_results


def test_every_reader_takes_its_names_from_the_registry():
    assert pn.IMPLS == registry.JAX_IMPLS and torch_bridge.BACKENDS == registry.TORCH_BACKENDS
    assert len(registry.BY_NAME) == len(registry.IMPLEMENTATIONS)  # names are unique
    assert set(parity.implementations("cpu")) == {"interpret", "mosaic_interpret", "xla", "pallas_dlpack", "triton"}
    mosaic = {"mosaic"} if backend.mosaic_capable() else set()
    assert set(parity.implementations("cuda")) == {"auto", "pallas", "xla", "pallas_launch", "pallas_dlpack",
                                                   "triton"} | mosaic
    assert set(bench_names.OURS) <= set(registry.BY_NAME) and not set(bench_names.PEER_LABELS) & set(registry.BY_NAME)
    train = next(a for a in cli.parser()._subparsers._group_actions[0].choices["train"]._actions
                 if a.dest == "backend")
    assert tuple(train.choices) == registry.TORCH_BACKENDS and train.default == registry.DEFAULT_TORCH_BACKEND


def test_names_are_refused_by_the_other_stack():
    with pytest.raises(ValueError, match=r"impl must be None or one of \('auto', 'pallas', 'interpret', 'xla', "
                                         r"'mosaic', 'mosaic_interpret'\)"):
        pn.rms_norm(jnp.ones((2, 8)), impl="pallas_dlpack")
    with pytest.raises(ValueError, match=r"backend must be one of \('pallas', 'pallas_launch', 'pallas_dlpack', "
                                         r"'triton'\), got 'interpret'"):
        torch_bridge.rms_norm(torch.ones(2, 8), backend="interpret")


def test_the_default_alias_is_its_implementation():
    """``"pallas"`` is ``pallas_launch`` on CUDA and ``pallas_dlpack`` elsewhere; both promise the JAX kernel's bits."""
    x, w, dy = torch_inputs((5, 96), torch.bfloat16, 1.0, seed=3)
    kw = dict(offset=1.0, casting="gemma")
    default = torch_results(x, w, dy, backend=registry.DEFAULT_TORCH_BACKEND, **kw)
    assert_same_bits(default, torch_results(x, w, dy, backend=registry.resolve_torch("pallas", x.is_cuda), **kw))
    assert registry.resolve_torch("pallas", True) == "pallas_launch"
    assert registry.resolve_torch("pallas", False) == registry.resolve_torch("pallas_dlpack", True) == "pallas_dlpack"
    assert all(registry.BY_NAME[n].same_bits_as == "auto" for n in registry.TORCH_ALIASES["pallas"])
    assert KERNEL in registry.BY_NAME
    module = torch_bridge.RMSNorm(8)
    assert "backend='pallas' (runs 'pallas_dlpack')" in repr(module)
    assert "(runs 'pallas_launch' on CUDA, 'pallas_dlpack' elsewhere)" in repr(
        torch_bridge.RMSNorm(8, elementwise_affine=False))
