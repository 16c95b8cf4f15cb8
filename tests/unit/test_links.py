"""Link shaping: the achieved rate follows the set rate; changes apply live."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest
import torch

from swarm_core.pipeline.codecs import FP32_WIRE
from swarm_core.pipeline.frames import Kind
from swarm_core.pipeline.links import LinkShaper, TokenBucket
from swarm_core.pipeline.transport import LinkClosed, PeerLink


def test_bucket_rate_within_5_percent():
    bucket = TokenBucket(mbps=40.0)
    n = 4 * 1024 * 1024  # 4 MiB at 40 Mbit/s: ~0.84 s
    t0 = time.monotonic()
    for _ in range(n // 65536):
        bucket.consume(65536)
    elapsed = time.monotonic() - t0
    ideal = (n - 65536) * 8 / 40e6  # the first burst is free
    assert abs(elapsed - ideal) / ideal < 0.05, (elapsed, ideal)


def test_unlimited_bucket_does_not_wait():
    bucket = TokenBucket(None)
    t0 = time.monotonic()
    bucket.consume(1 << 30)
    assert time.monotonic() - t0 < 0.01


def test_rate_change_applies_while_waiting():
    bucket = TokenBucket(mbps=0.01)  # 1.25 kB/s: a 1 MiB debt would take minutes
    done = threading.Event()

    def consume() -> None:
        bucket.consume(1 << 20)
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    time.sleep(0.1)
    assert not done.is_set()
    bucket.set_mbps(None)
    assert done.wait(1.0), "lifting the limit must release a waiting sender"


def _sockets(tcp: bool) -> tuple[socket.socket, socket.socket]:
    """A connected pair: a socketpair, or real TCP over loopback (which, unlike a socketpair,
    often hands a read less than it asked for)."""
    if not tcp:
        return socket.socketpair()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def _pair(tx_mbps: float | None, rx_mbps: float | None = None,
          tcp: bool = False) -> tuple[PeerLink, PeerLink, LinkShaper, LinkShaper]:
    a, b = _sockets(tcp)
    shaper_a, shaper_b = LinkShaper(), LinkShaper()
    shaper_a.tx.set_mbps(tx_mbps)
    shaper_b.rx.set_mbps(rx_mbps)
    return (PeerLink(a, shaper_a, 7, "b"), PeerLink(b, shaper_b, 7, "a"), shaper_a,
            shaper_b)


def _shaped_transfer(side: str, tcp: bool) -> tuple[float, float]:
    left, right, tx_shaper, rx_shaper = _pair(None if side == "rx" else 80.0,
                                              None if side == "tx" else 80.0, tcp)
    x = torch.randn(8, 128, 1024)  # 4 MiB fp32, twice
    try:
        t0 = time.monotonic()
        sent = sum(left.send_tensor(Kind.ACT, 0, i, x, FP32_WIRE) for i in range(2))
        got = [right.recv_tensor(Kind.ACT, 0, i, timeout=10)[1] for i in range(2)]
        elapsed = time.monotonic() - t0
        left.flush(5)  # the sender counts a chunk after the receiver may already have it
    finally:
        left.close()
        right.close()
    assert all(torch.equal(x, y) for y in got)
    assert tx_shaper.tx_bytes == sent and rx_shaper.rx_bytes == sent
    return elapsed, (sent - 65536) * 8 / 80e6  # the first burst is free


@pytest.mark.parametrize("side, tcp", [("tx", False), ("tx", True), ("rx", True),
                                       ("both", True)])
def test_shaped_transfer_of_several_mb_within_5_percent(side, tcp):
    # Never faster than the limit; the best of three tries within 5% (a busy CI core can only
    # make a try slower, never faster). The receiving side is shaped on real TCP: behind a
    # shaped sender its reads come back short, and the bucket must charge what arrived, not
    # what was asked for (charging the ask ran 1.3x slow).
    tries = []
    for _ in range(3):
        elapsed, ideal = _shaped_transfer(side, tcp)
        assert elapsed >= 0.95 * ideal, (elapsed, ideal)
        tries.append(elapsed / ideal)
        if tries[-1] <= 1.05:
            break
    assert min(tries) <= 1.05, tries


def test_a_peer_that_closes_once_it_has_everything_fails_no_flush():
    """The last frame of a run is written; the peer reads it, finishes and closes the link
    before this side's sender (descheduled on a busy machine, played here by a slow
    task_done) has marked the frame written. The flush that waits for that frame finds the
    link closed: it must still return, as the peer had all it was sent. A sender whose own
    write fails still fails the flush."""
    left, right, _, _ = _pair(None, tcp=True)
    done = left._out.task_done

    def late_done() -> None:
        time.sleep(0.3)
        done()

    left._out.task_done = late_done  # type: ignore[method-assign]
    try:
        left.send_tensor(Kind.ACT, 0, 0, torch.ones(4), FP32_WIRE)
        right.recv_tensor(Kind.ACT, 0, 0, timeout=5)
        right.close()  # the peer's run is over
        deadline = time.monotonic() + 2
        while left._error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert left._error is not None, "the close reached this side first"
        left.flush(5)
    finally:
        left.close()
    left, right, _, _ = _pair(None, tcp=True)
    try:
        right.close()
        with pytest.raises(LinkClosed):
            for i in range(64):  # until the kernel refuses: a write that truly failed
                left.send_tensor(Kind.ACT, 0, i, torch.ones(1 << 16), FP32_WIRE)
                left.flush(5)
    finally:
        left.close()


def test_a_send_returns_before_its_bytes_have_left():
    """Sends overlap compute: a stage queues an activation and goes on to its next forward
    while the link threads move the bytes. Four 1 MiB frames at 40 Mbit/s take ~0.8 s on
    the wire; queueing all four takes a small part of that, and they arrive whole, in order."""
    left, right, _, _ = _pair(40.0, tcp=True)
    xs = [torch.full((256, 1024), float(i)) for i in range(4)]
    try:
        t0 = time.monotonic()
        for i, x in enumerate(xs):
            left.send_tensor(Kind.ACT, 0, i, x, FP32_WIRE)
        queued = time.monotonic() - t0
        got = [right.recv_tensor(Kind.ACT, 0, i, timeout=10)[1] for i in range(4)]
        left.flush(5)
        on_wire = time.monotonic() - t0
    finally:
        left.close()
        right.close()
    assert all(torch.equal(x, y) for x, y in zip(xs, got, strict=True))
    assert on_wire >= 0.95 * (4 * (1 << 20) - 65536) * 8 / 40e6, on_wire
    assert queued < on_wire / 4, (queued, on_wire)


def test_a_frame_lands_where_its_owner_said_or_in_a_buffer_of_its_own():
    """A landing set before a frame arrives gets its payload read straight into it (the
    ring's chunks: no buffer of megabytes per frame); one of another length, or set for a
    frame that already came, is left alone and the frame arrives in a buffer of its own.
    Landings left from an earlier step are dropped when a later step's are set."""
    left, right, _, _ = _pair(None, tcp=True)
    x = torch.randn(300, 1024)
    into, late = torch.zeros(300, 1024), torch.zeros(300, 1024)
    wrong = torch.zeros(10)

    def view(t: torch.Tensor) -> memoryview:
        return memoryview(t.numpy()).cast("B")

    try:
        left.send_tensor(Kind.ACT, 1, 2, x, FP32_WIRE)  # (before its landing is set)
        deadline = time.monotonic() + 10
        while not right.ready(Kind.ACT) and time.monotonic() < deadline:
            time.sleep(0.01)
        right.land(Kind.ACT, 1, {0: view(into), 1: view(wrong), 2: view(late),
                                 5: view(wrong)})  # (5: never sent)
        for i in range(2):
            left.send_tensor(Kind.ACT, 1, i, x, FP32_WIRE)
        _, early = right.recv_tensor(Kind.ACT, 1, 2, timeout=10)
        _, landed = right.recv_tensor(Kind.ACT, 1, 0, timeout=10)
        _, own = right.recv_tensor(Kind.ACT, 1, 1, timeout=10)
        assert sorted(k[2] for k in right._landing) == [2, 5]  # (2 came first; 5 never)
        right.land(Kind.ACT, 2, {0: view(wrong)})
        left.flush(5)
    finally:
        left.close()
        right.close()
    assert torch.equal(into, x) and landed.data_ptr() == into.data_ptr()
    assert right.landed == 1
    for got in (early, own):
        assert torch.equal(got, x) and got.data_ptr() not in (into.data_ptr(),
                                                              late.data_ptr())
    assert torch.equal(wrong, torch.zeros(10)) and torch.equal(late, torch.zeros(300, 1024))
    assert list(right._landing) == [(Kind.ACT, 2, 0)]  # (step 1's left ones dropped)


def test_latency_delays_without_cutting_throughput():
    left, right, shaper, _ = _pair(None)
    shaper.latency_s = 0.05
    try:
        t0 = time.monotonic()
        for i in range(10):
            left.send_tensor(Kind.ACT, 0, i, torch.ones(4), FP32_WIRE)
        for i in range(10):
            right.recv_tensor(Kind.ACT, 0, i, timeout=5)
        elapsed = time.monotonic() - t0
    finally:
        left.close()
        right.close()
    # Ten frames queued together each arrive ~50 ms after they were sent, not 10 x 50 ms.
    assert 0.05 <= elapsed < 0.25


def test_a_flush_in_flight_leaves_frames_crossing_a_latency_to_cross():
    """A real link's sender does not wait while its bytes cross: ``flush(in_flight=True)``
    returns while the frames it queued are only held for the added latency, and they still
    arrive, in order, a latency after they were sent; a plain flush waits them out (what a
    close needs). Frames whose bytes would still be leaving a real link at its rate are
    waited for either way."""
    left, right, shaper, _ = _pair(None)
    shaper.latency_s = 0.3
    try:
        t0 = time.monotonic()
        for i in range(3):
            left.send_tensor(Kind.ACT, 0, i, torch.full((4,), float(i)), FP32_WIRE)
        left.flush(5.0, in_flight=True)
        assert time.monotonic() - t0 < 0.2
        for i in range(3):
            _, got = right.recv_tensor(Kind.ACT, 0, i, timeout=5)
            assert torch.equal(got, torch.full((4,), float(i)))
        assert time.monotonic() - t0 >= 0.3
        t0 = time.monotonic()
        left.send_tensor(Kind.ACT, 1, 0, torch.ones(4), FP32_WIRE)
        left.flush(5.0)
        assert time.monotonic() - t0 >= 0.3
        right.recv_tensor(Kind.ACT, 1, 0, timeout=5)
    finally:
        left.close()
        right.close()
    left, right, shaper, _ = _pair(16.0, tcp=True)
    shaper.latency_s = 0.01
    try:
        t0 = time.monotonic()
        for i in range(4):  # 256 KiB each: ~0.13 s at 16 Mbit/s, one behind the other
            left.send_tensor(Kind.ACT, 0, i, torch.randn(256, 256), FP32_WIRE)
        left.flush(5.0, in_flight=True)
        # (a real link's sender has the last one leave at ~0.52 s: the frames written
        # already count, not only those still held)
        assert time.monotonic() - t0 > 0.45
        for i in range(4):
            right.recv_tensor(Kind.ACT, 0, i, timeout=5)
    finally:
        left.close()
        right.close()


def test_a_wait_times_out_on_a_quiet_link_not_a_busy_one():
    """The frame timeout counts seconds with no byte moving: a GRAD that arrives behind 1.5 s
    of activations on a slow link is waited for with a 0.8 s timeout; on a quiet link the
    same wait gives up after 0.8 s."""
    from swarm_core.pipeline.transport import PeerTimeout

    left, right, _, _ = _pair(16.0, tcp=True)
    try:
        x = torch.randn(256, 1024)  # 1 MiB: about 0.5 s at 16 Mbit/s
        for i in range(3):
            left.send_tensor(Kind.ACT, 0, i, x, FP32_WIRE)
        left.send_tensor(Kind.GRAD, 0, 0, torch.ones(4), FP32_WIRE)
        t0 = time.monotonic()
        _, g = right.recv_tensor(Kind.GRAD, 0, 0, timeout=0.8)
        assert torch.equal(g, torch.ones(4)) and time.monotonic() - t0 > 1.2
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"nothing moved for 0\.8s"):
            right.recv(Kind.GRAD, 0, 1, timeout=0.8)
        assert 0.7 < time.monotonic() - t0 < 2.0
    finally:
        left.close()
        right.close()


def test_a_live_peer_busy_elsewhere_pulses_and_is_waited_for():
    """A peer that sends nothing for longer than the frame timeout, but is alive and not
    waiting on this link, keeps it alive with empty PULSE frames: the wait lasts until its
    frame comes. The pulses reach no queue (the GRAD is the first frame the wait sees)."""
    from swarm_core.pipeline.frames import HEADER_SIZE

    a, b = _sockets(tcp=True)
    busy = PeerLink(a, LinkShaper(), 7, "waiter", pulse_s=0.1)
    waiter = PeerLink(b, LinkShaper(), 7, "busy", pulse_s=0.1)
    seen: dict[str, int] = {}

    def answer() -> None:
        # Counted while the waiter surely still waits (it pulses again once the wait is over).
        seen.update(pulses=busy.pulse_bytes // HEADER_SIZE, waiter=waiter.pulse_bytes)
        busy.send_tensor(Kind.GRAD, 0, 0, torch.ones(4), FP32_WIRE)

    try:
        t0 = time.monotonic()
        threading.Timer(1.5, answer).start()
        _, g = waiter.recv_tensor(Kind.GRAD, 0, 0, timeout=0.5)
        waited = time.monotonic() - t0
        assert torch.equal(g, torch.ones(4)) and waited > 1.4
        # About one a pulse_s while idle, and none of them counted as data.
        assert 5 <= seen["pulses"] <= waited / 0.1 + 1, (seen, waited)
        # The sender counts a frame once its last write returns, which may be after the
        # receiver already has it: the flush waits for that.
        busy.flush(timeout=5.0)
        assert busy.sent == HEADER_SIZE + 16
        assert seen["waiter"] == 0, "no pulses from the side that was waiting on the link"
    finally:
        busy.close()
        waiter.close()


def test_two_stages_waiting_on_each_other_both_time_out():
    """Neither side pulses a link it is itself waiting on: a schedule mismatch (each waits for
    the other's frame) times out on both ends instead of keeping both alive for ever."""
    from swarm_core.pipeline.transport import PeerTimeout

    a, b = _sockets(tcp=True)
    left = PeerLink(a, LinkShaper(), 7, "b", pulse_s=0.1)
    right = PeerLink(b, LinkShaper(), 7, "a", pulse_s=0.1)
    errors: list[BaseException] = []

    def wait(link: PeerLink, kind: Kind) -> None:
        try:
            link.recv(kind, 0, 0, timeout=0.6)
        except BaseException as exc:
            errors.append(exc)

    try:
        t0 = time.monotonic()
        threads = [threading.Thread(target=wait, args=(left, Kind.GRAD)),
                   threading.Thread(target=wait, args=(right, Kind.ACT))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert len(errors) == 2 and all(isinstance(e, PeerTimeout) for e in errors), errors
        assert time.monotonic() - t0 < 2.0
    finally:
        left.close()
        right.close()


def test_a_link_whose_wait_timed_out_stops_pulsing():
    """A timed-out wait is a side that has given up: its link must not keep the peer alive.
    (The peer starts waiting only after A gave up, so without this A's pulses would hold it.)"""
    from swarm_core.pipeline.transport import PeerTimeout

    a, b = _sockets(tcp=True)
    left = PeerLink(a, LinkShaper(), 7, "b", pulse_s=0.1)
    right = PeerLink(b, LinkShaper(), 7, "a")  # never pulses: A times out on its own
    try:
        with pytest.raises(PeerTimeout):
            left.recv(Kind.GRAD, 0, 0, timeout=0.3)
        with pytest.raises(PeerTimeout):  # again, not a wait held open by pulses
            left.recv(Kind.GRAD, 0, 0, timeout=0.3)
        sent = left.pulse_bytes
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                right.recv(Kind.ACT, 0, 0, timeout=0.6)
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(3.0)
        assert len(errors) == 1 and isinstance(errors[0], PeerTimeout), errors
        assert left.pulse_bytes == sent, "the side that gave up went on pulsing"
    finally:
        left.close()
        right.close()


def test_a_link_that_failed_stops_pulsing():
    """B's link fails on a frame it never takes while B's stage is busy elsewhere: B does not
    keep the dead link alive with pulses, so A's wait times out. (B's stage raises the real
    reason when it next touches the link, and closing it then tells A.)"""
    from swarm_core.pipeline.frames import HEADER_SIZE, FrameError
    from swarm_core.pipeline.transport import PeerTimeout

    a, b = _sockets(tcp=True)
    left = PeerLink(a, LinkShaper(), 7, "b", pulse_s=0.1)
    right = PeerLink(b, LinkShaper(), 7, "a", pulse_s=0.1, receives=(Kind.ACT,))
    try:
        left.send_tensor(Kind.GRAD, 0, 0, torch.ones(4), FP32_WIRE)  # not for that link
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout):
            left.recv(Kind.GRAD, 0, 0, timeout=0.5)
        assert time.monotonic() - t0 < 1.5
        assert right.pulse_bytes <= HEADER_SIZE, "at most one pulse raced the failure"
        with pytest.raises(FrameError, match="unexpected GRAD frame from a"):
            right.recv(Kind.ACT, 0, 0, timeout=5.0)
    finally:
        left.close()
        right.close()


def test_a_stage_that_shows_no_progress_stops_pulsing():
    """Pulses speak for a live owner: once its liveness is older than the limit (a compute
    thread stuck in a hung call), they stop, and the peer's wait times out."""
    from swarm_core.pipeline.frames import HEADER_SIZE
    from swarm_core.pipeline.transport import Liveness, PeerTimeout

    a, b = _sockets(tcp=True)
    owner = Liveness(limit_s=0.5)
    stuck = PeerLink(a, LinkShaper(), 7, "waiter", pulse_s=0.1, liveness=owner)
    waiter = PeerLink(b, LinkShaper(), 7, "stuck")
    try:
        with pytest.raises(PeerTimeout):
            waiter.recv(Kind.GRAD, 0, 0, timeout=0.4)
        # About 0.5 s of pulses (the last one up to a pulse_s early), then 0.4 s of quiet.
        assert 0.65 < time.monotonic() - owner.at < 2.0
        assert stuck.pulse_bytes >= 3 * HEADER_SIZE
    finally:
        stuck.close()
        waiter.close()


def test_a_link_counts_the_time_its_owner_spends_blocked_on_it():
    """``waited``: seconds in recv before the frame was there, and in flush before the sends
    drained; a frame that had already arrived costs no wait."""
    left, right, _, _ = _pair(16.0)
    try:
        timer = threading.Timer(0.3, left.send_tensor,
                                (Kind.ACT, 0, 0, torch.ones(4), FP32_WIRE))
        timer.start()
        right.recv_tensor(Kind.ACT, 0, 0, timeout=5)
        assert 0.25 < right.waited < 1.0
        left.send_tensor(Kind.ACT, 0, 1, torch.ones(4), FP32_WIRE)
        deadline = time.monotonic() + 5
        while not right.ready(Kind.ACT) and time.monotonic() < deadline:
            time.sleep(0.01)
        before = right.waited
        right.recv_tensor(Kind.ACT, 0, 1, timeout=5)
        assert right.waited - before < 0.05
        assert left.waited == 0.0  # sending queues: no wait
        left.send_tensor(Kind.ACT, 0, 2, torch.randn(256, 1024), FP32_WIRE)  # 1 MiB: ~0.5 s
        left.flush(5)
        assert left.waited > 0.35
    finally:
        left.close()
        right.close()


def test_stop_reaches_a_flush_and_the_sender_at_once():
    from swarm_core.pipeline.transport import LinkAborted

    left, right, shaper, _ = _pair(8.0)
    try:
        left.send_tensor(Kind.ACT, 0, 0, torch.randn(512, 1024), FP32_WIRE)  # 2 MiB: 2 s
        threading.Timer(0.2, left.abort.set).start()
        t0 = time.monotonic()
        with pytest.raises(LinkAborted):
            left.flush(5)
        assert time.monotonic() - t0 < 0.5
        time.sleep(0.2)
        sent = shaper.tx_bytes
        time.sleep(0.3)
        assert shaper.tx_bytes == sent, "the sender stopped sending"
    finally:
        left.close()
        right.close()


def test_close_returns_once_the_links_threads_have_ended():
    """Even mid-transfer on a throttled link: close() ends both threads before it returns, so
    none is left in native code when the process exits."""
    left, right, _shaper, _ = _pair(8.0)
    left.send_tensor(Kind.ACT, 0, 0, torch.randn(512, 1024), FP32_WIRE)  # 2 MiB: 2 s
    time.sleep(0.2)
    t0 = time.monotonic()
    left.close()
    right.close()
    assert time.monotonic() - t0 < 2
    threads = [left._sender, left._receiver, right._sender, right._receiver]
    assert not [t.name for t in threads if t.is_alive()]
    # Nor does it wait out a frame's added latency.
    left, right, shaper, _ = _pair(None)
    shaper.latency_s = 30.0
    left.send_tensor(Kind.ACT, 0, 0, torch.ones(4), FP32_WIRE)
    time.sleep(0.1)
    t0 = time.monotonic()
    left.close()
    right.close()
    assert time.monotonic() - t0 < 1 and not left._sender.is_alive()


def test_a_farewell_on_a_link_left_idle_is_written_though_its_sender_is_slow(monkeypatch):
    """A link idle for longer than the farewell's quiet limit (a neighbour's wait for the
    cell that died) still waits for its FAREWELL, counted from when it was queued: a sender
    thread slow to run under load once let the close go first, and a survivor that let go
    was named as the one that died (a regroup CI failure)."""
    from swarm_core.pipeline.transport import FAREWELL_QUIET_S, farewell

    left, right, shaper, _ = _pair(None)
    try:
        time.sleep(FAREWELL_QUIET_S + 0.1)  # idle past the quiet limit
        slow = shaper.tx.consume

        def late(n, halted=None):  # type: ignore[no-untyped-def]
            time.sleep(0.3)  # the sender thread gets the CPU late
            return slow(n, halted) if halted is not None else slow(n)

        monkeypatch.setattr(shaper.tx, "consume", late)
        farewell([left], limit_s=5.0)
        left.close()
        deadline = time.monotonic() + 5
        while not right.peer_closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert right.peer_closed and right.peer_left and not right.died
    finally:
        left.close()
        right.close()


def test_a_stopping_receiver_leaves_no_debt_in_the_fellows_bucket():
    """The rx bucket is the fellow's: bytes a stopping link still reads are not charged, or
    the next job would start seconds in debt."""
    from swarm_core.pipeline.links import CHUNK

    left, right, _, rx_shaper = _pair(None, 8.0, tcp=True)
    try:
        for i in range(4):
            left.send_tensor(Kind.ACT, 0, i, torch.randn(1024, 1024), FP32_WIRE)  # 4 MiB
        time.sleep(0.2)
        right.abort.set()
        time.sleep(0.5)  # the receiver reads on at full speed until the link closes
    finally:
        left.close()
        right.close()
    rx_shaper.rx._refill(time.monotonic())
    assert rx_shaper.rx._tokens >= -CHUNK


def test_an_error_in_a_link_thread_fails_the_link_at_once(monkeypatch):
    """Not only socket errors: anything that ends the receiver (a bug, MemoryError) reaches
    the stage now, not after its frame timeout."""
    from swarm_core.pipeline import transport
    from swarm_core.pipeline.transport import LinkClosed

    def broken(raw, max_payload):  # type: ignore[no-untyped-def]
        raise MemoryError("no room for the payload")

    monkeypatch.setattr(transport.FrameHeader, "unpack", staticmethod(broken))
    left, right, _, _ = _pair(None)
    try:
        left.send_tensor(Kind.ACT, 0, 0, torch.ones(4), FP32_WIRE)
        t0 = time.monotonic()
        with pytest.raises(LinkClosed, match="failed while receiving: MemoryError"):
            right.recv(Kind.ACT, 0, 0, timeout=30)
        assert time.monotonic() - t0 < 2
    finally:
        left.close()
        right.close()


def test_a_jobs_link_limits_last_while_any_of_its_stages_runs():
    """Two stages of one job on one fellow share its shaper: the job's limits hold until the
    last of them ends, then the fellow's own come back, including a SET_SPEED sent mid-job
    (applied at once, and kept)."""
    from swarm_core.fellow.jobs import LinkOverrides
    from swarm_core.protocol import LinkLimits

    shaper = LinkShaper()
    links = LinkOverrides(shaper)
    job = LinkLimits(tx_mbps=500.0, rx_mbps=500.0)
    links.hold(job)
    links.hold(job)  # the second stage of the job
    assert shaper.limits() == job
    links.release()
    assert shaper.limits() == job, "one stage still runs"
    links.set_speed(LinkLimits(tx_mbps=80.0, latency_ms=20.0))
    assert shaper.tx.mbps == 80.0
    links.release()
    assert shaper.limits() == LinkLimits(tx_mbps=80.0, latency_ms=20.0)


async def test_a_push_that_fails_unforeseen_neither_fails_the_job_nor_keeps_its_limits(
        tmp_path, caplog, monkeypatch, make_start):
    """A shard push that raises something no one planned for (here a JSON error, as from a
    proxy's HTML page) is logged; the job still completes, the later pushes still go out, and
    the fellow's own link limits come back."""
    import json

    from swarm_core.fellow.jobs import JobContext, LinkOverrides, Progress
    from swarm_core.fellow.train import run_train
    from swarm_core.protocol import LinkLimits

    monkeypatch.setenv("SWARM_HOME", str(tmp_path))
    shaper = LinkShaper()
    links = LinkOverrides(shaper)
    links.set_speed(LinkLimits(tx_mbps=80.0))
    reports: list[Any] = []
    pushed: list[int] = []

    async def report(update: Any) -> None:
        reports.append(update)

    async def push_shard(job: str, stage: int, manifest: dict, *_: Any) -> None:
        pushed.append(manifest["step"])
        raise json.JSONDecodeError("Expecting value", "<html>502</html>", 0)

    start = make_start(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                       {"steps": 2, "batch_size": 4, "micro_batches": 2, "eval_batches": 0,
                          "shard_push_interval_steps": 1,
                          "link": {"tx_mbps": 5.0, "rx_mbps": 5.0}})
    ctx = JobContext(fellow_id=0, progress=Progress(), report=report, shaper=shaper,
                     push_shard=push_shard, links=links)
    await run_train(start, ctx)
    assert reports[-1].state == "COMPLETED"
    assert pushed == [1, 2]
    assert links.holders == 0
    assert shaper.limits() == LinkLimits(tx_mbps=80.0)
    assert "shard push of stage 0 failed" in caplog.text


async def test_checkpoints_are_written_while_the_stage_trains_on(tmp_path, monkeypatch,
                                                                 make_start):
    """A checkpoint costs the stage thread a copy of its state: the shard's serialisation and
    write (slowed to 0.4 s here) go on while the stage trains its next steps. The shards
    still reach disk and the leader in step order, the final one before COMPLETED, and no
    more than SNAPSHOTS_IN_FLIGHT copies ever wait for the writer."""
    import threading
    import time

    from swarm_core.artifacts import shards
    from swarm_core.fellow import train
    from swarm_core.fellow.jobs import JobContext, Progress
    from swarm_core.fellow.train import run_train

    monkeypatch.setenv("SWARM_HOME", str(tmp_path))
    events: list[tuple[str, int, float]] = []
    waiting = [0, 0]  # copies taken and not yet written; the most at once
    lock = threading.Lock()
    copy, write = shards.state_arrays, shards.write_shard

    def copying(module: Any) -> Any:
        with lock:
            waiting[0] += 1
            waiting[1] = max(waiting)
        return copy(module)

    def slow_write(root: Any, manifest: dict, *rest: Any) -> Any:
        time.sleep(0.4)
        out = write(root, manifest, *rest)
        with lock:
            waiting[0] -= 1
        events.append(("written", manifest["step"], time.monotonic()))
        return out

    monkeypatch.setattr(shards, "state_arrays", copying)
    monkeypatch.setattr(shards, "write_shard", slow_write)
    reports: list[Any] = []

    async def report(update: Any) -> None:
        reports.append(update)
        if update.state == "RUNNING" and update.step:
            events.append(("trained", update.step, time.monotonic()))

    async def push_shard(job: str, stage: int, manifest: dict, *_: Any) -> None:
        events.append(("pushed", manifest["step"], time.monotonic()))

    start = make_start(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                       {"steps": 5, "batch_size": 4, "micro_batches": 2, "eval_batches": 0,
                          "shard_push_interval_steps": 1})
    await run_train(start, JobContext(fellow_id=0, progress=Progress(), report=report,
                                      shaper=LinkShaper(), push_shard=push_shard))
    assert reports[-1].state == "COMPLETED"
    written = [step for kind, step, _ in events if kind == "written"]
    assert written == [1, 2, 3, 4, 5]
    assert [step for kind, step, _ in events if kind == "pushed"] == [1, 2, 3, 4, 5]
    at = {(kind, step): t for kind, step, t in events}
    # Step 2 trained while step 1's shard was still being written.
    assert at[("trained", 2)] < at[("written", 1)]
    assert 2 <= waiting[1] <= train.SNAPSHOTS_IN_FLIGHT
    shard = tmp_path / "runs" / "job-000001" / "model_export" / "shards" / "stage-0-fellow-0"
    assert (shard / "shard_manifest.json").exists() and (shard / "weights.npz").exists()


@pytest.mark.parametrize("fail_at", [2, 4])
async def test_a_shard_that_cannot_be_written_fails_the_job(tmp_path, monkeypatch, fail_at,
                                                            make_start):
    """A disk that refuses a shard (mid-run, or the final one) fails the stage with that error,
    as it did when the stage thread wrote them itself; nothing hangs."""
    from swarm_core.artifacts import shards
    from swarm_core.fellow.jobs import JobContext, Progress
    from swarm_core.fellow.train import run_train

    monkeypatch.setenv("SWARM_HOME", str(tmp_path))
    write = shards.write_shard

    def full_disk(root: Any, manifest: dict, *rest: Any) -> Any:
        if manifest["step"] == fail_at:
            raise OSError(28, "No space left on device")
        return write(root, manifest, *rest)

    monkeypatch.setattr(shards, "write_shard", full_disk)
    reports: list[Any] = []

    async def report(update: Any) -> None:
        reports.append(update)

    start = make_start(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                       {"steps": 4, "batch_size": 4, "micro_batches": 2, "eval_batches": 0,
                          "shard_push_interval_steps": 1})
    with pytest.raises(OSError, match=rf"^cannot write the shard of step {fail_at}: OSError: "
                                      r"\[Errno 28\] No space left on device$"):
        await asyncio.wait_for(run_train(start, JobContext(
            fellow_id=0, progress=Progress(), report=report, shaper=LinkShaper())), 60)
    assert not [r for r in reports if r.state == "COMPLETED"]


async def test_a_job_cancelled_while_a_shard_write_hangs_ends_without_it(tmp_path, monkeypatch,
                                                                          make_start):
    """The disk hangs in a shard write; the job is cancelled. The stage stops, the pending
    copies are dropped (neither written nor pushed), and the job ends within about a frame
    timeout instead of waiting on the disk: the fellow is free for the next job."""
    import threading
    import time

    from swarm_core.artifacts import shards
    from swarm_core.fellow.jobs import JobContext, Progress
    from swarm_core.fellow.train import run_train

    monkeypatch.setenv("SWARM_HOME", str(tmp_path))
    hung, release = threading.Event(), threading.Event()
    written: list[int] = []
    write = shards.write_shard

    def hanging(root: Any, manifest: dict, *rest: Any) -> Any:
        if manifest["step"] == 1:
            hung.set()
            release.wait(60)  # the disk, stuck
        written.append(manifest["step"])
        return write(root, manifest, *rest)

    monkeypatch.setattr(shards, "write_shard", hanging)
    pushed: list[int] = []

    async def report(_update: Any) -> None:
        pass

    async def push_shard(job: str, stage: int, manifest: dict, *_: Any) -> None:
        pushed.append(manifest["step"])

    start = make_start(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                       {"steps": 500, "batch_size": 4, "micro_batches": 2,
                          "eval_batches": 0, "shard_push_interval_steps": 1,
                          "frame_timeout_s": 1.0})
    job = asyncio.create_task(run_train(start, JobContext(
        fellow_id=0, progress=Progress(), report=report, shaper=LinkShaper(),
        push_shard=push_shard)))
    try:
        while not hung.is_set():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the stage takes its next copies, then waits for a slot
        t0 = time.monotonic()
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    await asyncio.sleep(0.5)  # the write that was under way finishes; nothing else follows
    assert written == [1] and pushed == []



async def test_a_job_cancelled_while_its_final_shard_is_pushed_ends_cancelled(tmp_path,
                                                                             monkeypatch,
                                                                             make_start):
    """The run trained every step; the fellow is stopped while the final shard is still on
    its way to the leader. The job ends cancelled, not COMPLETED: the cancellation reaches
    whoever cancelled it instead of being taken for the pusher's own time limit."""
    from swarm_core.fellow.jobs import JobContext, Progress
    from swarm_core.fellow.train import run_train

    monkeypatch.setenv("SWARM_HOME", str(tmp_path))
    reports: list[Any] = []
    final_push = asyncio.Event()

    async def report(update: Any) -> None:
        reports.append(update)

    async def push_shard(job: str, stage: int, manifest: dict, *_: Any) -> None:
        if manifest["step"] == 3:
            final_push.set()
            await asyncio.Event().wait()  # the leader, never answering

    start = make_start(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                       {"steps": 3, "batch_size": 4, "micro_batches": 2, "eval_batches": 0,
                        "shard_push_interval_steps": 0})
    job = asyncio.create_task(run_train(start, JobContext(
        fellow_id=0, progress=Progress(), report=report, shaper=LinkShaper(),
        push_shard=push_shard)))
    await asyncio.wait_for(final_push.wait(), 60)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(job, 10)
    assert not [r for r in reports if r.state == "COMPLETED"]
