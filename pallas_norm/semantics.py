"""Framework-free checks of RMSNorm's scalar arguments, shared by the JAX and PyTorch entry points.

The formulas themselves are in ``docs/semantics.md``; each stack implements them once (``pallas_norm.rowmath``
for JAX, ``torch_bridge.triton_kernels`` for Triton).
"""

from __future__ import annotations

import math
from numbers import Real

CASTINGS: tuple[str, ...] = ("llama", "gemma", "none")
_PLAIN = (float, int)
_CHECKED: dict[tuple, tuple[float, float, str]] = {}  # plain Python arguments already found valid


def check_scalars(eps: object, offset: object, casting: object, *, has_weight: bool) -> tuple[float, float, str]:
    """Validate ``eps``, ``offset`` and ``casting``; return them as ``(float, float, str)``.

    Raises ``TypeError`` for a non-real ``eps``/``offset`` or a non-string ``casting`` and ``ValueError`` for
    ``eps`` not finite and > 0, a non-finite ``offset``, an unknown ``casting``, or ``offset != 0`` without weight.
    Plain ``float``/``int``/``str`` arguments found valid once are looked up afterwards (a torch call's host budget
    is a few µs).
    """
    key = None
    if type(eps) in _PLAIN and type(offset) in _PLAIN and type(casting) is str:
        key = (type(eps), eps, type(offset), offset, casting, has_weight)
        hit = _CHECKED.get(key)
        if hit is not None:
            return hit
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps must be a real number > 0, got {type(eps).__name__}")
    if not (math.isfinite(float(eps)) and float(eps) > 0.0):
        raise ValueError(f"eps must be finite and > 0, got {eps!r}")
    if isinstance(offset, bool) or not isinstance(offset, Real):
        raise TypeError(f"offset must be a real number (e.g. 0.0 or 1.0), got {type(offset).__name__}")
    if not math.isfinite(float(offset)):
        raise ValueError(f"offset must be finite, got {offset!r}")
    if not isinstance(casting, str):
        raise TypeError(f"casting must be one of {CASTINGS}, got {type(casting).__name__}")
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if not has_weight and float(offset) != 0.0:
        raise ValueError(f"offset must be 0.0 when weight is None (offset scales the weight), got {offset!r}")
    result = float(eps), float(offset), casting
    if key is not None and len(_CHECKED) < 4096:
        _CHECKED[key] = result
    return result
