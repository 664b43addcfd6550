"""Issue 4: quantizing the real SmolLM2-135M-Instruct with llama.cpp's quantizer: quality gate,
cache, requantization, and what a cancelled, killed or crashed quantizer leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from ctxq import tempfiles
from ctxq.conversion import quantize as q
from ctxq.errors import ConversionError
from ctxq.models import models_dir
from ctxq.testing.models import dequantized_smollm2_gguf, synthetic_imatrix_gguf, tiny_llama_gguf

from .conftest import run_ctxq

# Measured on this model (docs/quantize.md): Q8_0 agrees on 95% of 291 positions with KL 0.004;
# every disagreement is a near-tie (top-2 probabilities within 0.025), so thread-count rounding can
# flip one or two: the bounds leave that room. SmolLM2's rows of 576 are not multiples of 256, so
# most K-quant tensors fall back to 32-blocks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and its
# weights come from a Q4_1 file: Q5_K_M (mostly Q5_1) is no closer than Q4_K_M (mostly Q5_0) here.
BOUNDS = {"Q8_0": (0.93, 0.01), "Q6_K": (0.88, 0.02), "Q5_K_M": (0.75, 0.12), "Q4_K_M": (0.75, 0.12)}


@pytest.fixture(scope="module")
def f16(smollm2):
    """SmolLM2 dequantized to F16 (kept next to the default model: it takes ~10 s to make)."""
    return dequantized_smollm2_gguf(models_dir() / "SmolLM2-135M-Instruct.F16.gguf")


@pytest.fixture(scope="module")
def hf_dir(smollm2):
    """Where the rebuilt Hugging Face checkpoint lives, read before `home` changes CTXQ_HOME."""
    from ctxq.testing.smollm2_hf import smollm2_hf_dir

    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def home(tmp_path_factory, f16, hf_dir):
    """A private CTXQ_HOME (cache records) for this module, set after the models are in place."""
    with pytest.MonkeyPatch.context() as mp:
        h = tmp_path_factory.mktemp("home")
        mp.setenv("CTXQ_HOME", str(h))
        yield h


@pytest.fixture(scope="module")
def quantized(f16, home, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized")
    return {t: q.quantize_gguf(f16, out / q.default_output_name(f16, t), t) for t in BOUNDS}


@pytest.mark.slow
def test_smollm2_types_load_generate_and_pass_the_gate(quantized, f16, home):
    from llama_cpp import Llama

    sizes = {}
    for t, r in quantized.items():
        assert r.path.name == f"SmolLM2-135M-Instruct-{t}.gguf" and not r.cached and not r.source_was_quantized
        top1, kl = BOUNDS[t]
        assert r.quality["n_tokens"] >= 128 and r.quality["reference"] == str(f16)
        assert r.quality["top1_agreement"] >= top1 and r.quality["mean_kl"] <= kl, (t, r.quality)
        llm = Llama(str(r.path), n_ctx=256, n_threads=2, seed=0, verbose=False)
        text = llm("The capital of France is", max_tokens=8, temperature=0.0)["choices"][0]["text"]
        llm.close()
        assert "Paris" in text, (t, text)
        sizes[t] = r.size
    kl = {t: r.quality["mean_kl"] for t, r in quantized.items()}
    assert kl["Q8_0"] < kl["Q6_K"] < min(kl["Q5_K_M"], kl["Q4_K_M"])  # fewer bits, further away
    assert sizes["Q8_0"] > sizes["Q6_K"] > sizes["Q5_K_M"] > sizes["Q4_K_M"]
    assert f16.stat().st_size > sizes["Q8_0"]
    # The reference was evaluated once for the four gates; its logits are kept for the next run.
    assert len(list((home / "cache" / "reference-logits").glob("*.npy"))) == 1


@pytest.mark.slow
def test_hugging_face_route_matches_the_gguf_route(quantized, home, hf_dir, tmp_path):
    """The issue's path: SmolLM2 rebuilt as a Hugging Face checkpoint -> `ctxq.convert` (an f16
    GGUF, then this quantizer, then the f16 deleted) -> Q4_K_M gives the F16 GGUF route's numbers."""
    import ctxq
    from ctxq.testing.models import rebuild_smollm2_hf

    out = tmp_path / "hf-Q4_K_M.gguf"
    r = ctxq.convert(rebuild_smollm2_hf(hf_dir), "q4_k_m", out)
    assert r.path == out and sorted(tmp_path.iterdir()) == [out]  # the f16 temporary is gone
    recs = [json.loads(p.read_text()) for p in (home / "cache" / "quantize").glob("*.json")]
    rec = next(x for x in recs if x["path"] == str(out.resolve()))
    ref = quantized["Q4_K_M"].quality
    assert rec["quality"]["top1_agreement"] == ref["top1_agreement"]
    assert rec["quality"]["mean_kl"] == pytest.approx(ref["mean_kl"], rel=1e-4)  # float32-cached reference
    assert abs(rec["size"] - quantized["Q4_K_M"].size) < 4096  # the same tensors; metadata may differ


@pytest.mark.slow
def test_cache_hit_does_nothing_and_force_redoes(quantized, f16, home, tmp_path):
    first = quantized["Q8_0"]
    mtime = first.path.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = q.quantize_gguf(f16, tmp_path / "elsewhere.gguf", "q8_0")  # another -o: still the same conversion
    assert again.cached and again.path == tmp_path / "elsewhere.gguf" and again.quality == first.quality
    assert time.perf_counter() - t0 < 5 and again.path.read_bytes() == first.path.read_bytes()  # put where asked
    assert first.path.stat().st_mtime_ns == mtime
    assert q.cache_lookup(q.make_cache_key("Q8_0", source=f16)) == first.path
    assert q.cache_lookup(q.make_cache_key("Q8_0", source=f16, pure=True)) is None
    records = list((home / "cache" / "quantize").glob("*.json"))
    assert any(json.loads(p.read_text())["quality"] == first.quality for p in records)
    forced = q.quantize_gguf(f16, first.path, "Q8_0", force=True, check=False)
    assert not forced.cached and forced.path.stat().st_mtime_ns != mtime
    assert forced.path.read_bytes() == first.path.read_bytes()  # llama.cpp's output is deterministic
    # The record from --no-check has no gate numbers: a checked rerun runs only the gate.
    regated = q.quantize_gguf(f16, first.path, "Q8_0")
    assert regated.cached and regated.quality["top1_agreement"] == first.quality["top1_agreement"]


def test_existing_file_is_not_overwritten_without_force(f16, home, tmp_path):
    dst = tmp_path / "mine.gguf"
    dst.write_bytes(b"user data")
    with pytest.raises(ConversionError, match="exists and is not this conversion's cached result; pass force=True"):
        q.quantize_gguf(f16, dst, "Q5_0", check=False)
    assert dst.read_bytes() == b"user data"


@pytest.mark.slow
def test_requantizing_says_so(smollm2, home, tmp_path):
    r = q.quantize_gguf(smollm2, tmp_path / "re.gguf", "Q4_K_M")
    assert r.source_was_quantized and r.quality["reference_is_quantized"]
    assert r.quality["reference"] == str(smollm2) and r.quality["top1_agreement"] >= 0.7


def test_imatrix_types_refused_before_any_work(f16, home, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ConversionError, match="IQ2_XXS needs an importance matrix: pass imatrix=FILE"):
        q.quantize_gguf(f16, tmp_path / "x.gguf", "iq2_xxs")
    assert time.perf_counter() - t0 < 2 and list(tmp_path.iterdir()) == []


def test_llama_cpp_refusal_is_one_line(f16, home, tmp_path):
    """An imatrix made for another model: llama.cpp's own error, one line, nothing left behind."""
    tiny = tiny_llama_gguf(tmp_path / "tiny.gguf")
    imatrix = synthetic_imatrix_gguf(tiny, tmp_path / "tiny.imatrix.gguf")
    dst = tmp_path / "out" / "x.gguf"
    with pytest.raises(ConversionError) as e:
        q.quantize_gguf(f16, dst, "Q4_K_M", imatrix=imatrix, check=False)
    assert "imatrix size 256 is different from tensor size 576" in str(e.value) and "\n" not in str(e.value)
    assert list(dst.parent.iterdir()) == []


def test_disk_space_checked_first(f16, home, tmp_path, monkeypatch):
    # A full disk cannot be made here without root; the check reads shutil.disk_usage, so shrink it.
    real = q.shutil.disk_usage
    monkeypatch.setattr(q.shutil, "disk_usage", lambda p: real(p)._replace(free=50 * 2**20))
    with pytest.raises(ConversionError, match=r"not enough disk space .*Q8_0 needs about 0\.1\d GiB, 0\.05 GiB free"):
        q.quantize_gguf(f16, tmp_path / "x.gguf", "Q8_0", force=True)  # force: past the cache
    assert list(tmp_path.iterdir()) == []


def test_estimate_bounds_real_sizes(quantized, f16):
    for t, r in quantized.items():
        assert r.size <= q.estimate_size(f16, t) <= 1.3 * r.size, t


_SCRIPT = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in the background
from pathlib import Path
from ctxq.errors import CtxqError
from ctxq.conversion.quantize import quantize_gguf
try:
    quantize_gguf(Path(sys.argv[1]), Path(sys.argv[2]), "Q8_0", check=False, force=True)
except CtxqError as e:
    print(f"Error: {e}", file=sys.stderr)
    sys.exit(1)
"""


def _start_mid_quantization(src: Path, dst: Path):
    """A process quantizing src to dst, returned once its worker has written a few MB."""
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(src), str(dst)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    part = tempfiles.temp_path(dst, "quantize", pid=proc.pid)
    deadline = time.time() + 120
    while not (part.exists() and part.stat().st_size > 8 << 20):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the quantizer never started writing"
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children()
    assert len(workers) == 1 and "quantize_worker" in " ".join(workers[0].cmdline())
    return proc, workers[0], part


def test_kill_9_leaves_nothing_and_the_rerun_completes(f16, home, tmp_path):
    dst = tmp_path / "k.gguf"
    proc, worker, part = _start_mid_quantization(f16, dst)
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs([worker], timeout=10)
    assert not alive, "the quantizer outlived ctxq"
    assert not dst.exists() and part.exists()  # only the killed run's temporary
    r = q.quantize_gguf(f16, dst, "Q8_0", check=False, force=True)  # the killed command, run again
    assert not r.cached and r.path == dst and dst.stat().st_size == r.size
    assert not part.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["k.gguf"]  # swept


def test_ctrl_c_cancels_cleanly(f16, home, tmp_path):
    dst = tmp_path / "c.gguf"
    proc, worker, part = _start_mid_quantization(f16, dst)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 5, "Ctrl-C waited for the quantizer"
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert not dst.exists() and not part.exists()


def test_abort_in_llama_cpp_is_one_line_error(f16, home, tmp_path):
    """The worker dies by SIGABRT, as GGML_ABORT/GGML_ASSERT make it (abort()); ctxq reports one line."""
    dst = tmp_path / "a.gguf"
    proc, worker, part = _start_mid_quantization(f16, dst)
    worker.send_signal(signal.SIGABRT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert err.strip().splitlines() == [err.strip()] and "llama.cpp died with SIGABRT" in err
    assert not dst.exists() and not part.exists()


def test_default_output_name():
    assert q.default_output_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "q4_k_m") == "SmolLM2-135M-Instruct-Q4_K_M.gguf"
    assert q.default_output_name("Llama-3-8B-F16.gguf", "Q8_0") == "Llama-3-8B-Q8_0.gguf"
    assert q.default_output_name("phi3-bf16.gguf", "IQ4_XS") == "phi3-IQ4_XS.gguf"
    assert q.default_output_name("model.gguf", "Q6_K") == "model-Q6_K.gguf"


def _q8_source(tmp_path: Path, env: dict) -> Path:
    """A tiny already quantized (Q8_0) model: quantizing it again is a requantization."""
    src = tmp_path / "tiny-Q8_0.gguf"
    rc = run_ctxq("convert", str(tiny_llama_gguf(tmp_path / "tiny.gguf")), "q8_0", "-o", str(src), "--no-check", env=env)
    assert rc.returncode == 0, rc.stderr
    return src


def test_cached_requantization_is_written_to_each_output(tmp_path):
    """`ctxq convert model.gguf Q4_K_M -o out.gguf` whose result is cached: the file is at -o (a hard link or a
    copy of the cached one), the line names -o, and the same command again finds it in place."""
    env = {"CTXQ_HOME": str(tmp_path / "home")}
    src = _q8_source(tmp_path, env)
    a, b = tmp_path / "a" / "out.gguf", tmp_path / "b" / "out.gguf"
    first = run_ctxq("convert", str(src), "Q4_K_M", "-o", str(a), "--no-check", env=env)
    second = run_ctxq("convert", str(src), "Q4_K_M", "-o", str(b), "--no-check", env=env)
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    assert "(from the cache)" not in first.stdout and first.stdout.startswith(f"{a}  Q4_K_M")
    assert "(from the cache)" in second.stdout and second.stdout.startswith(f"{b}  Q4_K_M")
    assert a.read_bytes()[:4] == b"GGUF" and b.read_bytes() == a.read_bytes()
    assert b.samefile(a)  # one file system: a hard link, no second copy on the disk
    stamp = (b.stat().st_ino, b.stat().st_mtime_ns)
    a.unlink()  # the cached file gone: -o b still holds the conversion, and the same command finds it
    again = run_ctxq("convert", str(src), "Q4_K_M", "-o", str(b), "--no-check", env=env)
    assert again.returncode == 0 and again.stdout.startswith(f"{b}  Q4_K_M"), again.stderr
    assert (b.stat().st_ino, b.stat().st_mtime_ns) == stamp
    # a file ctxq did not put there is still never replaced without --force
    other = tmp_path / "other.gguf"
    other.write_bytes(b"keep me")
    rc = run_ctxq("convert", str(src), "Q4_K_M", "-o", str(other), "--no-check", env=env)
    assert rc.returncode == 1 and "--force" in rc.stderr and other.read_bytes() == b"keep me"


def test_cached_requantization_is_copied_to_another_file_system(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's folder (a hard link would do)")
    env = {"CTXQ_HOME": str(tmp_path / "home")}
    src = _q8_source(tmp_path, env)
    a = tmp_path / "a.gguf"
    assert run_ctxq("convert", str(src), "Q4_K_M", "-o", str(a), "--no-check", env=env).returncode == 0
    with tempfile.TemporaryDirectory(dir=shm) as d:
        rc = run_ctxq("convert", str(src), "Q4_K_M", "-o", f"{d}/c.gguf", "--no-check", env=env)
        assert rc.returncode == 0 and rc.stdout.startswith(f"{d}/c.gguf  Q4_K_M") and "(from the cache)" in rc.stdout
        assert Path(d, "c.gguf").read_bytes() == a.read_bytes() and os.listdir(d) == ["c.gguf"]  # no temporaries
