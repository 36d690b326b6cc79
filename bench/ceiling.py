"""``python -m bench ceiling``: what a copy reaches at each shape's size, beside the default kernels.

The suite's percentages divide by one copy of 2 GiB (``timing.copy_tbps``). A call that moves tens of MB pays
fixed costs a 2 GiB copy hides (the grid's ramp-up, the first DRAM latency, the tail), so its ceiling is lower.
This measures, per shape, a torch ``copy_`` moving the same bytes as the norm (forward: M·N·s read and written;
backward: 1.5·M·N·s read and written, the same 3·M·N·s), timed as the suite times JAX providers (the kernels' own
durations over ``timing.rotations`` buffer sets, past L2), and ``rms_norm(impl=None)``'s forward and backward in the
same process, the same way. The backward reads two arrays and writes one; a copy reads one: ``add`` is XLA's
elementwise ``x + dy`` (JAX, jitted: launched as our JAX kernels are), the backward's three streams and bytes with
nothing else, timed the same way.
"""

from __future__ import annotations

from bench import timing

SHAPES = tuple((4096, n) for n in (1024, 2048, 2304, 3584, 4096, 5120, 8192, 16384)) + (
    (32768, 1024), (32768, 2304), (32768, 4096), (32768, 16384))


def copy_tbps(nbytes: int) -> float:
    """TB/s (read + written) of a torch ``copy_`` of ``nbytes``, by its kernels' durations, over rotated buffers."""
    import torch

    reps = timing.rotations(nbytes)
    pairs = [(torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(),
              torch.empty(nbytes, dtype=torch.uint8, device="cuda")) for _ in range(reps)]

    def run():
        for src, dst in pairs:
            dst.copy_(src)
        return pairs[-1][1]

    run()
    us = sum(timing.kernel_us(run, 20, timing.torch_sync).values()) / reps
    return 2 * nbytes / us / 1e6


def add_tbps(x, dy) -> float:
    """TB/s (two read, one written) of XLA's ``x + dy``, by its kernels' durations over ``jax_modes``' rotated JAX
    copies (as the suite times JAX providers): the add is ``jax_modes``' forward, ``dy`` in the weight's place."""
    from bench.providers import jax_modes

    fwd = jax_modes(lambda a, b: a + b, x, dy, dy)["fwd"]
    return timing.tbps("bwd", *x.shape, x.element_size(), timing.time_jax(fwd))


def run(shapes=SHAPES) -> dict:
    import torch

    import pallas_norm
    from bench.providers import jax_modes

    rows = []
    for m, n in shapes:
        x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
        size = m * n * x.element_size()
        fns = jax_modes(lambda a, b: pallas_norm.rms_norm(a, b, eps=timing.EPS), x, w, dy)
        row = dict(m=m, n=n, copy_fwd=copy_tbps(size), copy_bwd=copy_tbps(3 * size // 2), add=add_tbps(x, dy))
        for mode in ("fwd", "bwd"):
            row[mode] = timing.tbps(mode, m, n, x.element_size(), timing.time_jax(fns[mode]))
        rows.append(row)
        del x, w, dy, fns
        torch.cuda.empty_cache()
    return dict(env=timing.environment(copy_tbps=timing.copy_tbps()), rows=rows)


def markdown(result: dict) -> str:
    env = result["env"]
    big = env["copy_tbps"]
    out = [f"# The copy ceiling at each shape's size: {env['gpu']}, bfloat16, casting=llama", "",
           f"{timing.versions(env)} · copy of 2 GiB "
           f"{big:.2f} TB/s (this run, the suite's ceiling). Made by `python -m bench ceiling`. `copy`: a torch "
           "`copy_` moving the norm's bytes (fwd M·N·s each way, bwd 1.5·M·N·s each way), its kernels timed over "
           "rotated buffers as the suite times JAX providers; `ours`: `rms_norm(impl=None)` in JAX, timed the same "
           "way; `add`: XLA's `x + dy` (two arrays read, one written: the backward's streams and bytes), launched by "
           "JAX and timed the same way. TB/s (% of the 2 GiB copy); `of copy`, `of add`: ours over the same-size "
           "copy, over the add.", "",
           "| M×N | MB moved (fwd) | copy fwd | ours fwd | of copy | copy bwd | add | ours bwd | of copy | of add |",
           "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(v: float) -> str:
        return f"{v:.2f} ({100 * v / big:.0f}%)"

    for r in result["rows"]:
        mb = 2 * r["m"] * r["n"] * 2 / 1e6
        add, of_add = (cell(r["add"]), f"{100 * r['bwd'] / r['add']:.0f}%") if "add" in r else ("–", "–")
        out.append(f"| {r['m']}×{r['n']} | {mb:.0f} | {cell(r['copy_fwd'])} | {cell(r['fwd'])} | "
                   f"{100 * r['fwd'] / r['copy_fwd']:.0f}% | {cell(r['copy_bwd'])} | {add} | {cell(r['bwd'])} | "
                   f"{100 * r['bwd'] / r['copy_bwd']:.0f}% | {of_add} |")
    return "\n".join(out) + "\n"
