"""``python -m bench kernels``: where a provider's time goes, kernel by kernel, timed as the suite times it.

The suite sums every kernel of a call (``timing.time_kernels``); here each kernel's own µs per op is kept
(``timing.settled_kernel_us``, CUPTI through ``torch.profiler``) for the providers, shapes and modes asked, over the
suite's rotated inputs and after its settle. It answers "which kernels ran and which one grew" in one call: e.g.
whether a backward took the resident tile or column bands (their kernel names differ), or what its dweight reduction
costs beside its main kernel. TB/s are the suite's (``timing.tbps``: fwd 2·M·N·s, bwd 3·M·N·s, fwd+bwd 5·M·N·s).
"""

from __future__ import annotations

from bench import timing
from bench.names import label

ITERS = 20


def breakdown(kernel_us: dict[str, float], reps: int) -> dict[str, float]:
    """µs per op of each kernel (``kernel_us``: per call of ``reps`` ops), slowest first."""
    return dict(sorted(((name, us / reps) for name, us in kernel_us.items()), key=lambda kv: -kv[1]))


def run(shapes, dtype: str, casting: str, providers: tuple[str, ...], modes: tuple[str, ...] = timing.MODES) -> dict:
    """Each provider × shape × mode: its kernels' µs per op and the total's TB/s."""
    import torch

    from bench.providers import providers as build_providers

    offset = timing.casting_offset(casting)
    rows = []
    for m, n in shapes:
        x, w, dy = timing.inputs(m, n, getattr(torch, dtype), offset)
        for provider in build_providers(providers):
            fns = provider.build(x, w, dy, offset, casting)
            for mode in modes:
                fn = fns[mode]
                kernels = breakdown(timing.settled_kernel_us(fn, timing.sync_any, ITERS), getattr(fn, "reps", 1))
                total = sum(kernels.values())
                rows.append(dict(provider=provider.name, mode=mode, m=m, n=n, kernels=kernels, us=total,
                                 tbps=timing.tbps(mode, m, n, x.element_size(), total * 1e-6)))
        del x, w, dy
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype=dtype, casting=casting), rows=rows)


def markdown(result: dict) -> str:
    env = result["env"]
    out = [f"# Kernels per op: {env['gpu']}, {env['dtype']}, casting={env['casting']}", "",
           f"{timing.versions(env)}. Made by `python -m "
           f"bench kernels`: each kernel's own µs per op (CUPTI, {ITERS} calls over the suite's rotated inputs, L2 "
           "settled), slowest first; TB/s of their sum, as the suite counts bytes.", "",
           "| provider | M×N | mode | TB/s | µs | kernels (µs) |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        parts = "; ".join(f"`{name[:60]}` {us:.2f}" for name, us in r["kernels"].items())
        out.append(f"| {label(r['provider'])} | {r['m']}×{r['n']} | {r['mode']} | {r['tbps']:.3f} | {r['us']:.2f} | "
                   f"{parts} |")
    return "\n".join(out) + "\n"
