"""Peak resident memory of this process over a block of code, anonymous memory apart.

RSS counts the pages of mapped files as well as anonymous memory (heap, buffers); a
container's memory limit counts both, and a converter that maps its sources can look
small in one and large in the other, so both are reported. The kernel keeps the peak RSS
(``VmHWM``, reset on entry through ``/proc/self/clear_refs``); it keeps no peak of
``RssAnon``, which a thread samples every millisecond. ``run_watched`` measures another
process (and its children) the same way from outside. Linux only (``/proc``).
"""
from __future__ import annotations

import contextlib

import threading
import time
from dataclasses import dataclass
from pathlib import Path

STATUS = Path("/proc/self/status")


def status_kib(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    out = {}
    for line in STATUS.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in fields:
            out[key] = int(rest.split()[0])
    return out


class PeakMemory:
    """``with PeakMemory() as m: ...`` then m.rss / m.anon: peak minus the value on entry,
    in MiB; m.peak_rss / m.peak_anon: the peaks themselves; m.end_anon: RssAnon on exit.
    ``reset=False`` leaves the kernel's peak RSS alone (a PeakMemory inside another one):
    then only the RssAnon numbers are this block's."""

    def __init__(self, interval: float = 0.001, reset: bool = True):
        self.interval, self.reset = interval, reset
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_anon_kib = max(self.peak_anon_kib, status_kib("RssAnon")["RssAnon"])
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        # resets VmHWM to the current RSS; without it (no permission) the peak counts from start
        if self.reset:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")
        now = status_kib("VmRSS", "RssAnon")
        self.base_rss_kib, self.base_anon_kib = now["VmRSS"], now["RssAnon"]
        self.peak_anon_kib = self.base_anon_kib
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        now = status_kib("VmHWM", "RssAnon")
        self.peak_anon_kib = max(self.peak_anon_kib, now["RssAnon"])
        self.peak_rss_kib, self.end_anon_kib = now["VmHWM"], now["RssAnon"]

    @property
    def rss(self) -> float:
        return (self.peak_rss_kib - self.base_rss_kib) / 1024

    @property
    def anon(self) -> float:
        return (self.peak_anon_kib - self.base_anon_kib) / 1024

    @property
    def peak_rss(self) -> float:
        return self.peak_rss_kib / 1024

    @property
    def peak_anon(self) -> float:
        return self.peak_anon_kib / 1024

    @property
    def base_anon(self) -> float:
        return self.base_anon_kib / 1024

    @property
    def end_anon(self) -> float:
        return self.end_anon_kib / 1024


def _kib(pid: int, *fields: str) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in fields:
            out[key] = int(rest.split()[0])
    return out


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (a scan of /proc: kernels without .../children)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@dataclass
class Watched:
    wall: float  # seconds from start to exit
    rss: float  # MiB: the process's peak RSS (+ each child's peak, when it has children)
    anon: float  # MiB: peak of the sampled sum of RssAnon over the process and its children
    code: int
    stderr: str
    cpu: float = 0.0  # seconds of CPU (user + system) of the process and the children it waited for


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot (/proc/stat: every process
    and kernel thread, e.g. the write-back workers a `cp` leaves its flushing to), summed over
    the CPUs; NaN where /proc/stat is missing."""
    import os

    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6) if i < len(fields))  # user nice system irq softirq
    return busy / os.sysconf("SC_CLK_TCK")  # not idle, iowait, or steal (the hypervisor's)


def run_watched(cmd: list[str], env: dict | None = None, interval: float = 0.005) -> Watched:
    """Run ``cmd`` and watch its memory from outside: the kernel's peak RSS of the process
    (wait4), each child's VmHWM, and the RssAnon of all of them every ``interval`` s."""
    import os
    import subprocess
    import tempfile

    err = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    kids: list[int] = []
    child_hwm: dict[int, int] = {}
    peak_anon, next_scan = 0, 0.0
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        now = time.perf_counter()
        if now >= next_scan:
            kids, next_scan = _children(p.pid), now + 0.5
        anon = _kib(p.pid, "RssAnon").get("RssAnon", 0)
        for k in kids:
            s = _kib(k, "RssAnon", "VmHWM")
            anon += s.get("RssAnon", 0)
            if "VmHWM" in s:
                child_hwm[k] = s["VmHWM"]
        peak_anon = max(peak_anon, anon)
        time.sleep(interval)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err.seek(0)
    rss = usage.ru_maxrss + sum(child_hwm.values())
    return Watched(wall, rss / 1024, peak_anon / 1024, p.returncode, err.read(), usage.ru_utime + usage.ru_stime)
