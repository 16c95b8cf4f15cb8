"""The stage group's ring all-reduce itself, its members as threads of this process over
socket pairs (the frames, codecs and checks a fellow's ring uses)."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

from swarm_core.config.schemas import SyncConfig
from swarm_core.pipeline import codecs
from swarm_core.pipeline import ring as sync
from swarm_core.pipeline.frames import Kind
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.ring import Ring
from swarm_core.pipeline.syncs.dp import GradientAverage
from swarm_core.pipeline.transport import PeerLink


def _links(n: int) -> list[PeerLink]:
    """A ring of n members' links: 2r is member r's to r+1, 2r+1 member r+1's from r."""
    pairs = [socket.socketpair() for _ in range(n)]
    return [PeerLink(s, LinkShaper(), 0, f"end {i}", receives={Kind.SYNC})
            for i, s in enumerate(s for pair in pairs for s in pair)]


def _run_members(member: Callable[[int], None], links: list[PeerLink]) -> None:
    """``member(r)`` for each member, each on a thread of its own; then the links closed,
    and what any member raised raised here."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            member(r)
        except BaseException as exc:  # (raised in the test's thread below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(links) // 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for link in links:
        link.close()
    assert not errors, errors


def _all_reduce(tensors: list[list[torch.Tensor]], compression: str, steps: int = 1,
                slow: float = 0.0) -> list[list[torch.Tensor]]:
    """Each member's tensors after ``steps`` all-reduces around a ring of len(tensors)
    members, each of the same tensors, over one ring. ``slow``: member 0 dawdles that long
    after each frame it receives, before it uses it, so the others run ahead of it."""
    n = len(tensors)
    codec = codecs.WireCodec.of_sync(SyncConfig(compression=compression))
    links = _links(n)
    if slow:
        link = links[2 * (n - 1) + 1]  # (member 0's from the last)
        plain = link.recv_tensor

        def dawdling(*args, **kwargs):
            got = plain(*args, **kwargs)
            time.sleep(slow)
            return got

        link.recv_tensor = dawdling  # type: ignore[method-assign]
    out: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def member(r: int) -> None:
        mine = [t.clone() for t in tensors[r]]
        ring = Ring([t.numel() for t in mine], links[2 * r], links[2 * ((r - 1) % n) + 1],
                    r, n, codec, torch.device("cpu"))
        for step in range(steps):
            sent, _ = ring.reduce_(step, 10.0, mine)
            assert sent == ring.expected_bytes(), "it sent what the spec expects"
            ring.confirm(step, 10.0)
            # (what it was given is left as it was: a broken ring redoes from it)
            for t, orig in zip(mine, tensors[r], strict=True):
                assert torch.equal(t, orig), "the ring wrote into its member's tensors"
        got = [torch.empty_like(t) for t in mine]
        ring.put_back(got)
        out[r] = got

    _run_members(member, links)
    return out


def _check_means(tensors: list[list[torch.Tensor]], got: list[list[torch.Tensor]],
                 compression: str, tol: float) -> None:
    """Every member holds the same bytes, and they are the members' mean to the codec."""
    for r in range(1, len(tensors)):
        for a, b in zip(got[0], got[r], strict=True):
            assert torch.equal(a, b), (compression, r)
    for i, t in enumerate(got[0]):
        mean = sum(ts[i] for ts in tensors) / len(tensors)
        assert float((t - mean).abs().max()) <= tol * float(mean.abs().max()), compression


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("compression, tol", [("none", 1e-6), ("fp16", 1e-3), ("bf16", 1e-2),
                                              ("int8", 2e-2), ("int8_b64", 2e-2)])
def test_every_member_ends_with_the_same_mean(replicas, compression, tol):
    """Every member holds the same bytes after an all-reduce, a lossy codec's rounding
    included (the member that summed a chunk keeps what it sent, as the others decode it):
    data parallel's replicas stay one model. And it is the members' mean, to the codec."""
    gen = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(37, 11, generator=gen), torch.randn(300, generator=gen)]
               for _ in range(replicas)]
    got = _all_reduce(tensors, compression)
    _check_means(tensors, got, compression, tol)
    if compression == "none" and replicas == 2:  # (the sum, then one division: to the bit)
        for i, t in enumerate(got[0]):
            assert torch.equal(t, (tensors[0][i] + tensors[1][i]) / 2)


@pytest.mark.parametrize("lane_bytes", [None, 256])
@pytest.mark.parametrize("compression, tol", [("none", 1e-6), ("int8", 2e-2),
                                              ("int8_b64", 2e-2)])
def test_a_member_that_lags_gets_every_chunk_intact(monkeypatch, compression, tol,
                                                    lane_bytes):
    """Frames are read straight into where they go (the buffer, or buffers kept for the
    run), set before they arrive, and each lane of a chunk goes on as soon as it is summed.
    A member that dawdles over each frame lets the others run rounds ahead of it; what they
    send meanwhile must not land over a lane it has yet to use, in any round of a ring of
    four, step after step, a chunk in one frame or in several lanes."""
    if lane_bytes:
        monkeypatch.setattr(sync, "LANE_BYTES", lane_bytes)
    gen = torch.Generator().manual_seed(1)
    tensors = [[torch.randn(64, 9, generator=gen), torch.randn(500, generator=gen)]
               for _ in range(4)]
    got = _all_reduce(tensors, compression, steps=3, slow=0.01)
    _check_means(tensors, got, compression, tol)


def test_lanes_sum_to_the_bit_what_one_frame_does(monkeypatch):
    """A chunk in lanes is the same sum, divided once, as in one frame: to the bit."""
    gen = torch.Generator().manual_seed(2)
    tensors = [[torch.randn(257, generator=gen), torch.randn(40, 3, generator=gen)]
               for _ in range(2)]
    monkeypatch.setattr(sync, "LANE_BYTES", 100)
    assert sync.lane_count(sync.chunk_bounds(257 + 120, 2), 1) > 1
    got = _all_reduce(tensors, "none")
    for i, t in enumerate(got[0]):
        assert torch.equal(t, (tensors[0][i] + tensors[1][i]) / 2)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("compression", ["none", "int8_b64"])
def test_data_parallel_buckets_land_in_place_and_agree(monkeypatch, replicas, compression):
    """Data parallel as a stage runs it: several buckets over the same two links, their
    landings set when the last backward is armed, members a little out of step with each
    other. Every member commits the same mean into its gradients, step after step; an exact
    ring reads its frames straight into its buffer (those that come after their landing is
    set), a lossy one each into a buffer of its own (its frames are coded)."""
    monkeypatch.setattr(sync, "LANE_BYTES", 64)
    codec = codecs.WireCodec.of_sync(SyncConfig(compression=compression))
    n, steps, sizes = replicas, 3, [50, 30, 70, 20, 90, 10]
    gen = torch.Generator().manual_seed(3)
    inputs = [[[torch.randn(k, generator=gen) for k in sizes] for _ in range(steps)]
              for _ in range(n)]
    links = _links(n)
    got: list[list[list[torch.Tensor]]] = [[] for _ in range(n)]

    def member(r: int) -> None:
        skew = random.Random(r)
        params = [torch.nn.Parameter(torch.zeros(k)) for k in sizes]
        avg = GradientAverage(params, links[2 * r], links[2 * ((r - 1) % n) + 1], r, n,
                              codec, torch.device("cpu"), 256)
        assert len(avg.buckets) > 2
        for step in range(steps):
            for p in params:
                p.grad = None
            time.sleep(skew.random() * 0.02)
            avg.arm(step, 10.0)
            sum((p * x).sum() for p, x in zip(params, inputs[r][step], strict=True)).backward()
            time.sleep(skew.random() * 0.02)
            avg.after_backward(step, 10.0)
            got[r].append([p.grad.clone() for p in params])
        avg.close()

    _run_members(member, links)
    tol = 1e-6 if compression == "none" else 2e-2
    for step in range(steps):
        _check_means([inputs[r][step] for r in range(n)], [got[r][step] for r in range(n)],
                     compression, tol)
    landed = sum(link.landed for link in links)
    if compression == "none":
        assert landed > 0
    else:
        assert landed == 0
