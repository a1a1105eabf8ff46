"""The tuner's harness of the flash-attention family: problems, runs and references.

For each tunable table it knows how to build a problem of a given size that exercises a
functional, run one candidate configuration on it (through the same launch plans and
launcher the operators use: from images on a GPU, in the interpreter on CPU tensors),
and compare the outputs with the float64 reference (:mod:`aotattn.families.flash.reference`).

Tables: the forward kernel, the three backward kernels (dK/dV, dQ, fused) and the
backward operator (``flash.backward``: the backend, timed as the whole backward pass).
Dropout functionals are timed and checked at ``dropout_p`` = :data:`DROPOUT_P` (the kernels
draw every element's random bits whatever p is), against the reference applied with the
exact keep-mask the kernels use. Functionals with an additive bias or varlen are not tuned
yet (their tables keep their hand-picked blocks); ``supports`` says which are.

This module is the family-specific part of the tuner; everything else in
:mod:`aotattn.tune` knows no family by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aotattn.families.flash import planning, reference, rules
from aotattn.families.flash.checks import check_flash
from aotattn.runtime import launch
from aotattn.runtime.images import entry_key
from aotattn.spec import Config, Functional
from aotattn.tune.candidates import Footprint, Tile

DROPOUT_P = 0.1  # the rate dropout cells are timed and checked at (flash-attn's usual training value)
MASK_KWARGS = {rules.MASK_NONE: {}, rules.MASK_TOP_LEFT: {"causal": True, "diagonal": "top_left"},
               rules.MASK_BOTTOM_RIGHT: {"causal": True}}

# What one program keeps (docs/tuner.md, "Pruning"): checked against compiled sm_90
# kernels' shared memory in tests/tune/test_candidates.py.
_Q, _K, _V = Tile("BLOCK_M", "BLOCK_D"), Tile("BLOCK_N", "BLOCK_D"), Tile("BLOCK_N", "BLOCK_DV")
_DO = Tile("BLOCK_M", "BLOCK_DV")
_BIAS = Tile("BLOCK_M", "BLOCK_N", when="BIAS")
_ROWS = (Tile("BLOCK_M", 1, "fp32"), Tile("BLOCK_M", 1, "fp32"))  # the query rows' stats (lse, delta)
_SCORES = (Tile("BLOCK_M", "BLOCK_N", "fp32"),)
_PADS = (("BLOCK_M", "seqlen_q"), ("BLOCK_N", "seqlen_k"))


def _ws_registers(values: Mapping[str, Any]) -> str | None:
    """A consumer warpgroup of attn_fwd_ws holds its 64 rows' output and scores in fp32 and
    P in 16 bits; with ~32 registers for addresses and loop state that must fit the
    partition's budget (kernels/forward_ws.consumer_regs: 240 with two consumers, 160
    with three)."""
    from aotattn.families.flash.kernels.forward_ws import consumer_regs  # noqa: PLC0415 (Gluon, on demand)

    if values.get("Q_SLOTS", 1) == 2 and not values.get("PERSISTENT", 0):
        return "Q_SLOTS=2 loads the next tile's Q ahead: one tile per program has none (PERSISTENT=1)"
    if values.get("PERSISTENT", 0) == 2 and values.get("MASK", 0) == rules.MASK_NONE:
        return "PERSISTENT=2 orders masked tiles only: without a mask it is PERSISTENT=1"
    held = (64 * values["BLOCK_D"] + 64 * values["BLOCK_N"] * 3 // 2) // 128
    budget = consumer_regs(values["BLOCK_M"] // 64) - 32
    if held > budget:
        return f"a consumer's tiles ~{held} registers/thread > its budget {budget}"
    return None


def _ws_bwd_registers(values: Mapping[str, Any]) -> str | None:
    """A consumer warpgroup of attn_bwd_ws holds dK and dV of its keys (BLOCK_N=128: 64
    keys, every column) or of its columns (BLOCK_N=64: every key, half the columns) and the
    step's scores and dP of its queries in fp32; with ~32 registers for addresses, lse and
    loop state that must fit its budget (kernels/backward_ws.consumer_regs: 240). The column
    split is for head dim 256 alone: at 64 and 128 it ran 0.63-0.73x the key split (RESULTS.md,
    sixteenth session)."""
    from aotattn.families.flash.kernels.backward_ws import consumer_regs  # noqa: PLC0415 (Gluon, on demand)

    columns = values["BLOCK_N"] == 64
    if values.get("PERSISTENT", 0) == 2 and values.get("MASK", 0) == rules.MASK_NONE:
        return "PERSISTENT=2 orders masked tiles only: without a mask it is PERSISTENT=1"
    if columns != (values["BLOCK_D"] == 256):
        return "the column split (BLOCK_N=64) serves head dim 256, the key split (BLOCK_N=128) 64 and 128"
    if values.get("NARROW", 0) and not (columns and values["PAD_HEAD"]):
        return "NARROW splits the padded heads of the column split (head dims up to 192 in the d256 bucket)"
    if values.get("TMA_STORE", 0) and values.get("NARROW", 0):
        return "TMA_STORE stages dK and dV of the key split or of the column split's halves, not NARROW's 128 + 64"
    if values.get("KV_SLOTS", 1) == 2 and not values.get("PERSISTENT", 0):
        return "KV_SLOTS=2 loads the next tile's K and V ahead: one tile per program has none (PERSISTENT=1)"
    if values["STAGES"] == 1 and (values.get("KV_SLOTS", 1) == 1 or values["BLOCK_D"] != 128):
        return "STAGES=1 makes room for KV_SLOTS=2 at d128 (d64 has room for both, d256 for neither)"
    held = (2 * 64 * values["BLOCK_D"] + 2 * 64 * values["BLOCK_M"]) // (2 if columns else 1) // 128
    budget = consumer_regs(2) - 32
    if held > budget:
        return f"a consumer's tiles ~{held} registers/thread > its budget {budget}"
    return None


def _ws_columns(values: Mapping[str, Any]) -> bool:
    """attn_bwd_ws with BLOCK_N=64: the consumers split the columns (kernels/backward_ws.py)."""
    return values["BLOCK_N"] == 64


def _ws_keys(values: Mapping[str, Any]) -> bool:
    return not _ws_columns(values)


def _two_kv_slots(values: Mapping[str, Any]) -> bool:
    """attn_bwd_ws with KV_SLOTS=2: a second K and V slot (and its two mbarriers)."""
    return values.get("KV_SLOTS", 1) == 2


def _backend_runs(values: Mapping[str, Any]) -> str | None:
    """The backward operator's ws choice exists only where attn_bwd_ws serves the cell."""
    kernel = {**values, "BLOCK_DV": values["BLOCK_D"]}  # an operator cell's heads are one bucket
    if values["backend"] == "ws" and not rules.ws_backward_serves(kernel, values["arch"], values["DETERMINISTIC"]):
        return "the ws backend does not serve this cell (fp16/bf16, d64/d128/d256, dense, not deterministic, sm_90)"
    return None


FOOTPRINTS: dict[str, Footprint] = {
    # OVERLAP: the interior's first K tile is loaded outside the pipelined loop, and the
    # next block's scores are alive beside the current ones (TMA: the same tiles, through
    # descriptors; in padded heads too, spanning the real head dim)
    "attn_fwd": Footprint(resident=(_Q, Tile("BLOCK_N", "BLOCK_D", when="OVERLAP")), pipelined=(_K, _V, _BIAS),
                          accumulators=(Tile("BLOCK_M", "BLOCK_DV", "fp32"), *_SCORES,
                                        Tile("BLOCK_M", "BLOCK_N", "fp32", when="OVERLAP")), pads=_PADS,
                          loop=("BLOCK_N", "seqlen_k")),
    # attn_fwd_ws: each consumer's Q tile resident (two with Q_SLOTS=2), K and V in rings
    # STAGES deep, the output's staging tiles with TMA_STORE; its accumulators are per
    # consumer warpgroup (the budget), checked by _ws_registers
    "attn_fwd_ws": Footprint(resident=(_Q, Tile("BLOCK_M", "BLOCK_D", when=lambda v: v.get("Q_SLOTS", 1) == 2),
                                       Tile("BLOCK_M", "BLOCK_DV", when="TMA_STORE")),
                             pipelined=(_K, _V), stages="STAGES", budget=_ws_registers, pads=_PADS),
    # attn_bwd_ws: the program's K and V resident (in two slots with KV_SLOTS=2), q and its
    # rows' stats in a ring STAGES deep, dO in one too (the key split) or in one slot (the
    # column split), dS^T tiles double-buffered (and P^T's, in the column split) and the
    # consumers' fp32 dQ columns staged for the bulk reduce (D/2 each, or 64 of them at a
    # time in the column split); its mbarriers count at its largest tiles (4: K/V's ready and
    # empty, dS^T's two; 2 more with a second K/V slot; and 4 per stage)
    "attn_bwd_ws": Footprint(resident=(_K, _V, Tile("BLOCK_N", "BLOCK_D", when=_two_kv_slots),
                                       Tile("BLOCK_N", "BLOCK_DV", when=_two_kv_slots),
                                       Tile(1, 2, "int64", when=_two_kv_slots),
                                       Tile("BLOCK_N", "BLOCK_M"), Tile("BLOCK_N", "BLOCK_M"),
                                       Tile("BLOCK_N", "BLOCK_M", when=_ws_columns),
                                       Tile("BLOCK_N", "BLOCK_M", when=_ws_columns),
                                       Tile("BLOCK_M", "BLOCK_D", "fp32", when=_ws_keys),
                                       Tile("BLOCK_M", 128, "fp32", when=_ws_columns),
                                       Tile("BLOCK_M", "BLOCK_DV", when=_ws_columns), Tile(1, 4, "int64")),
                             pipelined=(_Q, Tile("BLOCK_M", "BLOCK_DV", when=_ws_keys), *_ROWS, Tile(1, 4, "int64")),
                             stages="STAGES", budget=_ws_bwd_registers, pads=_PADS),
    # the operator: which backends can run in a cell
    "backward": Footprint(budget=_backend_runs),
    "attn_bwd_dq": Footprint(resident=(_Q, _DO), pipelined=(_K, _V, _BIAS),
                             accumulators=(Tile("BLOCK_M", "BLOCK_D", "fp32"), *_SCORES, *_SCORES), pads=_PADS),
    "attn_bwd_dkdv": Footprint(resident=(_K, _V), pipelined=(_Q, _DO, *_ROWS, _BIAS),
                               accumulators=(Tile("BLOCK_N", "BLOCK_D", "fp32"), Tile("BLOCK_N", "BLOCK_DV", "fp32"),
                                             *_SCORES, *_SCORES),
                               mma_rows="BLOCK_N", mma_cols="BLOCK_M", pads=_PADS),
    # the fused kernel also keeps a second copy of the q and dO tiles (measured: one more
    # BLOCK_M x (D + Dv) than dK/dV alone, for the transposed operands of the dQ product)
    "attn_bwd_fused": Footprint(resident=(_K, _V, _Q, _DO), pipelined=(_Q, _DO, *_ROWS, _BIAS),
                                accumulators=(Tile("BLOCK_N", "BLOCK_D", "fp32"),
                                              Tile("BLOCK_N", "BLOCK_DV", "fp32"),
                                              Tile("BLOCK_M", "BLOCK_D", "fp32"), *_SCORES, *_SCORES),
                                mma_rows="BLOCK_N", mma_cols="BLOCK_M", pads=_PADS),
}
TABLES = ("flash.attn_fwd", "flash.attn_fwd_ws", "flash.attn_bwd_dkdv", "flash.attn_bwd_dq", "flash.attn_bwd_fused",
          "flash.attn_bwd_ws", "flash.forward", "flash.backward")
# the tables whose work is the forward pass (its output, the forward's FLOPs)
FORWARD_TABLES = ("flash.attn_fwd", "flash.attn_fwd_ws", "flash.forward")
_TORCH_DTYPES = {name: dtype for dtype, name in rules.DTYPES.items()}


@dataclass(frozen=True)
class Shape:
    """One attention problem: ``q (batch, seqlen_q, heads, head_dim)``, k and v alike with
    ``heads / group`` heads (a grouped-query problem when ``group`` > 1)."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    group: int = 1

    def __str__(self) -> str:
        grouped = f" G{self.group}" if self.group > 1 else ""
        return f"B{self.batch} H{self.heads}{grouped} Sq{self.seqlen_q} Sk{self.seqlen_k} D{self.head_dim}"


OPERATOR_TABLE = "flash.backward"  # timed at training sizes (default_tokens)
# query heads per key/value head of a grouped-query task (GROUPED=True), as the GQA models
# of the perfmon grid and Llama-style checkpoints; the ws backward's WIDE_GROUPS cells
# are timed at WIDE_GROUP
GROUP, WIDE_GROUP = rules.GROUP_WIDTH, rules.WIDE_GROUP_WIDTH


def group_of(functional: Functional) -> int:
    """Query heads per key/value head of a task's problems: :data:`WIDE_GROUP` for wide
    groups, :data:`GROUP` for other grouped ones, else 1."""
    f = functional.as_dict()
    return WIDE_GROUP if f.get("WIDE_GROUPS") else GROUP if f.get("GROUPED") else 1


def default_tokens(table: str) -> int:
    """``batch x heads x seqlen_q`` a table's tasks are timed at unless ``--tokens`` says.

    Kernel tables: 2^17, enough programs to fill the GPU many times over. The operator
    table: 2^19. Its choice is between split and fused, whose difference is memory
    traffic: fused accumulates dQ with fp32 atomics, and at 2^17 tokens that buffer
    (32 MB at D 64) and K, V fit the H200's 50 MB L2, so fused won cells at 2^17 that
    it lost by 10-25% at the 2^19-2^20 tokens of the benchmark grid and the models
    (benchmarks/RESULTS.md, 2026-11-30): timed where the working set is several times
    the L2, as in training steps.
    """
    return 2**19 if table == OPERATOR_TABLE else 2**17


def default_limit(table: str) -> int:
    """Candidates per cell the speed model keeps: 8 of a Triton kernel's hundreds; 72 of the
    warp-specialized forward's (its rings, partitions and persistent grid are what the model
    knows least): every tile (36 at d64, 28 at d128, 8 at d256) and the leading tiles' knob
    variants, of 216, 156 and 28 fitting. Beside them, the current choice's tile is timed with
    every knob (candidates.knob_variants)."""
    return 72 if table == "flash.attn_fwd_ws" else 8


def supports(table: str, functional: Functional, cell: tuple[int, ...] | None = None, arch: str | None = None) -> bool:
    """Whether this harness can build problems for the functional (dense or dropout, no bias,
    not varlen) at the cell: none where a call of the cell's lengths runs another MASK
    variant (rules.kernel_mask: top-left on the diagonal runs bottom-right), nor a top-left
    backward with fewer queries than keys and no dropout (its plans drop the keys no query
    sees, planning.trim_keys: a causal call runs the Sq x Sq cell). Grouped-query cells
    (``GROUPED=True``) are timed with groups of :data:`GROUP`, wide ones of :data:`WIDE_GROUP`
    (:func:`group_of`). ``arch``: the warp-specialized kernels' tables and the forward's
    engine choice exist only where those kernels run (sm_90); None, wherever they run."""
    f = functional.as_dict()
    if cell is not None and len(cell) == 2 and "MASK" in f \
            and rules.kernel_mask(f["MASK"], f.get("VARLEN", False), *cell) != f["MASK"]:
        return False
    if cell is not None and len(cell) == 2 and table not in FORWARD_TABLES and f.get("MASK") == rules.MASK_TOP_LEFT \
            and not f.get("DROPOUT") and cell[0] < cell[1]:
        return False
    if table in ("flash.attn_fwd_ws", "flash.forward") and not rules.ws_serves(f, arch):
        return False  # the forward table's choice matters only where the warp-specialized kernel serves
    if table == "flash.attn_bwd_ws" and not rules.ws_backward_serves(f, arch):
        return False
    return table in TABLES and not f.get("VARLEN") and not f.get("BIAS")


def footprint(table: str) -> Footprint | None:
    return FOOTPRINTS.get(table.split(".", 1)[1])


def image_key(table: str, functional: Functional, config: Config) -> str:
    """The key of the candidate's kernel in its image archive."""
    spec = rules.KERNELS[table.split(".", 1)[1]]
    functional = spec.compiled_functional(functional)
    return entry_key(functional.as_dict(), config.as_dict(), spec.variant(functional))


def flops(table: str, shape: Shape, functional: Functional) -> float:
    """Standard count: forward 4*B*H*Sq*Sk*D (halved when causal), backward 2.5x."""
    fwd = 4.0 * shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_k * shape.head_dim
    fwd /= 2 if functional["MASK"] != rules.MASK_NONE else 1
    return fwd if table in FORWARD_TABLES else 2.5 * fwd


def _previous(buckets: tuple[int, ...], bucket: int) -> int:
    i = buckets.index(bucket)
    return buckets[i - 1] if i > 0 else 0


def _irregular(bucket: int, lower: int, step: int) -> int:
    """A length in (lower, bucket], ``step`` below the bucket where it can be."""
    return max(lower + 1, bucket - step)


def head_dims(functional: Functional) -> tuple[int, int]:
    """Head dims exercising the functional: the bucket when unpadded; when padded, two below
    it that are multiples of 8 (what the padded kernels assume, rules._variant_of; smaller
    ones are padded to the bucket by copy): three quarters of the bucket, as the common
    off-bucket dims (96 for 128, 192 for 256, 48 for 64), timed; then the lowest above the
    bucket below (72, 136, 40)."""
    bucket = functional["BLOCK_D"]
    if not functional.as_dict().get("PAD_HEAD", False):
        return bucket, bucket
    lower = _previous(rules.HEAD_DIM_BUCKETS, bucket)
    unit = planning.ROW_UNIT
    return max(lower + unit, bucket * 3 // 4 // unit * unit), lower + unit


def timing_shape(functional: Functional, cell: tuple[int, ...], tokens: int = 2**17,
                 memory_bytes: int = 8 << 30, min_traffic: int = 0) -> Shape:
    """The problem timed for a cell: ``batch x heads x seqlen_q ~ tokens`` (fills the GPU),
    more batch where that reads and writes (q, k, v, o; k and v once per key head) less than
    ``min_traffic`` bytes (``Settings.min_traffic_bytes``).

    Heads as in a model of hidden size 2048 (``2048 / D``, as the benchmarks), batch
    the rest; capped so q, k, v and their gradients fit ``memory_bytes``.
    """
    seqlen_q = cell[0]
    seqlen_k = cell[1] if len(cell) > 1 else seqlen_q
    head_dim = head_dims(functional)[0]
    element = 4 if functional["dtype"] == "fp32" else 2
    group = group_of(functional)
    per_row = element * (2 * seqlen_q + 2 * seqlen_k) * head_dim  # q, o, k, v of one (batch, query head)
    fit = max(1, memory_bytes // (2 * per_row))  # rows whose tensors and gradients fit
    rows = max(1, min(tokens // seqlen_q, fit))  # batch x heads
    # what a row moves: its q and o, and its group's share of k and v (read once per key head)
    least = min(-(-min_traffic * group // (element * (2 * seqlen_q * group + 2 * seqlen_k) * head_dim)), fit)
    heads = max(1, min(max(rows, least), 2048 // functional["BLOCK_D"]))
    heads = max(group, heads // group * group)
    batch = max(1, rows // heads, min(-(-least // heads), fit // heads))
    return Shape(batch, heads, seqlen_q, seqlen_k, head_dim, group)


def accuracy_shapes(functional: Functional, cell: tuple[int, ...], batch: int = 3, heads: int = 5) -> list[Shape]:
    """Batch 3 x 5 heads: the cell's own lengths, then irregular lengths (and head dims) near it."""
    seqlen_q = cell[0]
    seqlen_k = cell[1] if len(cell) > 1 else seqlen_q
    low_q = _previous(rules.SEQLEN_BUCKETS, seqlen_q)
    low_k = _previous(rules.SEQLEN_BUCKETS, seqlen_k)
    d1, d2 = head_dims(functional)
    group = group_of(functional)
    heads = heads if group == 1 else 2 * group  # two key/value heads
    return [Shape(batch, heads, seqlen_q, seqlen_k, d1, group),
            Shape(batch, heads, _irregular(seqlen_q, low_q, 3), _irregular(seqlen_k, low_k, 5), d2, group)]


# ----------------------------------------------------------------------------- problems


class Problem:
    """Tensors of one shape for one task, refilled with fresh random values on demand.

    ``run(config)`` launches the table's work with that configuration (the other kernels
    of the pass use the database's, as a user call would) and returns its outputs.
    """

    def __init__(self, table: str, functional: Functional, shape: Shape, device: torch.device,
                 generator: torch.Generator | None = None):
        if not supports(table, functional):
            raise ValueError(f"the flash harness cannot build {table} [{functional}] (bias and varlen "
                             "functionals are not tuned yet)")
        self.table, self.kernel = table, table.split(".", 1)[1]
        self.forward = table in FORWARD_TABLES
        self.functional, self.shape, self.device = functional, shape, torch.device(device)
        self.generator = generator
        f = functional.as_dict()
        dtype = _TORCH_DTYPES[f["dtype"]]
        b, h, sq, sk, d = shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k, shape.head_dim
        self.q = torch.empty(b, sq, h, d, dtype=dtype, device=self.device)
        self.k = torch.empty(b, sk, h // shape.group, d, dtype=dtype, device=self.device)
        self.v = torch.empty(b, sk, h // shape.group, d, dtype=dtype, device=self.device)
        self.dout = torch.empty(b, sq, h, d, dtype=dtype, device=self.device)
        self.dropout_p = DROPOUT_P if f.get("DROPOUT") else 0.0
        p = check_flash(self.q, self.k, self.v, dropout_p=self.dropout_p, softmax_scale=None, window_size=(-1, -1),
                        **{"causal": False, "diagonal": "bottom_right", **MASK_KWARGS[f["MASK"]]})
        seed, offset = (torch.randint(0, 2**62, (2,), dtype=torch.int64, device=self.device,
                                      generator=generator).tolist()
                        if self.dropout_p else (0, 0))  # one mask per problem, for every candidate
        self.call = planning.Call(p, seed=seed, offset=offset)
        self._check_functional()
        self.out = torch.empty_like(self.dout)
        self.lse = torch.empty(b, h, sq, dtype=torch.float32, device=self.device)
        self.stats = planning.row_stats(p, self.q)
        self.dq = torch.empty(self.q.shape, dtype=self._dq_dtype(), device=self.device)
        self.dk, self.dv = torch.empty_like(self.k), torch.empty_like(self.v)
        self.refill()

    def _backward_choice(self) -> tuple[str, bool]:
        f = self.functional.as_dict()
        if self.kernel == "attn_bwd_fused":
            return "fused", not f["ATOMIC_DQ"]
        if self.kernel == "backward":
            return "", bool(f["DETERMINISTIC"])
        if self.kernel == "attn_bwd_ws":
            return "ws", False
        return "split", False

    def _dq_accumulates(self) -> bool:
        return planning.dq_accumulates(*self._backward_choice())

    def _dq_dtype(self) -> torch.dtype:
        return torch.float32 if self._dq_accumulates() else self.q.dtype

    def _check_functional(self) -> None:
        """The problem must select exactly the task's functional (else it times another kernel)."""
        if not self.functional.as_dict().get("PAD_HEAD") and not self.call.tiles_aligned(self.q, self.k, self.v):
            raise ValueError(f"{self.shape}: tensors not 16-byte aligned, the aligned variant cannot run")
        got = self.call.functional(backward=not self.forward)
        want = self.functional.as_dict()
        if self.kernel == "backward":
            got = rules.operator_functional(got, want["DETERMINISTIC"], self.call.p.group_size > 1).as_dict()
        elif self.kernel == "attn_bwd_fused":
            got["ATOMIC_DQ"] = want["ATOMIC_DQ"]
        elif self.kernel == "attn_bwd_ws":
            got = planning.ws_functional(self.call).as_dict()
        if got != want:
            raise ValueError(f"{self.shape} selects functional {got}, not the task's {want}")

    # ------------------------------------------------------------------ inputs
    def refill(self) -> None:
        """Fresh random q, k, v, dO; then the forward's out and lse and the stats (delta, lse
        in base 2) the backward kernels read, from the backend's first launch (split: the dQ
        kernel, fused: the preprocess), with the database's configurations."""
        for t in (self.q, self.k, self.v, self.dout):
            t.normal_(generator=self.generator)
        if not self.forward:
            # into the same lse: the launch plans made by runner() keep its pointer
            launch(planning.forward_plan(self.call, self.q, self.k, self.v, self.out, self.lse))
            if self.kernel != "backward":
                launch(self._plans(None)[0])  # the stats
        if self._dq_accumulates():
            self.dq.zero_()  # the atomic fused backward and the ws one accumulate into it

    def reset(self) -> None:
        """Outputs poisoned with NaN (an element the run leaves unwritten fails the check),
        an atomically accumulated dQ zeroed; the inputs are kept."""
        for t in self._written().values():
            t.fill_(math.nan)
        if self._dq_accumulates():
            self.dq.zero_()

    def _plans(self, config: Config | None) -> list:
        backend, deterministic = self._backward_choice()
        configs = {} if config is None else {self.kernel: config}
        return planning.backward_plans(self.call, self.dout, self.q, self.k, self.v, self.out, self.lse, self.stats,
                                  self.dq, self.dk, self.dv, None, backend, deterministic, configs)

    # ------------------------------------------------------------------ runs
    def runner(self, config: Config) -> Callable[[], None]:
        """A callable that runs the table's work once with ``config`` on the current tensors."""
        if self.forward:
            if self.kernel == "forward":  # the operator's choice: that kernel with the database's configuration
                plan = planning.forward_plan(self.call, self.q, self.k, self.v, self.out, self.lse,
                                             engine=config["engine"])
            else:
                plan = planning.forward_plan(self.call, self.q, self.k, self.v, self.out, self.lse, config,
                                             "ws" if self.kernel == "attn_fwd_ws" else "triton")
            return lambda: launch(plan)
        if self.kernel == "backward":
            backend, deterministic = config["backend"], self._backward_choice()[1]

            def operator() -> None:
                self.dq, self.dk, self.dv, _ = planning.run_backward(
                    self.call, self.dout, self.q, self.k, self.v, self.out, self.lse, backend, deterministic)

            return operator
        plan = next(p for p in self._plans(config) if p.kernel.name == self.kernel)
        return lambda: launch(plan)

    def outputs(self) -> dict[str, torch.Tensor]:
        """What the table's work writes, as the operators return it (an accumulated dQ
        scaled and converted: planning.finish_dq)."""
        written = self._written()
        if "dq" in written:
            scale = planning.accumulated_dq_scale(self.call, *self._backward_choice())
            written["dq"] = planning.finish_dq(written["dq"], self.q, scale)
        return written

    def _written(self) -> dict[str, torch.Tensor]:
        """The buffers the table's work writes into."""
        if self.forward:
            return {"out": self.out}
        if self.kernel == "attn_bwd_dkdv":
            return {"dk": self.dk, "dv": self.dv}
        if self.kernel == "attn_bwd_dq":
            return {"dq": self.dq}
        return {"dq": self.dq, "dk": self.dk, "dv": self.dv}

    def reference(self) -> dict[str, torch.Tensor]:
        """The float64 outputs, one (batch, head) at a time (the score matrix of one head
        at the longest lengths is 2 GiB in float64)."""
        mask = MASK_KWARGS[self.functional["MASK"]]
        if self.dropout_p:
            keep = torch.empty((self.shape.batch, self.shape.heads, self.shape.seqlen_q, self.shape.seqlen_k),
                               dtype=torch.int8, device=self.device)
            launch(planning.dropout_mask_plan(keep, self.shape.seqlen_q, self.shape.seqlen_k, self.shape.heads,
                                              self.dropout_p, self.call.seed, self.call.offset))
        names = tuple(self.outputs())
        result = {name: torch.zeros(t.shape, dtype=torch.float64, device=t.device)
                  for name, t in self.outputs().items()}
        for b in range(self.shape.batch):
            for h in range(self.shape.heads):
                part = (slice(b, b + 1), slice(None), slice(h, h + 1))
                kv = (slice(b, b + 1), slice(None), slice(h // self.shape.group, h // self.shape.group + 1))
                q, k, v = (t[p].to(torch.float64).requires_grad_(not self.forward)
                           for t, p in ((self.q, part), (self.k, kv), (self.v, kv)))
                if self.dropout_p:
                    dropped = {"dropout_mask": keep[b:b + 1, h:h + 1].bool(), "dropout_p": self.dropout_p}
                else:
                    dropped = {}
                out, _ = reference.attention(q, k, v, **mask, **dropped)
                if self.forward:
                    result["out"][part] = out.detach()
                    continue
                grads = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v),
                                                                         self.dout[part].to(torch.float64))))
                for name in names:  # a key/value head sums its group's gradients
                    result[name][part if name == "dq" else kv] += grads[name]
        return result


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN or inf anywhere in ``out`` gives NaN."""
    out = out.to(torch.float64)
    if not torch.isfinite(out).all():
        return math.nan
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def errors(outputs: Mapping[str, torch.Tensor], references: Mapping[str, torch.Tensor]) -> dict[str, float]:
    return {name: relative_error(outputs[name], references[name]) for name in references}


def current_config(db: Any, arch: str, table: str, functional: Functional, cell: tuple[int, ...]) -> Config | None:
    """The database's configuration for the cell today, or None when it names none (no
    block, a ``.`` cell). A database that does not resolve is an error, not None: planning
    and timing would quietly leave the current choice out."""
    from aotattn.tuning import NoEntryError

    spec = next(s for s in rules.TABLES if s.qualname == table)
    try:
        return db.lookup(arch, spec, functional, dict(zip((k for k, _ in spec.tuning_keys), cell)))
    except NoEntryError:
        return None


def auxiliary(table: str, functional: Functional, arch: str | None = None) -> list[tuple[str, Functional]]:
    """The (table, functional) pairs of the other kernels a problem of this table launches
    with the database's configurations on ``arch`` (None: where every kernel runs): their
    images must be built too."""
    f = functional.as_dict()
    kernel = table.split(".", 1)[1]
    attention = {k: v for k, v in f.items() if k not in ("ATOMIC_DQ", "DETERMINISTIC", "GROUPED", "WIDE_GROUPS")}
    if kernel == "backward":
        attention["BLOCK_DV"] = f["BLOCK_D"]
    forward = {**attention, "BIAS": min(attention.get("BIAS", 0), 1)}
    pre = {"dtype": f["dtype"], "BLOCK_DV": attention["BLOCK_DV"], "PAD_HEAD": attention["PAD_HEAD"],
           "VARLEN": attention["VARLEN"]}
    pairs: list[tuple[str, dict]] = []
    if kernel in ("attn_fwd", "attn_fwd_ws"):
        return _mask_kernel(f)
    if kernel == "forward":  # both engines' kernels, with the database's configurations
        return [("flash.attn_fwd", functional), ("flash.attn_fwd_ws", functional)]
    pairs += [("flash.attn_fwd", forward), ("flash.attn_bwd_preprocess", pre)]
    if rules.ws_serves(forward, arch):  # the problem's forward runs the kernel flash.forward chooses
        pairs.append(("flash.attn_fwd_ws", forward))
    if kernel == "attn_bwd_dkdv":  # the split backend's dQ kernel writes the stats dK/dV reads
        pairs.append(("flash.attn_bwd_dq", attention))
    if kernel == "backward":
        pairs += [("flash.attn_bwd_dkdv", attention), ("flash.attn_bwd_dq", attention),
                  ("flash.attn_bwd_fused", {**attention, "ATOMIC_DQ": not f["DETERMINISTIC"]})]
        if rules.ws_backward_serves(attention, arch, deterministic=f["DETERMINISTIC"]):
            # the ws backward's tiles are keyed by GROUPED too (named when True): a grouped
            # problem launches the grouped tile, so that is the image to build
            ws = rules.ATTN_BWD_WS.canonical_functional({**attention, "GROUPED": f.get("GROUPED", False)})
            pairs.append(("flash.attn_bwd_ws", ws.as_dict()))
    return [(t, Functional.of(v)) for t, v in pairs] + _mask_kernel(f)


def _mask_kernel(f: Mapping[str, Any]) -> list[tuple[str, Functional]]:
    """The keep-mask kernel a dropout problem's reference launches."""
    return [(rules.DROPOUT_MASK.qualname, Functional.of({}))] if f.get("DROPOUT") else []
