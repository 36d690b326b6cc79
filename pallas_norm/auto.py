"""``impl="auto"`` (what ``impl=None`` runs on a GPU): per direction and shape, the faster of the two lowerings of
the kernels, from the committed H100 bench, never a guess.

``bench/results/mosaic_h100_bfloat16_llama.md`` (H100, 2026-11-24, both timed through JAX in one run): the Mosaic
GPU backward beat the Triton lowering's at every N ≤ 16384 of the grid (16/16 shapes; 1.03–1.44×; it reads x and dy
once and does not spill), and lost at N = 32768 and 65536 (0.93–0.96×); the Mosaic forward lost everywhere (0.79–
0.96×). So: the backward (plain and fused, which must agree: the fused add's ``dweight`` is ``rms_norm``'s bits)
runs on Mosaic GPU for rows of at most 16384 columns that need no padding (a multiple of 128), on GPUs that run
Mosaic GPU (compute capability >= 9.0); everything else runs the Triton lowering (``"pallas"``). A config passed
for a direction picks its lowering (``Config``: Triton, ``MosaicConfig``: Mosaic GPU).
"""

from __future__ import annotations

from . import backend
from .mosaic_config import MosaicConfig

MOSAIC_BWD_MAX_COLS = 16384
MOSAIC_ALIGN = 128


def lowering(backward: bool, n: int, config: object = None) -> str:
    """``"pallas"`` or ``"mosaic"`` for one launch of rows of ``n`` columns."""
    if config is not None:
        return "mosaic" if isinstance(config, MosaicConfig) else "pallas"
    if backward and n <= MOSAIC_BWD_MAX_COLS and n % MOSAIC_ALIGN == 0 and backend.mosaic_capable():
        return "mosaic"
    return "pallas"
