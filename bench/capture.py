"""The CUDA-graph capture check of ``python -m bench overhead``: can each provider's forward and forward+backward be
captured by ``torch.cuda.graph``, and does a replay on new inputs give the eager bits?"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench import timing


def _outputs(fn: Callable, x, w, dy, mode: str) -> list[torch.Tensor]:
    y = fn(x, w)
    return [y] if mode == "fwd" else [y, *torch.autograd.grad(y, (x, w), dy)]


def check(fn: Callable, mode: str, shape=(8, 4096), dtype=torch.bfloat16) -> str:
    """"✓" (replay = eager bits), "≠" (captured, replay differs) or "✗ <error>" for ``fn(x, w) -> y``."""
    x0, w0, dy0 = timing.inputs(*shape, dtype, 0.0, seed=1)
    x1, w1, dy1 = timing.inputs(*shape, dtype, 0.0, seed=2)
    xs, ws, dys = x0.clone().requires_grad_(), w0.clone().requires_grad_(), dy0.clone()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                _outputs(fn, xs, ws, dys, mode)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _outputs(fn, xs, ws, dys, mode)
        with torch.no_grad():
            xs.copy_(x1), ws.copy_(w1), dys.copy_(dy1)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001  (any failure to capture is the result)
        torch.cuda.synchronize()
        return f"✗ {type(err).__name__}: {str(err).splitlines()[0][:90]}"
    eager = _outputs(fn, x1.clone().requires_grad_(), w1.clone().requires_grad_(), dy1, mode)
    return "✓" if all(torch.equal(a, b) for a, b in zip(static, eager)) else "≠"


def run(fns: dict[str, Callable]) -> dict[str, dict[str, str]]:
    return {name: {mode: check(fn, mode) for mode in ("fwd", "fwd+bwd")} for name, fn in fns.items()}
