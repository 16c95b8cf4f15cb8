"""``transport: torch``: a link met through the data listener's proven handshake carries the
same frames over a two-rank gloo group, counts the same bytes, binds loopback only, and
closes as a TCP link does (the peer's wait ends, not hangs). Real sockets on loopback, a real
listener and dialer, gloo between them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarm_core.pipeline.codecs import FP32_WIRE, Codec, WireCodec, as_bytes
from swarm_core.pipeline.frames import HEADER_SIZE, Kind, job_tag
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.listener import DataListener
from swarm_core.pipeline.torch_link import INLINE, TorchLink, _payload
from swarm_core.pipeline.transport import LinkClosed, PeerLink, connect, farewell

KEY = "the-jobs-session-key-0123456789"
TAG = job_tag("job-000007")


def _pair(ln: DataListener, transport: str, pulse_s: float | None = None
          ) -> tuple[PeerLink, PeerLink]:
    out: dict = {}

    def take() -> None:
        out["up"] = ln.accept_many(KEY, TAG, [_expected()], timeout=20, pulse_s=pulse_s,
                                   transport=transport)["up"]

    t = threading.Thread(target=take, daemon=True)
    t.start()
    down = connect(ln.addr, KEY, 0, TAG, LinkShaper(), timeout=20, pulse_s=pulse_s,
                   receives=(Kind.GRAD,), transport=transport)
    t.join(20)
    return down, out["up"]


def _expected():
    from swarm_core.pipeline.listener import Expected
    return Expected("up", 0, None, LinkShaper(), receives=(Kind.ACT,))


@pytest.fixture
def links() -> Iterator[tuple[PeerLink, PeerLink]]:
    ln = DataListener()
    down, up = _pair(ln, "torch")
    yield down, up
    down.close()
    up.close()
    ln.close()


def test_frames_cross_both_ways_with_their_bytes_counted(links):
    down, up = links
    assert isinstance(down, TorchLink) and isinstance(up, TorchLink)
    x = torch.randn(4, 8, 16)
    sent = down.send_tensor(Kind.ACT, 3, 1, x)
    _, got = up.recv_tensor(Kind.ACT, 3, 1, timeout=10, shape=(4, 8, 16))
    assert torch.equal(got, x)
    g = torch.randn(4, 8, 16)
    up.send_tensor(Kind.GRAD, 3, 1, g, FP32_WIRE)
    _, back = down.recv_tensor(Kind.GRAD, 3, 1, timeout=10)
    assert torch.equal(back, g)
    down.flush(10)
    # The same bytes as a shaped link's frame: header and fp32 payload.
    assert sent == HEADER_SIZE + x.numel() * 4 == down.sent
    assert down.shaper.tx_bytes == sent and up.shaper.rx_bytes == sent


def test_an_empty_payload_and_a_float_cross(links):
    down, up = links
    down.send_tensor(Kind.ACT, 0, 0, torch.empty(0))
    _, got = up.recv_tensor(Kind.ACT, 0, 0, timeout=10)
    assert got.numel() == 0
    down.send_float(Kind.ACT, 0, 1, 1.25)
    assert up.recv_float(Kind.ACT, 0, 1, timeout=10) == 1.25


def test_a_frame_lands_in_its_owners_buffer(links):
    down, up = links
    into = torch.zeros(256)
    up.land(Kind.ACT, 5, {0: memoryview(into.numpy()).cast("B")})
    x = torch.randn(256)
    down.send_tensor(Kind.ACT, 5, 0, x)
    _, got = up.recv_tensor(Kind.ACT, 5, 0, timeout=10)
    assert torch.equal(into, x) and torch.equal(got, x) and up.landed == 1


@pytest.mark.parametrize("nbytes", [4, INLINE, INLINE + 4])
def test_a_payload_in_its_headers_slot_or_after_it_lands_alike(links, nbytes):
    """A payload that fits the header's slot crosses in it (one message), one that does not
    after it; either lands in its owner's buffer, and the bytes counted are the frame's."""
    down, up = links
    n = nbytes // 4
    into = torch.zeros(n)
    up.land(Kind.ACT, 9, {0: memoryview(into.numpy()).cast("B")})
    x = torch.arange(n, dtype=torch.float32)
    sent = down.send_tensor(Kind.ACT, 9, 0, x)
    down.send_tensor(Kind.ACT, 9, 1, x + 1)  # (no landing: a buffer of its own)
    _, got = up.recv_tensor(Kind.ACT, 9, 0, timeout=10)
    _, other = up.recv_tensor(Kind.ACT, 9, 1, timeout=10)
    assert torch.equal(into, x) and torch.equal(got, x) and torch.equal(other, x + 1)
    down.flush(10)
    assert sent == HEADER_SIZE + nbytes and up.shaper.rx_bytes == 2 * sent == down.sent


def test_multi_megabyte_payloads_arrive_byte_identical_however_they_are_held(links):
    """A codec's one writable buffer (sent without a copy), its several buffers (joined), and
    ``send_raw``'s read-only bytes (copied): each arrives as the bytes that were queued."""
    down, up = links
    x = torch.randn(3, 1 << 19)  # 6 MiB of fp32
    int8 = WireCodec(Codec.INT8)
    blob = os.urandom(3 << 20 | 5)
    down.send_tensor(Kind.ACT, 2, 0, x)
    down.send_tensor(Kind.ACT, 2, 1, x, int8)
    down.send_raw(Kind.ACT, 2, 2, blob)
    _, one = up.recv(Kind.ACT, 2, 0, timeout=20)
    _, several = up.recv(Kind.ACT, 2, 1, timeout=20)
    _, raw = up.recv(Kind.ACT, 2, 2, timeout=20)
    assert bytes(one) == bytes(as_bytes(x))
    assert bytes(several) == bytes(bytearray().join(int8.encode(x)))
    assert bytes(raw) == blob


def test_only_a_single_writable_buffer_is_sent_without_a_copy():
    t = torch.arange(64, dtype=torch.float32)
    view = as_bytes(t)
    assert _payload([view]) is view
    ro = memoryview(bytes(range(200)))
    assert isinstance(_payload([ro]), bytearray) and _payload([ro]) == ro
    assert _payload([view[:8], view[8:]]) == view


def test_closing_one_end_ends_the_peers_wait_as_a_closed_link():
    ln = DataListener()
    down, up = _pair(ln, "torch")
    t0 = time.monotonic()
    down.close()
    with pytest.raises(LinkClosed):
        up.recv(Kind.ACT, 0, 0, timeout=30)
    assert up.peer_closed and time.monotonic() - t0 < 10
    up.close()
    ln.close()
    # Both receivers have ended: nothing of the link is left waiting.
    deadline = time.monotonic() + 5
    while (up._receiver.is_alive() or down._receiver.is_alive()) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not up._receiver.is_alive() and not down._receiver.is_alive()


@pytest.mark.parametrize("transport", ["shaped", "torch"])
@pytest.mark.parametrize("said", [True, False], ids=["farewell", "no-farewell"])
def test_a_close_after_a_farewell_is_no_death(transport, said):
    """A cell that lets go to regroup says FAREWELL before it closes: its peer sees the
    close, and that it was no death (``died`` false); a close without one (a process that
    ended) is a death. Either way the peer's wait ends as a closed link's."""
    ln = DataListener()
    down, up = _pair(ln, transport)
    if said:
        farewell([down])
    down.close()
    with pytest.raises(LinkClosed):
        up.recv(Kind.ACT, 0, 0, timeout=30)
    assert up.peer_closed and (up.peer_left, up.died) == (said, not said)
    assert up.sent == 0 and down.sent == 0  # (a pulse, not data: no wire bytes counted)
    up.close()
    ln.close()


def test_a_farewell_waits_for_the_frame_in_flight_and_drops_the_queued_ones():
    """On a link slowed to 8 Mbit/s, a 2 MiB frame (about two seconds on the wire) is being
    written and two more wait behind it: the FAREWELL goes out after the first (never cut
    mid-frame) and before the rest (dropped), so the peer reads one whole frame and then a
    close that was no death."""
    from swarm_core.protocol import LinkLimits

    ln = DataListener()
    down, up = _pair(ln, "shaped")
    down.shaper.apply(LinkLimits(tx_mbps=8.0))
    x = torch.zeros(1 << 19)  # (2 MiB of fp32)
    for mb in range(3):
        down.send_tensor(Kind.ACT, 0, mb, x)
    time.sleep(0.2)  # (the first frame is on its way)
    t0 = time.monotonic()
    farewell([down])
    assert time.monotonic() - t0 > 1.2  # (it waited for the frame ahead of it)
    down.close()
    _, got = up.recv(Kind.ACT, 0, 0, timeout=30)
    assert bytes(got) == bytes(as_bytes(x))
    with pytest.raises(LinkClosed):
        up.recv(Kind.ACT, 0, 1, timeout=30)
    assert up.peer_left and not up.died
    up.close()
    ln.close()


def test_an_idle_link_pulses_over_gloo_and_a_wait_sees_it_as_progress():
    ln = DataListener()
    down, up = _pair(ln, "torch", pulse_s=0.05)
    try:
        time.sleep(0.5)
        assert down.pulse_bytes >= 2 * HEADER_SIZE and down.sent == 0
        assert time.monotonic() - up.last_progress < 0.3
        # A frame after the pulses is read as ever (the pulses left nothing behind).
        down.send_tensor(Kind.ACT, 1, 0, torch.ones(3))
        _, got = up.recv_tensor(Kind.ACT, 1, 0, timeout=10)
        assert got.tolist() == [1.0, 1.0, 1.0]
    finally:
        down.close()
        up.close()
        ln.close()


def test_gloo_and_the_store_listen_on_loopback_only(links):
    # Every listening socket this process holds is on 127.0.0.0/8.
    ports = Path("/proc/net/tcp").read_text().splitlines()[1:]
    inodes = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}")}
    mine = [line.split() for line in ports if line.split()[3] == "0A"
            and f"socket:[{line.split()[9]}]" in inodes]
    assert mine, "no listening socket found"
    for fields in mine:
        ip = fields[1].split(":")[0]
        assert ip.endswith("7F"), f"listening on {fields[1]} (hex, little-endian)"


# --- whole runs over the torch transport --------------------------------------------------


def _exact_run(transport: str, stages: int = 2, replicas: int = 2) -> list[float]:
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.local import run_local_pipeline
    from swarm_core.pipeline.stage import StageResult
    from swarm_core.schema import structure

    mc = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    tc = structure({"steps": 20, "batch_size": 8, "micro_batches": 2, "eval_batches": 1,
                    "transport": transport}, TrainingConfig)
    data = load_token_data(tc, mc.seq_len)
    res = run_local_pipeline(mc, tc, data, stages, replicas=replicas, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    per_replica = [res[r * stages + stages - 1].losses for r in range(replicas)]
    return [sum(step) / replicas for step in zip(*per_replica, strict=True)], res


def test_a_torch_transport_grid_trains_what_one_process_and_the_shaped_one_train():
    """fp32, ``none``, dp: S=2 x R=2 over gloo computes the losses of the shaped transport's
    run and of one process at the same global batch, to 1e-5 over 20 steps."""
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.contract import split_layers
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.reference import train_reference

    got, res = _exact_run("torch")
    shaped, _ = _exact_run("shaped")
    mc = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    tc = TrainingConfig(steps=20, batch_size=8, micro_batches=2, eval_batches=1)
    ref, _ = train_reference(mc, tc, load_token_data(tc, mc.seq_len), split_layers(2, [1, 1]))
    assert len(got) == 20 and ref[-1] < ref[0]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(shaped, got, strict=True)) <= 1e-5
    # The same byte counters: each stage's boundary and sync bytes are what the plan says.
    for r in res.values():
        assert r.metrics.sync_tx_bytes_per_step == r.metrics.expected_sync_tx_bytes_per_step
    # The stage groups' mean went through gloo's all_reduce: no ring frames, so no headers.
    _, shaped_res = _exact_run("shaped")
    for cell, r in res.items():
        assert r.metrics.expected_sync_tx_bytes_per_step < \
            shaped_res[cell].metrics.expected_sync_tx_bytes_per_step


def test_the_transport_and_codec_choose_the_groups_all_reduce():
    from swarm_core.pipeline.codecs import WireCodec
    from swarm_core.pipeline.collective import GroupAllReduce, Meeting, make_ring
    from swarm_core.pipeline.ring import Ring

    cpu = torch.device("cpu")
    exact = make_ring("torch", Meeting(), [10], None, None, 0, 1, FP32_WIRE, cpu)
    assert isinstance(exact, GroupAllReduce)
    lossy = WireCodec.of_sync(__import__("swarm_core.config.schemas", fromlist=["x"])
                              .SyncConfig(compression="int8"))
    assert type(make_ring("torch", Meeting(), [10], None, None, 0, 1, lossy, cpu)) is Ring
    assert type(make_ring("shaped", Meeting(), [10], None, None, 0, 1, FP32_WIRE, cpu)) is Ring


def test_diloco_over_the_torch_transport_trains_what_it_trains_over_the_shaped_one():
    """DiLoCo's outer steps (fp32: gloo's all_reduce) and its inner steps over gloo links:
    the shaped transport's losses, S=1 x R=3, H=2 (three replicas: a sum in gloo's order)."""
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.local import run_local_pipeline
    from swarm_core.pipeline.stage import StageResult
    from swarm_core.schema import structure

    mc = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    got = {}
    for transport in ("shaped", "torch"):
        tc = structure({"steps": 8, "batch_size": 12, "micro_batches": 1, "eval_batches": 0,
                        "warmup_steps": 2, "transport": transport,
                        "sync": {"mode": "diloco", "inner_steps": 2}}, TrainingConfig)
        res = run_local_pipeline(mc, tc, load_token_data(tc, mc.seq_len), 1, replicas=3,
                                 timeout=120)
        assert all(isinstance(r, StageResult) for r in res.values()), res
        got[transport] = [sum(s) / 3 for s in zip(*(res[r].losses for r in range(3)),
                                                  strict=True)]
    assert len(got["torch"]) == 8
    assert max(abs(a - b) for a, b in zip(got["shaped"], got["torch"], strict=True)) <= 1e-5
