"""Throwaway: Inductor's forward kernel for HF's Llama formula at 5120 and 8192 columns (its code, its speed)."""
import os, glob, torch
from bench import timing
out = os.environ.get("OUT", "/tmp")
for m, n in ((4096, 5120), (32768, 5120), (4096, 8192)):
    torch._dynamo.reset()
    f = torch.compile(timing.hf_formula(0.0, "llama"), dynamic=False)
    x, w, dy = timing.inputs(m, n, torch.bfloat16, 0.0)
    with torch.no_grad():
        f(x, w)
    sets = timing.input_sets((x, w))
    def call(a, b):
        with torch.no_grad():
            return f(a, b)
    t = timing.time_sets(call, sets)
    print(m, n, f"{2 * m * n * 2 / t / 1e12:.3f}", flush=True)
