"""PyTorch side of pallas-norm.

``rms_norm`` and ``RMSNorm`` run the Pallas kernels (the same ones ``pallas_norm`` runs in JAX) or the Triton
reference kernel; both are autograd-aware and ``torch.compile``-friendly custom ops (``custom_ops``).
``patch_hf_model`` swaps them into Hugging Face models; ``torch_bridge.eager`` holds the plain-torch formula.
Depends on ``pallas_norm`` (and torch, triton); the cross-stack tools (``pallas_norm_tools``) build on it.
"""

from torch_bridge.eager import rms_norm_ref, rms_norm_ref_backward, rms_norm_ref_forward
from torch_bridge.hf import patch_hf_model, unpatch_hf_model
from torch_bridge.module import RMSNorm
from torch_bridge.ops import BACKENDS, rms_norm

__all__ = ["BACKENDS", "RMSNorm", "patch_hf_model", "rms_norm", "rms_norm_ref", "rms_norm_ref_backward",
           "rms_norm_ref_forward", "unpatch_hf_model"]
