"""``python -m bench carveout``: the same Triton-lowered Pallas binaries launched by XLA and by torch.

XLA's CUDA runtime asks for the most shared memory (``cuFuncSetCacheConfig(CU_FUNC_CACHE_PREFER_SHARED)``) for
every kernel it launches with dynamic shared memory, which leaves the least L1. Each row times one kernel config
(the Triton lowering's heuristic) three ways, by the kernels' own durations: XLA's binaries launched from torch
(``launch_route``) with the driver's default carveout, the same after ``set_carveout(100)``, and the JAX call on
the same buffers. The two last agreeing, away from the first, says the carveout is what XLA's launch costs.
"""

from __future__ import annotations

from bench import timing

SHAPES = (("fwd", 32768, 4096), ("fwd", 32768, 16384), ("fwd", 8192, 32768), ("fwd", 1024, 262144),
          ("bwd", 32768, 1024), ("bwd", 32768, 4096), ("bwd", 32768, 16384), ("bwd", 2048, 131072))
MAX_SHARED = 100
COLUMNS = (("torch_default", "launched by torch, default carveout"),
           ("torch_max_shared", "launched by torch, carveout 100"), ("jax", "launched by XLA (JAX)"))


def _tbps(nbytes: int, run, sync) -> float:
    sync(run())
    return nbytes / sum(timing.kernel_us(run, 20, sync).values()) / 1e6


def run(shapes=SHAPES) -> dict:
    import jax
    import torch

    from pallas_norm import api, pallas_config
    from torch_bridge import launch_route

    rows = []
    for mode, m, n in shapes:
        backward = mode == "bwd"
        cfg = pallas_config.heuristic(m, n, backward=backward)
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        dev = x.get_device()
        forward = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, "llama", dev,
                                                pallas_config.heuristic(m, n, backward=False))
        if backward:  # JAX runs what the API runs for this config (the band kernels' own launcher for a band config)
            launcher = launch_route.backward_launcher(m, n, x.dtype, w.dtype, 0.0, "llama", dev, cfg)
            args, step = (x, w, dy, forward(x, w)[1]), jax.jit(api.backward_fn(0.0, "llama", "pallas", True, cfg))
        else:
            launcher, args = forward, (x, w)
            step = jax.jit(api.forward_fn(timing.EPS, 0.0, "llama", "pallas", cfg))
        nbytes = (3 if backward else 2) * m * n * x.element_size()
        row = dict(mode=mode, m=m, n=n, config=repr(cfg),
                   torch_default=_tbps(nbytes, lambda: launcher(*args), timing.torch_sync))
        with timing.carveout(launcher.kernels, MAX_SHARED):
            row["torch_max_shared"] = _tbps(nbytes, lambda: launcher(*args), timing.torch_sync)
        jargs = [jax.dlpack.from_dlpack(a) for a in args]
        row["jax"] = _tbps(nbytes, lambda: step(*jargs), jax.block_until_ready)
        rows.append(row)
    return dict(env=timing.environment(copy_tbps=timing.copy_tbps()), rows=rows)


def markdown(result: dict) -> str:
    env = result["env"]
    out = [f"# One binary, two launchers: {env['gpu']}, bfloat16, casting=llama", "",
           f"{timing.versions(env)} · copy "
           f"{env['copy_tbps']:.2f} TB/s (this run). Made by `python -m bench carveout`; TB/s from the kernels' own "
           "durations (the Triton lowering's heuristic config; bytes fwd 2·M·N·s, bwd 3·M·N·s).", "",
           "| mode | M×N | " + " | ".join(label for _, label in COLUMNS) + " | JAX vs torch default |",
           "|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for r in result["rows"]:
        cells = " | ".join(f"{r[key]:.2f}" for key, _ in COLUMNS)
        gap = 100 * (r["jax"] / r["torch_default"] - 1)
        out.append(f"| {r['mode']} | {r['m']}×{r['n']} | {cells} | {gap:+.0f}% |")
    return "\n".join(out) + "\n"
