"""Hostile tokenizer headers on the load and tokenize paths of `ctxq run`, `ctxq serve` and `ctxq quality` (issue 56):
0 aborts, one line each. llama.cpp aborts the process on some vocabularies (ctxq.gguf.vocab lists them, from the
vendored llama-vocab.cpp); ctxq refuses those from the header before llama.cpp is asked. Every case runs the real
console script in a child, so an abort fails the test instead of killing pytest. The models are tiny llamas (one
layer, 64 wide, random weights) written here, with a small vocabulary whose tokenizer keys each seed mutates: the
geometry is untouched, so every header passes the planner and reaches the tokenizer."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from ctxq.errors import NoTokenizer
from ctxq.gguf.reader import read_gguf
from ctxq.gguf.vocab import check_tokenizer
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

from .conftest import ctxq_exe, run_ctxq

_ABORT = ("GGML_ASSERT", "GGML_ABORT", "terminate called", "gdb", "core dumped", "Traceback")
_TEXT = "hi é\x01 h"  # é and \x01 are no tokens of these vocabularies: SentencePiece falls back to bytes


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet (what a BPE vocabulary holds for the 256 bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _base(kind: str) -> dict:
    """Tokenizer keys of a small working vocabulary: SentencePiece, byte-level BPE or WordPiece."""
    if kind == "llama":
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁h", "i", "▁hi", "▁"]
        types = [2, 3, 3] + [6] * 256 + [1] * 4
        return {"model": "llama", "tokens": tokens, "token_type": types, "scores": [0.0] * len(tokens),
                "bos_token_id": 1, "eos_token_id": 2}
    if kind == "gpt2":
        tokens = _bytes_to_unicode() + ["hi", "<|endoftext|>"]
        return {"model": "gpt2", "pre": "default", "tokens": tokens, "token_type": [1] * 257 + [3],
                "merges": ["h i"], "eos_token_id": 257, "bos_token_id": 257}
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hi", "##i"] + [chr(c) for c in range(97, 123)]
    return {"model": "bert", "tokens": tokens, "token_type": [3, 2, 3, 3, 3] + [1] * (len(tokens) - 5),
            "bos_token_id": 2, "seperator_token_id": 3, "unknown_token_id": 1}


def _mutate(rng: random.Random) -> dict:
    """A base vocabulary with a few of its keys changed the ways llama.cpp's loader and tokenizer care about."""
    tok = _base(rng.choice(["llama", "gpt2", "bert"]))
    drop = False
    for _ in range(rng.randint(1, 3)):
        what = rng.randrange(9)
        if what == 0:
            tok["model"] = rng.choice(["none", "no_vocab", "test", "rwkv", "t5", "llama", "gpt2", "bert"])
        elif what == 1:
            tok.pop("model", None)
        elif what == 2:  # a special id missing, past the vocabulary, or another token
            key = rng.choice(["bos_token_id", "eos_token_id", "seperator_token_id"])
            tok[key] = rng.choice([None, len(tok["tokens"]) + 5, 0, 7])
        elif what == 3:
            tok[rng.choice(["add_bos_token", "add_eos_token"])] = rng.choice([True, False])
        elif what == 4:  # a duplicate, or an empty entry
            i, j = rng.sample(range(len(tok["tokens"])), 2)
            tok["tokens"][j] = rng.choice([tok["tokens"][i], ""])
        elif what == 5:  # byte tokens dropped (renamed: the vocabulary keeps its size)
            tok["tokens"] = [f"x{i}" if t.startswith("<0x") else t for i, t in enumerate(tok["tokens"])]
        elif what == 6:  # no vocabulary (gguf's writer cannot write an empty array)
            drop = True
        elif what == 7 and "token_type" in tok:  # every entry typed BYTE
            tok["token_type"] = [6] * len(tok["token_type"])
        elif what == 8:
            tok["pre"] = rng.choice(["llama-bpe", "gemma4", "tekken", "default"])
    if drop:
        tok["tokens"] = None
    return {k: v for k, v in tok.items() if v is not None}


def _write(path: Path, tok: dict, seed: int = 0) -> Path:
    """A one-layer llama with these tokenizer keys; its embedding and output rows match the vocabulary's size."""
    import gguf

    n_vocab = len(tok.get("tokens") or []) or 64
    n_embd, n_ff = 64, 128
    rng = np.random.default_rng(seed)

    def mat(rows, cols):
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.02

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("context_length", 512), ("embedding_length", n_embd),
                       ("feed_forward_length", n_ff), ("attention.head_count", 1), ("attention.head_count_kv", 1),
                       ("rope.dimension_count", n_embd)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_file_type(0)
    w.add_vocab_size(n_vocab)
    for key, value in tok.items():
        name = f"tokenizer.ggml.{key}"
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, str):
            w.add_string(name, value)
        elif key in ("tokens", "merges"):
            w.add_array(name, value)
        elif key == "token_type":
            w.add_key_value(name, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        else:
            w.add_key_value(name, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, n_embd))
    for name, shape in [("attn_norm", None), ("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, n_embd)),
                        ("attn_v", (n_embd, n_embd)), ("attn_output", (n_embd, n_embd)), ("ffn_norm", None),
                        ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))]:
        w.add_tensor(f"blk.0.{name}.weight", np.ones(n_embd, dtype=np.float32) if shape is None else mat(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _refused(path: Path) -> bool:
    try:
        check_tokenizer(read_gguf(path))
    except NoTokenizer:
        return True
    return False


def _no_abort(r_code: int, out: str, err: str, what: str) -> None:
    """Exit 0, or 1 with one line `Error: ...` (which may report an abort of one of ctxq's children, as the planner's
    dry run reports llama.cpp's); never an abort of the command's own process (SIGABRT, 134, a backtrace)."""
    assert r_code not in (-signal.SIGABRT, 128 + signal.SIGABRT, -signal.SIGFPE, -signal.SIGSEGV), (what, r_code, err[-2000:])
    if r_code == 0:
        assert not any(word in err for word in _ABORT), (what, err[-2000:])
    else:
        lines = err.strip().splitlines()
        assert r_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), (what, r_code, err[-2000:])


_SEEDS = range(8)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[tuple[str, Path]]:
    d = tmp_path_factory.mktemp("vocab")
    out = [("base-" + k, _write(d / f"base-{k}.gguf", _base(k))) for k in ("llama", "gpt2", "bert")]
    out.append(("none", write_synthetic_gguf(d / "none.gguf", GEOMETRIES["tiny"])))
    for seed in _SEEDS:
        out.append((f"seed{seed}", _write(d / f"seed{seed}.gguf", _mutate(random.Random(seed)), seed)))
    return out


def test_the_dummy_vocabulary_is_refused_in_one_line(cases):
    """The issue's case: ctxq.testing.synthetic's `tokenizer.ggml.model = "none"` aborted `ctxq run` with exit 134
    and a gdb backtrace; now one line that says what to do, from run, and the same error from ctxq.load()."""
    path = dict(cases)["none"]
    r = run_ctxq("run", str(path), "--ctx", "256", "-p", "hi", "-n", "1")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith('Error: none.gguf has no tokenizer (tokenizer.ggml.model = "none"') and \
        "convert the model again with its tokenizer" in r.stderr
    import ctxq

    with pytest.raises(NoTokenizer, match="has no tokenizer"):
        ctxq.load(str(path), n_ctx=256)


def test_the_working_vocabularies_run(cases):
    """The three base vocabularies pass the check and run: the check refuses what llama.cpp aborts on, not more."""
    for name, path in cases[:3]:
        assert not _refused(path), name
        r = run_ctxq("run", str(path), "--ctx", "256", "-p", _TEXT, "-n", "2", "--temp", "0")
        assert r.returncode == 0, (name, r.stderr[-2000:])


def test_run_fuzzed_vocabularies_never_abort(cases):
    """Each seed's header through `ctxq run` (tokenize from a vocabulary-only load, then load, prefill, generate and
    detokenize): no abort; refused ones fail in one line, and the check refuses no other."""
    counts = {"ran": 0, "refused": 0, "llama.cpp error": 0}
    for name, path in cases[3:]:
        r = run_ctxq("run", str(path), "--ctx", "256", "-p", _TEXT, "-n", "2", "--temp", "0", timeout=120)
        _no_abort(r.returncode, r.stdout, r.stderr, name)
        refused = _refused(path)
        # a refused header fails (by the check, or earlier by llama.cpp's own error in the planner's dry run)
        assert r.returncode == 1 if refused else "convert the model again" not in r.stderr, (name, r.stderr)
        counts["ran" if r.returncode == 0 else "refused" if refused else "llama.cpp error"] += 1
    assert counts["ran"] and counts["refused"], counts  # the seeds reach both sides of the check


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_before_listening_or_serves_without_abort(cases):
    """`ctxq serve` on a refused header exits 1 in one line before it listens; on the others it answers a
    completion (tokenize, generate, detokenize in its own process) and stops on SIGTERM without an abort."""
    import urllib.request

    picked = [c for c in cases if c[0] in ("none", "base-llama")] + \
        [next(c for c in cases[4:] if _refused(c[1])), next(c for c in cases[4:] if not _refused(c[1]))]
    for name, path in picked:
        port = _port()
        proc = subprocess.Popen([ctxq_exe(), "serve", str(path), "--ctx", "256", "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if _refused(path):
                out, err = proc.communicate(timeout=60)
                _no_abort(proc.returncode, out, err, name)
                assert proc.returncode == 1, (name, err)  # before it listens: by the check or the plan's dry run
                continue
            deadline, answered = time.time() + 90, None
            while time.time() < deadline and proc.poll() is None and answered is None:
                try:
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                                 data=f'{{"prompt": "{_TEXT[:4]}", "max_tokens": 2}}'.encode(),
                                                 headers={"Content-Type": "application/json"})
                    answered = urllib.request.urlopen(req, timeout=30).status
                except OSError:
                    time.sleep(0.3)
            assert answered == 200, (name, proc.poll())
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
            assert not any(word in err for word in _ABORT), (name, err[-2000:])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_quality_refuses_in_one_line_or_measures(cases, tmp_path):
    """`ctxq quality` (its evaluation in workers) on the dummy vocabulary and a refused seed: one line from the
    check, before a worker starts; on a working vocabulary it measures."""
    text = tmp_path / "text.txt"
    text.write_text("hi h hi " * 40)
    refused = next(c for c in cases[4:] if _refused(c[1]))
    for name, path in [c for c in cases if c[0] in ("none", "base-gpt2")] + [refused]:
        r = run_ctxq("quality", str(path), "--ctx", "64", "-f", str(text), "--kv", "f16/f16",
                     env={"CTXQ_HOME": str(tmp_path / "home")}, timeout=300)
        _no_abort(r.returncode, r.stdout, r.stderr, name)
        assert (r.returncode == 1) == _refused(path), (name, r.stderr)
