"""The data-plane frame: a fixed 64-byte header, then the raw payload.

    magic "SWRM" | version u8 | kind u8 | codec u8 | dtype u8 | ndim u8 | flags u8 | codec_arg u16
    job u64 | step u64 | micro_batch u32 | shape 4 x u32 | payload_len u64 | payload_check u32
    header_check u32

Little-endian. The payload goes out straight from the tensor's buffer: no JSON, no base64. A frame
for the wrong job, step, micro-batch or kind is an error, never a guess.

Both checks are the low 32 bits of XXH3-64 (since version 2; version 1 used zlib's CRC-32).
Version 3 added PULSE, the empty frame a live stage sends on a link it has left idle; version 4
the codec's argument (int8's scale block; 0 for one scale per row and for the other codecs) where
version 3 had two bytes of padding; version 5 SYNC, a share of a stage group's gradient
all-reduce on the ring between its replicas; version 7 the flag HEARD on a training step's
activations and gradients (its chain was told of a replica joining; see stage.py). A checksum
pass runs over every payload on both ends, so its speed bounds the frame path: CRC-32 ran at
~3.5 GB/s a core here, XXH3 at ~19 GB/s (and it releases the GIL, so the receiver thread's check
overlaps the compute thread). Random corruption passes it with probability 2^-32, as with
CRC-32, though without CRC-32's guarantee for short bursts (TCP's checksum and the link CRC stand
below it). It is an integrity check against corruption, not authentication:
the data plane's session key (HELLO) decides who may send.
"""

from __future__ import annotations

import enum
import hashlib
import struct

import attrs
import xxhash

MAGIC = b"SWRM"
VERSION = 8
_HEADER = struct.Struct("<4sBBBBBBHQQI4IQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _CRC.size
assert HEADER_SIZE == 64
MAX_DIMS = 4
DEFAULT_MAX_PAYLOAD = 1 << 30
_MASK32 = 0xFFFFFFFF


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The frame's 32-bit check of ``data``: the low half of its XXH3-64."""
    return xxhash.xxh3_64_intdigest(data) & _MASK32


class Kind(enum.IntEnum):
    ACT = 1  # activations, forward
    GRAD = 2  # gradients, backward
    NORM = 3  # squared gradient norms for global clipping
    HELLO = 4  # the handshake: both ends prove the job's session key (see handshake)
    PULSE = 5  # empty; "this stage is alive" on a link it has left idle (see transport)
    SYNC = 6  # a chunk of a stage group's gradient all-reduce (see pipeline/ring.py)


# What a link may carry once its HELLO is through (besides PULSE, which every link takes).
DATA_KINDS = frozenset({Kind.ACT, Kind.GRAD, Kind.NORM})


class FrameError(ValueError):
    """A frame that must not be used. The message says what was wrong."""


FLAG_EVAL = 1  # forward-only evaluation pass; no gradient will come back
# On a training step's ACT and GRAD frames: a cell of the sender's chain had been told of a
# membership change (a replica joining) when the step began. Every stage group of the job
# learns of it at the same step through its chains, so all take the joiner in together.
FLAG_HEARD = 2
# On a PULSE: the sender is about to close this link of its own will (its cell regroups), so
# the close that follows is no sign that its process died (see transport.PeerLink.farewell).
FLAG_FAREWELL = 4
FLAGS = FLAG_EVAL | FLAG_HEARD | FLAG_FAREWELL
DTYPE = 1  # the header's dtype field: the codec says how the payload is coded


def job_tag(job_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "little")


@attrs.frozen
class FrameHeader:
    kind: Kind
    codec: int
    dtype: int
    job: int
    step: int
    micro_batch: int
    shape: tuple[int, ...]
    payload_len: int
    payload_check: int
    flags: int = 0
    codec_arg: int = 0

    def pack(self) -> bytes:
        if len(self.shape) > MAX_DIMS:
            raise FrameError(f"at most {MAX_DIMS} dimensions, got {len(self.shape)}")
        dims = (*self.shape, *([0] * (MAX_DIMS - len(self.shape))))
        head = _HEADER.pack(MAGIC, VERSION, int(self.kind), self.codec, self.dtype,
                            len(self.shape), self.flags, self.codec_arg, self.job, self.step,
                            self.micro_batch, *dims, self.payload_len, self.payload_check)
        return head + _CRC.pack(checksum(head))

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview,
               max_payload: int = DEFAULT_MAX_PAYLOAD) -> FrameHeader:
        if len(data) != HEADER_SIZE:
            raise FrameError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
        head = bytes(data[: _HEADER.size])
        (magic, version, kind, codec, dtype, ndim, flags, codec_arg, job, step, micro,
         d0, d1, d2, d3, plen, pcrc) = _HEADER.unpack(head)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r} (not a SilentSwarm data-plane stream)")
        if version != VERSION:
            raise FrameError(f"frame version {version}, this fellow speaks {VERSION}")
        (hcrc,) = _CRC.unpack(bytes(data[_HEADER.size:]))
        if hcrc != checksum(head):
            raise FrameError("header checksum mismatch (corrupted header)")
        try:
            kind_e = Kind(kind)
        except ValueError:
            raise FrameError(f"unknown frame kind {kind}") from None
        if ndim > MAX_DIMS:
            raise FrameError(f"ndim {ndim} > {MAX_DIMS}")
        # Fields this version does not use must be as it writes them: a peer that sets them
        # means something this fellow would not do.
        if dtype != DTYPE:
            raise FrameError(f"unknown frame dtype {dtype} (version {VERSION} writes {DTYPE})")
        if flags & ~FLAGS:
            raise FrameError(f"unknown frame flags {flags:#x}")
        if flags & FLAG_HEARD and kind_e not in (Kind.ACT, Kind.GRAD):
            raise FrameError(f"{kind_e.name} frame with the flag HEARD")
        if flags & FLAG_FAREWELL and kind_e is not Kind.PULSE:
            raise FrameError(f"{kind_e.name} frame with the flag FAREWELL")
        if codec_arg and kind_e not in (Kind.ACT, Kind.GRAD, Kind.SYNC):
            raise FrameError(f"{kind_e.name} frame with a codec argument ({codec_arg})")
        if any((d0, d1, d2, d3)[ndim:]):
            raise FrameError(f"shape {[d0, d1, d2, d3]} has sizes past its {ndim} dimensions")
        if plen > max_payload:
            raise FrameError(f"payload of {plen} bytes exceeds the limit of {max_payload}")
        return cls(kind_e, codec, dtype, job, step, micro, (d0, d1, d2, d3)[:ndim], plen,
                   pcrc, flags, codec_arg)


def make_header(kind: Kind, job: int, step: int, micro_batch: int, shape: tuple[int, ...],
                codec: int, payload: list[memoryview] | bytes, dtype: int = DTYPE,
                flags: int = 0, codec_arg: int = 0) -> FrameHeader:
    bufs = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    if len(bufs) == 1:
        check = checksum(bufs[0])
    else:  # the int8 codec's scales + codes: one streaming hash over the concatenation
        h = xxhash.xxh3_64()
        for b in bufs:
            h.update(b)
        check = h.intdigest() & _MASK32
    return FrameHeader(kind, codec, dtype, job, step, micro_batch, tuple(shape),
                       sum(len(b) for b in bufs), check, flags, codec_arg)


def pulse_header(job: int, flags: int = 0) -> FrameHeader:
    """The PULSE frame for ``job``: a header and no payload (``FLAG_FAREWELL``: the one a
    link's last, before a close of the sender's own will)."""
    return make_header(Kind.PULSE, job, 0, 0, (), 0, b"", flags=flags)


def check_payload(header: FrameHeader, payload: bytes | bytearray | memoryview) -> None:
    if len(payload) != header.payload_len:
        raise FrameError(f"payload length {len(payload)} != header's {header.payload_len}")
    if checksum(payload) != header.payload_check:
        raise FrameError(f"payload checksum mismatch in {header.kind.name} step {header.step} "
                         f"micro-batch {header.micro_batch}")


def expect(header: FrameHeader, kind: Kind, job: int, step: int, micro_batch: int,
           flags: int = 0) -> None:
    """Raise unless this is exactly the frame the schedule waits for (``flags``: FLAG_EVAL for
    an evaluation pass's activations, else none; HEARD is the stage's to read)."""
    if header.job != job:
        raise FrameError(f"frame for another job (tag {header.job:#x}, expected {job:#x})")
    if header.kind != kind or header.step != step or header.micro_batch != micro_batch:
        raise FrameError(
            f"expected {kind.name} step {step} micro-batch {micro_batch}, got "
            f"{header.kind.name} step {header.step} micro-batch {header.micro_batch}")
    if header.flags & FLAG_EVAL != flags & FLAG_EVAL:
        def what(f: int) -> str:
            return "an evaluation" if f & FLAG_EVAL else "a training"
        raise FrameError(f"expected {what(flags)} {kind.name} step {step} micro-batch "
                         f"{micro_batch}, got {what(header.flags)} one")
