"""A request body, read before any route sees it: JSON, nested at most `MAX_DEPTH` deep, and no lone
UTF-16 surrogate. Python's json parser recurses once per level and a deep body ends in a
RecursionError (a 500); a lone surrogate parses but cannot be encoded as UTF-8, which every route
does with its text (another 500)."""

from __future__ import annotations

import json

from .http_errors import reject

# serde_json's default recursion limit (Deserializer::disable_recursion_limit's docs): no request
# of this API nests anywhere near it, and Python's parser stays far from its own limit
MAX_DEPTH = 128
_CHUNK = 1 << 22  # bytes scanned at a time: a few arrays of 4 Mi int64, 32 MiB each


def depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, brackets inside strings left out (for a
    valid text; for another, a number the parser's error then makes moot). Linear in the body and
    vectorized with numpy: a regular expression over strings costs a Python call per string."""
    import numpy as np

    step = np.zeros(256, np.int8)
    step[list(b"[{")], step[list(b"]}")] = 1, -1
    data = np.frombuffer(body, np.uint8)
    deepest = level = inside = slashes = 0  # carried over chunks: depth, in a string, backslashes before
    for start in range(0, len(data), _CHUNK):
        c = data[start:start + _CHUNK]
        at = np.arange(len(c))
        last_other = np.maximum.accumulate(np.where(c == ord("\\"), -1, at))
        run = at - last_other + np.where(last_other < 0, slashes, 0)  # backslashes ending at each byte
        before = np.concatenate(([slashes], run[:-1]))
        quotes = (c == ord('"')) & (before % 2 == 0)  # a quote after an even run of backslashes
        in_string = (np.cumsum(quotes) + inside) % 2 == 1
        depths = np.cumsum(np.where(in_string, 0, step[c]), dtype=np.int64) + level
        if len(depths):
            deepest, level = max(deepest, int(depths.max())), int(depths[-1])
            inside, slashes = int(in_string[-1]), int(run[-1])
    return deepest


def parse(body: bytes):
    """The JSON value of a request body, or a 400: not JSON, nested too deep, a lone surrogate."""
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and depth(body) > MAX_DEPTH:
        raise reject(400, f"the body nests arrays and objects more than {MAX_DEPTH} deep", code="invalid_json")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise reject(400, "the body is not valid JSON", code="invalid_json") from None
    try:  # JSON may escape half a UTF-16 pair ("\udc00"); no text made of it can be encoded
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise reject(400, "the body holds a lone UTF-16 surrogate (an escape like \\udc00 without its pair); "
                     "text must be valid Unicode", code="invalid_value") from None
    return data
