"""The stage group's ring all-reduce itself, its members as threads of this process over
socket pairs (the frames, codecs and checks a fellow's ring uses)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from swarm_core.config.schemas import SyncConfig
from swarm_core.pipeline import codecs
from swarm_core.pipeline.frames import Kind
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.sync import Ring
from swarm_core.pipeline.transport import PeerLink


def _all_reduce(tensors: list[list[torch.Tensor]], compression: str) -> list[list[torch.Tensor]]:
    """Each member's tensors after one all-reduce around a ring of len(tensors) members."""
    n = len(tensors)
    codec = codecs.WireCodec.of_sync(SyncConfig(compression=compression))
    pairs = [socket.socketpair() for _ in range(n)]  # pair r: member r -> member r+1
    links = [PeerLink(s, LinkShaper(), 0, f"end {i}", receives={Kind.SYNC})
             for i, s in enumerate(s for pair in pairs for s in pair)]
    out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def member(r: int) -> None:
        try:
            mine = [t.clone() for t in tensors[r]]
            ring = Ring([t.numel() for t in mine], links[2 * r], links[2 * ((r - 1) % n) + 1],
                        r, n, codec, torch.device("cpu"))
            ring.reduce_(0, 10.0, mine)
            ring.put_back(mine)
            out[r] = mine
        except BaseException as exc:  # (raised in the test's thread below)
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for link in links:
        link.close()
    assert not errors, errors
    return out


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
    for r in range(1, replicas):
        for a, b in zip(got[0], got[r], strict=True):
            assert torch.equal(a, b), (compression, r)
    for i, t in enumerate(got[0]):
        mean = sum(ts[i] for ts in tensors) / replicas
        assert float((t - mean).abs().max()) <= tol * float(mean.abs().max()), compression
    if compression == "none" and replicas == 2:  # (the sum, then one division: to the bit)
        for i, t in enumerate(got[0]):
            assert torch.equal(t, (tensors[0][i] + tensors[1][i]) / 2)
