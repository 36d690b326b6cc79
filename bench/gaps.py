"""Where the GPU waits, from a Chrome trace of ``torch.profiler`` (``python -m bench step --trace``).

The GPU's activity (kernels, memcpys, memsets) is merged into busy intervals; every stretch between them is a gap.
Gaps are summed by size and by where in the trace they fall (the first tenth of the span, where a step starts
after a sync and the host must get ahead, against the rest), and the largest are listed with the kernel that
ended them and the innermost host op that launched that kernel (matched through the launch's correlation id).
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import math
import pathlib

from bench import timing

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
SIZES = ((5.0, "< 5 µs"), (20.0, "5–20 µs"), (100.0, "20–100 µs"), (math.inf, "≥ 100 µs"))


@dataclasses.dataclass(frozen=True)
class Gap:
    """An idle stretch of ``us`` µs starting ``at_ms`` after the first GPU activity, ended by ``kernel``, which
    the host op ``launched_in`` launched ("?" when the trace has no launch record for it)."""

    us: float
    at_ms: float
    kernel: str
    launched_in: str


def load(path) -> list[dict]:
    """The trace's events (``.json`` or ``.json.gz``)."""
    raw = pathlib.Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)["traceEvents"]


def _innermost(host: list[dict], starts: list[float], ts: float) -> str:
    """The shortest host op running at ``ts`` (ops nest, so the shortest one containing ``ts`` is the innermost)."""
    found = [e for e in host[:bisect.bisect_right(starts, ts)] if ts <= e["ts"] + e["dur"]]
    return min(found, key=lambda e: e["dur"])["name"] if found else "?"


def idle(events: list[dict], top: int = 10) -> dict:
    """Busy and idle time of the GPU over the trace's span, idle by gap size and by place, the ``top`` gaps."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("the trace has no GPU activity (was CUDA profiled?)")
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and "dur" in e), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    t0, end, busy, gaps = gpu[0]["ts"], gpu[0]["ts"], 0.0, []
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    span = end - t0
    by_size = {label: 0.0 for _, label in SIZES}
    for us, _, _ in gaps:
        by_size[next(label for limit, label in SIZES if us < limit)] += us
    first = sum(us for us, at, _ in gaps if at - t0 < span / 10)
    worst = sorted(gaps, key=lambda g: -g[0])[:top]
    listed = [Gap(us, (at - t0) / 1e3, e["name"],
                  _innermost(host, starts, launches[e["args"]["correlation"]])
                  if e.get("args", {}).get("correlation") in launches else "?") for us, at, e in worst]
    return dict(gpu_events=len(gpu), span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
                idle_first_tenth_ms=first / 1e3, idle_by_size_us=by_size, gaps=listed)


def markdown(name: str, summary: dict) -> str:
    s = summary
    out = [f"## {name}", "",
           f"{s['gpu_events']} GPU events over {s['span_ms']:.2f} ms: busy {s['busy_ms']:.2f} ms, idle "
           f"{s['idle_ms']:.2f} ms, of which {s['idle_first_tenth_ms']:.2f} ms in the first tenth of the span.", "",
           "| idle in gaps of | µs |", "|---|---|"]
    out += [f"| {label} | {us:.0f} |" for label, us in s["idle_by_size_us"].items()]
    out += ["", "| gap µs | at ms | kernel after it | launched in |", "|---|---|---|---|"]
    out += [f"| {g.us:.1f} | {g.at_ms:.2f} | `{g.kernel[:60]}` | {g.launched_in[:60]} |" for g in s["gaps"]]
    return "\n".join(out) + "\n"


def report(paths, env: dict) -> str:
    """The Markdown report of several traces (one section each) on the GPU and versions of ``env``."""
    head = [f"# Where the GPU waits in one training step, {env['gpu']}", "",
            f"{timing.versions(env)}. Made by `python -m "
            "bench step --trace` (one step per provider after a warm-up step, traced by torch.profiler; the step "
            "starts after a sync, as every traced step does).", ""]
    sections = [markdown(pathlib.Path(p).name.split(".")[0], idle(load(p))) for p in paths]
    return "\n".join(head) + "\n" + "\n".join(sections)
