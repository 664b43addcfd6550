"""Issue 23: `ctxq convert` run again. The same conversion into the same file is "up to date" at once
(the file untouched); another source or type into it needs --force; a changed source converts again.
And an unwritable destination is one line."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers", reason="random checkpoints need transformers (pip install ctxq[test])")

from .conftest import run_ctxq  # noqa: E402
from .test_convert import make_tiny  # noqa: E402


@pytest.fixture()
def home(tmp_path):
    return {"CTXQ_HOME": str(tmp_path / "home")}  # the output records live in ctxq's cache


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _stamp(path):
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino, path.read_bytes()


@pytest.mark.parametrize("kind", ["f16", "Q4_K_M"])
def test_second_identical_convert_is_up_to_date(tmp_path, home, kind):
    folder = make_tiny(tmp_path / "m", "llama")
    out = tmp_path / "o.gguf"
    rc = run_ctxq("convert", str(folder), kind, "-o", str(out), env=home)
    assert rc.returncode == 0, rc.stderr
    before = _stamp(out)
    t0, cpu0 = time.perf_counter(), _children_cpu()
    rc = run_ctxq("convert", str(folder), kind, "-o", str(out), env=home)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    assert rc.returncode == 0, rc.stderr
    assert "(up to date)" in rc.stdout and str(out) in rc.stdout
    assert _stamp(out) == before  # not rewritten: same bytes, same mtime, same inode
    # 0.46-0.53 s of wall time measured on an idle machine; CPU time is what a shared machine cannot
    # inflate (the suite runs beside other jobs), the wall time gets room for that
    assert cpu < 1.0 and wall < 3.0, f"an up-to-date rerun took {wall:.2f} s ({cpu:.2f} s of CPU)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "m", "o.gguf"]  # no temporaries


def test_other_type_or_source_into_an_existing_file_needs_force(tmp_path, home):
    a = make_tiny(tmp_path / "a", "llama")
    b = make_tiny(tmp_path / "b", "qwen2")
    out = tmp_path / "o.gguf"
    assert run_ctxq("convert", str(a), "f16", "-o", str(out), env=home).returncode == 0
    before = _stamp(out)
    for args in ((str(a), "q8_0"), (str(b), "f16")):
        rc = run_ctxq("convert", *args, "-o", str(out), env=home)
        assert rc.returncode == 1 and rc.stderr.startswith("Error:") and "--force" in rc.stderr, rc.stderr
        assert len(rc.stderr.strip().splitlines()) == 1 and str(a) in rc.stderr  # names what the file holds
        assert _stamp(out) == before
    rc = run_ctxq("convert", str(b), "f16", "-o", str(out), "--force", env=home)
    assert rc.returncode == 0 and "(up to date)" not in rc.stdout, rc.stderr
    assert _stamp(out)[3] != before[3]
    # forced in, it is now b's conversion: b again is up to date, a needs force
    assert "(up to date)" in run_ctxq("convert", str(b), "f16", "-o", str(out), env=home).stdout
    assert run_ctxq("convert", str(a), "f16", "-o", str(out), env=home).returncode == 1
    # a file ctxq did not write (or that changed since) is never replaced without force
    other = tmp_path / "other.gguf"
    other.write_bytes(b"keep me")
    rc = run_ctxq("convert", str(a), "f16", "-o", str(other), env=home)
    assert rc.returncode == 1 and "exists" in rc.stderr and other.read_bytes() == b"keep me"


def test_changed_source_converts_again(tmp_path, home):
    folder = make_tiny(tmp_path / "m", "llama", seed=0)
    out = tmp_path / "o.gguf"
    assert run_ctxq("convert", str(folder), "f16", "-o", str(out), env=home).returncode == 0
    before = _stamp(out)
    make_tiny(tmp_path / "m2", "llama", seed=1)  # same shapes, other weights
    (folder / "model.safetensors").write_bytes((tmp_path / "m2" / "model.safetensors").read_bytes())
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out), env=home)
    assert rc.returncode == 0 and "(up to date)" not in rc.stdout, rc.stderr
    after = _stamp(out)
    assert after[3] != before[3] and after[0] == before[0]  # new weights, same layout
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out), env=home)
    assert "(up to date)" in rc.stdout and _stamp(out) == after


def test_unwritable_destination_is_one_line(tmp_path, home):
    folder = make_tiny(tmp_path / "m", "llama")
    for kind in ("f16", "q4_k_m"):
        rc = run_ctxq("convert", str(folder), kind, "-o", "/proc/x.gguf", env=home)
        assert rc.returncode == 1 and rc.stderr.startswith("Error: cannot write /proc/x.gguf"), rc.stderr
        assert len(rc.stderr.strip().splitlines()) == 1 and ".part" not in rc.stderr and "-o" in rc.stderr
        assert "Traceback" not in rc.stderr
    assert not any(p.name.startswith(".x.gguf") for p in __import__("pathlib").Path("/proc").iterdir())
    # a GGUF quantized into an unwritable place: the same line
    f16 = tmp_path / "f.gguf"
    assert run_ctxq("convert", str(folder), "f16", "-o", str(f16), env=home).returncode == 0
    rc = run_ctxq("convert", str(f16), "q8_0", "-o", "/proc/y.gguf", env=home)
    assert rc.returncode == 1 and rc.stderr.startswith("Error: cannot write /proc/y.gguf"), rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1 and ".part" not in rc.stderr


# --- a hub id converted again: the Hugging Face cache answers, the Hub is asked only what its revision names ----

REPO = "ctxq-test/tiny"


class _BadHub:
    """A Hub on 127.0.0.1 that cannot answer: every request gets `status`, or (status None) its connection is
    dropped before any answer (httpx's RemoteProtocolError, as a proxy or a broken link does)."""

    def __init__(self, status: int | None):
        import socket
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(handler):  # noqa: N805 (the handler, not this class)
                self.requests += 1
                if status is None:
                    handler.connection.shutdown(socket.SHUT_RDWR)
                    handler.close_connection = True
                    return
                handler.send_response(status)
                handler.send_header("Content-Length", "0")
                handler.end_headers()

            do_HEAD = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _closed_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it is closed: refused


# How a Hub fails to answer; each case is one conversion and one rerun (about 3 s), so one runs in the fast suite.
_NO_ANSWER = ("HF_HUB_OFFLINE=1", "refused", "dropped", "429", "503")


@pytest.mark.parametrize("kind,hub", [("f16", "dropped")] + [pytest.param(k, h, marks=pytest.mark.slow)
                                                                for k in ("f16", "Q4_K_M") for h in _NO_ANSWER
                                                                if (k, h) != ("f16", "dropped")])
def test_hub_rerun_is_up_to_date_without_the_hub(tmp_path, home, kind, hub):
    """A hub id converted from the Hugging Face cache, then the same command while the Hub cannot answer
    (offline, refused, dropped, rate-limited, down): up to date from the cache, the file untouched."""
    from .test_convert import _hub_cache

    hf = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1", **home}
    sha = _hub_cache(tmp_path / "hf", REPO, make_tiny(tmp_path / "m", "llama"))
    out = tmp_path / "o.gguf"
    rc = run_ctxq("convert", REPO, kind, "-o", str(out), env={**hf, "HF_HUB_OFFLINE": "1"})
    assert rc.returncode == 0 and "(up to date)" not in rc.stdout, rc.stderr
    before = _stamp(out)
    bad = {"dropped": None, "429": 429, "503": 503}
    server = _BadHub(bad[hub]) if hub in bad else None
    env = {"HF_HUB_OFFLINE": "1"} if hub == "HF_HUB_OFFLINE=1" else {
        "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": server.url if server else _closed_port()}
    try:
        rc = run_ctxq("convert", REPO, kind, "-o", str(out), env={**hf, **env})
    finally:
        if server:
            server.stop()
    assert rc.returncode == 0 and "(up to date)" in rc.stdout, rc.stderr
    assert _stamp(out) == before
    if hub != "HF_HUB_OFFLINE=1":  # the user is told what the answer rests on
        assert "could not ask the Hub whether it moved" in rc.stderr and sha[:12] in rc.stderr, rc.stderr
    assert server is None or server.requests == 1  # one question, asked once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "home", "m", "o.gguf"]


@pytest.mark.slow
def test_hub_rerun_converts_again_when_the_revision_moved(tmp_path, home):
    """The cache holds commit A, from which the output was converted; the Hub's main now names commit B (other
    weights): the rerun downloads B and converts again. Then one request (what main names) is all a rerun
    takes, and offline the cache answers."""
    from .hubserver import HubServer
    from .test_convert import _hub_cache

    _hub_cache(tmp_path / "hf", REPO, make_tiny(tmp_path / "a", "llama", seed=0))
    make_tiny(tmp_path / "b", "llama", seed=1)  # same shapes, other weights
    hub = HubServer(max_requests=60, lifetime=300).start()
    commit_b = hub.add_repo(REPO, {p.name: p for p in (tmp_path / "b").iterdir()})
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1",
           **home}
    out = tmp_path / "o.gguf"
    try:
        assert run_ctxq("convert", REPO, "f16", "-o", str(out), env={**env, "HF_HUB_OFFLINE": "1"}).returncode == 0
        before = _stamp(out)
        rc = run_ctxq("convert", REPO, "f16", "-o", str(out), env={**env, "HF_HUB_OFFLINE": "0"})
        assert rc.returncode == 0 and "(up to date)" not in rc.stdout, rc.stderr
        after = _stamp(out)
        assert after[3] != before[3] and after[0] == before[0]  # B's weights, the same layout
        assert (tmp_path / "hf" / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit_b).is_dir()
        hub.reset_counts()
        for offline in ("0", "1"):
            rc = run_ctxq("convert", REPO, "f16", "-o", str(out), env={**env, "HF_HUB_OFFLINE": offline})
            assert rc.returncode == 0 and "(up to date)" in rc.stdout and _stamp(out) == after, rc.stderr
        assert [(m, p) for m, p, _ in hub.log] == [("GET", f"/api/models/{REPO}")]  # what main names, no file
    finally:
        hub.stop()
