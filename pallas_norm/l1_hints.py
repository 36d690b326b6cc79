"""Where the resident forward's loads carry L1 eviction hints (``Config.l1_hints`` in both stacks: x, the fused add's
residual and the weight loaded at L1's ``evict_last`` priority); ``pallas_config.heuristic`` and the Triton
reference's ``triton_config.forward_config`` both read it. (The two-pass forward's hints: ``ffi_tables``.)

A resident row is read once, yet these hints are worth up to 1.8% in the forward (plain and fused add) of rows from
1024 columns. H100, kernels timed over rotated inputs, both stacks (thirtieth session,
probes_h100_2026-11-27_thirtieth.md §3-6), TB/s without → with, bf16 llama plain: 32768×16384 3.03 → 3.05
(torch.compile 3.05), 8192×32768 3.00 → 3.04 (Liger 3.00), 32768×8192 3.03 → 3.04, 32768×3584 2.98 → 3.03,
32768×2304 2.99 → 3.01, 32768×1024 2.91 → 2.92, 4096×1024 level; fused add 32768×16384 3.01 → 3.03,
32768×3584 3.01 → 3.04, 4096×2304 2.78 → 2.82, 32768×1024 2.94 → 2.97 (every width from 1024 columns level to +1.3%).
bf16 gemma, fp16 and float32 alike. The values are the same bits with or without them. Shorter rows (the per-head
norms') were not measured and keep none.

Triton lowers ``evict_last`` to L1 *and* L2 priorities (``createpolicy ... L2::evict_last``): after such a kernel,
the lines it read stay in L2 ahead of others until normal traffic displaces them. So a kernel that reads the same x
right after a hinted forward runs faster (the forward without hints: 32768×2304 2.99 after a 1 GB copy, 3.06 right
after the hinted forward, 2.99 again with the copy between; §6), which made the first A/B rounds misleading, and a
kernel that relies on L2 for other data runs slower (§5): a 24 MB buffer read again right after a 32768×8192 forward
takes 17.6 µs after a hinted one against 12.4 µs after one without; one 256 MB read in between and the difference is
gone. torch.compile's forward (its looped reduction's ``evict_last``) and the 5120-column two-pass forward leave the
same 17.6 µs. Inside a layer that did not show (thirty-first session, probes_h100_2026-11-27_thirtyfirst.md §6): a
GEMM on the norm's output (8192×2048 @ 2048×4096 to 16384×4096 @ 4096×6144) took the same time after a hinted norm,
and an add reading x again ran 2-8% faster.
"""

from __future__ import annotations

MIN_COLS = 1024  # rows padded to at least this many columns take the hints (shorter ones were not measured)


def resident(n_pad: int) -> bool:
    """Whether the resident forward (plain and fused add: measured for both) of rows padded to ``n_pad`` columns takes
    ``l1_hints``."""
    return n_pad >= MIN_COLS
