"""Whether llama.cpp can tokenize text with a model's vocabulary, decided from the header before llama.cpp is asked.

llama.cpp (the version llama-cpp-python 0.3.36 vendors, src/llama-vocab.cpp) answers some vocabularies with an abort
of the whole process, not an error: a GGML_ASSERT, or a C++ exception thrown through its C API (`llama_tokenize` has
no try). `ctxq run`, `ctxq serve` and `ctxq.load()` load and tokenize in ctxq's own process, so `check_tokenizer`
refuses such a model first (`NoTokenizer`, one line). The conditions, each llama.cpp's own:

- `tokenizer.ggml.model` "none" or "no_vocab" (the dummy vocabulary of a model used without text, what
  `ctxq.testing.synthetic` writes): `llama_vocab::impl::load` returns early with type NONE and never calls
  `init_tokenizer`, so the tokenizer stays null and the first `tokenize` fails
  `GGML_ASSERT(tokenizer && "Tokenizer not initialized...")`. The key missing, not a string, or no
  `tokenizer.ggml.tokens` string array: the loader throws (an error; refused here with the same words).
- an empty `tokenizer.ggml.tokens`: the "test" tokenizer divides by the vocabulary's size (SIGFPE); nothing
  tokenizes with no tokens.
- two equal entries in `tokenizer.ggml.tokens` (an empty one counts as "[EMPTY_<i>]"): `token_to_id` ends up
  smaller than `id_to_token` and `GGML_ASSERT(id_to_token.size() == token_to_id.size())` aborts at load.
- a special token the tokenizer adds that resolves to no token: `tokenize(..., add_special)` asserts
  `special_bos_id != LLAMA_TOKEN_NULL` (SPM, UGM, BPE with add_bos; WPM always), `special_eos_id` (with add_eos)
  and `special_sep_id` (WPM). Defaults per tokenizer (and for BPE per pre-tokenizer) are llama.cpp's; a default id
  beyond the vocabulary is disabled, an id from the header replaces it only when inside the vocabulary.
- a SentencePiece ("llama") vocabulary without a byte token (`<0xXX>`, or the byte itself) for a byte UTF-8 text
  can hold: `llm_tokenizer_spm_session::resegment` falls back to bytes for a piece that is no token, and
  `byte_to_token`'s `token_to_id.at()` throws out of `llama_tokenize`: the process ends (`terminate`).
- a WordPiece ("bert") vocabulary with a token typed BYTE: building the token-to-piece cache at load reaches
  `token_to_byte`, which is `GGML_ABORT` for WPM.

ctxq tokenizes with special tokens added (a plain prompt; a chat template may put BOS itself), so the checks assume
it. Anything else llama.cpp refuses with an error (an unknown tokenizer or pre-tokenizer, missing merges, a
wrongly typed key) is left to it: its loader's message reaches the user.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import NoTokenizer
from .reader import GGUFFile

# tokenizer.ggml.model -> llama.cpp's vocabulary type (llama_vocab::impl::load)
_TYPES = {"llama": "spm", "bert": "wpm", "gpt2": "bpe", "hybriddna": "bpe", "whitespace": "bpe", "gemma4": "bpe",
          "t5": "ugm", "rwkv": "rwkv", "test": "test", "plamo2": "plamo2"}
_NONE = ("none", "no_vocab")
# default (bos, eos, sep) ids per tokenizer.ggml.model; None is LLAMA_TOKEN_NULL
_DEFAULT_IDS = {"llama": (1, 2, None), "bert": (101, None, 102), "gpt2": (11, 11, None), "hybriddna": (11, 11, None),
                "whitespace": (11, 11, None), "gemma4": (None, None, None), "t5": (None, 1, None),
                "rwkv": (None, None, None), "test": (None, None, None), "plamo2": (1, 2, None)}
# default (add_bos, add_eos) per vocabulary type; BPE's add_bos also by pre-tokenizer (_BPE_BOS_PRE)
_DEFAULT_ADD = {"spm": (True, False), "wpm": (True, False), "bpe": (False, False), "ugm": (False, True),
                "rwkv": (False, False), "test": (False, False), "plamo2": (False, False)}
_BPE_BOS_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                "jina-v5-nano", "tekken", "chameleon"}
_GEMMA4_PRE = {"gemma4", "granite-embed-multi-311m"}  # add_bos forced on, whatever the header says
_UINT32, _BOOL, _STRING, _ARRAY = 4, 7, 8, 9
_BYTE = 6  # LLAMA_TOKEN_TYPE_BYTE
_ID_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
            "sep": "tokenizer.ggml.seperator_token_id"}  # llama.cpp's spelling (llama-arch.cpp LLM_KV_TOKENIZER_SEP_ID)
# the bytes UTF-8 text can hold (never 0xC0, 0xC1, 0xF5-0xFF)
_TEXT_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]

_FIX = "convert the model again with its tokenizer (`ctxq convert`, or llama.cpp's convert_hf_to_gguf.py)"


def tokenizer_problem(g: GGUFFile) -> str | None:
    """Why llama.cpp cannot tokenize text with `g`'s vocabulary without aborting or refusing it (see the module's
    docstring), or None. Arrays a header read left out (`skip_arrays`) are checked for their length only."""
    meta, types = g.metadata, g.value_types
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return "has no tokenizer (no tokenizer.ggml.model key)"
    if not isinstance(model, str) or types.get("tokenizer.ggml.model", (_STRING,))[0] != _STRING:
        return f"has no usable tokenizer (tokenizer.ggml.model is {model!r}, not a name)"
    if model in _NONE:
        return (f'has no tokenizer (tokenizer.ggml.model = "{model}", a GGUF for use without text), so llama.cpp '
                "cannot tokenize text for it")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or types.get("tokenizer.ggml.tokens", (None, None)) != (_ARRAY, _STRING):
        return "has no vocabulary (no tokenizer.ggml.tokens array of strings)"
    listed = isinstance(tokens, list)
    n_tokens = len(tokens) if listed else int(tokens)
    if n_tokens == 0:
        return "has an empty vocabulary (tokenizer.ggml.tokens holds no token)"
    kind = _TYPES.get(model)
    if kind is None:
        return None  # llama.cpp refuses it with "unknown tokenizer": an error, its own words
    if listed:
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            t = t or f"[EMPTY_{i}]"
            if "\ufffd" in t:  # not UTF-8 in the file: the reader's replacement may merge distinct bytes
                continue
            if t in seen:
                return (f"has a vocabulary with the token {t!r} twice (ids {seen[t]} and {i}), which llama.cpp "
                        "aborts on")
            seen[t] = i
    special = _special_ids(meta, types, model, n_tokens)
    add_bos, add_eos = _DEFAULT_ADD[kind]
    pre = "gemma4" if model == "gemma4" else meta.get("tokenizer.ggml.pre")
    if kind == "bpe" and pre in _BPE_BOS_PRE:
        add_bos = True
    add_bos = _flag(meta, types, "tokenizer.ggml.add_bos_token", add_bos)
    add_eos = _flag(meta, types, "tokenizer.ggml.add_eos_token", add_eos)
    if kind == "bpe" and pre in _GEMMA4_PRE:
        add_bos = True
    needed = []
    if kind == "wpm":
        needed = [("bos", "BOS"), ("sep", "SEP")]
    elif kind in ("spm", "ugm", "bpe"):
        needed = ([("bos", "BOS")] if add_bos else []) + ([("eos", "EOS")] if add_eos else [])
    for key, name in needed:
        if special[key] is None:
            return (f"has a tokenizer that adds a {name} token but names none inside its vocabulary "
                    f"({_ID_KEYS[key]}), which llama.cpp aborts on")
    if kind == "spm" and listed:
        have = set(tokens)
        missing = [b for b in _TEXT_BYTES if f"<0x{b:02X}>" not in have and (b >= 0x80 or chr(b) not in have)]
        if missing:
            return (f"has a SentencePiece vocabulary without byte tokens (<0x{missing[0]:02X}> and "
                    f"{len(missing) - 1} more): llama.cpp aborts on text it cannot spell")
    if kind == "wpm":
        types_ = meta.get("tokenizer.ggml.token_type")
        if isinstance(types_, list) and _BYTE in types_[:n_tokens]:
            return "has a WordPiece vocabulary with a byte token, which llama.cpp aborts on at load"
    return None


def _special_ids(meta: dict, types: dict, model: str, n_tokens: int) -> dict[str, int | None]:
    """The bos, eos and sep ids llama.cpp ends with: a default beyond the vocabulary disabled, one from the
    header taken when inside it (llama_vocab::impl::load, "special tokens")."""
    out = {}
    for key, default in zip(("bos", "eos", "sep"), _DEFAULT_IDS[model]):
        value = default if default is not None and default < n_tokens else None
        given = meta.get(_ID_KEYS[key])
        if (isinstance(given, int) and types.get(_ID_KEYS[key], (_UINT32,))[0] == _UINT32
                and 0 <= given < n_tokens):
            value = given
        out[key] = value
    return out


def _flag(meta: dict, types: dict, key: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None or types.get(key, (_BOOL,))[0] != _BOOL:
        return default
    return bool(value)


def check_tokenizer(g: GGUFFile) -> None:
    """Raise `NoTokenizer` when llama.cpp cannot tokenize text with `g`'s vocabulary (`tokenizer_problem`)."""
    why = tokenizer_problem(g)
    if why is not None:
        name = g.source or Path(g.path).name
        raise NoTokenizer(f"{name} {why}: {_FIX}", path=str(g.path))
