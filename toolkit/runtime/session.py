"""Saved KV state, "sessions": read a long document once, ask many questions.

A session file is llama.cpp's own sequence-state file (`llama_state_seq_save_file`: magic, version,
the token ids, then the KV cells of sequence 0) followed by ctxq's trailer: JSON metadata (what the
state was made from, and the SHA-256 of everything before it), the JSON's length and a magic.
llama.cpp's loader reads only its own part (`llama_state_seq_load_file` checks the bytes it read,
not the file's size), so the file loads as it is once ctxq has checked the trailer.

The state is only reused for the same model file (by digest), the same settings that shape the cache
(`cache_settings`), the same llama-cpp-python, and an input that starts with the saved tokens; any
other file is refused with one logged line and the input is processed from the start. A file is
written under a temporary name and renamed when complete, so an interrupted save leaves no session.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import struct
import time
from pathlib import Path

from ..errors import CtxqError, SessionMismatch
from ..llama import backend
from ..units import GiB, MiB

log = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"CTXQKV01"
TRAILER = struct.Struct("<Q8s")  # the metadata's length in bytes, MAGIC
STATE_HEADER = 12  # llama_state_seq_save_file: u32 magic, u32 version, u32 token count, then the tokens
AUTO = "auto"
DEFAULT_CACHE_GIB = 20.0  # `auto` sessions kept, least recently used evicted first (CTXQ_SESSION_CACHE_GIB)


def cache_settings(plan) -> dict:
    """The plan's settings that shape the saved cache. n_ubatch sizes the window caches of
    sliding-window models (pad256(n_swa + n_ubatch) cells unless swa_full), so it is kept too."""
    return {"n_ctx": plan.n_ctx, "type_k": plan.type_k, "type_v": plan.type_v, "flash_attn": bool(plan.flash_attn),
            "n_ubatch": plan.n_ubatch, "swa_full": bool(plan.swa_full)}


def _versions() -> dict:
    import importlib.metadata as md

    import llama_cpp

    return {"ctxq": md.version("ctxq"), "llama_cpp_python": llama_cpp.__version__}


def _model_digest(plan) -> str:
    from ..digest import file_digest  # SHA-256, remembered per (path, inode, size, mtime)

    from ..models import resolve_model

    return file_digest(resolve_model(plan.model))  # a Hub model's file in the Hugging Face cache


def _sha256(path: Path, n_bytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = n_bytes
        while left > 0 and (chunk := f.read(min(left, 1 << 22))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _partial_name(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.{pid}.partial")


def _remove_stale_partials(path: Path) -> None:
    """Remove what saves of `path` killed mid-write left behind (their process is gone)."""
    for p in path.parent.glob(f".{path.name}.*.partial"):
        try:
            os.kill(int(p.name[len(path.name) + 2:-len(".partial")]), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass


def predicted_bytes(llm, n_tokens: int, *, ctx=None, seq_id: int = 0) -> int:
    """The size of a session of `n_tokens` (evaluated in llm, or in sequence `seq_id` of `ctx`): llama.cpp
    sizes the state by writing it to a counting writer (`llama_state_seq_get_size`), so this is exact,
    less ctxq's small trailer."""
    lc = backend.llama_cpp()
    return STATE_HEADER + 4 * n_tokens + lc.llama_state_seq_get_size(ctx or llm._ctx.ctx, seq_id)


def save_session(llm, path, tokens: list[int], plan, *, ctx=None, seq_id: int = 0) -> None:
    """Save the KV state of `tokens` (already evaluated in llm, or in sequence `seq_id` of the context
    `ctx`: an engine's) atomically with its metadata."""
    lc = backend.llama_cpp()
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(path)
    ctx = ctx or llm._ctx.ctx
    state_bytes = predicted_bytes(llm, len(tokens), ctx=ctx, seq_id=seq_id)
    free = shutil.disk_usage(path.parent).free
    if state_bytes + MiB > free:  # + 1 MiB: the metadata and the filesystem's own rounding
        raise CtxqError(f"the session needs {state_bytes / MiB:,.1f} MiB but {path.parent} has "
                        f"{free / MiB:,.1f} MiB free; free some space or save the session elsewhere")
    part = _partial_name(path, os.getpid())
    try:
        arr = (lc.llama_token * len(tokens))(*tokens)
        written = lc.llama_state_seq_save_file(ctx, str(part).encode(), seq_id, arr, len(tokens))
        if not written:
            raise CtxqError(f"llama.cpp could not write the session to {part.parent}")
        meta = {"format": FORMAT, **_versions(), "model": Path(plan.model).name, "model_sha256": _model_digest(plan),
                "settings": cache_settings(plan), "n_tokens": len(tokens), "state_bytes": written,
                "state_sha256": _sha256(part, written), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        blob = json.dumps(meta, sort_keys=True).encode()
        with open(part, "ab") as f:
            f.write(blob + TRAILER.pack(len(blob), MAGIC))
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)  # atomic: the path holds a whole session or what it held before
    except OSError as e:
        raise CtxqError(f"cannot write the session {path}: {e.strerror}") from None
    finally:
        part.unlink(missing_ok=True)
    log.info("session: saved %d tokens to %s (%.1f MiB)", len(tokens), path, path.stat().st_size / MiB)


def read_metadata(path) -> dict:
    """The metadata of a session file; SessionMismatch when it is not one (or was cut short)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < TRAILER.size:
                raise SessionMismatch("it is truncated (shorter than its trailer)")
            f.seek(size - TRAILER.size)
            n, magic = TRAILER.unpack(f.read(TRAILER.size))
            if magic != MAGIC or n > size - TRAILER.size:
                raise SessionMismatch("it is not a ctxq session file, or it is truncated")
            f.seek(size - TRAILER.size - n)
            meta = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise SessionMismatch(f"its metadata cannot be read ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SessionMismatch(f"it has format {meta.get('format') if isinstance(meta, dict) else '?'}, "
                              f"this ctxq reads {FORMAT}")
    if not isinstance(meta.get("state_bytes"), int) or meta["state_bytes"] + n + TRAILER.size != size:
        raise SessionMismatch("its size does not match its metadata (truncated or altered)")
    return meta


def _saved_tokens(path: Path, n: int) -> list[int]:
    import numpy as np

    return np.fromfile(path, dtype="<i4", count=n, offset=STATE_HEADER).tolist()


def _check(path: Path, meta: dict, plan, tokens: list[int] | None) -> list[int]:
    """Raise SessionMismatch unless the session fits this model, plan and input; the saved tokens."""
    if meta.get("llama_cpp_python") != _versions()["llama_cpp_python"]:
        raise SessionMismatch(f"it was made by llama-cpp-python {meta.get('llama_cpp_python')}, "
                              f"this is {_versions()['llama_cpp_python']}")
    if meta.get("model_sha256") != _model_digest(plan):
        raise SessionMismatch(f"it was made from another model file ({meta.get('model')}, "
                              f"sha256 {str(meta.get('model_sha256'))[:12]}…)")
    ours = cache_settings(plan)
    theirs = meta.get("settings") or {}
    diff = [f"{k}={theirs.get(k)!r}" for k in ours if theirs.get(k) != ours[k]]
    if diff:
        now = ", ".join(f"{k}={ours[k]!r}" for k in ours if theirs.get(k) != ours[k])
        raise SessionMismatch(f"it was made with {', '.join(diff)}; this plan has {now}")
    saved = _saved_tokens(path, int(meta["n_tokens"]))
    if tokens is not None:
        if len(saved) > len(tokens):
            raise SessionMismatch(f"it holds {len(saved):,} tokens, more than this input's {len(tokens):,}")
        first = next((i for i, (a, b) in enumerate(zip(saved, tokens)) if a != b), None)
        if first is not None:
            raise SessionMismatch(f"its {len(saved):,} tokens are not the start of this input "
                                  f"(they differ from token {first:,} on)")
    if _sha256(path, meta["state_bytes"]) != meta.get("state_sha256"):
        raise SessionMismatch("its checksum does not match (the file is corrupted)")
    return saved


def _load(llm, path: Path, saved: list[int]) -> None:
    """Put the saved KV cells into sequence 0 and tell llama-cpp-python which tokens it holds."""
    lc = backend.llama_cpp()
    ctx = llm._ctx.ctx
    mem = lc.llama_get_memory(ctx)
    lc.llama_memory_clear(mem, True)
    out = (lc.llama_token * max(1, len(saved)))()
    n_out = ctypes.c_size_t(0)
    with backend.capture_log() as lines:
        ok = lc.llama_state_seq_load_file(ctx, str(path).encode(), 0, out, len(saved), ctypes.byref(n_out))
    if not ok or n_out.value != len(saved):
        lc.llama_memory_clear(mem, True)
        llm.n_tokens = 0
        tail = [l.strip() for l in lines if l.strip()][-1:]
        raise SessionMismatch(f"llama.cpp could not restore it{': ' + tail[0] if tail else ''}")
    llm.input_ids[:len(saved)] = saved
    llm.n_tokens = len(saved)
    llm._requires_eval = True  # no logits were restored: llama-cpp-python re-evaluates the last token


def restore_session(llm, path, plan, tokens: list[int] | None = None) -> int:
    """Load the saved state into llm when it was made from the same model file (digest), the same plan
    settings that shape the cache, and (when `tokens` is given) its tokens are a prefix of `tokens`;
    returns the number of tokens restored (llm then holds them, so llama-cpp-python's own prefix reuse
    continues from there), 0 when the file does not match (the reason logged as a warning; nothing raised)."""
    def load(path: Path, saved: list[int]) -> int:
        if len(saved) > llm.n_ctx():
            raise SessionMismatch(f"it holds {len(saved):,} tokens, more than the context's {llm.n_ctx():,}")
        _load(llm, path, saved)
        return len(saved)

    return _restore(path, plan, tokens, load)


def _restore(path, plan, tokens: list[int] | None, load) -> int:
    """Check the saved state at `path` against the plan and `tokens` (_check) and `load(path, saved tokens)` it:
    the number of tokens restored, 0 when the file is missing or does not match (the reason logged)."""
    path = Path(path).expanduser()
    if not path.is_file():
        return 0
    t0 = time.perf_counter()
    try:
        n = load(path, _check(path, read_metadata(path), plan, tokens))
    except SessionMismatch as e:
        log.warning("session %s not used: %s; processing the input from the start", path, e)
        return 0
    os.utime(path)  # the `auto` cache evicts the least recently used first
    log.info("session: restored %d tokens from %s in %.2f s", n, path, time.perf_counter() - t0)
    return n


# --- the engine's shared prefix (ctxq run with several questions) ---------------------------------

def restore_into_engine(engine, path, plan, tokens: list[int]) -> int:
    """Load a saved document into a sequence of `engine` that its requests then share (forked with
    llama_memory_seq_cp): the number of tokens restored, 0 when the file does not match (logged)."""
    lc = backend.llama_cpp()

    def load(path: Path, saved: list[int]) -> int:
        def read(ctx, seq_id: int) -> list[int]:
            out = (lc.llama_token * max(1, len(saved)))()
            n_out = ctypes.c_size_t(0)
            with backend.capture_log() as lines:
                ok = lc.llama_state_seq_load_file(ctx, str(path).encode(), seq_id, out, len(saved),
                                                  ctypes.byref(n_out))
            if not ok or n_out.value != len(saved):
                tail = [l.strip() for l in lines if l.strip()][-1:]
                raise SessionMismatch(f"llama.cpp could not restore it{': ' + tail[0] if tail else ''}")
            return saved

        return engine.load_prefix(read)

    return _restore(path, plan, tokens, load)


def save_from_engine(engine, session, tokens: list[int], plan) -> bool:
    """Save the engine's resident sequence that holds exactly `tokens` (a path or `auto`); a failed save
    is logged as a warning. Whether it was saved."""
    def write(ctx, seq_id: int) -> None:
        if str(session) == AUTO:
            need, cap = predicted_bytes(None, len(tokens), ctx=ctx, seq_id=seq_id), cache_cap()
            if need > cap:
                raise CtxqError(f"the session needs {need / MiB:,.1f} MiB, more than the session cache may hold "
                                f"({cap / MiB:,.1f} MiB, CTXQ_SESSION_CACHE_GIB)")
            evict(cache_dir(), cap, room=need)
        save_session(None, session_path(session, plan, tokens), tokens, plan, ctx=ctx, seq_id=seq_id)

    try:
        return engine.save_prefix(tokens, write)
    except CtxqError as e:
        log.warning("session not saved: %s", e)
        return False


# --- the `auto` cache ---------------------------------------------------------------------------

def cache_dir() -> Path:
    from ..paths import ctxq_home

    return ctxq_home() / "sessions"


def cache_cap() -> int:
    """Bytes the `auto` cache may hold: CTXQ_SESSION_CACHE_GIB, else 20 GiB."""
    value = os.environ.get("CTXQ_SESSION_CACHE_GIB")
    try:
        return int(float(value) * GiB) if value else int(DEFAULT_CACHE_GIB * GiB)
    except ValueError:
        raise CtxqError(f"CTXQ_SESSION_CACHE_GIB must be a number of GiB, not {value!r}") from None


def auto_path(plan, tokens: list[int]) -> Path:
    """The `auto` cache's file for these tokens under this model and these settings."""
    key = json.dumps([_model_digest(plan), cache_settings(plan), _versions()["llama_cpp_python"], tokens])
    return cache_dir() / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".kv")


def evict(folder: Path, cap: int, room: int = 0) -> list[Path]:
    """Remove the least recently used sessions in `folder` until they and `room` more bytes fit in
    `cap`; the removed paths."""
    files = sorted(folder.glob("*.kv"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    total = sum(p.stat().st_size for p in files)
    removed = []
    while files and total + room > cap:
        p = files.pop(0)
        total -= p.stat().st_size
        p.unlink(missing_ok=True)
        removed.append(p)
        log.info("session: evicted %s from the cache (least recently used)", p.name)
    return removed


def save_cached(llm, tokens: list[int], plan) -> Path:
    """`save_session` into the `auto` cache, evicting the least recently used sessions to make room."""
    need, cap = predicted_bytes(llm, len(tokens)), cache_cap()
    if need > cap:
        raise CtxqError(f"the session needs {need / MiB:,.1f} MiB, more than the session cache may hold "
                        f"({cap / MiB:,.1f} MiB, CTXQ_SESSION_CACHE_GIB)")
    evict(cache_dir(), cap, room=need)
    path = auto_path(plan, tokens)
    save_session(llm, path, tokens, plan)
    return path


def session_path(session, plan, tokens: list[int]) -> Path:
    """The file `session` names: a path, or `auto` (the cache's file for these tokens)."""
    return auto_path(plan, tokens) if str(session) == AUTO else Path(session).expanduser()


def save_for_run(llm, session, tokens: list[int], plan) -> bool:
    """Save a run's session (a path or `auto`); a save that fails (no space, no permission) is logged
    as a warning and the run goes on. Whether it was saved."""
    try:
        if str(session) == AUTO:
            save_cached(llm, tokens, plan)
        else:
            save_session(llm, session, tokens, plan)
    except CtxqError as e:
        log.warning("session not saved: %s", e)
        return False
    return True
