"""Vocabularies: byte-level BPE from `tokenizer.json`, SentencePiece from `tokenizer.model`.

The BPE pre-tokenizer name (`tokenizer.ggml.pre`) is recognised from the structure of
tokenizer.json's `pre_tokenizer` (its split regexes and byte-level step), matched against the
regexes llama.cpp implements for each name (llama_vocab::impl::load / llm_tokenizer_bpe in
src/llama-vocab.cpp). An unrecognised structure is refused with a pointer to `pre=NAME`.
SentencePiece models are read with a small protobuf reader, so `sentencepiece` is not needed.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
from gguf import TokenType

from ..errors import ConversionError

log = logging.getLogger(__name__)

# Split regexes as they appear in tokenizer.json files (quoted in llama-vocab.cpp beside the
# adapted regex llama.cpp runs for the same name).
LLAMA3_RE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
             "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_RE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
            "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

# Canonical pre-tokenizer structure -> llama.cpp name. ("bytelevel", True) is GPT-2's own regex.
KNOWN_PRE: dict[tuple, str] = {
    (("bytelevel", True),): "gpt-2",
    (("digits", True), ("bytelevel", True)): "smollm",
    (("split", LLAMA3_RE), ("bytelevel", False)): "llama-bpe",
    (("split", QWEN2_RE), ("bytelevel", False)): "qwen2",
}


@dataclass
class Vocab:
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    pre: str | None = None
    add_space_prefix: bool | None = None
    special: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad -> id
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        if self.merges:
            w.add_token_merges(self.merges)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        for kind, tid in self.special.items():
            getattr(w, f"add_{kind}_token_id")(tid)
        if self.add_bos is not None:
            w.add_add_bos_token(self.add_bos)
        if self.add_eos is not None:
            w.add_add_eos_token(self.add_eos)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def pre_signature(pt: dict | None) -> tuple:
    """tokenizer.json's pre_tokenizer as a comparable tuple; unknown parts keep their full JSON."""
    if pt is None:
        return ()
    if pt.get("type") == "Sequence":
        return tuple(x for p in pt["pretokenizers"] for x in pre_signature(p))
    kind = pt.get("type")
    if kind == "ByteLevel" and not pt.get("add_prefix_space", False):
        return (("bytelevel", bool(pt.get("use_regex", True))),)
    if kind == "Digits":
        return (("digits", bool(pt.get("individual_digits", False))),)
    if kind == "Split" and pt.get("behavior") == "Isolated" and not pt.get("invert", False):
        pat = pt.get("pattern", {})
        return (("split", pat.get("Regex", pat.get("String"))),)
    return ((kind, json.dumps(pt, sort_keys=True)),)


def recognise_pre(tj: dict) -> str:
    sig = pre_signature(tj.get("pre_tokenizer"))
    name = KNOWN_PRE.get(sig)
    if name is None:
        parts = ", ".join(p[0] for p in sig) or "none"
        raise ConversionError(f"unrecognised BPE pre-tokenizer ({parts}); pass pre=NAME with the llama.cpp "
                              f"pre-tokenizer that matches it (known here: {', '.join(sorted(set(KNOWN_PRE.values())))})")
    return name


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_vocab(folder: Path, config: dict, n_vocab: int, pre: str | None = None) -> Vocab:
    """The vocabulary of a checkpoint folder, padded to the embedding's n_vocab rows."""
    tj_path, spm_path = folder / "tokenizer.json", folder / "tokenizer.model"
    tj = json.loads(tj_path.read_text(encoding="utf-8")) if tj_path.is_file() else None
    if str(config.get("model_type", "")).startswith("gemma4"):
        return load_gemma4_vocab(folder, config, tj, n_vocab)
    byte_level = tj is not None and tj.get("model", {}).get("type") == "BPE" and \
        (tj.get("decoder") or {}).get("type") in ("ByteLevel", None) and \
        any(p[0] == "bytelevel" for p in pre_signature(tj.get("pre_tokenizer")))
    if byte_level or (tj is not None and pre is not None and not spm_path.is_file()):
        vocab = _bpe_vocab(tj, n_vocab, pre or recognise_pre(tj))
    elif spm_path.is_file():
        vocab = _spm_vocab(spm_path, tj, n_vocab)
    elif tj is not None:
        raise ConversionError(f"{folder}: tokenizer.json is a {tj.get('model', {}).get('type')} tokenizer that is not "
                              "byte-level BPE and there is no tokenizer.model; ctxq converts byte-level BPE or SentencePiece")
    else:
        raise ConversionError(f"{folder}: no tokenizer.json or tokenizer.model; download the tokenizer files too")
    _special_tokens(folder, config, tj, vocab)
    return vocab


def _pad(tokens: list[str | None], types: list[int], n_vocab: int) -> None:
    if len(tokens) > n_vocab:
        raise ConversionError(f"the tokenizer has {len(tokens)} tokens but the embedding only {n_vocab} rows")
    for i in range(len(tokens), n_vocab):
        tokens.append(None)
        types.append(TokenType.UNUSED)
    for i, t in enumerate(tokens):
        if t is None:  # ids the tokenizer never produces; llama.cpp needs a distinct text for each
            tokens[i], types[i] = f"[PAD{i}]", TokenType.UNUSED


def _bpe_vocab(tj: dict, n_vocab: int, pre: str) -> Vocab:
    model = tj["model"]
    size = max([n_vocab - 1, *model["vocab"].values(), *(a["id"] for a in tj.get("added_tokens", []))]) + 1
    tokens: list[str | None] = [None] * size
    types = [TokenType.NORMAL] * size
    for text, i in model["vocab"].items():
        tokens[i] = text
    for a in tj.get("added_tokens", []):
        tokens[a["id"]] = a["content"]
        types[a["id"]] = TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    _pad(tokens, types, n_vocab)
    return Vocab("gpt2", tokens, [int(t) for t in types], merges=merges, pre=pre)


def _spm_vocab(path: Path, tj: dict | None, n_vocab: int) -> Vocab:
    pieces, add_dummy_prefix = read_spm(path)
    tokens: list[str | None] = [p[0] for p in pieces]
    scores = [p[1] for p in pieces]
    types = [p[2] for p in pieces]
    for a in (tj or {}).get("added_tokens", []):
        i = a["id"]
        while len(tokens) <= i:
            tokens.append(None), scores.append(-1000.0), types.append(TokenType.UNUSED)
        if i >= len(pieces) or tokens[i] != a["content"]:
            tokens[i] = a["content"]
            types[i] = TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED
    n_before = len(tokens)
    _pad(tokens, types, n_vocab)
    scores += [-1000.0] * (len(tokens) - n_before)
    return Vocab("llama", tokens, [int(t) for t in types], scores=scores, add_space_prefix=add_dummy_prefix)


# Gemma4Model.set_vocab: tokens llama.cpp's chat parser must see, typed USER_DEFINED whatever the tokenizer says
GEMMA4_VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                  '<|"|>'}


def load_gemma4_vocab(folder: Path, config: dict, tj: dict | None, n_vocab: int) -> Vocab:
    """llama.cpp's `gemma4` tokenizer model: the SentencePiece-style BPE of tokenizer.json (spaces as
    U+2581, byte fallback) with its merges, every score -1000, no pre-tokenizer name (llama_vocab::impl::load
    sets it), BOS added and no space prefix, as Gemma4Model.set_vocab writes it through gguf's LlamaHfVocab."""
    model = (tj or {}).get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise ConversionError(f"{folder}: Gemma 4 needs its tokenizer.json (a BPE with byte fallback); download "
                              "the tokenizer files too")
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    named = {_token_text(tc.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                                              "cls_token", "mask_token")}
    extra = tc.get("extra_special_tokens") or tc.get("additional_special_tokens") or []
    named |= {_token_text(t) for t in (extra.values() if isinstance(extra, dict) else extra)}  # {name: token} too
    size = max([*model["vocab"].values(), *(a["id"] for a in tj.get("added_tokens", []))]) + 1
    tokens: list[str | None] = [None] * size
    types = [TokenType.NORMAL] * size
    for text, i in model["vocab"].items():
        tokens[i] = text
        types[i] = TokenType.BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text) else TokenType.NORMAL
    # LlamaHfVocab: CONTROL are the tokens transformers names special (all_special_ids, from
    # tokenizer_config.json), USER_DEFINED the other added tokens past the base vocabulary
    for a in tj.get("added_tokens", []):
        tokens[a["id"]] = a["content"]
        if a["content"] not in model["vocab"]:
            types[a["id"]] = TokenType.USER_DEFINED
    for i, t in enumerate(tokens):
        if t in named:
            types[i] = TokenType.CONTROL
    for i, t in enumerate(tokens):
        if t in GEMMA4_VISIBLE:
            types[i] = TokenType.USER_DEFINED
    _pad(tokens, types, n_vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    vocab = Vocab("gemma4", tokens, [int(t) for t in types], scores=[-1000.0] * len(tokens), merges=merges,
                  add_space_prefix=False)
    _special_tokens(folder, config, tj, vocab)
    vocab.add_bos, vocab.add_eos = True, (bool(tc["add_eos_token"]) if "add_eos_token" in tc else None)
    return vocab


# --- a minimal protobuf reader for sentencepiece's ModelProto (sentencepiece_model.proto) -------

def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return out, i


def _fields(buf: bytes):
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            val, i = buf[i:i + n], i + n
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            raise ConversionError(f"tokenizer.model: unsupported protobuf wire type {wire}")
        yield num, val


def read_spm(path: Path) -> tuple[list[tuple[str, float, int]], bool]:
    """(piece, score, type) for every piece, and add_dummy_prefix. Types use sentencepiece's
    numbering, which is gguf's TokenType numbering (NORMAL 1 ... BYTE 6)."""
    pieces, add_dummy_prefix = [], True  # proto2 default of NormalizerSpec.add_dummy_prefix
    try:
        for num, val in _fields(path.read_bytes()):
            if num == 1:  # repeated SentencePiece pieces
                piece, score, kind = "", 0.0, 1
                for n, v in _fields(val):
                    if n == 1:
                        piece = v.decode("utf-8")
                    elif n == 2:
                        (score,) = struct.unpack("<f", v)
                    elif n == 3:
                        kind = v
                pieces.append((piece, score, kind))
            elif num == 3:  # NormalizerSpec
                for n, v in _fields(val):
                    if n == 1 and v not in (b"identity", b""):
                        # llama.cpp's SPM tokenizer does not normalize (no NFKC, newlines kept)
                        log.warning("%s: SentencePiece normalizer %r is not reproduced by llama.cpp; "
                                    "tokenization may differ on unusual text", path, v.decode(errors="replace"))
                    elif n == 3:
                        add_dummy_prefix = bool(v)
    except (IndexError, UnicodeDecodeError, struct.error):
        raise ConversionError(f"{path}: not a SentencePiece model") from None
    if not pieces:
        raise ConversionError(f"{path}: not a SentencePiece model (no pieces)")
    return pieces, add_dummy_prefix


# --- special tokens, add-bos, chat template ----------------------------------------------------

def _special_tokens(folder: Path, config: dict, tj: dict | None, vocab: Vocab) -> None:
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    stm_path = folder / "special_tokens_map.json"
    stm = json.loads(stm_path.read_text(encoding="utf-8")) if stm_path.is_file() else {}
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    for kind in ("bos", "eos", "unk", "pad"):
        text = _token_text(tc.get(f"{kind}_token")) or _token_text(stm.get(f"{kind}_token"))
        tid = ids.get(text) if text else None
        if tid is None:
            cid = config.get(f"{kind}_token_id")
            tid = cid[0] if isinstance(cid, list) and cid else cid
        if isinstance(tid, int) and 0 <= tid < len(vocab.tokens):
            vocab.special[kind] = tid
    vocab.add_bos, vocab.add_eos = _adds_special(tj, vocab, tc)
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates; llama.cpp takes the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = folder / "chat_template.jinja"  # transformers 5 saves the template beside the config
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    vocab.chat_template = template or None


def _adds_special(tj: dict | None, vocab: Vocab, tc: dict) -> tuple[bool | None, bool | None]:
    """Whether encoding adds BOS/EOS: what the tokenizer's post-processor does, else the config's flags."""
    bos, eos = vocab.special.get("bos"), vocab.special.get("eos")
    if tj is not None and tj.get("post_processor") and vocab.model == "gpt2":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(json.dumps(tj))
        plain = tok.encode("a", add_special_tokens=False).ids
        full = tok.encode("a", add_special_tokens=True).ids
        extra = len(full) - len(plain)
        return (extra > 0 and full[0] == bos and (not plain or plain[0] != bos),
                extra > 0 and full[-1] == eos and (not plain or plain[-1] != eos))
    default_bos = vocab.model == "llama"  # LlamaTokenizer/GemmaTokenizer add BOS unless told not to
    return bool(tc.get("add_bos_token", default_bos)), bool(tc.get("add_eos_token", False))
