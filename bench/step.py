"""``python -m bench step``: one training step (forward + backward) of Hugging Face decoder stacks, norms by provider.

Llama and Gemma2 causal LMs (random weights; 8 layers, hidden 2048, 16 heads, SDPA attention, vocab 32000, bf16)
on 4 × 2048 tokens: the HF model as is (``hf``), its norms patched by ``torch_bridge.patch_hf_model`` with each torch
backend, and with Liger's RMSNorm function (when ``liger_kernel`` is installed; ``in_place=False``, as Liger's own
Gemma2 patch does, since Gemma2 feeds one gradient into two norms); ``<backend>+fused``: also
``fuse_residual=True`` (every residual add and the norm after it as one ``rms_norm_add``). Every provider gets its
own copy of one model and the providers' steps take turns (``timing.interleaved_samples``), so the ratios to
``hf`` are from the same moments; a fused provider's ratio to its unfused backend is paired by round.
``--profile`` adds the GPU time per step in norm and add kernels (``kernel_us_by_kind``, torch.profiler);
``--trace`` writes one step per provider as a Chrome trace instead of timing (``write_traces``).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable

import torch

from bench import timing
from pallas_norm_tools.tiny_models import tiny_model, tokens
from torch_bridge import RMSNorm, patch_hf_model

FAMILIES = ("llama", "gemma2")
BACKENDS = ("pallas", "pallas_dlpack", "triton")
FUSED = ("pallas+fused", "triton+fused")  # the backend's norms and each layer's residual add fused in
SHAPE = dict(layers=8, hidden=2048, vocab=32000, batch=4, length=2048)


class _LigerNorm(torch.nn.Module):
    """Liger's RMSNorm function in place of one of our patched modules (same weight, eps, offset, casting)."""

    def __init__(self, ours: RMSNorm):
        super().__init__()
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        self.fn, self.weight, self.eps, self.offset, self.casting = (LigerRMSNormFunction.apply, ours.weight,
                                                                      ours.eps, ours.offset, ours.casting)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.eps, self.offset, self.casting, False)


def _with_liger(model: torch.nn.Module) -> torch.nn.Module:
    patch_hf_model(model, backend="triton", verify=False)  # finds each norm's mode; then swapped for Liger's
    for path, module in list(model.named_modules()):
        if isinstance(module, RMSNorm):
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, _LigerNorm(module))
    return model


def models(family: str, providers: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    base = tiny_model(family, layers=SHAPE["layers"], hidden=SHAPE["hidden"], vocab=SHAPE["vocab"],
                      dtype=torch.bfloat16, device="cuda", num_attention_heads=16, num_key_value_heads=8,
                      intermediate_size=4 * SHAPE["hidden"], max_position_embeddings=SHAPE["length"],
                      attn_implementation="sdpa", **({"head_dim": 128} if family.startswith("gemma") else {}))
    out = {}
    for name in providers:
        model = copy.deepcopy(base)
        if name == "liger":
            model = _with_liger(model)
        elif name != "hf":
            backend, _, fused = name.partition("+")
            patch_hf_model(model, backend=backend, verify=False, fuse_residual=bool(fused))
        out[name] = model.train()
    return out


def _step(model: torch.nn.Module, ids: torch.Tensor):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return step


_OUR_KERNELS = ("norm", "_fwd_kernel", "_bwd_kernel", "_dweight_reduce_kernel", "_bwd_rowdot_kernel")


def kernel_us_by_kind(step: Callable[[], object], steps: int = 5) -> dict[str, float]:
    """GPU µs per step (``timing.kernel_us``): in norm kernels (ours, Liger's; HF's norm is elementwise kernels,
    counted only under ``all``), in elementwise adds (the residual adds and gradient sums, and the rotary
    embedding's), and in all kernels."""
    step()
    torch.cuda.synchronize()
    out = {"norm": 0.0, "add": 0.0, "all": 0.0}
    for key, us in timing.kernel_us(step, steps, timing.torch_sync).items():
        name = key.lower()
        out["all"] += us
        if any(k in name for k in _OUR_KERNELS):
            out["norm"] += us
        elif "functor_add" in name:
            out["add"] += us
    return out


def write_traces(out_dir, family: str = "llama", providers: tuple[str, ...] = ("hf", "pallas", "pallas+fused")
                 ) -> list:
    """One step of ``family`` per provider as a Chrome trace (CPU ops and CUDA kernels, ``torch.profiler``) in
    ``out_dir``: where the GPU waits for the host inside a step (``bench.gaps`` reads them)."""
    import pathlib

    from torch.profiler import ProfilerActivity, profile

    ids = tokens(SHAPE["batch"], SHAPE["length"], SHAPE["vocab"], device="cuda")
    paths = []
    for name, model in models(family, providers).items():
        step = _step(model, ids)
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        paths.append(pathlib.Path(out_dir) / f"step_trace_{family}_{name.replace('+', '_')}.json")
        prof.export_chrome_trace(str(paths[-1]))
    return paths


PAIR_STEPS, PAIR_ROUNDS = 10, 30  # fused vs unfused: steps per timed loop, rounds


def fused_vs_unfused(steps: dict[str, Callable], fused: str, rounds: int = PAIR_ROUNDS) -> dict:
    """``fused``'s step time over its backend's, from loops of ``PAIR_STEPS`` steps of the two alone, taking turns
    for ``rounds`` rounds: the median of the per-round ratios and in how many rounds the fused loop was faster.
    A step's GPU time varies by a few % from step to step, more than fusion saves (~1%): the table's 3-step loops
    among seven providers cannot resolve it, this can."""
    base = fused.partition("+")[0]
    samples = timing.interleaved_samples({base: steps[base], fused: steps[fused]}, timing.torch_sync, PAIR_STEPS,
                                         repeats=rounds)
    ratios = [a / b for a, b in zip(samples[fused], samples[base])]
    return dict(ratio=statistics.median(ratios), faster=sum(r < 1 for r in ratios), rounds=len(ratios))


def run(repeats: int = 15, profile: bool = False) -> dict:
    import importlib.util

    providers = ("hf", *BACKENDS, *FUSED) + (("liger",) if importlib.util.find_spec("liger_kernel") else ())
    ids = tokens(SHAPE["batch"], SHAPE["length"], SHAPE["vocab"], device="cuda")
    results, paired, kernels = {}, {}, {}
    for family in FAMILIES:
        built = models(family, providers)
        steps = {k: _step(m, ids) for k, m in built.items()}
        samples = timing.interleaved_samples(steps, timing.torch_sync, 3, repeats=repeats)
        results[family] = {k: 1e3 * statistics.median(s) for k, s in samples.items()}
        paired[family] = {k: fused_vs_unfused(steps, k) for k in FUSED}
        if profile:
            kernels[family] = {k: kernel_us_by_kind(_step(m, ids)) for k, m in built.items()}
        del built
        torch.cuda.empty_cache()
    return dict(env=timing.environment(copy_tbps=timing.copy_tbps()), shape=SHAPE, ms=results, fused_vs_unfused=paired,
                **({"kernel_us": kernels} if profile else {}))


def markdown(result: dict) -> str:
    env, shape = result["env"], result["shape"]
    out = [f"# One training step of HF decoder stacks on {env['gpu']}", "",
           f"{env['date']} · jax {env['jax']} · torch {env['torch']} · triton {env['triton']}. Made by `python -m "
           f"bench step`: {shape['layers']} layers, hidden {shape['hidden']}, {shape['batch']} × {shape['length']} "
           f"tokens, vocab {shape['vocab']}, bf16, SDPA attention; forward + backward, median of interleaved loops.",
           "", "``× unfused``: the fused provider's step time over its backend's unfused one, median over rounds of "
           f"the ratio within a round (drift between rounds cancels); from loops of {PAIR_STEPS} steps of the two "
           "alone taking turns, with the rounds in which the fused loop was faster.", "",
           "| family | provider (norms) | ms per step | × HF | × unfused |", "|---|---|---|---|---|"]
    for family, times in result["ms"].items():
        paired = result.get("fused_vs_unfused", {}).get(family, {})
        for name, ms in times.items():
            out.append(f"| {family} | {name} | {ms:.1f} | {ms / times['hf']:.3f} | {_ratio_cell(paired.get(name))} |")
    if "kernel_us" in result:
        out += ["", "GPU µs per step in kernels (``--profile``: torch.profiler, 5 steps): norm kernels (ours, "
                "Liger's; HF's norm runs as elementwise kernels, under all), elementwise adds (residual adds, "
                "gradient sums, rotary embedding), all kernels.", "",
                "| family | provider (norms) | norm µs | add µs | norm + add µs | all kernels ms |",
                "|---|---|---|---|---|---|"]
        for family, by_provider in result["kernel_us"].items():
            for name, us in by_provider.items():
                out.append(f"| {family} | {name} | {us['norm']:.0f} | {us['add']:.0f} | {us['norm'] + us['add']:.0f} | "
                           f"{us['all'] / 1e3:.1f} |")
    return "\n".join(out) + "\n"


def _ratio_cell(paired: float | dict | None) -> str:
    """A fused provider's ``× unfused`` (runs before ``fused_vs_unfused`` stored the bare ratio)."""
    if paired is None:
        return ""
    if isinstance(paired, float):
        return f"{paired:.4f}"
    return f"{paired['ratio']:.4f} (faster in {paired['faster']}/{paired['rounds']} rounds)"


def plot(result: dict, path) -> None:
    """Bars of ms per step, one panel per family, HF eager first."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = result["ms"]
    fig, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 3.8))
    for ax, (family, times) in zip(axes, families.items()):
        names = list(times)
        ax.barh(names, [times[k] for k in names])
        for i, k in enumerate(names):
            ax.text(times[k], i, f" {times[k]:.1f} ({times[k] / times['hf']:.2f}×)", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.25 * max(times.values()))
        ax.set_title(f"{family}: ms per training step (norms by provider)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
