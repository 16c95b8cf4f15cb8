"""Device slots as torch devices: ``cpu`` or ``cuda:N``, checked against what this machine has.

A fellow started with a slot its machine cannot serve is refused at start (``swarm fellow``), and
a stage assigned one anyway refuses its START: training never falls back to the CPU unasked.
"""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """A device slot this machine cannot serve."""


def resolve_device(name: str, dtype: str = "float32") -> torch.device:
    """``name`` as a torch device, if this machine has it and it can compute in ``dtype``
    (a model profile's: ``float32`` or ``bfloat16``)."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"{name!r} is not 'cpu' or 'cuda:N'") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda" or dev.index is None:
        raise DeviceError(f"{name!r} is not 'cpu' or 'cuda:N'")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"{name}: torch sees no CUDA device here (torch {torch.__version__}, "
                          f"{build})")
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise DeviceError(f"{name}: this machine has {count} CUDA device(s), "
                          f"cuda:0..cuda:{count - 1}")
    if dtype == "bfloat16" and not _cuda_bf16(dev):
        raise DeviceError(f"{name} ({torch.cuda.get_device_name(dev)}) has no native "
                          "bfloat16: use dtype float32 on it")
    return dev


def check_slots(slots: list[str]) -> None:
    """Every slot of a fellow-to-be, as :func:`resolve_device` sees it: refused now, not at a
    job's START (and never trained on the CPU instead)."""
    for d in slots:
        resolve_device(d)


def _cuda_bf16(dev: torch.device) -> bool:
    with torch.cuda.device(dev):
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch before 2.5 has no including_emulation
            return torch.cuda.is_bf16_supported()
