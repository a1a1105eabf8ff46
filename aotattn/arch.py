"""The GPU architectures aotattn builds for and tunes: the one list every layer reads.

Each is named as the tuning database's folders and the image archives name it
(``sm_90``, ``gfx942``); the build compiles for :attr:`Arch.target`, the tuner prunes
configurations by :attr:`Arch.shared_memory` and :attr:`Arch.registers`, and a derived
architecture's tables start as ``#! base <base>`` of another's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arch:
    """One compile target.

    Attributes:
        name: ``sm_90``, ``gfx942``, ...
        vendor: the tuning database's top folder, ``nvidia`` or ``amd``.
        target: ``(backend, arch, warp size)`` for Triton's ``GPUTarget``.
        shared_memory: bytes of shared memory (LDS on AMD) one block may opt into (CUDA
            programming guide's compute-capability table; AMD's LDS per workgroup).
        registers: 32-bit registers per thread at most.
        warpgroup_mma: Hopper's wgmma (four warps issue one matrix instruction).
        base: the architecture whose tables a derived one inherits, or None.
    """

    name: str
    vendor: str
    target: tuple[str, Any, int]
    shared_memory: int
    registers: int = 255
    warpgroup_mma: bool = False
    base: str | None = None

    @property
    def warp_size(self) -> int:
        return self.target[2]


ARCHES: dict[str, Arch] = {a.name: a for a in (
    Arch("sm_90", "nvidia", ("cuda", 90, 32), 227 * 1024, warpgroup_mma=True),
    Arch("sm_80", "nvidia", ("cuda", 80, 32), 163 * 1024, base="sm_90"),
    Arch("sm_86", "nvidia", ("cuda", 86, 32), 99 * 1024, base="sm_80"),
    Arch("sm_89", "nvidia", ("cuda", 89, 32), 99 * 1024, base="sm_80"),
    Arch("gfx942", "amd", ("hip", "gfx942", 64), 64 * 1024, registers=512, base="sm_90"),
    Arch("gfx90a", "amd", ("hip", "gfx90a", 64), 64 * 1024, registers=512, base="gfx942"),
    Arch("gfx950", "amd", ("hip", "gfx950", 64), 160 * 1024, registers=512, base="gfx942"),
    Arch("gfx1100", "amd", ("hip", "gfx1100", 32), 64 * 1024, registers=256, base="gfx942"),
)}


def arch(name: str) -> Arch:
    """The architecture called ``name``; an unknown name lists the known ones."""
    found = ARCHES.get(name)
    if found is None:
        raise ValueError(f"unknown architecture {name!r}: expected one of {', '.join(ARCHES)}")
    return found
