"""Issue 4: every llama.cpp quantization type, walked on a tiny real llama GGUF (rows of 256, so no
type falls back), through the real quantizer in its child process."""

from __future__ import annotations

import ctypes

import pytest

from ctxq.conversion import quantize as q
from ctxq.llama.backend import capture_log, lib_dir, llama_cpp
from ctxq.errors import ConversionError, CtxqError
from ctxq.testing.models import synthetic_imatrix_gguf, tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    # IQ1_S/IQ1_M (with the imatrix) take most of the walk, and not per weight: IQ1_S took 36 s on a
    # one-layer 0.6M-weight model and 44 s on this 1.4M one (shared 2-core machine), the cost of
    # llama.cpp building its search grids once per process. A smaller model would not help.
    model = tiny_llama_gguf(d / "tiny-F16.gguf")
    return model, synthetic_imatrix_gguf(model, d / "tiny.imatrix.gguf")


@pytest.fixture(autouse=True)
def _cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))


def _dry_run_needs_imatrix(src, ftype: int) -> bool:
    """llama.cpp's own verdict: its dry run warns when the real run would need an imatrix."""
    lc = llama_cpp()
    p = lc.llama_model_quantize_default_params()
    p.ftype, p.dry_run = ftype, True
    with capture_log() as lines:
        assert lc.llama_model_quantize(str(src).encode(), b"", ctypes.byref(p)) == 0
    return any("will require an imatrix" in ln for ln in lines)


def test_type_names_are_llama_cpps():
    lc = llama_cpp()
    for name, ftype in q.QUANT_TYPES.items():
        alias = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "F32": "ALL_F32", "COPY": "ALL_F32"}
        const = alias.get(name, name)
        assert getattr(lc, f"LLAMA_FTYPE_{'' if const == 'ALL_F32' else 'MOSTLY_'}{const}") == ftype, name
    assert q.parse_type("q4_k_m") == ("Q4_K_M", 15)
    with pytest.raises(CtxqError, match=r"unknown quantization type 'Q4_K_X'; choose one of: Q1_0, .*IQ4_XS, .*Q4_K_M, .*COPY$"):
        q.parse_type("Q4_K_X")


@pytest.mark.parametrize("ours, theirs", [("QuantizeParams", "llama_model_quantize_params"),
                                           ("ModelParams", "llama_model_params")])
def test_lean_worker_structures_match_llama_cpp_python(ours, theirs):
    """The lean worker binds libllama itself: its structures must be llama-cpp-python's, field for
    field (name, offset, size), or the quantizer would read the wrong parameters."""
    from ctxq.conversion import quantize_worker as w

    a, b = getattr(w, ours), getattr(llama_cpp(), theirs)
    layout = lambda s: [(n, getattr(s, n).offset, getattr(s, n).size) for n, *_ in s._fields_]  # noqa: E731
    assert layout(a) == layout(b)
    assert ctypes.sizeof(a) == ctypes.sizeof(b)


def test_lean_worker_defaults_are_llama_cpps():
    """Defaults read through the worker's own binding equal those read through llama-cpp-python."""
    from ctxq.conversion import quantize_worker as w

    lib = w.bind(str(lib_dir()))
    lc = llama_cpp()
    fields = lambda s: {n: ctypes.string_at(ctypes.addressof(s) + getattr(type(s), n).offset,  # noqa: E731
                                            getattr(type(s), n).size) for n, *_ in s._fields_}
    for ours, theirs in ((lib.llama_model_quantize_default_params(), lc.llama_model_quantize_default_params()),
                         (lib.llama_model_default_params(), lc.llama_model_default_params())):
        assert fields(ours) == fields(theirs)  # field by field: padding bytes may differ
    assert lib.llama_model_quantize_default_params().quantize_output_tensor  # not all zero: it read something


def test_needs_imatrix_matches_llama_cpp_dry_run(tiny):
    model, _ = tiny
    verdicts = {n for n, f in q.QUANT_TYPES.items() if _dry_run_needs_imatrix(model, f)}
    assert verdicts == set(q.NEEDS_IMATRIX)


GATED = {"F32", "COPY", "Q8_0", "Q4_K_M", "Q2_K", "IQ2_XXS"}
ALIASES = {"Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # in QUANT_TYPES, the alias comes first


@pytest.mark.slow
def test_walk_every_type(tiny, tmp_path):
    """Each type produces a file that llama.cpp loads, with quality numbers and a size within the
    estimate, or (types needing an imatrix, without one) is refused before any work."""
    model, imatrix = tiny
    lc = llama_cpp()
    made = {}
    for name in q.QUANT_TYPES:
        dst = tmp_path / f"tiny-{name}.gguf"
        if name in q.NEEDS_IMATRIX:
            with pytest.raises(ConversionError, match=f"{name} needs an importance matrix: pass imatrix=FILE"):
                q.quantize_gguf(model, dst, name, check=False)
            assert not dst.exists() and not list(tmp_path.glob(".*.part"))
        check = name in GATED  # the gate costs two model loads; the walk runs it on a few types
        r = q.quantize_gguf(model, dst, name, imatrix=imatrix if name in q.NEEDS_IMATRIX else None, check=check)
        if name in ALIASES:  # same llama_ftype as the type it names: the cache's file, put at dst too
            assert r.cached and r.path == dst, name
            assert dst.read_bytes() == (tmp_path / f"tiny-{ALIASES[name]}.gguf").read_bytes(), name
        else:
            assert r.path == dst and r.size == dst.stat().st_size and not r.cached, name
        assert r.size <= q.estimate_size(model, name), name
        if check:
            assert 0 <= r.quality["mean_kl"] < 1.0 and 0 <= r.quality["top1_agreement"] <= 1, (name, r.quality)
        m = lc.llama_model_load_from_file(str(dst).encode(), lc.llama_model_default_params())
        assert m, f"{name}: llama.cpp cannot load {dst}"
        buf = ctypes.create_string_buffer(128)
        lc.llama_model_desc(m, buf, 128)
        made[name] = (r.size, lc.llama_model_n_params(m), buf.value.decode(), r.quality and r.quality["mean_kl"])
        lc.llama_model_free(m)
    assert len({n for _, n, _, _ in made.values()}) == 1  # every file holds the same weights' count
    assert made["F32"][3] < 1e-6 and made["COPY"][3] < 1e-6  # lossless types match the reference
    assert made["F32"][0] > made["F16"][0] > made["Q8_0"][0] > made["Q4_K_M"][0] > made["Q2_K"][0] > made["IQ1_S"][0]
    assert made["Q8_0"][3] < made["Q4_K_M"][3] < made["Q2_K"][3]
    assert "Q4_K - Medium" in made["Q4_K_M"][2]


def test_imatrix_is_used_and_recorded(tiny, tmp_path):
    """With an imatrix the quantizer writes llama.cpp's provenance keys into the file, as its tool does."""
    from ctxq.gguf.reader import read_gguf

    model, imatrix = tiny
    r = q.quantize_gguf(model, tmp_path / "t.gguf", "IQ4_XS", imatrix=imatrix, check=False)
    meta = read_gguf(r.path, skip_arrays=True).metadata
    assert meta["quantize.imatrix.file"] == str(imatrix)
    assert meta["quantize.imatrix.entries_count"] == 2 * 7 + 1  # 7 matrices per layer + output
    assert meta["quantize.imatrix.dataset"] == "synthetic" and meta["quantize.imatrix.chunks_count"] == 10


def test_bad_options_are_one_line_errors(tiny, tmp_path):
    model, _ = tiny
    with pytest.raises(CtxqError, match="unknown tensor type 'q9_9' for `output_tensor_type`"):
        q.quantize_gguf(model, tmp_path / "x.gguf", "Q4_0", output_tensor_type="q9_9")
    with pytest.raises(CtxqError, match="not a GGUF importance matrix"):
        q.quantize_gguf(model, tmp_path / "x.gguf", "IQ2_XS", imatrix=model)
    with pytest.raises(CtxqError, match="would overwrite the source"):
        q.quantize_gguf(model, model, "Q4_0")
    assert not (tmp_path / "x.gguf").exists()


def test_pass_through_options_change_the_output(tiny, tmp_path):
    from ctxq.gguf.reader import read_gguf

    model, _ = tiny

    def types(**kw):
        r = q.quantize_gguf(model, tmp_path / f"{len(list(tmp_path.iterdir()))}.gguf", "Q4_K_M", check=False, **kw)
        return {t.name: t.type_name for t in read_gguf(r.path, skip_arrays=True).tensors}

    base = types()
    assert base["output.weight"] == "Q6_K" and base["token_embd.weight"] == "Q4_K"
    assert types(output_tensor_type="q8_0")["output.weight"] == "Q8_0"
    assert types(token_embedding_type="F16")["token_embd.weight"] == "F16"
    assert types(leave_output_tensor=True)["output.weight"] == "F16"
    pure = types(pure=True)
    assert {t for n, t in pure.items() if n.endswith(".weight") and "norm" not in n} == {"Q4_K"}


def test_progress_follows_the_tensor_lines(tiny, tmp_path):
    model, _ = tiny
    calls = []
    q.quantize_gguf(model, tmp_path / "p.gguf", "Q4_K_M", check=False, progress=lambda *a: calls.append(a))
    n = 3 + 2 * 9  # token_embd, output_norm, output + 9 tensors per layer
    assert calls[-1] == (n, n, "") and all(total == n for _, total, _ in calls)
    done = [d for d, _, _ in calls]
    assert done == sorted(done) and done[0] == 0
    assert {name for _, _, name in calls} >= {"blk.1.ffn_down.weight", "output.weight"}


def test_a_second_writer_is_refused(tiny, tmp_path):
    """Two ctxq processes never write the same destination: a live process's temporary says it is busy."""
    import subprocess

    from ctxq import tempfiles

    model, _ = tiny
    dst = tmp_path / "locked.gguf"
    other = subprocess.Popen(["sleep", "60"])  # a live process, standing for a running quantization
    part = tempfiles.temp_path(dst, "quantize", pid=other.pid)
    part.write_bytes(b"half a model")
    try:
        with pytest.raises(ConversionError, match=f"another ctxq process \\(pid {other.pid}\\) is writing {dst}"):
            q.quantize_gguf(model, dst, "Q4_0", check=False)
        assert part.exists() and not dst.exists()
    finally:
        other.kill()
        other.wait()
    assert q.quantize_gguf(model, dst, "Q4_0", check=False).path == dst  # once it is gone
    assert not part.exists()  # and its temporary was swept


def test_cache_key_extra_stands_for_the_source(tiny, tmp_path):
    """A caller (the Hugging Face route) keys by its own source identity, tuples included."""
    model, _ = tiny
    extra = {"hf_repo": "org/tiny", "revision": "abc123", "files": ("a", "b")}
    key = q.make_cache_key("Q4_0", cache_key_extra=extra)
    assert key["source"] is None and q.cache_lookup(key) is None
    r = q.quantize_gguf(model, tmp_path / "x.gguf", "Q4_0", check=False, cache_key_extra=extra)
    assert q.cache_lookup(key) == r.path.resolve()
    assert q.quantize_gguf(model, tmp_path / "y.gguf", "Q4_0", check=False, cache_key_extra=extra).cached
    assert q.cache_lookup(q.make_cache_key("Q4_0", cache_key_extra={**extra, "revision": "def"})) is None
    r.path.write_bytes(r.path.read_bytes() + b"x")  # edited since: no longer a hit
    assert q.cache_lookup(key) is None
