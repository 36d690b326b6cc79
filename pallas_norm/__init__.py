"""pallas-norm: RMSNorm written once in JAX Pallas (forward + backward), for JAX and PyTorch.

``rms_norm`` is the differentiable entry point (``rms_norm_add`` the residual add fused with it);
``rms_norm_reference`` the plain ``jax.numpy`` formula; ``pallas_norm.nnx.RMSNorm`` the Flax module (imported on
first use). This package depends on JAX, NumPy and
Flax only: the PyTorch side (``torch_bridge``) and the cross-stack tools (``pallas_norm_tools``) build on it.
"""

from __future__ import annotations

import importlib

from .api import IMPLS, rms_norm, rms_norm_with_rstd
from .fused_add import rms_norm_add
from .mosaic_config import MosaicConfig
from .pallas_config import Config
from .semantics import CASTINGS
from .xla import rms_norm_reference

__all__ = ["CASTINGS", "Config", "IMPLS", "MosaicConfig", "rms_norm", "rms_norm_add", "rms_norm_reference",
           "rms_norm_with_rstd", "nnx"]
__version__ = "0.2.0"  # the one version string (pyproject.toml reads it; `pallas-norm --version` prints it)


def __getattr__(name: str):
    if name == "nnx":
        return importlib.import_module(".nnx", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
