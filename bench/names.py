"""Provider names: ours are ``pallas_norm.registry`` names, peers have names of their own; labels are for display.
Results (JSON, CSV) key rows by name."""

from __future__ import annotations

from pallas_norm import registry

JAX_OURS = ("auto", "pallas", "mosaic")  # our JAX kernels (timed through JAX); "auto" is impl=None on a GPU
TORCH_OURS = ("pallas_launch", "pallas_dlpack", "triton")  # our torch backends (timed through torch)
OURS = JAX_OURS + TORCH_OURS
PEER_LABELS = {"torch_native": "torch F.rms_norm", "hf_eager": "HF formula, eager",
               "hf_compile": "HF formula, torch.compile", "xla_formula": "XLA (jit of jnp formula)",
               "liger": "Liger", "tokamax": "tokamax"}
JAX_PEERS = ("xla_formula", "tokamax")
# The tables' and plots' column order, whatever order a merged run's rows came in: ours (JAX, then torch), then the
# peers, the slowest last. (Merged runs had put the columns of the three suite tables in three different orders.)
COLUMNS = OURS + ("xla_formula", "torch_native", "hf_compile", "liger", "tokamax", "hf_eager")


def ordered(names) -> list[str]:
    """``names`` without repeats, in ``COLUMNS`` order; names not in it follow, in the order first seen."""
    return sorted(dict.fromkeys(names), key=lambda n: COLUMNS.index(n) if n in COLUMNS else len(COLUMNS))  # stable


def label(name: str) -> str:
    """Display label of a provider name (ours from the registry, peers from ``PEER_LABELS``)."""
    return PEER_LABELS.get(name, registry.label(name))
