"""Benchmark the Triton RMSNorm against torch and the HF formula on a CUDA GPU.

Bandwidth counts the bytes an RMSNorm must move: forward 2·M·N·s (read x, write y), backward 3·M·N·s
(read x and dy, write dx); copy counts bytes read + written. Times are ``triton.testing.do_bench`` medians.
Each tensor is >= 256 MiB (well over L2), so inputs are not rotated.

    python -m bench.triton_bench [--out bench/results/triton_h100.md] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import pathlib

import torch
import triton
from triton.testing import do_bench

from torch_bridge import rms_norm, triton_kernels

SHAPES = ((32768, 4096), (65536, 2304), (1024, 262144))
EPS = 1e-6


def hf_llama(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF LlamaRMSNorm.forward: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def fwd_bwd_ms(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[float, float]:
    """(forward ms, backward ms); the backward is timed alone on a retained graph (dx and dweight)."""
    with torch.no_grad():
        fwd = median_ms(lambda: fn(x, w))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(xr, wr)
    bwd = median_ms(lambda: torch.autograd.grad(y, (xr, wr), dy, retain_graph=True))
    return fwd, bwd


def ours_ms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[float, float]:
    """Our kernels called directly (no autograd bookkeeping in the timed region)."""
    fwd = median_ms(lambda: triton_kernels.rms_norm_fwd(x, w, EPS, 0.0, "llama"))
    _, rstd = triton_kernels.rms_norm_fwd(x, w, EPS, 0.0, "llama")
    bwd = median_ms(lambda: triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True))
    return fwd, bwd


def sweep(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> list[str]:
    """Our kernel under a few tile / warp / grid settings (restored afterwards)."""
    m, n = x.shape
    s = x.element_size()
    knobs = ("TILE_ELEMS", "NUM_WARPS", "BWD_PROGRAMS_PER_SM", "CHUNK_N", "BWD_CHUNK_N")
    saved = {k: getattr(triton_kernels, k) for k in knobs}
    if n <= triton_kernels.FUSED_MAX_N:
        configs = [dict(TILE_ELEMS=t, NUM_WARPS=nw, BWD_PROGRAMS_PER_SM=p)
                   for t, nw in ((2048, 2), (4096, 4), (4096, 8), (8192, 8))
                   for p in (2, 3)]
    else:
        configs = [dict(CHUNK_N=c, BWD_CHUNK_N=b, NUM_WARPS=nw, BWD_PROGRAMS_PER_SM=p)
                   for c, b, nw in ((8192, 4096, 8), (8192, 4096, 16), (16384, 4096, 16), (16384, 4096, 32))
                   for p in (2,)]
    lines = []
    for cfg in configs:
        for k, v in cfg.items():
            setattr(triton_kernels, k, v)
        f, b = ours_ms(x, w, dy)
        lines.append(f"| {m}x{n} | {cfg} | {2 * m * n * s / f / 1e9:.2f} | {3 * m * n * s / b / 1e9:.2f} |")
        for k, v in saved.items():
            setattr(triton_kernels, k, v)
    return lines


def profile_autograd(m: int = 32768, n: int = 4096) -> str:
    """CUDA kernels launched by one autograd backward through ``rms_norm`` (a table, slowest first)."""
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = rms_norm(x, w, EPS, backend="triton")
    for _ in range(3):
        torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(y, (x, w), dy, retain_graph=True)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/triton_h100.md")
    parser.add_argument("--sweep", action="store_true", help="also time our kernel under several configs")
    parser.add_argument("--profile", action="store_true", help="print the kernels of one autograd backward")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    if args.profile:
        print(profile_autograd())
    compiled_hf = torch.compile(hf_llama, dynamic=False)
    rows, sweep_rows = [], []
    for m, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
        w = (1.0 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
        nbytes = m * n * x.element_size()
        dst = torch.empty_like(x)
        copy = 2 * nbytes / median_ms(lambda: dst.copy_(x)) / 1e9
        results = {
            "ours (Triton)": ours_ms(x, w, dy),
            "ours via rms_norm autograd": fwd_bwd_ms(lambda a, b: rms_norm(a, b, EPS, backend="triton"), x, w, dy),
            "torch F.rms_norm": fwd_bwd_ms(lambda a, b: torch.nn.functional.rms_norm(a, (n,), b, EPS), x, w, dy),
            "HF Llama formula (eager)": fwd_bwd_ms(hf_llama, x, w, dy),
            "torch.compile(HF formula)": fwd_bwd_ms(compiled_hf, x, w, dy),
        }
        for name, (f, b) in results.items():
            rows.append(f"| {m}x{n} | {name} | {f * 1e3:.1f} | {2 * nbytes / f / 1e9:.2f} | "
                        f"{b * 1e3:.1f} | {3 * nbytes / b / 1e9:.2f} |")
        rows.append(f"| {m}x{n} | device-to-device copy | | {copy:.2f} | | |")
        if args.sweep:
            sweep_rows += sweep(x, w, dy)
        del x, dy, dst
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    header = [
        "# Triton RMSNorm benchmark",
        "",
        f"GPU: {props.name} ({props.multi_processor_count} SMs); torch {torch.__version__}; triton {triton.__version__}; "
        f"{datetime.date.today().isoformat()}. bf16 x, bf16 weight, casting llama, eps 1e-6.",
        "Median of `triton.testing.do_bench`. TB/s: forward 2·M·N·s, backward 3·M·N·s (dx and dweight both "
        "computed; weight/rstd bytes not counted); copy: bytes read + written.",
        "",
        "| shape | implementation | fwd µs | fwd TB/s | bwd µs | bwd TB/s |",
        "|---|---|---|---|---|---|",
    ]
    text = "\n".join(header + rows) + "\n"
    if sweep_rows:
        text += "\n## Our kernel under other configs\n\n| shape | config | fwd TB/s | bwd TB/s |\n|---|---|---|---|\n"
        text += "\n".join(sweep_rows) + "\n"
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
