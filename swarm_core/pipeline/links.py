"""Link shaping: token buckets for tx and rx, and an added one-way latency, changeable live.

What the bucket lets through is what the link carries, so the rates a run achieves answer "what
would this do on an 80 Mbit/s link". Buckets run on debt: a chunk may overdraw them and the
sender then sleeps the debt off, which keeps long transfers at the set rate within a chunk.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import attrs

from swarm_core.config.network import PairLink, SiteCaps
from swarm_core.protocol import LinkLimits

CHUNK = 64 * 1024
# An unshaped link moves a frame in larger pieces: each piece costs the sending and the
# receiving thread a round of Python (the bucket, the counters, a system call), which on a
# frame of megabytes is CPU taken from training; shaping needs the small ones to pace.
UNSHAPED_CHUNK = 1 << 20
BURST = 64 * 1024  # tbf needs at least this on loopback too (see anchors)
# And at a high rate, the credit of this many seconds (tbf's rule of thumb: a timer tick's
# worth, 4 ms at HZ=250): 64 KiB is half a millisecond at 1 Gbit/s, so a sender thread that
# wakes late (a sleep's overshoot, a wait for the GIL) lost that time for good and a 1 Gbit/s
# link ran 5-15 % slow (bench/bench_pair_links.py). Below ~130 Mbit/s BURST is the larger.
BURST_S = 0.004


class TokenBucket:
    def __init__(self, mbps: float | None = None, burst: int = BURST) -> None:
        self._lock = threading.Lock()
        self._base_burst = self._burst = burst
        self._rate: float | None = None  # bytes per second; None = unlimited
        self._tokens = float(burst)
        self._last = time.monotonic()
        self.set_mbps(mbps)

    @property
    def mbps(self) -> float | None:
        return None if self._rate is None else self._rate * 8 / 1e6

    @property
    def burst(self) -> int:
        """The credit an idle bucket holds: bytes that pass at once (see BURST_S)."""
        return self._burst

    def set_mbps(self, mbps: float | None) -> None:
        with self._lock:
            self._refill(time.monotonic())
            self._rate = None if mbps is None else mbps * 1e6 / 8
            self._burst = self._base_burst if self._rate is None \
                else max(self._base_burst, int(self._rate * BURST_S))
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


class Buckets:
    """Buckets a byte passes through one after another: the slowest of them sets the rate
    (while one makes the sender wait, the others refill)."""

    def __init__(self, *buckets: TokenBucket) -> None:
        self.buckets = buckets

    @property
    def mbps(self) -> float | None:
        rates = [b.mbps for b in self.buckets if b.mbps is not None]
        return min(rates) if rates else None

    def chunk(self) -> int:
        return min(b.chunk() for b in self.buckets)

    def consume(self, n: int, stop: Callable[[], bool] | None = None) -> None:
        for bucket in self.buckets:
            bucket.consume(n, stop)


@attrs.define(eq=False)
class LinkShaper:
    """One fellow's data-plane shaping and byte counters (shared by all its links), and the
    per-pair shapers of the links a link matrix shapes (see ``pair``)."""

    tx: TokenBucket = attrs.field(factory=TokenBucket)
    rx: TokenBucket = attrs.field(factory=TokenBucket)
    latency_s: float = 0.0
    tx_bytes: int = 0
    rx_bytes: int = 0
    # Frames sent whole: their bytes and seconds on the wire (the achieved rate's parts).
    frame_bytes: int = 0
    frame_s: float = 0.0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    # (job, own cell, peer cell) -> its pair's shaper; (job, own cell) -> its site's caps
    pairs: dict[tuple[str, str, str], PairShaper] = attrs.field(factory=dict)
    _site_caps: dict[tuple[str, str], LinkShaper] = attrs.field(factory=dict)

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

    def count_frame(self, n: int, seconds: float) -> None:
        with self._lock:
            self.frame_bytes += n
            self.frame_s += seconds

    @property
    def achieved_mbps(self) -> float | None:
        """The rate whole frames left at, while they were leaving (None before any did)."""
        with self._lock:
            if self.frame_s <= 0:
                return None
            return self.frame_bytes * 8 / self.frame_s / 1e6

    def pair(self, job: str, own: str, peer: str, peer_fellow: int | None, caps: SiteCaps,
             link: PairLink | None, sites: tuple[str, str],
             local: bool = False) -> PairShaper:
        """The shaper of the link from cell ``own`` to cell ``peer`` of ``job`` under a link
        matrix (one per pair: a ring's two links to one peer share it), made on first use.
        ``caps``: own site's up and down caps, shared by all the links of the cell.
        ``local``: the peer runs in this fellow, so the fellow's limits and counters leave
        the link out (its bytes never leave the machine), though the matrix shapes it."""
        with self._lock:
            site = self._site_caps.get((job, own))
            if site is None:
                site = self._site_caps[(job, own)] = LinkShaper()
                site.apply(LinkLimits(tx_mbps=caps.up_mbps, rx_mbps=caps.down_mbps))
            shaper = self.pairs.get((job, own, peer))
            if shaper is None:
                shaper = self.pairs[(job, own, peer)] = PairShaper(
                    LinkShaper() if local else self, site, link or PairLink(), own=own, peer=peer,
                    peer_fellow=peer_fellow, sites=sites, seed=f"{job}:{own}->{peer}")
            return shaper

    def pairs_to(self, fellow_id: int) -> list[PairShaper]:
        """The pair shapers of the links to the cells fellow ``fellow_id`` runs."""
        with self._lock:
            return [p for p in self.pairs.values() if p.peer_fellow == fellow_id]

    def forget(self, job: str, own: str) -> None:
        """Drop the pair shapers of cell ``own`` of ``job`` once it ends (a later job draws
        its own; set-speed --to and the heartbeat stop naming its pairs)."""
        with self._lock:
            for pair in [k for k in self.pairs if k[:2] == (job, own)]:
                del self.pairs[pair]
            self._site_caps.pop((job, own), None)


class PairShaper:
    """One peer link under a link matrix, duck-typed as a LinkShaper for ``PeerLink``: bytes
    sent pass the pair's own bucket, then the cell's site up cap, then the fellow's tx bucket;
    bytes received the site's down cap and the fellow's rx bucket. Latency is the fellow's plus
    the pair's, with the pair's jitter drawn per frame from a generator seeded by the pair, so
    a replay draws the same delays. Bytes count on the fellow (its heartbeat totals) and on the
    pair."""

    def __init__(self, fellow: LinkShaper, site: LinkShaper, link: PairLink, *, own: str,
                 peer: str, peer_fellow: int | None, sites: tuple[str, str],
                 seed: str) -> None:
        self.fellow, self.site = fellow, site
        self.own, self.peer, self.peer_fellow, self.sites = own, peer, peer_fellow, sites
        self.link = LinkShaper()  # the pair's own tx bucket and latency (set-speed --to)
        self.link.apply(LinkLimits(tx_mbps=link.mbps, latency_ms=link.latency_ms))
        self.jitter_s = link.jitter_ms / 1000.0
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self.tx = Buckets(self.link.tx, site.tx, fellow.tx)
        self.rx = Buckets(self.link.rx, site.rx, fellow.rx)

    @property
    def latency_s(self) -> float:
        base = self.fellow.latency_s + self.link.latency_s
        if not self.jitter_s:
            return base
        with self._rng_lock:
            drawn = self._rng.uniform(-self.jitter_s, self.jitter_s)
        return max(0.0, base + drawn)

    @property
    def tx_bytes(self) -> int:
        return self.link.tx_bytes

    @property
    def rx_bytes(self) -> int:
        return self.link.rx_bytes

    def apply(self, limits: LinkLimits) -> None:
        """A live set-speed of this pair (``swarm set-speed --to``): its own bucket and latency;
        the jitter, the site caps and the fellow's limits stay."""
        self.link.apply(limits)

    def limits(self) -> LinkLimits:
        return self.link.limits()

    def count_tx(self, n: int) -> None:
        self.fellow.count_tx(n)
        self.link.count_tx(n)

    def count_rx(self, n: int) -> None:
        self.fellow.count_rx(n)
        self.link.count_rx(n)

    def count_frame(self, n: int, seconds: float) -> None:
        self.fellow.count_frame(n, seconds)
        self.link.count_frame(n, seconds)

    @property
    def achieved_mbps(self) -> float | None:
        return self.link.achieved_mbps


# What a PeerLink paces and counts its bytes with.
Shaping = LinkShaper | PairShaper
