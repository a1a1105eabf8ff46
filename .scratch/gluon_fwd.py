"""Prototype: a warp-specialized Hopper forward in Gluon (one TMA loader warp, two
consumer warpgroups of 64 rows each sharing a K/V ring, intra-warpgroup overlap of the
softmax with the P V product). Not part of the package yet."""

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@gluon.jit
def _loader(loads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            CONSUMERS: gl.constexpr):
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, m0, lo, hi = loads
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [m0 + c * BLOCK_M, 0], q_bar.index(c), q_smem.index(c))
    i = 0
    for start_n in range(lo, hi, BLOCK_N):
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(kv_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [start_n, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [start_n, 0], v_ready.index(s), v_smem.index(s))
        i += 1


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, start_n, rows, seqlen_k, diag, MASKED: gl.constexpr,
                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """m_i in the scaled log2 domain; p = exp2(s * qk_scale - m) in one FMA per score."""
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = cols[None, :] < seqlen_k
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + diag)
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _turn_wait(turn, c: gl.constexpr, t, PINGPONG: gl.constexpr):
    """Ping-pong: consumer c issues its matrix products at point t only after the consumer
    before it issued its own (the first consumer's first turn is free)."""
    if PINGPONG:
        if c == 0:
            mbarrier.wait(turn.index(c), (t & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(c), t & 1)


@gluon.jit
def _turn_pass(turn, c: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((c + 1) % CONSUMERS), count=1)


@gluon.jit
def _consumer(c: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn,
              out_ptr, lse_ptr, stride_om, m0, lo, hi, first_masked, seqlen_q, seqlen_k, diag, qk_scale,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    rows = m0 + c * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q = q_smem.index(c)
    mbarrier.wait(q_bar.index(c), 0)

    n_blocks = (hi - lo + BLOCK_N - 1) // BLOCK_N
    # block 0: scores and softmax, its P V waits for the next block's scores
    mbarrier.wait(k_ready.index(0), 0)
    _turn_wait(turn, c, 0, PINGPONG)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _turn_pass(turn, c, PINGPONG, CONSUMERS)
    s = warpgroup_mma_wait(0, deps=(s, ))
    if lo >= first_masked:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, lo, rows, seqlen_k, diag, True, CAUSAL, BLOCK_N,
                                           s_layout)
    else:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, lo, rows, seqlen_k, diag, False, CAUSAL,
                                           BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for i in range(1, n_blocks):
        start_n = lo + i * BLOCK_N
        st = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (i // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
        _turn_wait(turn, c, i, PINGPONG)
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        _turn_pass(turn, c, PINGPONG, CONSUMERS)
        s = warpgroup_mma_wait(1, deps=(s, ))
        if start_n >= first_masked:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, start_n, rows, seqlen_k, diag, True, CAUSAL,
                                               BLOCK_N, s_layout)
        else:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, start_n, rows, seqlen_k, diag, False,
                                               CAUSAL, BLOCK_N, s_layout)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    _turn_wait(turn, c, n_blocks, PINGPONG)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    _turn_pass(turn, c, PINGPONG, CONSUMERS)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_empty.index(last), count=1)

    empty = l_i == 0.0
    inv_l = 1.0 / gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    out = acc * gl.convert_layout(inv_l, row_o)[:, None]
    orows = m0 + c * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    ocols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = out_ptr + orows[:, None].to(gl.int64) * stride_om + ocols[None, :]
    gl.store(o_ptrs, out.to(dtype), mask=orows[:, None] < seqlen_q)
    gl.store(lse_ptr + rows, lse, mask=rows < seqlen_q)


@gluon.jit
def _consumer0(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, lse_ptr, stride_om, m0, lo, hi,
     first_masked, seqlen_q, seqlen_k, diag, qk_scale) = args
    _consumer(0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, lse_ptr, stride_om, m0,
              lo, hi, first_masked, seqlen_q, seqlen_k, diag, qk_scale, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)


@gluon.jit
def _consumer1(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, lse_ptr, stride_om, m0, lo, hi,
     first_masked, seqlen_q, seqlen_k, diag, qk_scale) = args
    _consumer(1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, lse_ptr, stride_om, m0,
              lo, hi, first_masked, seqlen_q, seqlen_k, diag, qk_scale, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)


@gluon.jit
def _consumer2(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, lse_ptr, stride_om, m0, lo, hi,
     first_masked, seqlen_q, seqlen_k, diag, qk_scale) = args
    _consumer(2, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, lse_ptr, stride_om, m0,
              lo, hi, first_masked, seqlen_q, seqlen_k, diag, qk_scale, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)


@gluon.jit
def attn_fwd_ws(Q, K, V, Out, Lse,
                stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
                seqlen_q, seqlen_k, group_size, qk_scale,
                CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
                LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid (m blocks of CONSUMERS * BLOCK_M rows, Hq, B); num_warps 4 (the first consumer)."""
    pid_m = gl.program_id(0)
    off_h = gl.program_id(1)
    off_z = gl.program_id(2).to(gl.int64)
    num_m = gl.num_programs(0)
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    off_hk = (off_h // group_size).to(gl.int64)
    off_h = off_h.to(gl.int64)
    m0 = pid_m * (CONSUMERS * BLOCK_M)
    dtype: gl.constexpr = Q.dtype.element_ty

    diag = seqlen_k - seqlen_q  # bottom-right
    lo = 0
    if CAUSAL:
        hi = gl.minimum(seqlen_k, m0 + CONSUMERS * BLOCK_M + diag)
        first_masked = gl.minimum(((m0 + diag + 1) // BLOCK_N) * BLOCK_N, (seqlen_k // BLOCK_N) * BLOCK_N)
        first_masked = gl.maximum(first_masked, 0)
    else:
        hi = seqlen_k
        first_masked = (seqlen_k // BLOCK_N) * BLOCK_N
    hi = gl.maximum(hi, 1)  # at least one block (rows that see nothing still run it, masked)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
    q_desc = tma.make_tensor_descriptor(Q + off_z * stride_qz + off_h * stride_qh, shape=[seqlen_q, HEAD_D],
                                        strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_D], layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K + off_z * stride_kz + off_hk * stride_kh, shape=[seqlen_k, HEAD_D],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_D], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V + off_z * stride_vz + off_hk * stride_vh, shape=[seqlen_k, HEAD_D],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_D], layout=kv_layout)

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=CONSUMERS)
    fence_async_shared()

    out_ptr = Out + off_z * stride_oz + off_h * stride_oh
    lse_ptr = Lse + off_z * stride_lz + off_h * stride_lh
    args = (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, out_ptr, lse_ptr, stride_om, m0, lo,
            hi, first_masked, seqlen_q, seqlen_k, diag, qk_scale)
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, m0, lo, hi)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer0, (args, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)),
            (_consumer1, (args, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)),
            (_loader, (loads, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer0, (args, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)),
            (_consumer1, (args, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)),
            (_consumer2, (args, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, PINGPONG, CONSUMERS)),
            (_loader, (loads, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])


def compile_sm90(head_d=128, block_n=128, stages=2, causal=False, consumers=2, pingpong=True, dtype="bf16",
                 loader_regs=24, consumer_regs=240):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {n: f"*{dtype}" for n in ["Q", "K", "V", "Out"]}
    sig["Lse"] = "*fp32"
    for n in ["stride_qz", "stride_qh", "stride_qm", "stride_kz", "stride_kh", "stride_kn", "stride_vz",
              "stride_vh", "stride_vn", "stride_oz", "stride_oh", "stride_om", "stride_lz", "stride_lh",
              "seqlen_q", "seqlen_k", "group_size"]:
        sig[n] = "i32"
    sig["qk_scale"] = "fp32"
    constexprs = dict(CAUSAL=causal, HEAD_D=head_d, BLOCK_M=64, BLOCK_N=block_n, STAGES=stages,
                      CONSUMERS=consumers, PINGPONG=pingpong, LOADER_REGS=loader_regs, CONSUMER_REGS=consumer_regs)
    sig.update({k: "constexpr" for k in constexprs})
    return triton.compile(GluonASTSource(attn_fwd_ws, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})


if __name__ == "__main__":
    import sys
    k = compile_sm90(*[int(a) for a in sys.argv[1:4]])
    print(k.metadata.shared, k.metadata.num_warps, k.metadata.global_scratch_size)
