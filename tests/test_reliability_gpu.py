"""Reliability on the GPU (device): threads, and bitwise determinism of both kernels.

Streams (1000 iterations behind a slow producer on a side stream) and device and host memory over 10k calls are
in ``test_bridge_gpu.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from helpers import jax_results, torch_inputs, torch_results

pytestmark = pytest.mark.gpu
BACKENDS = ["pallas_dlpack", "pallas_launch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_threads_on_their_own_streams(backend):
    """Two Python threads call the bridge concurrently (first compiles included) on different data and shapes,
    each on its own stream, 200 times; every result equals the one computed afterwards in a single thread."""
    inputs = [torch_inputs((64 + 8 * t, 2048 + 512 * t), torch.bfloat16, 0.0, seed=20 + t) for t in range(2)]
    results: list[list | None] = [None, None]
    errors: list[str] = []

    def worker(t: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for it in range(200):
                got = torch_results(*inputs[t], backend=backend)
                stream.synchronize()
                if results[t] is None:
                    results[t] = [r.clone() for r in got]
                elif not all(torch.equal(a, b) for a, b in zip(got, results[t])):
                    errors.append(f"thread {t} iteration {it}: differs from its first result")
                    return

    torch.cuda.synchronize()  # the inputs exist before the side streams read them
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for t in range(2):
        alone = torch_results(*inputs[t], backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(results[t], alone)), f"thread {t}"


def bits(ts):
    return [t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu() for t in ts]


DETERMINISM = [((32768, 4096), torch.bfloat16), ((1024, 65536), torch.bfloat16), ((4099, 1000), torch.float32)]


@pytest.mark.parametrize("shape,dtype", DETERMINISM, ids=str)
def test_bitwise_deterministic_across_runs(shape, dtype):
    """y, dx and dweight (the multi-program reduction) identical bit for bit over 5 runs: Pallas in JAX, the
    bridge's two routes, and the Triton kernel."""
    x, w, dy = torch_inputs(shape, dtype, 1.0, seed=30)
    kw = dict(eps=1e-6, offset=1.0, casting="gemma")
    runs = {"pallas": lambda: [torch.from_dlpack(a) for a in jax_results(x, w, dy, **kw)]}
    runs.update({b: (lambda b=b: list(torch_results(x, w, dy, backend=b, **kw))) for b in BACKENDS})
    for name, run in runs.items():
        first = bits(run())
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(bits(run()), first)), name
    perturbed = x.clone()
    perturbed.view(-1)[12345] = perturbed.view(-1)[12345] * 1.01
    assert not all(torch.equal(a, b) for a, b in  # the comparison sees a one-element change
                   zip(bits(torch_results(perturbed, w, dy, backend="triton", **kw)),
                       bits(torch_results(x, w, dy, backend="triton", **kw))))
