"""Cross-stack tools of pallas-norm: the parity matrix (``parity``), the ``pallas-norm`` command line (``cli``),
and the tiny models they train (``tiny_models`` for Hugging Face, ``tiny_lm`` for Flax).

The top layer: it builds on ``pallas_norm`` (JAX) and ``torch_bridge`` (PyTorch); neither imports it.
"""
