"""A split model (llama.cpp's `gguf-split` shards) read as one header."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import GGUFError
from .reader import GGUFFile, read_gguf


# llama.cpp names a split model's shards PREFIX-%05d-of-%05d.gguf (llama_split_path) and keeps
# split.count / split.no in each; the first shard holds the metadata.
SHARD_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def shard_paths(first: Path, count: int) -> list[Path]:
    """The paths of all `count` shards of a split model, from its first shard's path."""
    m = SHARD_RE.match(first.name)
    if not m or int(m["no"]) != 1 or int(m["count"]) != count:
        raise GGUFError(f"{first}: split.count is {count} but the name is not llama.cpp's "
                        "PREFIX-00001-of-NNNNN.gguf; pass the first shard of a split model")
    return [first.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_model(path: str | os.PathLike) -> GGUFFile:
    """A model's header as one file: a split model's shards (the first is given, as llama.cpp takes
    it) merged into the first's metadata and every shard's tensors; tokenizer arrays left out."""
    g = read_gguf(path, skip_arrays=True)
    count = g.get("split.count", 0)
    if not isinstance(count, int) or count <= 1:
        return g
    for shard in shard_paths(g.path, count)[1:]:
        part = read_gguf(shard, skip_arrays=True)
        g.tensors += part.tensors
        g.file_size += part.file_size
    expected = g.get("split.tensors.count", len(g.tensors))
    if expected != len(g.tensors):
        raise GGUFError(f"{g.path}: the shards hold {len(g.tensors)} tensors, split.tensors.count says {expected}")
    for key in SPLIT_KEYS:  # one merged file: a derived copy must not look for shards
        g.metadata.pop(key, None)
        g.value_types.pop(key, None)
    return g
