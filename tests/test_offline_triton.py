"""``bench.offline_triton``: the Triton reference's kernels compiled for sm_90 on a machine without a GPU, from the
launches its own launcher makes on ``meta`` tensors. The launches are specialised as Triton's JIT specialises them,
and a persistent grid whose programs do not all fit an SM at once is visible (``per_sm`` below ``asks``): Gemma's
fused add backward of rows of 5120 held as pieces without a register cap (162 registers on 8 warps, one of the two
programs per SM its grid asks), which the launcher's cap of 128 makes fit."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from bench import offline_triton


def test_launches_are_captured_and_specialised_as_triton_s_jit_does():
    """The backward of 4096×2304 (bf16, Llama): the pieces kernel on the heuristic's grid (512 programs of 8 row
    blocks), then the dweight reduction; pointers typed by dtype and 16-divisible, N (2304) 16-divisible, ITERS (8)
    not, an int of 1 a constant, the meta-parameters constexprs, ``num_warps`` a compile option. Broken variant: N
    2300, which loses its divisibility."""
    calls = offline_triton.launches(4096, 2304)
    assert [c[0].__name__ for c in calls] == ["bwd_pieces_kernel", "_dweight_reduce_kernel"]
    kernel, grid, args, meta = calls[0]
    assert grid == (512, 1) and meta["num_warps"] == 2
    names = kernel.arg_names
    at = {name: (i,) for i, name in enumerate(names)}
    signature, constexprs, attrs, options = offline_triton.specialization(kernel, args, meta)
    assert (signature["X"], signature["RSTD"], signature["N"], signature["ITERS"]) == ("*bf16", "*fp32", "i32", "i32")
    assert attrs[at["X"]] == attrs[at["N"]] == [["tt.divisibility", 16]] and at["ITERS"] not in attrs
    assert (constexprs["P0"], constexprs["P1"]) == (2048, 256) and options == {"num_warps": 2}
    one = offline_triton.specialization(kernel, tuple(1 if n == "ITERS" else a for n, a in zip(names, args)), meta)
    assert one[0]["ITERS"] == "constexpr" and one[1]["ITERS"] == 1
    odd = offline_triton.specialization(kernel, tuple(2300 if n == "N" else a for n, a in zip(names, args)), meta)
    assert at["N"] not in odd[2]


def _cli(*argv: str) -> list[str]:
    """``python -m bench.offline_triton`` in a process of its own: the kernels compile there (this process's
    Triton interprets them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.offline_triton", *argv], env=env, capture_output=True,
                         text=True, check=True, cwd=pathlib.Path(__file__).parent.parent)
    return out.stdout.splitlines()


def test_the_launcher_s_register_cap_makes_a_persistent_grid_fit():
    """Gemma's fused add backward at 32768×5120 (pieces on 8 warps, 2 programs per SM): the launcher asks a register
    cap of 128 (``triton_kernels.backward_register_cap``, what ``pallas_config.register_cap`` gives such a grid), so
    both fit at once. Broken variant: assembled without it (``--maxnreg 0``) one fits at a time and the grid runs a
    second wave, which the report flags. Llama's product fits both either way. The dweight reduction walks no row
    blocks: nothing asked, no cap."""
    gemma, reduce = _cli("32768x5120", "--fused", "--casting", "gemma")
    assert "bwd_pieces_kernel warps=8 grid=(263, 1) maxnreg=128: 128 registers" in gemma
    assert gemma.endswith("2 per SM (its grid asks 2)")
    assert "_dweight_reduce_kernel" in reduce and "maxnreg=None" in reduce and "asks" not in reduce
    uncapped = _cli("32768x5120", "--fused", "--casting", "gemma", "--maxnreg", "0")[0]
    assert "maxnreg=None" in uncapped and uncapped.endswith("1 per SM (its grid asks 2)")
    llama = _cli("32768x5120", "--fused", "--maxnreg", "0")[0]
    assert llama.endswith("2 per SM (its grid asks 2)")
