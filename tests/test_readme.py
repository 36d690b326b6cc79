"""The README stays true: its Python examples run (on small inputs), its speed table is what the committed bench
results give, and its links point to files that exist."""

from __future__ import annotations

import pathlib
import re

import pytest

from bench import summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

PRELUDE = {  # what each example assumes the reader already has
    "JAX": """
import jax, jax.numpy as jnp
x, weight = jnp.ones((4, 64), jnp.bfloat16) * jnp.arange(64), jnp.full((64,), 0.5)
loss = lambda x, w: jnp.sum(pn.rms_norm(x, w).astype(jnp.float32) ** 2)
import pallas_norm as pn
residual = jnp.ones((4, 64), jnp.bfloat16)
""",
    "Flax": """
from pallas_norm_tools.tiny_lm import TinyDecoder
from flax import nnx as flax_nnx
_rngs = flax_nnx.Rngs(0)
model = TinyDecoder(lambda d: flax_nnx.RMSNorm(d, rngs=_rngs), _rngs, d=64, layers=1)
""",
    "PyTorch": """
import torch
x, weight = torch.randn(4, 4096, requires_grad=True), torch.ones(4096, requires_grad=True)
residual = torch.randn(4, 4096)
""",
    "Hugging Face": """
from pallas_norm_tools.tiny_models import tiny_model
model = tiny_model("gemma2")
""",
}


def examples() -> dict[str, str]:
    """The first ```python block of each README section with a prelude, by section title."""
    found = {}
    for section in re.split(r"(?m)^## ", README)[1:]:
        title, body = section.split("\n", 1)
        block = re.search(r"```python\n(.*?)```", body, re.S)
        if block:
            found[title.strip()] = block.group(1)
    return found


def test_every_example_has_a_prelude():
    assert set(examples()) == set(PRELUDE)


@pytest.mark.parametrize("title", sorted(PRELUDE))
def test_readme_example_runs(title):
    namespace: dict = {}
    exec(compile(PRELUDE[title] + examples()[title], f"README.md ({title})", "exec"), namespace)  # noqa: S102
    if title == "Hugging Face":
        assert len(namespace["paths"]) == 9  # patched, then the originals put back
    if title == "Flax":
        assert len(namespace["paths"]) == 5


def test_speed_table_is_generated_from_the_committed_results():
    assert summary.replace_block(README, summary.table()) == README, "run `python -m bench summary --write README.md`"
    assert summary.BEGIN in README and "| H100 bf16 llama" in README


def test_the_summary_check_catches_a_hand_edit():
    row = next(line for line in README.splitlines()
               if line.startswith("| H100 bf16 llama, ") and "| 32768×4096 | fwd |" in line)
    edited = README.replace(row, row.replace("| fwd | ", "| fwd | 9", 1), 1)
    assert edited != README
    assert summary.replace_block(edited, summary.table()) != edited


def test_links_point_to_files():
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"
