"""Text a user gives ctxq as a file (`ctxq run -f` and `--questions`, `ctxq quality -f`): refused from its first
block when it is not text, and read only as far as a context can use.

`TextFile(path)` reads the first block at once and refuses a file that is not UTF-8 text: a GGUF model, a PDF, an
image or an archive by its magic bytes, anything else by a NUL byte or an invalid UTF-8 sequence in that block
(`NotText`, one line naming what it looks like). `read(limit)` then reads at most `limit` bytes in all. The limit
for a context of n tokens is `byte_limit`: n times the longest token of the model's vocabulary, in bytes. With
llama.cpp's BPE (over bytes) and SentencePiece vocabularies every byte of the input lies inside the text of one
token (a space is SentencePiece's three-byte "▁", a lone byte its six-character "<0xNN>": a token never stands for
more bytes than its text holds), so a longer text has more than n tokens, and nothing past the limit could be used.
Vocabularies that normalise text away (WordPiece, Unigram) get no limit: their input is read whole.
Past the first block an invalid sequence is replaced (U+FFFD), as before.
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path

from .errors import CtxqError, NotText

BLOCK = 1 << 16  # the first read: enough to tell text from a binary format

# magic bytes at offset 0 -> what the file looks like (the formats people mistake for text)
_MAGIC = [
    (b"GGUF", "a GGUF model"),
    (b"%PDF", "a PDF document"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF87a", "a GIF image"), (b"GIF89a", "a GIF image"),
    (b"PK\x03\x04", "a ZIP archive (or a .docx, .xlsx, .odt, .epub)"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\x28\xb5\x2f\xfd", "a zstd archive"),
    (b"BZh", "a bzip2 archive"),
    (b"\xfd7zXZ\x00", "an xz archive"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"\x93NUMPY", "a NumPy array (.npy)"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old Microsoft Office document (.doc, .xls)"),
    (b"\xff\xfe", "UTF-16 text (convert it to UTF-8)"), (b"\xfe\xff", "UTF-16 text (convert it to UTF-8)"),
]
# bounded by the vocabulary: llama.cpp's BPE ("gpt2") and SentencePiece ("llama") tokenizers (llama-vocab.cpp)
_BOUNDED = {"gpt2", "llama"}


def looks_like(head: bytes) -> str | None:
    """What a file starting with `head` seems to be, from its magic bytes; None when nothing is recognised."""
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if len(head) >= 10 and head[8:10] == b'{"' and int.from_bytes(head[:8], "little") < (100 << 20):
        return "a safetensors file"  # an 8-byte header length, then the JSON header
    if head[4:8] == b"ftyp":
        return "an MP4/MOV/HEIC file"
    if head.startswith(b"RIFF") and head[8:12] in (b"WAVE", b"AVI ", b"WEBP"):
        return {b"WAVE": "a WAV file", b"AVI ": "an AVI file", b"WEBP": "a WebP image"}[head[8:12]]
    return None


def check_text(head: bytes, name: str, complete: bool) -> None:
    """NotText unless `head`, the first block of `name` (all of it when `complete`), reads as UTF-8 text."""
    what = looks_like(head)
    if what is not None:
        raise NotText(f"{name} is not text: it looks like {what}; give a UTF-8 text file", what)
    if b"\0" in head:
        at = head.index(b"\0")
        raise NotText(f"{name} is not text: it holds a NUL byte at offset {at:,}; give a UTF-8 text file")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=complete)  # a character cut by the block is fine
    except UnicodeDecodeError as e:
        raise NotText(f"{name} is not UTF-8 text: byte 0x{head[e.start]:02x} at offset {e.start:,} starts no "
                      "UTF-8 character; convert it (iconv -t UTF-8) or give a text file") from None


def byte_limit(model: str | os.PathLike, n_tokens: int) -> int | None:
    """Bytes of text that hold more than `n_tokens` tokens of `model`'s vocabulary, whatever the text: n_tokens
    times its longest token. None where the vocabulary gives no such bound (see the module's docstring)."""
    from .gguf.reader import vocabulary_bound

    kind, longest = vocabulary_bound(model)
    return n_tokens * longest if kind in _BOUNDED and longest > 0 else None


class TextFile:
    """A text file, open, its first block read and checked. `bytes_read` counts what was read so far."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb", buffering=0)  # unbuffered: nothing read beyond what is asked
        except OSError as e:
            raise CtxqError(f"cannot read {path}: {e.strerror}", option="file", value=str(path)) from None
        try:
            self.head = self._read(BLOCK)
            check_text(self.head, str(path), complete=len(self.head) < BLOCK)
        except BaseException:
            self.close()
            raise
        self.bytes_read = len(self.head)

    def _read(self, n: int) -> bytes:
        """Up to `n` bytes; fewer only at the end of the file (a FIFO's reads come in pieces)."""
        parts, left = [], n
        try:
            while left > 0:
                chunk = self._f.read(min(left, 1 << 20))
                if not chunk:
                    break
                parts.append(chunk)
                left -= len(chunk)
        except OSError as e:
            raise CtxqError(f"cannot read {self.path}: {e.strerror}", option="file", value=str(self.path)) from None
        return b"".join(parts)

    def read(self, limit: int | None = None) -> tuple[bytes, bool]:
        """(the file's bytes up to `limit` in all, None: to its end; whether that is the whole file). Closes it."""
        try:
            if limit is None:
                rest = self._read(1 << 62)
                data, whole = self.head + rest, True
            else:
                more = self._read(max(0, limit + 1 - len(self.head)))  # one byte past the limit tells the end
                data = (self.head + more)[:limit + 1]
                whole = len(data) <= limit
                data = data[:limit]
            self.bytes_read = len(self.head) + len(rest if limit is None else more)
            return data, whole
        finally:
            self.close()

    def text(self, limit: int | None = None) -> tuple[str, bool]:
        """`read(limit)` decoded (an invalid sequence past the first block replaced); a character cut at the
        limit is left out."""
        data, whole = self.read(limit)
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=whole), whole

    def close(self) -> None:
        self._f.close()

    def __repr__(self) -> str:
        return f"TextFile({str(self.path)!r})"
