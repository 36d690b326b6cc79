"""``pallas-norm check --model DIR`` on tiny Hugging Face models saved to a temporary directory: it lists what it
replaced and left alone, compares logits, loss and every gradient with the unpatched model against float64, and
fails (exit 1) on a wrong mode, whether ``verify`` catches it or the model-level comparison does."""

from __future__ import annotations

import json

import pytest
import torch

from pallas_norm_tools import cli
from pallas_norm_tools.cli import check_model
from pallas_norm_tools.tiny_models import tiny_model
from torch_bridge import hf, patch_hf_model

from helpers import DEVICE


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Directories holding tiny models, as ``save_pretrained`` writes them."""
    def save(family: str, dtype: torch.dtype = torch.float32) -> str:
        path = tmp_path_factory.mktemp(f"{family}_{str(dtype).removeprefix('torch.')}")
        tiny_model(family, dtype=dtype).save_pretrained(path)
        return str(path)
    return save


def check(path: str, *extra: str) -> int:
    return cli.main(["check", "--model", path, "--device", DEVICE, *extra])


@pytest.mark.parametrize("family,dtype,replaced", [("gemma2", torch.float32, "9 × Gemma2RMSNorm"),
                                                    ("qwen2", torch.bfloat16, "5 × Qwen2RMSNorm")])
def test_a_saved_model_passes(saved, tmp_path, capsys, family, dtype, replaced):
    out = tmp_path / "report.json"
    assert check(saved(family, dtype), "--batches", "2", "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert f"replaced {replaced.split()[0]} norms: {replaced}" in text and "all within the bound" in text
    report = json.loads(out.read_text())
    assert {"logits", "loss"} <= {r["quantity"] for r in report["rows"]} and all(r["ok"] for r in report["rows"])
    assert sum(r["quantity"].startswith("grad ") for r in report["rows"]) == sum(
        1 for _ in tiny_model(family).parameters())


def test_unknown_norms_are_listed_as_left_alone(saved, monkeypatch, capsys):
    monkeypatch.delitem(hf.KNOWN_NORMS, "LlamaRMSNorm")
    assert check(saved("llama"), "--batches", "1") == 0
    text = capsys.readouterr().out
    assert "replaced 0 norms: none" in text and "left alone: left transformers.models.llama" in text


def test_verify_refusing_a_wrong_mode_fails_the_check(saved, monkeypatch, capsys):
    monkeypatch.setitem(hf.KNOWN_NORMS, "Qwen2RMSNorm", ("gemma", 1.0, "variance_epsilon"))  # deliberately wrong
    assert check(saved("qwen2")) == 1
    assert "verify refused a replacement" in capsys.readouterr().out


def test_the_model_comparison_catches_a_wrong_mode_without_verify(saved, monkeypatch, capsys):
    monkeypatch.setitem(hf.KNOWN_NORMS, "Qwen2RMSNorm", ("gemma", 1.0, "variance_epsilon"))
    monkeypatch.setattr(check_model, "patch", lambda model, backend: (patch_hf_model(model, verify=False), []))
    assert check(saved("qwen2"), "--batches", "1") == 1
    assert "FAILED" in capsys.readouterr().out


def test_a_directory_without_a_model_is_a_usage_error(tmp_path, capsys):
    assert check(str(tmp_path)) == 2
    assert "holds no config.json" in capsys.readouterr().err
