"""PyTorch side of pallas-norm: ``rms_norm`` (autograd-aware, ``torch.compile``-friendly custom ops).

The Triton backend is the reference kernel; ``torch_bridge.reference`` holds the plain-torch formulas.
"""

from torch_bridge.ops import BACKENDS, rms_norm
from torch_bridge.reference import rms_norm_ref, rms_norm_ref_backward, rms_norm_ref_forward

__all__ = ["BACKENDS", "rms_norm", "rms_norm_ref", "rms_norm_ref_backward", "rms_norm_ref_forward"]
