"""The output layer: an lm_head.weight that llama.cpp would not use is refused, never dropped.

llama.cpp's gemma2 graph always computes the logits with token_embd (src/models/gemma2.cpp), and
a config that ties the output makes ctxq leave lm_head.weight out; transformers 5 computes with a
present lm_head either way. Converting such a checkpoint silently gave other logits (relative
error 1.36 against transformers, no top-1 agreement), so ctxq refuses it in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="transformers reference logits need torch (pip install ctxq[test])")
pytest.importorskip("transformers", reason="reference logits need transformers (ctxq[test])")

from safetensors.numpy import load_file, save_file  # noqa: E402

from ctxq import convert  # noqa: E402
from ctxq.errors import ConversionError  # noqa: E402

from .conftest import run_ctxq  # noqa: E402
from .test_convert import compare, hf_ids, llama_logits, make_tiny, reference_logits  # noqa: E402


def _with_lm_head(folder: Path, family: str, tie: bool, same: bool) -> Path:
    """A tiny `family` checkpoint with an explicit lm_head.weight (the embedding's values when
    `same`, other random values otherwise) and tie_word_embeddings set to `tie`."""
    make_tiny(folder, family)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    embed = tensors["model.embed_tokens.weight"]
    rng = np.random.default_rng(1)
    tensors["lm_head.weight"] = embed.copy() if same else rng.normal(0, 0.1, embed.shape).astype(embed.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = tie
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_gemma2_untied_different_lm_head_is_refused(tmp_path):
    folder = _with_lm_head(tmp_path / "g2", "gemma2", tie=False, same=False)
    out = tmp_path / "out" / "g2.gguf"
    with pytest.raises(ConversionError, match="lm_head.weight differs from the token embedding, but llama.cpp's "
                                              "gemma2 always computes the output with the embedding"):
        convert(folder, "f32", out)
    rc = run_ctxq("convert", str(folder), "f32", "-o", str(out))
    assert rc.returncode == 1 and rc.stderr.startswith("Error:") and len(rc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in rc.stderr and rc.stdout == ""
    assert not out.parent.exists() or list(out.parent.iterdir()) == []  # nothing written, not even a temporary


def test_gemma2_untied_lm_head_equal_to_the_embedding_converts(tmp_path):
    folder = _with_lm_head(tmp_path / "g2", "gemma2", tie=False, same=True)
    ids = hf_ids(folder)
    ref = reference_logits(folder, ids)  # transformers computes with the file's lm_head
    got, _ = llama_logits(convert(folder, "f32", tmp_path / "g2.gguf").path, ids)
    rel, flips, _ = compare(ref, got)
    assert rel <= 1e-3 and flips == 0, rel


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    """Llama ties only when told: a config that says tied while lm_head.weight differs is ambiguous."""
    folder = _with_lm_head(tmp_path / "l", "llama", tie=True, same=False)
    with pytest.raises(ConversionError, match="config.json ties the output .* set tie_word_embeddings to false"):
        convert(folder, "f16", tmp_path / "l.gguf")
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".l.gguf*")) == []
    # told the truth (untied), the same weights convert and compute as transformers does
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    ids = hf_ids(folder)
    got, _ = llama_logits(convert(folder, "f32", tmp_path / "l.gguf").path, ids)
    rel, flips, _ = compare(reference_logits(folder, ids), got)
    assert rel <= 1e-3 and flips == 0, rel
