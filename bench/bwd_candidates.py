"""``python -m bench.bwd_candidates MxN,...``: the resident backward's heuristic against candidate tilings, for
``rms_norm`` and for the fused add (``rms_norm_add``), as launched binaries timed by CUDA events (``bench sweep``'s
method), with each main kernel's registers and spill bytes. Prints one line per (shape, op, config); the committed
table is bench/results/sweep_h100_bwd_2026-11-24.md. Candidates: (elements per program, warps, programs per SM,
prefetch).
"""

from __future__ import annotations

import sys

import torch

from bench import timing
from pallas_norm import backend, pallas_config
from pallas_norm.pallas_config import Config, next_pow2
from torch_bridge import launch_route

CANDIDATES = [(8192, 16, 1, True), (8192, 8, 1, True), (16384, 16, 1, True), (8192, 16, 1, False),
              (4096, 16, 1, True), (16384, 16, 1, False)]


def run(shapes: list[tuple[int, int]]) -> None:
    dev, sms = torch.cuda.current_device(), backend.num_sms()
    for m, n in shapes:
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        r, _, dh = timing.inputs(m, n, torch.bfloat16, 0.0, seed=3)
        y, h, rstd = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, "llama", dev, None,
                                                   x.dtype, x.dtype)(x, r, w)
        n_pad = next_pow2(n)
        configs = [None] + [Config(max(1, e // n_pad), n_pad, warps, programs=per_sm * sms, prefetch=pf)
                            for e, warps, per_sm, pf in CANDIDATES if e >= n_pad]
        for fused in (False, True):
            for cfg in configs:
                launcher = launch_route.backward_launcher(m, n, x.dtype, w.dtype, 0.0, "llama", dev, cfg, fused)
                args = (h, w, dy, dh, rstd) if fused else (x, w, dy, rstd)
                seconds = timing.time_torch(lambda: launcher(*args))
                main = launcher.kernels[-2]  # the last kernel sums dweight
                name = f"{cfg or pallas_config.heuristic(m, n, backward=True)}{' (heuristic)' if cfg is None else ''}"
                print(f"{m}x{n} {'fused' if fused else 'plain'} {(4 if fused else 3) * m * n * 2 / seconds / 1e12:.2f}"
                      f" TB/s {name} {main.registers} regs {main.local_bytes} B", flush=True)
        del x, w, dy, r, dh, y, h, rstd
        torch.cuda.empty_cache()


if __name__ == "__main__":
    run([tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")])
