"""A Gemma-kind `tokenizer.json` for random test checkpoints (Gemma 3 / 3n / 4), without a model hub.

A BPE trained on the caller's texts with spaces as U+2581 and byte fallback (<0x00>..<0xFF>), Gemma's
specials at ids 0-3 (Gemma4TextConfig's pad / eos / bos defaults), one added special (`<|turn>`) and one
of llama.cpp's always-visible chat markers (`<|channel>`), and a small chat template: llama.cpp's converter
reads it as its `gemma4` tokenizer model. Used by tests/test_convert_gemma4.py and scripts/bench_convert.py.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def write_gemma_tokenizer(folder: Path, texts: list[str], vocab_size: int = 300) -> int:
    """Train the tokenizer on `texts` (newlines read as spaces) and save it into `folder`; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    space = normalizers.Replace(" ", "\u2581")
    t = Tokenizer(models.BPE())
    t.normalizer = space
    t.train_from_iterator([c.replace("\n", " ") for c in texts] * 4,
                          trainers.BpeTrainer(vocab_size=vocab_size, max_token_length=6, show_progress=False))
    learned = json.loads(t.to_str())["model"]
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    for text in ["\n", *sorted(learned["vocab"], key=learned["vocab"].get)]:
        vocab.setdefault(text, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = space
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([*SPECIALS, "<|turn>"])
    tok.add_tokens(["<|channel>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}<|turn>{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(folder)
    return tok.get_vocab_size()
