"""Link shaping: token buckets for tx and rx, and an added one-way latency, changeable live.

What the bucket lets through is what the link carries, so the rates a run achieves answer "what
would this do on an 80 Mbit/s link". Buckets run on debt: a chunk may overdraw them and the
sender then sleeps the debt off, which keeps long transfers at the set rate within a chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import attrs

from swarm_core.protocol import LinkLimits

CHUNK = 64 * 1024
# An unshaped link moves a frame in larger pieces: each piece costs the sending and the
# receiving thread a round of Python (the bucket, the counters, a system call), which on a
# frame of megabytes is CPU taken from training; shaping needs the small ones to pace.
UNSHAPED_CHUNK = 1 << 20
BURST = 64 * 1024  # tbf needs at least this on loopback too (see anchors)


class TokenBucket:
    def __init__(self, mbps: float | None = None, burst: int = BURST) -> None:
        self._lock = threading.Lock()
        self._burst = burst
        self._rate: float | None = None  # bytes per second; None = unlimited
        self._tokens = float(burst)
        self._last = time.monotonic()
        self.set_mbps(mbps)

    @property
    def mbps(self) -> float | None:
        return None if self._rate is None else self._rate * 8 / 1e6

    def set_mbps(self, mbps: float | None) -> None:
        with self._lock:
            self._refill(time.monotonic())
            self._rate = None if mbps is None else mbps * 1e6 / 8
            self._tokens = min(self._tokens, float(self._burst))

    def _refill(self, now: float) -> None:
        if self._rate is not None:
            self._tokens = min(float(self._burst),
                               self._tokens + (now - self._last) * self._rate)
        self._last = now

    def chunk(self) -> int:
        """The piece a link moves at a time through this bucket: small while it paces."""
        return CHUNK if self._rate is not None else UNSHAPED_CHUNK

    def consume(self, n: int, stop: Callable[[], bool] | None = None) -> None:
        """Block until ``n`` bytes may pass, or ``stop()`` says to give up. Rate changes apply
        within 50 ms."""
        if stop is not None and stop():
            return  # stopping: bytes still moving are not charged (no debt for the next job)
        with self._lock:
            self._refill(time.monotonic())
            if self._rate is None:
                return
            self._tokens -= n
        while True:
            with self._lock:
                self._refill(time.monotonic())
                if self._rate is None or self._tokens >= 0:
                    return
                wait = -self._tokens / self._rate
            if stop is not None and stop():
                return
            time.sleep(min(wait, 0.05))


@attrs.define(eq=False)
class LinkShaper:
    """One fellow's data-plane shaping and byte counters (shared by all its links)."""

    tx: TokenBucket = attrs.field(factory=TokenBucket)
    rx: TokenBucket = attrs.field(factory=TokenBucket)
    latency_s: float = 0.0
    tx_bytes: int = 0
    rx_bytes: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def apply(self, limits: LinkLimits) -> None:
        self.tx.set_mbps(limits.tx_mbps)
        self.rx.set_mbps(limits.rx_mbps)
        self.latency_s = limits.latency_ms / 1000.0

    def limits(self) -> LinkLimits:
        return LinkLimits(tx_mbps=self.tx.mbps, rx_mbps=self.rx.mbps,
                          latency_ms=self.latency_s * 1000.0)

    def count_tx(self, n: int) -> None:
        with self._lock:
            self.tx_bytes += n

    def count_rx(self, n: int) -> None:
        with self._lock:
            self.rx_bytes += n
