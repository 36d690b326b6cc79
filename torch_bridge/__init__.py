"""PyTorch side of pallas-norm.

``rms_norm`` and ``RMSNorm`` (``rms_norm_add`` and ``FusedAddRMSNorm``: the residual add fused in) run the Pallas
kernels (the same ones ``pallas_norm`` runs in JAX) or the Triton reference kernel; all are autograd-aware and
``torch.compile``-friendly custom ops (``custom_ops``, ``fused_ops``).
``patch_hf_model`` swaps them into Hugging Face models; ``torch_bridge.eager`` holds the plain-torch formula.
Depends on ``pallas_norm`` (and torch, triton); the cross-stack tools (``pallas_norm_tools``) build on it.
"""

from torch_bridge.eager import rms_norm_ref, rms_norm_ref_backward, rms_norm_ref_forward
from torch_bridge.hf import patch_hf_model, unpatch_hf_model
from torch_bridge.module import FusedAddRMSNorm, RMSNorm
from torch_bridge.ops import BACKENDS, rms_norm, rms_norm_add

__all__ = ["BACKENDS", "FusedAddRMSNorm", "RMSNorm", "patch_hf_model", "rms_norm", "rms_norm_add", "rms_norm_ref",
           "rms_norm_ref_backward", "rms_norm_ref_forward", "unpatch_hf_model"]
