"""Where the host time of one small bridge call goes (launch route, 8×4096 bf16), step by step.

    PYTHONPATH=. python -m bench.bridge_overhead

Each row times a loop of 5000 calls of one layer of the call stack, synchronised once; the differences between
rows are the cost of each layer (argument checks, autograd, route dispatch, allocation, the launch itself).
"""

from __future__ import annotations

import torch

from bench.bridge_bench import per_call, torch_sync
from pallas_norm.semantics import check_scalars
from torch_bridge import dlpack_route, jax_device, launch_route, ops, pallas_ops, rms_norm

EPS = 1e-6


def main() -> None:
    x = torch.randn(8, 4096, device="cuda").to(torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    key = (8, 4096, x.dtype, w.dtype, EPS, 0.0, "llama")
    launcher = launch_route.forward_launcher(*key, 0)
    go = launcher.launches[0]
    y, rstd = torch.empty_like(x), torch.empty(8, device="cuda")
    n = x.shape[-1]
    device = jax_device.jax_device_for(x)
    xj, wj = dlpack_route.to_jax(x, device), dlpack_route.to_jax(w, device)
    jitted = dlpack_route._forward_jit(EPS, 0.0, "llama", "pallas")
    yj, _ = jitted(xj, wj)
    steps = {
        "torch F.rms_norm (reference)": lambda: torch.nn.functional.rms_norm(x, (n,), w, EPS),
        "torch F.rms_norm, requires_grad inputs": lambda: torch.nn.functional.rms_norm(xg, (n,), wg, EPS),
        "rms_norm(backend='pallas_launch'), requires_grad inputs": lambda: rms_norm(xg, wg, EPS, backend="pallas_launch"),
        "rms_norm(backend='pallas_launch'), inference (no autograd node)": lambda: rms_norm(x, w, EPS, backend="pallas_launch"),
        "PallasRMSNormFunction.apply (no checks)": lambda: pallas_ops.PallasRMSNormFunction.apply(
            x, w, EPS, 0.0, "llama", "launch"),
        "pallas_ops.forward_impl": lambda: pallas_ops.forward_impl(x, w, EPS, 0.0, "llama", "launch"),
        "Launcher call (2 torch.empty + launch)": lambda: launcher(x, w, out_shapes=((8, 4096), (8,))),
        "C launch alone (preallocated outputs)": lambda: go(torch._C._cuda_getCurrentRawStream(0), x, w, y, rstd),
        "2× torch.empty": lambda: (torch.empty((8, 4096), dtype=x.dtype, device=x.device),
                                   torch.empty((8,), dtype=torch.float32, device=x.device)),
        "argument checks (check_scalars + check_tensors)": lambda: (check_scalars(EPS, 0.0, "llama", has_weight=True),
                                                                    ops.check_tensors(x, w)),
        "forward_launcher lru_cache lookup": lambda: launch_route.forward_launcher(*key, 0),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "rms_norm(backend='pallas') (DLPack route)": lambda: rms_norm(x, w, EPS, backend="pallas"),
        "dlpack_route.forward": lambda: dlpack_route.forward(x, w, EPS, 0.0, "llama"),
        "to_jax (one tensor)": lambda: dlpack_route.to_jax(x, device),
        "jitted JAX call": lambda: jitted(xj, wj),
        "to_torch (one array)": lambda: dlpack_route.to_torch(yj),
        "jax_device_for": lambda: jax_device.jax_device_for(x),
    }
    lines = [f"| {1e6 * per_call(fn, torch_sync, 5000):.1f} | {name} |" for name, fn in steps.items()]
    print("| µs per call | layer |\n|---|---|\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
