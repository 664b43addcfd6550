"""GPU memory as the driver sees it, sampled during a run: the device's used bytes and each process's.

`Sampler(read)` calls `read()` every `interval_s` on a thread and keeps the peaks; `read` returns a
`Reading`. `nvml_reader(index)` is the real source (pynvml, from nvidia-ml-py, a ctxq dependency);
tests inject a fake one. A peak is the largest value seen at one sample, so a short spike between two
samples is missed: the interval (10 ms) is far below a prefill's ubatch on these models.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Reading:
    used: int  # bytes in use on the device (all processes, the driver's own reserve included)
    procs: dict[int, int] = field(default_factory=dict)  # pid -> bytes that process holds


class Sampler:
    """Peaks of device and per-process GPU memory between start() and stop() (or a `with` block)."""

    def __init__(self, read: Callable[[], Reading], interval_s: float = 0.01):
        self.read = read
        self.interval_s = interval_s
        self.baseline: int | None = None  # device bytes in use at start()
        self.first: dict[int, int] = {}  # pid -> bytes at start() (e.g. a worker's CUDA context)
        self.peak_used = 0
        self.peaks: dict[int, int] = {}  # pid -> the most bytes seen for it
        self.samples = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Take one reading and update the peaks (the thread calls this; tests may call it directly)."""
        try:
            r = self.read()
        except Exception as e:  # a failed read must not end the measurement; it is reported
            if len(self.errors) < 5:
                self.errors.append(f"{type(e).__name__}: {e}")
            return
        self.samples += 1
        if self.baseline is None:
            self.baseline, self.first = r.used, dict(r.procs)
        self.peak_used = max(self.peak_used, r.used)
        for pid, used in r.procs.items():
            if used > self.peaks.get(pid, -1):
                self.peaks[pid] = used

    def start(self) -> "Sampler":
        self.sample()  # the baseline, before anything the caller starts allocates

        def loop():
            while not self._stop.wait(self.interval_s):
                self.sample()

        self._thread = threading.Thread(target=loop, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "Sampler":
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def peak_delta(self) -> int:
        """The most device memory in use beyond what was in use at start()."""
        return self.peak_used - (self.baseline or 0)

    def peak_of(self, pid: int | None) -> int | None:
        """The most bytes seen for `pid`; None when the driver never listed it (some containers hide
        other processes' pids: then `peak_delta` is the measure for one process at a time)."""
        return self.peaks.get(pid) if pid is not None else None

    def to_dict(self) -> dict:
        return {"baseline": self.baseline, "peak_used": self.peak_used, "peak_delta": self.peak_delta,
                "peaks_by_pid": {str(k): v for k, v in self.peaks.items()},
                "first_by_pid": {str(k): v for k, v in self.first.items()}, "samples": self.samples,
                "interval_s": self.interval_s, "errors": self.errors}


def nvml_reader(index: int = 0) -> Callable[[], Reading]:
    """A `read()` for GPU `index` (NVML's order, which ignores CUDA_VISIBLE_DEVICES)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read() -> Reading:
        used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        procs = {}
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.usedGpuMemory is not None:  # None: the driver does not say (e.g. without permission)
                procs[int(p.pid)] = int(p.usedGpuMemory)
        return Reading(used, procs)

    return read

