"""The Triton reference kernel as a torch backend (``custom_ops`` family ``"triton"``:
``pallas_norm::triton_rms_norm_fwd/bwd``, backend ``"triton"``).

CUDA tensors run the Triton kernels; CPU tensors run them under Triton's interpreter when ``TRITON_INTERPRET=1``
was set before import, else fall back to the plain-torch formula (``torch_bridge.eager``: same semantics and
rounding points). float64 is supported (for ``gradcheck``).
"""

from __future__ import annotations

import torch

from torch_bridge import custom_ops, eager, fused_ops, triton_kernels


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or (triton_kernels.INTERPRET and x.device.type == "cpu")


def _forward(x, weight, eps, offset, casting):
    if _use_triton(x):
        return triton_kernels.rms_norm_fwd(x, weight, eps, offset, casting)
    return eager.rms_norm_ref_forward(x, weight, eps, offset=offset, casting=casting)


def _forward_y(x, weight, eps, offset, casting):
    if x.is_cuda:  # rstd goes to a scratch buffer: one allocation fewer
        return triton_kernels.rms_norm_fwd(x, weight, eps, offset, casting,
                                           rstd=custom_ops.rstd_scratch(x, custom_ops.rows(x)[0]))[0]
    return _forward(x, weight, eps, offset, casting)[0]


def _backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight):
    if _use_triton(x):
        return triton_kernels.rms_norm_bwd(dy, x, weight, rstd, offset, casting, need_dx, need_dweight)
    dx, dweight = eager.rms_norm_ref_backward(dy, x, weight, offset=offset, casting=casting, rstd=rstd)
    return (dx if need_dx else None), (dweight if need_dweight else None)


custom_ops.define("triton", {"triton": custom_ops.Kernels(_forward, _backward, _forward_y)})


def _add_forward(x, residual, weight, eps, offset, casting, h_dtype):
    if _use_triton(x):
        return triton_kernels.rms_norm_fwd(x, weight, eps, offset, casting, residual=residual, h_dtype=h_dtype)
    return eager.rms_norm_add_ref_forward(x, residual, weight, eps, offset=offset, casting=casting, h_dtype=h_dtype)


def _add_backward(dy, dh_out, h, weight, rstd, offset, casting, need_dweight):
    if _use_triton(h):
        return triton_kernels.rms_norm_bwd(dy, h, weight, rstd, offset, casting, True, need_dweight, dh_out=dh_out)
    dh, dweight = eager.rms_norm_ref_backward(dy, h, weight, offset=offset, casting=casting, rstd=rstd, dh_out=dh_out)
    return dh, (dweight if need_dweight else None)


fused_ops.define("triton", {"triton": fused_ops.AddKernels(_add_forward, _add_backward)})
