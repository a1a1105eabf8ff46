"""What the sm_90 images' machine code must keep, read on the CPU machine (Triton compiles
for sm_90 here; its package carries cuobjdump): properties that cost speed, not
correctness, so no numerical test would notice them going."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aotattn import families
from aotattn.compiler.jobs import Job, _triton_inputs, compile_job
from aotattn.spec import Config, Functional
from aotattn.tune import candidates
from aotattn.tune import flash as tune_flash
from aotattn.tuning.format import parse_config

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TILES = Config.of(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(CUOBJDUMP), flag, str(path)], check=True, capture_output=True, text=True).stdout


def sass(cubin: bytes) -> str:
    return cuobjdump(cubin, "--dump-sass")


def image_sass(table: str, pad_head: bool) -> str:
    axes = dict(dtype="bf16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=pad_head, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0)
    if table == "flash.attn_bwd_fused":
        axes["ATOMIC_DQ"] = True
    functional = Functional.of(axes)
    _, cubin = compile_job(Job("sm_90", table, functional, TILES))
    return sass(cubin)


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
@pytest.mark.parametrize("table", ["flash.attn_bwd_dkdv", "flash.attn_bwd_dq", "flash.attn_bwd_fused"])
def test_unpadded_gradient_tiles_are_stored_16_bytes_at_a_time(table):
    """The unpadded variants know every head-dim column is inside the head (common.head_columns),
    so dK, dV and dQ leave in 16-byte stores. With a runtime ``offs < head_dim`` column mask
    the images stored them two bytes at a time: dK/dV 1.3-1.5x slower at seqlen 512 than
    the same kernel through Triton's JIT, which had seen head_dim divisible by 16. The fused
    backend's atomic dQ adds go four floats at a time for the same reason."""
    unpadded = image_sass(table, pad_head=False)
    assert "STG.E.128" in unpadded
    assert "STG.E.U16" not in unpadded
    if table == "flash.attn_bwd_fused":
        assert "REDG.E.ADD.F32x4" in unpadded



@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
@pytest.mark.parametrize("table", ["flash.attn_fwd", "flash.attn_bwd_dkdv", "flash.attn_bwd_dq", "flash.attn_bwd_fused"])
def test_padded_head_tiles_move_16_bytes_at_a_time(table):
    """The padded variants are built ``aligned8`` (rules._variant_of: rows of 16 bytes, head
    dims multiples of 8), so the head-dim mask is constant over each 8 columns and every
    tile moves in 16-byte loads and stores. Without those hints (generic) the same kernels
    loaded and stored two bytes at a time: 192-320 LDG.E.U16 per kernel, 0.5-0.7x
    SDPA-flash at seqlen 1024 with the copies to the bucket in front (RESULTS.md)."""
    padded = image_sass(table, pad_head=True)
    assert "LDG.E.U16" not in padded and "STG.E.U16" not in padded
    assert "STG.E.128" in padded
    assert "LDGSTS.E.BYPASS.128" in padded or "LDG.E.128" in padded


@pytest.mark.parametrize("table", ["flash.dropout_mask", "flash.attn_fwd"])
def test_a_dropout_threshold_of_one_compiles_as_the_jit_passes_it(table):
    """Triton's JIT turns an integer argument equal to 1 into a constant: dropout_p near 2^-16
    (threshold round(p * 2^16) = 1) reached the kernels as a Python int, and `.to()` on it
    failed to compile on the GPU (the interpreter and the images pass a tensor)."""
    spec = families.kernels()[table]
    functional = next(f for f in spec.enumerate_functionals()
                      if f.as_dict().get("DROPOUT", True) and f.as_dict().get("dtype", "bf16") == "bf16"
                      and f.as_dict().get("BLOCK_D", 64) == 64 and not f.as_dict().get("VARLEN", False))
    job = Job("sm_90", table, functional, Config.of(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1))
    fn, signature, constexprs, attrs, options = _triton_inputs(job)  # as the build compiles it, but:
    constexprs["dropout_threshold"] = 1
    signature["dropout_threshold"] = "constexpr"
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    assert compiled.asm["cubin"]


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
@pytest.mark.parametrize("table, tma", [("flash.attn_fwd", 2), ("flash.attn_bwd_dkdv", 1), ("flash.attn_bwd_dq", 1)])
def test_padded_heads_with_tma_load_through_the_bulk_copy_engine(table, tma):
    """TMA in a padded-head variant is a real choice: the descriptors span the real head
    dim (columns past it arrive as zeros), so its tiles come in UTMALDG bulk copies rather
    than the plain loop's loads (before, padded variants ignored the knob)."""
    axes = dict(dtype="bf16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=True, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0)
    config = Config.of(TILES.as_dict(), num_stages=3, TMA=tma)
    _, cubin = compile_job(Job("sm_90", table, Functional.of(axes), config))
    assert "UTMALDG" in sass(cubin)
    assert "UTMALDG" not in image_sass(table, pad_head=True)


def resources(cubin: bytes) -> dict[str, int]:
    usage = cuobjdump(cubin, "--dump-resource-usage")
    return {name: int(value) for name, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
@pytest.mark.parametrize("head_dim, mask, tiles", [
    (256, 0, "BLOCK_M=64 BLOCK_N=64 STAGES=2"),  # the column split
    (256, 2, "BLOCK_M=64 BLOCK_N=64 STAGES=2"),
    (128, 0, "BLOCK_M=64 BLOCK_N=128 STAGES=3"),  # the key split
    (128, 2, "BLOCK_M=64 BLOCK_N=128 STAGES=2"),
    (256, 2, "BLOCK_M=64 BLOCK_N=64 STAGES=2 PERSISTENT=1"),  # the tile loop around the step loop
    (128, 2, "BLOCK_M=64 BLOCK_N=128 STAGES=3 PERSISTENT=1"),
    (128, 2, "BLOCK_M=64 BLOCK_N=128 STAGES=3 PERSISTENT=2"),
    (256, 2, "BLOCK_M=64 BLOCK_N=64 STAGES=2 NARROW=1"),  # padded heads: 128 + 64 below 193, halves above
    (256, 0, "BLOCK_M=64 BLOCK_N=64 STAGES=2 NARROW=1 PERSISTENT=1"),
    (128, 0, "BLOCK_M=64 BLOCK_N=128 STAGES=2 PERSISTENT=1 TMA_STORE=1"),  # dK/dV by bulk stores
    (64, 2, "BLOCK_M=64 BLOCK_N=128 STAGES=3 TMA_STORE=1"),
    (128, 0, "BLOCK_M=64 BLOCK_N=128 STAGES=1 PERSISTENT=1 KV_SLOTS=2"),  # K/V by a warp of their own, 2 slots
    (128, 2, "BLOCK_M=64 BLOCK_N=128 STAGES=1 PERSISTENT=2 KV_SLOTS=2 TMA_STORE=1"),
    (64, 2, "BLOCK_M=64 BLOCK_N=128 STAGES=3 PERSISTENT=1 KV_SLOTS=2"),
    (256, 2, "BLOCK_M=64 BLOCK_N=64 STAGES=2 TMA_STORE=1"),  # the column split's halves by bulk stores
    (256, 0, "BLOCK_M=64 BLOCK_N=64 STAGES=2 PERSISTENT=1 TMA_STORE=1"),
])
def test_the_ws_backward_keeps_its_registers(head_dim, mask, tiles):
    """The ws backward's consumers spill nothing (no stack): with the wgmma descriptors of
    K, V and the dO slot hoisted out of the step loop (backward_ws._step_zero), one d256
    consumer spilled 15-23 registers a step and ran 20% more instructions than the other,
    which waits for it at every step; the d128 key split spilled 1-3."""
    spec = families.kernels()["flash.attn_bwd_ws"]
    axes = dict(dtype="bf16", BLOCK_D=head_dim, BLOCK_DV=head_dim, PAD_HEAD="NARROW" in tiles, MASK=mask,
                VARLEN=False, DROPOUT=False, BIAS=0)
    config = parse_config(spec, f"{tiles} num_warps=4 num_stages=1", "tiles")
    entry, cubin = compile_job(Job("sm_90", "flash.attn_bwd_ws", Functional.of(axes), config))
    used = resources(cubin)
    assert used["STACK"] == 0, used
    # the tuner's estimate of its shared memory is the compiler's within 1 KB (the pruning rests on it)
    estimate = candidates.shared_bytes(tune_flash.footprint("flash.attn_bwd_ws"), Functional.of(axes), config,
                                       candidates.target("sm_90"))
    assert abs(estimate - entry.shared) <= 1024, (estimate, entry.shared)
    stores = re.findall(r"\b(STG\S*|UTMASTG\S*)", sass(cubin))
    if "TMA_STORE=1" in tiles:  # dK and dV by two bulk copies a consumer, nothing from registers
        assert stores and all(s.startswith("UTMASTG") for s in stores), stores
    else:
        assert "UTMASTG.4D" not in stores and len(stores) >= 64, len(stores)
