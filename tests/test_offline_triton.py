"""``bench.offline_triton``: the Triton reference's kernels compiled for sm_90 on a machine without a GPU, from the
launches its own launcher makes on ``meta`` tensors. The launches are specialised as Triton's JIT specialises them,
and a persistent grid whose programs do not all fit an SM at once is visible (``per_sm`` below ``asks``): Gemma's
fused add backward of rows of 5120 held as pieces without a register cap (162 registers on 8 warps, one of the two
programs per SM its grid asks), which the launcher's cap of 128 makes fit; Gemma's pieces backward summing its row
without converting the 2048 piece between layouts."""

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


def _python(*argv: str) -> list[str]:
    """``python *argv``'s output lines, in a process of its own: the kernels compile there (this process's Triton
    interprets them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parent.parent)
    return out.stdout.splitlines()


def _cli(*argv: str) -> list[str]:
    """``python -m bench.offline_triton *argv``'s output lines."""
    return _python("-m", "bench.offline_triton", *argv)


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


# Run as a script: the pieces kernel rebuilt from its own source with the large piece's loads first (the order before
# the fifty-first session), then ``bench.offline_triton``'s CLI on it.
_LARGE_PIECE_FIRST = """
import importlib.util, inspect, pathlib, sys
from torch_bridge import triton_pieces
small = "    xb, dyb, dhb = _load(X, DY, DH, rows, row_mask, P0, P1, N, HAS_DH)\\n"
large = "    xa, dya, dha = _load(X, DY, DH, rows, row_mask, 0, P0, N, HAS_DH)\\n"
source = inspect.getsource(triton_pieces)
assert source.count(small + large) == 1
path = pathlib.Path(sys.argv[1])
path.write_text(source.replace(small + large, large + small))
spec = importlib.util.spec_from_file_location("large_piece_first", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
triton_pieces.bwd_pieces_kernel = module.bwd_pieces_kernel
from bench import offline_triton
offline_triton.main(sys.argv[2:])
"""


def _loop_barriers(lines: list[str]) -> int:
    """The pieces kernel's barriers inside loops, from its report line."""
    line = next(line for line in lines if line.split()[1] == "bwd_pieces_kernel")
    return int(line.split(" barriers (")[1].split()[0])


def test_gemma_s_pieces_backward_keeps_the_row_in_its_layout(tmp_path):
    """Gemma's backward of 32768×2304 held as pieces, plain and fused add: its row loop has about as many barriers
    as Llama's (7 and 9 against 6), since the small piece is loaded first (``triton_pieces._block``): Triton's layout
    pass then sums the 2048 piece in its own layout. Broken variant: the same kernel with the large piece loaded first
    converts the 2048 columns of x and g through shared memory every row (18 barriers in the loop)."""
    for fused in ([], ["--fused"]):
        llama = _loop_barriers(_cli("32768x2304", *fused))
        assert _loop_barriers(_cli("32768x2304", "--casting", "gemma", *fused)) <= llama + 3
        broken = _python("-c", _LARGE_PIECE_FIRST, str(tmp_path / "large_first.py"), "32768x2304", "--casting",
                         "gemma", *fused)
        assert _loop_barriers(broken) > llama + 3
