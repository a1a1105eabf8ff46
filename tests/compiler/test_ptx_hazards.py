"""The build's scan for registers a running wgmma still reads (aotattn.compiler.ptx_hazards),
on small PTX programs of known answer and on the kernel where the H200 showed the hazard:
the fused backward's d256 dropout variant, whose dK came back wrong (0.17 where the exact
answer is 0) because a tail select wrote into the dK wgmma's A-operand registers."""

from __future__ import annotations

import pytest

from aotattn.compiler import builder, jobs
from aotattn.compiler.jobs import Job, compile_job
from aotattn.compiler.ptx_hazards import HazardError, wgmma_hazards
from aotattn.runtime import launcher
from aotattn.spec import Config, Functional

RS = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1,%r2,%r3,%r4}, {%r10,%r11,%r12,%r13}, %rd5, p, 1, 1, 1;"
SS = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1,%r2,%r3,%r4}, %rd4, %rd5, p, 1, 1, 0, 0;"
COMMIT = "wgmma.commit_group.sync.aligned;"


def program(*lines: str) -> str:
    body = "\n".join(f"\t{line}" if not line.endswith(":") else line for line in lines)
    return f".visible .entry k()\n{{\n{body}\n\tret;\n}}\n"


def touched(ptx: str) -> list[tuple[str, ...]]:
    return [h.registers for h in wgmma_hazards(ptx)]


def test_writing_an_a_register_before_the_wait_is_found():
    ptx = program("wgmma.fence.sync.aligned;", RS, COMMIT, "mov.b32 %r11, %r20;",
                  "wgmma.wait_group.sync.aligned 0;")
    hazards = wgmma_hazards(ptx)
    assert [h.registers for h in hazards] == [("%r11",)]
    assert "mov.b32" in hazards[0].text and hazards[0].line > hazards[0].wgmma_line


def test_writes_and_reads_after_the_wait_are_fine():
    ptx = program(RS, COMMIT, "wgmma.wait_group.sync.aligned 0;", "mov.b32 %r11, %r20;",
                  "add.f32 %r30, %r1, %r2;", "st.shared.b32 [%r40], %r3;")
    assert wgmma_hazards(ptx) == []


def test_reading_an_a_register_while_the_wgmma_runs_is_allowed():
    ptx = program(RS, COMMIT, "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%r40], {%r10, %r11, %r12, %r13};",
                  "add.s32 %r41, %r12, 1;", "wgmma.wait_group.sync.aligned 0;")
    assert wgmma_hazards(ptx) == []


def test_the_accumulator_belongs_to_the_wgmma_chain_until_the_wait():
    chain = program(RS, SS, COMMIT, "wgmma.wait_group.sync.aligned 0;", "add.f32 %r30, %r1, %r2;")
    assert wgmma_hazards(chain) == []
    early = program(RS, COMMIT, "add.f32 %r30, %r1, %r2;", "wgmma.wait_group.sync.aligned 0;")
    assert touched(early) == [("%r1", "%r2")]


def test_a_wait_covers_a_group_only_once_enough_later_groups_were_committed():
    # wait_group 1 lets the newest group run on: the first is covered once a second is committed
    one_group = program(RS, COMMIT, "wgmma.wait_group.sync.aligned 1;", "mov.b32 %r10, %r20;",
                        "wgmma.wait_group.sync.aligned 0;")
    assert touched(one_group) == [("%r10",)]
    two_groups = program(RS, COMMIT, SS.replace("%r1,%r2,%r3,%r4", "%r5,%r6,%r7,%r8"), COMMIT,
                         "wgmma.wait_group.sync.aligned 1;", "mov.b32 %r10, %r20;",
                         "wgmma.wait_group.sync.aligned 0;")
    assert touched(two_groups) == []
    uncommitted = program(RS, "wgmma.wait_group.sync.aligned 0;", "mov.b32 %r10, %r20;", COMMIT,
                          "wgmma.wait_group.sync.aligned 0;")
    assert touched(uncommitted) == [("%r10",)]


def test_every_path_is_followed_branches_and_loop_back_edges_included():
    # the fused backward's shape: the product issued, then a branch that rewrites its operand
    branch = program(RS, COMMIT, "@%p1 bra $L__BB0_2;", "selp.b16 %rs1, %rs2, 0x0000, %p2;",
                     "mov.b32 %r12, {%rs1, %rs2};", "$L__BB0_2:", "wgmma.wait_group.sync.aligned 0;")
    assert touched(branch) == [("%r12",)]
    # a loop whose next iteration writes the operand before it waits
    loop = program("$L__BB0_1:", "mov.b32 %r13, %r20;", "wgmma.fence.sync.aligned;", RS, COMMIT,
                   "@%p1 bra $L__BB0_1;", "wgmma.wait_group.sync.aligned 0;")
    assert ("%r13",) in touched(loop)
    waits_first = program("$L__BB0_1:", "wgmma.wait_group.sync.aligned 0;", "mov.b32 %r13, %r20;", RS, COMMIT,
                          "@%p1 bra $L__BB0_1;", "wgmma.wait_group.sync.aligned 0;")
    assert wgmma_hazards(waits_first) == []


def test_inline_asm_blocks_and_several_instructions_on_a_line_are_read():
    ptx = program(RS, COMMIT, "{ .reg .pred k; setp.ge.s32 k, %r50, %r51; selp.f32 %r12, %r52, 0f00000000, k; }",
                  "wgmma.wait_group.sync.aligned 0;")
    assert touched(ptx) == [("%r12",)]


D256_DROPOUT_FUSED = Job("sm_90", "flash.attn_bwd_fused", Functional.of(dict(
    dtype="fp16", BLOCK_D=256, BLOCK_DV=256, PAD_HEAD=False, MASK=0, VARLEN=False, DROPOUT=True, BIAS=0,
    ATOMIC_DQ=True)), Config.of(BLOCK_M=16, BLOCK_N=64, num_warps=8, num_stages=2))


def test_the_kernel_the_h200_caught_compiles_without_the_hazard():
    """The cell of the pinned GPU failure (tests/test_fuzz.py::PINNED_DROPOUT): its tail
    zeroing of dS now comes before the dK product, so nothing rewrites that product's
    registers; compile_job would raise HazardError otherwise."""
    entry, cubin = compile_job(D256_DROPOUT_FUSED)
    assert cubin and entry.num_warps == 8


def test_a_kernel_with_a_hazard_is_refused_and_the_build_reports_it(monkeypatch, tmp_path):
    def found(ptx):
        return [type("H", (), {"__str__": lambda self: "PTX line 7 (mov.b32 %r1, %r2) touches %r1"})()]

    monkeypatch.setattr(jobs.ptx_hazards, "wgmma_hazards", found)
    job = Job("sm_90", "rmsnorm.rmsnorm_fwd", Functional.of(dict(dtype="bf16", BLOCK=1024, HAS_WEIGHT=True)),
              Config.of(num_warps=4, num_stages=1))
    with pytest.raises(HazardError, match=r"registers a running wgmma reads, first: PTX line 7"):
        compile_job(job)
    outcomes = builder.run_jobs([job], tmp_path / "cache", workers=1, timeout=300, on_outcome=lambda o: None)
    assert [o.status for o in outcomes] == ["failed"]
    assert "HazardError" in outcomes[0].message


def test_the_jit_path_scans_each_compiled_kernel_once(monkeypatch):
    """AOTATTN_MODE=jit (or auto without an image) runs what Triton's JIT compiled: the launcher
    scans each such kernel's PTX after its first launch and raises on a hazard."""
    class Compiled:
        def __init__(self, ptx, key):
            self.asm, self.hash, self.name = {"ptx": ptx}, key, "attn_bwd_fused"

    monkeypatch.setattr(launcher, "_checked", set())
    clean = Compiled(program(RS, COMMIT, "wgmma.wait_group.sync.aligned 0;", "mov.b32 %r11, %r20;"), "clean")
    launcher._check_once(clean)
    assert "clean" in launcher._checked
    bad = Compiled(program(RS, COMMIT, "mov.b32 %r11, %r20;", "wgmma.wait_group.sync.aligned 0;"), "bad")
    for _ in range(2):  # not marked checked: every launch of it raises
        with pytest.raises(HazardError, match=r"^attn_bwd_fused: 1 write\(s\) to registers a running wgmma reads"):
            launcher._check_once(bad)
    scans = []
    monkeypatch.setattr("aotattn.compiler.ptx_hazards.wgmma_hazards", lambda ptx: scans.append(ptx) or [])
    launcher._check_once(clean)
    assert scans == []  # scanned once already


def _jit_compile(spec, functional, config, values):
    """Compile ``spec`` for sm_90 the way Triton's JIT specializes a call with these integer
    argument values (constants for 1, divisibility hints for multiples of 16), honouring the
    launcher's JIT function's do_not_specialize flags; pointers are taken aligned."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    fn = launcher.jit_function(spec)
    signature = spec.signature(functional)
    constexprs = dict(spec.constexprs(functional, config))
    attrs = {}
    for i, (arg, param) in enumerate(zip(spec.arguments, fn.params)):
        if arg.type.startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        value = values.get(arg.name, 3)  # neither 1 nor a multiple of 16
        if isinstance(value, float):
            continue
        kind, spec_ = native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize, True)
        if kind == "constexpr":
            constexprs[arg.name] = spec_
        elif spec_ == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    return triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def test_the_jit_takes_sizes_as_plain_integers_like_the_images():
    """The H200 (sixteenth session's next call): AOTATTN_MODE=auto without images, a d224
    backward with one query row raised HazardError. Triton's JIT had folded max_seqlen_q = 1
    into the padded d256-bucket dK/dV (m16 n64, 8 warps), a program the images never hold,
    and that one rewrites a running wgmma's accumulator. The launcher's JIT function now
    leaves the integers the declaration does not mark aligned unspecialized, as the images
    take them; aligned ones keep their divisibility hints."""
    from aotattn.families.flash import rules

    spec = rules.ATTN_BWD_DKDV
    fn = launcher.jit_function(spec)
    flags = {p.name: p.do_not_specialize for p in fn.params}
    for arg in spec.arguments:
        assert flags[arg.name] == (not arg.aligned and not arg.type.startswith("*")), arg.name
    functional = Functional.of(dict(dtype="bf16", BLOCK_D=256, BLOCK_DV=256, PAD_HEAD=True, MASK=0, VARLEN=False,
                                    DROPOUT=False, BIAS=0))
    config = Config.of(BLOCK_M=16, BLOCK_N=64, num_warps=8, num_stages=2)
    values = dict(max_seqlen_q=1, max_seqlen_k=333, num_heads_q=2, group_size=2, head_dim=224, head_dim_v=224,
                  sm_scale=0.07, qk_scale=0.1, window_left=1 << 30, window_right=1 << 30)
    for name in ("stride_qz", "stride_qh", "stride_qm", "stride_kz", "stride_kh", "stride_kn", "stride_vz",
                 "stride_vh", "stride_vn", "stride_doz", "stride_doh", "stride_dom", "stride_dkz", "stride_dkh",
                 "stride_dkn", "stride_dvz", "stride_dvh", "stride_dvn", "stride_sz", "stride_sh", "stride_sp"):
        values[name] = 448
    compiled = _jit_compile(spec, functional, config, values)
    assert compiled.src.signature["max_seqlen_q"] == "i32"
    assert wgmma_hazards(compiled.asm["ptx"]) == []
    try:  # what the JIT compiled before: max_seqlen_q folded to 1
        for p in fn.params:
            p.do_not_specialize = False
        folded = _jit_compile(spec, functional, config, values)
    finally:
        fn._aotattn_specialized = False
        launcher.jit_function(spec)
    assert folded.src.signature["max_seqlen_q"] == "constexpr"  # a constant of that program
    assert wgmma_hazards(folded.asm["ptx"]), "the folded program no longer shows the hazard: rewrite this test"
