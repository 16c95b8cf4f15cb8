"""Write the safetensors format with numpy alone, so the glued model opens in the Hugging Face
ecosystem's tools without SilentSwarm depending on the ``safetensors`` package at run time.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` plus an
optional ``"__metadata__"`` of string values, padded with spaces to a multiple of 8, then the
tensors' raw little-endian C-order bytes, back to back, offsets counted from the data's start.
"""

from __future__ import annotations

import json
import struct

import numpy as np

# numpy's dtype -> the format's name for it (numpy has no bfloat16: weights on disk are float32)
DTYPE_NAMES = {
    np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16",
    np.dtype("int8"): "I8", np.dtype("uint64"): "U64", np.dtype("uint32"): "U32",
    np.dtype("uint16"): "U16", np.dtype("uint8"): "U8", np.dtype("bool"): "BOOL",
}


def safetensors_bytes(arrays: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> bytes:
    """``arrays`` as one safetensors file, tensors in name order (the same bytes for the same
    arrays: the file's sha256 names its content). A dtype the format has no name for is a
    ValueError."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(arrays):
        array = np.asarray(arrays[name])
        kind = DTYPE_NAMES.get(array.dtype.newbyteorder("="))
        if kind is None:
            raise ValueError(f"{name}: dtype {array.dtype} has no safetensors name")
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)
