"""benchmarks/sass_loops.py: the loops of a kernel's sm_90 machine code, read on the CPU
machine (the seventh session's figures in benchmarks/RESULTS.md came from it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.compiler.test_machine_code import CUOBJDUMP

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_loops.py"
_SPEC = importlib.util.spec_from_file_location("sass_loops", _PATH)
sass_loops = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_loops)


def _line(address: int, text: str) -> str:
    return f"        /*{address:04x}*/                   {text} ;   /* 0x0000000000000000 */"


def test_a_loop_is_a_backward_branch_before_the_exit():
    sass = "\n".join([
        _line(0x00, "@P0 EXIT"),                          # an early, predicated exit: the body goes on
        _line(0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"),
        _line(0x20, "MUFU.EX2 R1, R1"),
        _line(0x30, "LDL R2, [R1]"),
        _line(0x40, "@!P1 BRA 0x10"),                     # the loop: 0x10 .. 0x40
        _line(0x50, "EXIT"),
        _line(0x60, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3"),
        _line(0x70, "@!P0 BRA 0x20"),                     # a barrier-wait retry after the exit: no loop
        _line(0x80, "BRA 0x80"),
    ])
    (loop,) = sass_loops.loops(sass)
    assert (loop["start"], loop["end"], loop["instructions"]) == (0x10, 0x40, 4)
    assert (loop["HGMMA"], loop["EX2"], loop["LDL"], loop["STL"]) == (1, 1, 1, 0)


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
def test_the_forward_compiled_for_sm90_has_its_key_block_loops(capsys):
    """The dense forward: the interior and the sequence-end loop, each with its Q K^T and P V
    wgmmas and its exponentials, no spills; a bad knob value is refused."""
    assert sass_loops.main(["attn_fwd", "--where", "BLOCK_D=64 BLOCK_DV=64",
                            "--config", "BLOCK_M=64 BLOCK_N=64 num_warps=4 num_stages=2"]) == 0
    out = capsys.readouterr().out
    loops = [line for line in out.splitlines() if line.strip().startswith("loop ")]
    assert len(loops) == 2 and all("LDL 0, STL 0" in line and "HGMMA 0" not in line for line in loops), out
    with pytest.raises(ValueError):
        sass_loops.main(["attn_fwd", "--config", "BLOCK_M=64 BLOCK_N=64 num_warps=4 num_stages=2 TMA=3"])
