"""Model references that name a Hugging Face repository, and the GGUF file a quantization tag picks.

    USER/REPO                 a safetensors checkpoint (planned per quantization, or converted)
    USER/REPO:Q4_K_M          a GGUF repo; the tag picks the file, case-insensitively, in any
                              folder, a split model by its first shard (...-00001-of-00003.gguf)
    hf.co/USER/REPO/PATH.gguf one exact file of a GGUF repo (the CLI's --hf-file); without `hf.co/`
                              it would be a local path
    ...@REVISION              a branch, tag or commit; `hf.co/` or `huggingface.co/` in front is optional

These are llama.cpp's `-hf user/repo:Q4_K_M` and Ollama's `hf.co/user/repo:Q4_K_M`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import HubError
from ..gguf.shards import SHARD_RE

# the Hub's rule for repo names: letters, digits, '-', '_', '.'; an owner and a name
_PART = r"[A-Za-z0-9][\w.-]*"
_REF = re.compile(rf"^(?:https?://)?(?P<host>hf\.co/|huggingface\.co/)?(?P<repo>{_PART}/{_PART})"
                  rf"(?P<file>(?:/[^@:]+)+\.gguf)?(?::(?P<tag>[\w.-]+))?(?:@(?P<rev>[\w./-]+))?$")


@dataclass(frozen=True)
class HubRef:
    repo: str
    tag: str | None = None  # a quantization tag (Q4_K_M), matched in file names
    file: str | None = None  # an exact file in the repo
    revision: str | None = None  # None: the default branch

    @property
    def is_gguf(self) -> bool:
        return bool(self.tag or self.file)

    def __str__(self) -> str:
        return ((f"hf.co/{self.repo}/{self.file}" if self.file else self.repo) + (f":{self.tag}" if self.tag else "")
                + (f"@{self.revision}" if self.revision else ""))


def parse_ref(model) -> HubRef | None:
    """The Hub reference `model` spells, or None when it is no such thing (a path, a name)."""
    text = str(model)
    if text.endswith((".safetensors",)) or text.startswith((".", "/", "~")):
        return None
    m = _REF.match(text)
    # a missing local file (dir/model.gguf, dir/sub/model.gguf) is no repo
    if not m or (m["file"] and (m["tag"] or not m["host"])) or m["repo"].endswith(".gguf"):
        return None
    return HubRef(m["repo"], m["tag"], m["file"][1:] if m["file"] else None, m["rev"])


def with_file(model: str, hf_file: str | None) -> str:
    """`model` (USER/REPO[@REVISION]) naming one exact file of the repo (the CLI's --hf-file)."""
    if not hf_file:
        return model
    ref = parse_ref(model)
    if ref is None or ref.is_gguf:
        raise HubError(f"hf_file={hf_file} names a file of a Hub repo: give the repo as USER/REPO, not {model!r}",
                       option="hf_file", value=hf_file)
    return str(HubRef(ref.repo, None, hf_file.lstrip("/"), ref.revision))


def quant_of(name: str) -> str:
    """The quantization tag a GGUF file name carries: the last '-' or '.' field before the
    extension and any shard suffix (Llama-3-70B-Instruct-Q4_K_M-00001-of-00003.gguf -> Q4_K_M)."""
    stem = name.rsplit("/", 1)[-1]
    m = SHARD_RE.match(stem)
    stem = m["prefix"] if m else stem.removesuffix(".gguf")
    return re.split(r"[-.]", stem)[-1].upper()


def pick_gguf(ref: HubRef, files: dict[str, int]) -> list[str]:
    """The repo files (first shard first) that `ref` names among `files` (path -> bytes)."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ref.file:
        if ref.file not in files:
            raise HubError(f"{ref.repo} has no file {ref.file}" + _listing(ggufs))
        return shards_of(ref.file, files)
    # a file matches when the tag is one of its name's fields (case-insensitive), a split model by
    # its first shard; mmproj files (vision projectors) are never the model
    tag = ref.tag.upper()
    firsts = [f for f in ggufs if _is_first(f) and "mmproj" not in f.lower()]
    hits = [f for f in firsts if tag in re.split(r"[-.]", _stem(f).upper())]
    if not hits:
        raise HubError(f"{ref.repo} has no {ref.tag} GGUF; it has: {', '.join(quants(files)) or 'no GGUF files'}",
                       option="tag", value=ref.tag, limit=quants(files))
    if len(hits) > 1:
        raise HubError(f"{ref.repo}:{ref.tag} matches {len(hits)} files ({', '.join(hits)}); "
                       "name one with hf_file=PATH", option="tag", value=ref.tag, limit=hits)
    return shards_of(hits[0], files)


def quants(files) -> list[str]:
    """The quantization tags of a repo's GGUF models, in name order, once each."""
    seen = dict.fromkeys(quant_of(f) for f in sorted(files)
                         if f.endswith(".gguf") and _is_first(f) and "mmproj" not in f.lower())
    return list(seen)


def shards_of(first: str, files: dict[str, int]) -> list[str]:
    """All shards of a split model from its first shard's repo path (a single file: itself)."""
    m = SHARD_RE.match(first)
    if not m:
        return [first]
    count = int(m["count"])
    shards = [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [s for s in shards if s not in files]
    if missing:
        raise HubError(f"{first} is split in {count} but the repo lacks {missing[0]}")
    return shards


def _stem(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    m = SHARD_RE.match(name)
    return m["prefix"] if m else name.removesuffix(".gguf")


def _is_first(path: str) -> bool:
    m = SHARD_RE.match(path.rsplit("/", 1)[-1])
    return not m or int(m["no"]) == 1


def _listing(files: list[str]) -> str:
    return f"; its GGUF files: {', '.join(files)}" if files else "; it has no GGUF files"
