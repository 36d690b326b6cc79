"""``impl="auto"`` (what ``impl=None`` runs on a GPU): per direction and shape the faster of the two lowerings of
the kernels, from the committed H100 bench, never a guess.

Both lowerings timed through JAX in one run (``bench/results/mosaic_h100_bfloat16_llama.md``, H100, bf16, after the
sweep ``sweep_h100_bfloat16_llama_mosaic.md`` retuned the Mosaic kernels' long rows): the Mosaic GPU backward reads
x and dy once and beat the Triton lowering's at most N ≤ 65536 of the grid (e.g. 32768×16384 2.49 against 1.90 TB/s,
8192×32768 2.29 against 1.69, 4096×65536 1.89 against 1.58; within noise or slightly behind at 32768×3584 and
32768×8192); the Mosaic forward won only on rows split over a cluster (8192×32768 2.52 against 2.33, 4096×65536 2.43
against 2.25) and lost on rows one CTA holds (0.88–0.98×). So, on GPUs that run Mosaic GPU (compute capability
>= 9.0) and rows that need no padding (a multiple of 128 columns): the backward (plain and fused, which must agree:
the fused add's ``dweight`` is ``rms_norm``'s bits) on Mosaic GPU up to 65536 columns, the forward (plain and
fused) for 16384 < N ≤ 65536; everything else on the Triton lowering (``"pallas"``), which also takes the longest
rows (the Mosaic backward cannot hold them; its forward is slower there). A config passed for a direction picks
its lowering (``Config``: Triton, ``MosaicConfig``: Mosaic GPU).
"""

from __future__ import annotations

from . import backend
from .mosaic_config import MosaicConfig

MOSAIC_BWD_MAX_COLS = 65536
MOSAIC_FWD_COLS = (16384, 65536)  # the forward runs on Mosaic GPU for lo < N <= hi
MOSAIC_ALIGN = 128


def lowering(backward: bool, n: int, config: object = None) -> str:
    """``"pallas"`` or ``"mosaic"`` for one launch of rows of ``n`` columns."""
    if config is not None:
        return "mosaic" if isinstance(config, MosaicConfig) else "pallas"
    if n % MOSAIC_ALIGN or not backend.mosaic_capable():
        return "pallas"
    lo, hi = MOSAIC_FWD_COLS
    fits = n <= MOSAIC_BWD_MAX_COLS if backward else lo < n <= hi
    return "mosaic" if fits else "pallas"
