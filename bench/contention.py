"""``python -m bench contention``: the column-band kernels beside other streams' work.

A band grid's row group runs at speed only while all its bands are resident at once (each waits for its peers' row
sums; one that waits ``SPIN_LIMIT`` polls recomputes them: correct, slow). A grid that asks for every program slot
of the GPU is fast alone and loses a group as soon as any other kernel holds one slot. This times both stacks' band
kernels (the heuristics' band layout, ``min_cols=0``) alone and while ``k`` one-thread kernels
(``torch.cuda._sleep``), each on its own stream, hold a slot each; once with the grid the heuristics launch
(``band_tables.BANDS_SPARE`` slots left free) and once with every slot asked (no spare). CUDA events around
``REPS`` back-to-back calls on the current stream, the sleepers launched just before.
"""

from __future__ import annotations

from bench import timing

SHAPES = ((4096, 16384), (32768, 16384), (8192, 32768), (4096, 65536), (1024, 262144))
SLEEPERS = (0, 1, 4)
REPS = 10
SLEEP_S = 0.05  # each sleeper's length: longer than REPS calls of the slowest case


def _seconds(fn, sleepers: int, streams) -> float:
    import torch

    for stream in streams[:sleepers]:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(2e9 * SLEEP_S))  # cycles: ~SLEEP_S at the H100's ~2 GHz
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS * 1e-3


def _calls(m: int, n: int, backward: bool, x, w, dy, rstd) -> dict[str, tuple]:
    """``{kernel: (programs, call)}`` for the Triton reference and the Pallas kernels (XLA's binaries launched by
    torch) on the heuristics' band layout at the current ``BANDS_SPARE``."""
    from pallas_norm import backend, pallas_config
    from torch_bridge import launch_route, triton_config, triton_kernels

    tc = triton_config.bands_config(n, backend.num_sms(), backward=backward, min_n=0)
    pc = pallas_config.bands_config(m, n, backward=backward, min_cols=0)
    if backward:
        launcher = launch_route.backward_launcher(m, n, x.dtype, w.dtype, 0.0, "llama", x.get_device(), pc)
        return {"triton": (tc.groups * -(-n // tc.block_n),
                           lambda: triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True, config=tc)),
                "pallas": (pc.programs, lambda: launcher(x, w, dy, rstd))}
    launcher = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, "llama", x.get_device(), pc)
    return {"triton": (tc.groups * -(-n // tc.block_n),
                       lambda: triton_kernels.rms_norm_fwd(x, w, timing.EPS, 0.0, "llama", config=tc)),
            "pallas": (pc.programs, lambda: launcher(x, w))}


def run(shapes=SHAPES) -> dict:
    import torch

    from pallas_norm import band_tables
    from torch_bridge import triton_kernels

    streams = [torch.cuda.Stream() for _ in range(max(SLEEPERS))]
    spare = band_tables.BANDS_SPARE
    rows = []
    for m, n in shapes:
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        _, rstd = triton_kernels.rms_norm_fwd(x, w, timing.EPS, 0.0, "llama")
        for backward in (False, True):
            mode = "bwd" if backward else "fwd"
            for slots_free in (spare, 0):
                band_tables.BANDS_SPARE = slots_free
                try:
                    calls = _calls(m, n, backward, x, w, dy, rstd)
                finally:
                    band_tables.BANDS_SPARE = spare
                for kernel, (programs, fn) in calls.items():
                    fn()
                    torch.cuda.synchronize()
                    tbps = {k: timing.tbps(mode, m, n, x.element_size(), _seconds(fn, k, streams)) for k in SLEEPERS}
                    rows.append(dict(kernel=kernel, mode=mode, m=m, n=n, spare=slots_free, programs=programs,
                                     tbps={str(k): v for k, v in tbps.items()}))
                    print(f"contention: {kernel} {mode} {m}x{n} spare {slots_free}: "
                          + " / ".join(f"{v:.2f}" for v in tbps.values()), flush=True)
        del x, w, dy, rstd
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype="bfloat16", casting="llama", copy_tbps=timing.copy_tbps()), rows=rows,
                spare=spare, sleepers=list(SLEEPERS))


def markdown(result: dict) -> str:
    env = result["env"]
    heads = " | ".join("alone" if k == 0 else f"beside {k}" for k in result["sleepers"])
    out = [f"# Band kernels beside other streams' work: {env['gpu']}, bfloat16, casting=llama", "",
           f"{timing.versions(env)} · copy "
           f"{env['copy_tbps']:.2f} TB/s. Made by `python -m bench contention`. TB/s of each stack's band kernels "
           f"(the heuristics' layout) alone and beside k one-thread kernels on other streams (each holding one "
           f"program slot), with the grid the heuristics launch ({result['spare']} slots left free) and with every "
           "slot asked (spare 0). `programs`: the grid (bands × row groups).", "",
           f"| kernel | mode | M×N | spare | programs | {heads} |",
           "|---|---|---|---|---|" + "---|" * len(result["sleepers"])]
    for r in result["rows"]:
        cells = " | ".join(f"{r['tbps'][str(k)]:.2f}" for k in result["sleepers"])
        out.append(f"| {r['kernel']} | {r['mode']} | {r['m']}×{r['n']} | {r['spare']} | {r['programs']} | {cells} |")
    return "\n".join(out) + "\n"
