"""What the current GPU is, in the names the tuning database and the images use."""

from __future__ import annotations

from functools import cache

import torch


@cache
def _arch_of_index(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    gcn = getattr(props, "gcnArchName", "")
    if torch.version.hip and gcn:
        return gcn.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def arch_of(device: torch.device) -> str:
    """``sm_90`` for an H100/H200, ``gfx942`` for an MI300X, ..."""
    return _arch_of_index(_index(device))


@cache
def _multiprocessors_of_index(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int | None:
    """The GPU's streaming multiprocessors (132 on an H200); None off the GPU. Persistent
    kernels launch at most one program per SM."""
    if device.type != "cuda":
        return None
    return _multiprocessors_of_index(_index(device))
