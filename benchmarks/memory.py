"""Peak resident memory of this process over a block of code, anonymous memory apart.

RSS counts the pages of mapped files as well as anonymous memory (heap, buffers); a
container's memory limit counts both, and a converter that maps its sources can look
small in one and large in the other, so both are reported. The kernel keeps the peak RSS
(``VmHWM``, reset on entry through ``/proc/self/clear_refs``); it keeps no peak of
``RssAnon``, which a thread samples every millisecond. Linux only (``/proc``).
"""
from __future__ import annotations

import threading
import time
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
    in MiB; m.peak_rss / m.peak_anon: the peaks themselves."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_anon_kib = max(self.peak_anon_kib, status_kib("RssAnon")["RssAnon"])
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
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
        self.peak_rss_kib = now["VmHWM"]

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
