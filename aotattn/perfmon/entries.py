"""What perfmon measures: a declared, data-driven set of attention calls ("entries").

An entry is one call of a public operator at one size, measured in one or more passes:

* ``fwd``: the forward call (inference, no autograd) or, for a *training* entry, the
  forward with inputs that require grad (what a training step pays before backward);
* ``bwd``: the backward of one forward, through autograd, as ``loss.backward()`` runs it;
* ``fwdbwd``: forward then backward, back to back (training entries).

FLOPs are the standard counts: forward ``4·B·H·Sq·Sk·D`` (``2·(D + Dv)`` per visible
query-key pair when the head dims differ), halved when causal on a square problem; for
every other mask (sliding windows, causal on the bottom-right diagonal of a non-square
problem) the visible pairs are counted exactly. Backward is 2.5x the forward, forward +
backward 3.5x. Dropout and bias add no FLOPs.

The synthetic grid fills the GPU the way the issue-2/3 benchmarks do: hidden size 2048
(``H = 2048 / D``) and 16k query tokens per call (``B = 16384 / Sq``, at least 1).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import numpy as np

PASSES = ("fwd", "bwd", "fwdbwd")
BACKWARD_PASSES = ("bwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
DTYPES = ("fp16", "bf16", "fp32")
APIS = ("flash", "sdpa", "varlen")
BIASES = ("none", "bias", "bias-grad")
DIAGONALS = ("bottom_right", "top_left")

TOKENS = 16384
HIDDEN = 2048


def _integer(text: str) -> int:
    """A plain decimal integer, optionally signed: ``int`` also takes ``5_12`` and spaces."""
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(text)
    return int(text)


@dataclass(frozen=True)
class Entry:
    """One measured call.

    ``api``: ``flash`` calls :func:`aotattn.flash_attn_func` on ``(B, S, H, D)`` tensors,
    ``sdpa`` calls :func:`aotattn.scaled_dot_product_attention` on ``(B, H, S, D)`` ones
    (top-left causal, ``enable_gqa``), ``varlen`` calls :func:`aotattn.flash_attn_varlen_func`
    on sequences of ``lengths`` packed (q and k lengths equal; ``batch`` is their number,
    ``seqlen_q``/``seqlen_k`` the longest). ``window`` is ``(left, right)``, -1 unbounded,
    on ``diagonal``; ``causal`` sets ``right = 0``. ``bias``: an additive ``(1, Hq, Sq, Sk)``
    bias broadcast over the batch, ``bias-grad`` one whose gradient is wanted.
    ``training``: the inputs require grad and the call is timed back to back with no cache
    flush (host time counts, as in a training loop). ``flex``: also time FlexAttention,
    which compiles per shape (seconds), so only a few entries ask for it.
    """

    name: str
    group: str
    dtype: str
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    diagonal: str = "bottom_right"
    api: str = "flash"
    lengths: tuple[int, ...] = ()
    dropout_p: float = 0.0
    bias: str = "none"
    deterministic: bool = False
    training: bool = False
    flex: bool = False
    passes: tuple[str, ...] = ("fwd", "bwd")

    # ------------------------------------------------------------------ derived
    @property
    def masked(self) -> bool:
        return self.causal or self.window != (-1, -1)

    @property
    def mask_name(self) -> str:
        """``none``, ``causal``, ``window(L,R)``, with ``-tl`` on the top-left diagonal."""
        if not self.masked:
            return "none"
        left, right = self.window
        name = "causal" if self.causal and left < 0 else f"window({left},{0 if self.causal else right})"
        return name + ("-tl" if self.diagonal == "top_left" and self.seqlen_q != self.seqlen_k else "")

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_k

    def sequences(self) -> list[tuple[int, int]]:
        """(Sq, Sk) of each sequence: ``batch`` copies of the shape, or the varlen lengths."""
        if self.api == "varlen":
            return [(n, n) for n in self.lengths]
        return [(self.seqlen_q, self.seqlen_k)] * self.batch

    def pairs(self) -> float:
        """Query-key pairs computed per head, summed over the batch (standard counting)."""
        return float(sum(visible_pairs(sq, sk, self.causal, self.window, self.diagonal, standard=True)
                         for sq, sk in self.sequences()))

    def flops(self, pass_: str) -> float:
        if pass_ not in FLOP_FACTOR:
            raise ValueError(f"pass: expected one of {PASSES}, got {pass_!r}")
        forward = self.heads_q * self.pairs() * 2.0 * (self.head_dim + self.head_dim_v)
        return forward * FLOP_FACTOR[pass_]

    def describe(self) -> str:
        """``key=value`` tokens that :meth:`parse` reads back (the perfdb's entry lines)."""
        tokens = []
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if value == f.default and f.name not in _ALWAYS:
                continue
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, tuple):
                text = ",".join(map(str, value))
            else:
                text = str(value)
            tokens.append(f"{_SHORT.get(f.name, f.name)}={text}")
        return " ".join(tokens)

    @classmethod
    def parse(cls, name: str, text: str) -> "Entry":
        """The inverse of :meth:`describe`; raises ``ValueError`` naming the bad token."""
        long = {v: k for k, v in _SHORT.items()}
        kinds = {f.name: f for f in fields(cls)}
        values: dict[str, object] = {"name": name}
        for token in text.split():
            key, eq, raw = token.partition("=")
            key = long.get(key, key)
            if not eq or key not in kinds or key == "name":
                raise ValueError(f"entry {name}: unknown field {token!r}")
            if key in values:  # the last one silently won: `causal=1 ... causal=0` read as not causal
                raise ValueError(f"entry {name}: field {_SHORT.get(key, key)} given twice")
            if not raw.isascii():  # int() and float() take other scripts' digits and underscores
                raise ValueError(f"entry {name}: bad value in {token!r} (plain ASCII expected)")
            default = kinds[key].default
            try:
                if isinstance(default, bool):
                    values[key] = {"1": True, "0": False}[raw]
                elif key in ("passes",):
                    values[key] = tuple(raw.split(","))
                elif key in ("window", "lengths"):
                    values[key] = tuple(_integer(x) for x in raw.split(",") if x)
                elif key == "dropout_p":
                    if "_" in raw:
                        raise ValueError(raw)
                    values[key] = float(raw)
                elif kinds[key].type in ("int",):
                    values[key] = _integer(raw)
                else:
                    values[key] = raw
            except (KeyError, ValueError) as exc:
                raise ValueError(f"entry {name}: bad value in {token!r}") from exc
        missing = [_SHORT.get(f.name, f.name) for f in fields(cls) if f.name not in values
                   and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"entry {name}: missing fields {', '.join(missing)}")
        entry = cls(**values)  # type: ignore[arg-type]
        entry.validate()
        return entry

    def validate(self) -> None:
        """Raise ``ValueError`` for a declaration the operators would refuse or perfmon cannot time."""
        check_name(self.name)
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.api not in APIS:
            problems.append(f"api {self.api!r} not in {APIS}")
        if self.bias not in BIASES:
            problems.append(f"bias {self.bias!r} not in {BIASES}")
        if self.diagonal not in DIAGONALS:
            problems.append(f"diagonal {self.diagonal!r} not in {DIAGONALS}")
        if not self.passes or any(p not in PASSES for p in self.passes) or len(set(self.passes)) != len(self.passes):
            problems.append(f"passes {self.passes!r}: distinct names from {PASSES}")
        if min(self.batch, self.heads_q, self.heads_k, self.seqlen_q, self.seqlen_k) < 1:
            problems.append("sizes must be positive")
        if self.heads_k > 0 and self.heads_q % self.heads_k:
            problems.append(f"heads_q {self.heads_q} is not a multiple of heads_k {self.heads_k}")
        if len(self.window) != 2 or any(side < -1 for side in self.window):
            problems.append(f"window {self.window!r}: two sides, each -1 (unbounded) or >= 0")
        if not (1 <= self.head_dim <= 256 and 1 <= self.head_dim_v <= 256):
            problems.append("head dims must be in 1..256")
        if self.api == "varlen":
            if len(self.lengths) != self.batch or not self.lengths:
                problems.append("varlen: one length per sequence (batch of them)")
            elif max(self.lengths) != self.seqlen_q or self.seqlen_q != self.seqlen_k:
                problems.append("varlen: seqlen_q = seqlen_k = the longest length")
            if self.bias != "none":
                problems.append("varlen takes no bias")
        elif self.lengths:
            problems.append("lengths are for the varlen api")
        if self.api == "sdpa" and (self.window != (-1, -1) or (self.causal and self.diagonal != "top_left")):
            problems.append("the sdpa api has only top-left causal masks")
        if not 0.0 <= self.dropout_p < 1.0:
            problems.append("dropout_p must be in [0, 1)")
        if self.training != ("fwdbwd" in self.passes):
            problems.append("training entries, and only they, time fwdbwd")
        if problems:
            raise ValueError(f"entry {self.name}: " + "; ".join(problems))


def check_name(name: object) -> str:
    """An entry's name as the perfdb file spells it: one printable token without spaces, not
    starting with ``#`` or ``[`` (a line starting so reads as a comment, a directive or a
    section, and the entry was silently lost)."""
    if not isinstance(name, str) or not name or not name.isprintable() or " " in name or name[0] in "#[":
        raise ValueError(f"entry name {name!r}: expected one printable token without spaces, not starting with "
                         "'#' or '[' (it would read as a comment or a section)")
    return name


_SHORT = {"batch": "B", "heads_q": "Hq", "heads_k": "Hk", "seqlen_q": "Sq", "seqlen_k": "Sk", "head_dim": "D",
          "head_dim_v": "Dv", "dropout_p": "dropout"}
_ALWAYS = {"dtype", "batch", "heads_q", "heads_k", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "passes"}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False, window: tuple[int, int] = (-1, -1),
                  diagonal: str = "bottom_right", standard: bool = False) -> int | float:
    """Query-key pairs one head computes: row i sees column j iff
    ``i + d - left <= j <= i + d + right`` (``d = Sk - Sq`` bottom-right, 0 top-left).

    ``standard``: a causal mask on a square problem counts ``Sq·Sk/2`` (the convention
    every published attention figure uses) instead of the exact ``Sq·(Sq+1)/2``.
    """
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return seqlen_q * seqlen_k
    if standard and causal and left < 0 and seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2
    d = seqlen_k - seqlen_q if diagonal == "bottom_right" else 0
    rows = np.arange(seqlen_q, dtype=np.int64)
    lo = np.maximum(rows + d - left, 0) if left >= 0 else np.zeros_like(rows)
    hi = np.minimum(rows + d + right, seqlen_k - 1) if right >= 0 else np.full_like(rows, seqlen_k - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


# ---------------------------------------------------------------------------- the declaration

def _dims(head_dim: int | tuple[int, int]) -> tuple[int, int]:
    return (head_dim, head_dim) if isinstance(head_dim, int) else head_dim


def _grid_batch(seqlen_q: int) -> int:
    return max(1, TOKENS // seqlen_q)


def _grid_heads(head_dim: int) -> int:
    return max(1, HIDDEN // head_dim)


def _mask_tag(causal: bool, window: tuple[int, int]) -> str:
    if window != (-1, -1):
        return f"w{window[0]}-{window[1]}"
    return "causal" if causal else "full"


def _dense(group: str, dtype: str, head_dim: int | tuple[int, int], seqlen_q: int, seqlen_k: int | None = None, *,
           causal: bool = False, window: tuple[int, int] = (-1, -1), group_size: int = 1, **extra) -> Entry:
    """A synthetic entry on the grid: H = 2048 / D query heads, B = 16384 / Sq."""
    d, dv = _dims(head_dim)
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    heads = _grid_heads(max(d, dv))
    seq = f"s{seqlen_q}" if seqlen_k == seqlen_q else f"q{seqlen_q}-k{seqlen_k}"
    dim = f"d{d}" if d == dv else f"d{d}-{dv}"
    parts = [group, dtype, dim, seq, _mask_tag(causal, window)]
    if group_size > 1:
        parts.insert(3, f"g{group_size}")
    if extra.get("api") == "sdpa":
        parts.append("sdpa")
    if extra.get("dropout_p"):
        parts.append(f"p{extra['dropout_p']}")
    if extra.get("bias", "none") != "none":
        parts.append(extra["bias"])
    if extra.get("deterministic"):
        parts.append("det")
    return Entry("-".join(parts), group, dtype, _grid_batch(seqlen_q), heads, max(1, heads // group_size),
                 seqlen_q, seqlen_k, d, dv, causal=causal, window=window, **extra)


def _varlen(dtype: str, head_dim: int, longest: int, causal: bool) -> Entry:
    """Sequences of lengths uniform in [longest/8, longest], packed to about 16k tokens."""
    rng = random.Random(f"varlen-{dtype}-{head_dim}-{longest}-{causal}")
    lengths: list[int] = []
    while sum(lengths) < TOKENS:
        lengths.append(rng.randint(max(1, longest // 8), longest))
    lengths[rng.randrange(len(lengths))] = longest  # the longest is always there
    heads = _grid_heads(head_dim)
    return Entry(f"varlen-{dtype}-d{head_dim}-max{longest}-{'causal' if causal else 'full'}", "varlen", dtype,
                 len(lengths), heads, heads, longest, longest, head_dim, head_dim, causal=causal, api="varlen",
                 lengths=tuple(lengths))


SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def _synthetic() -> list[Entry]:
    out: list[Entry] = []
    # square, no mask / causal: the grid the peers' published figures use
    for dtype in ("bf16", "fp16"):
        for d in (64, 128, 256):
            for s in SEQLENS:
                for causal in (False, True):
                    out.append(_dense("dense", dtype, d, s, causal=causal,
                                      flex=dtype == "bf16" and causal and (d, s) == (128, 4096)))
    # head dims off the compiled buckets (padded heads), and D != Dv
    for d in (72, 80, 96, 112, 160, 192, 200, 224, (192, 128), (96, 64)):
        for s in (1024, 4096):
            for causal in (False, True):
                out.append(_dense("odd-dim", "bf16", d, s, causal=causal))
    # sliding windows on the bottom-right diagonal
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            for s in (2048, 4096, 8192, 16384):
                for window in ((256, 0), (1024, 0), (128, 128)):
                    out.append(_dense("window", dtype, d, s, window=window,
                                      flex=(dtype, d, s, window) == ("bf16", 128, 4096, (1024, 0))))
    # non-square: chunked prefill (Sq < Sk) and cross-attention-like (Sq > Sk)
    for d in (64, 128):
        for sq, sk in ((512, 4096), (1024, 8192), (128, 16384), (2048, 4096), (4096, 512), (4096, 77)):
            for causal in (False, True):
                out.append(_dense("nonsquare", "bf16", d, sq, sk, causal=causal))
        for sq, sk in ((512, 4096), (4096, 1024)):  # PyTorch's top-left causal through the SDPA API
            out.append(_dense("nonsquare", "bf16", d, sq, sk, causal=True, diagonal="top_left", api="sdpa"))
    # grouped-query attention
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            for g in (4, 8):
                for s in (1024, 4096, 16384):
                    for causal in (False, True):
                        out.append(_dense("gqa", dtype, d, s, causal=causal, group_size=g))
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            for longest in (512, 2048, 8192):
                for causal in (False, True):
                    out.append(_varlen(dtype, d, longest, causal))
    for d in (64, 128):
        for s in (512, 1024, 4096):
            for causal in (False, True):
                out.append(_dense("dropout", "bf16", d, s, causal=causal, dropout_p=0.1))
    for d in (64, 128):
        for s in (512, 1024, 2048):
            for bias in ("bias", "bias-grad"):
                out.append(_dense("bias", "bf16", d, s, bias=bias))
    for d in (64, 128):
        for s in (1024, 4096):
            for causal in (False, True):
                out.append(_dense("deterministic", "bf16", d, s, causal=causal, deterministic=True))
                out.append(_dense("fp32", "fp32", d, s, causal=causal))
    return out


def _models() -> list[Entry]:
    """Shapes of real models, called as their PyTorch code calls attention (SDPA layout)."""
    def model(name, batch, heads_q, seqlen, head_dim, causal=False, heads_k=None, flex=False):
        return Entry(f"model-{name}", "model", "bf16", batch, heads_q, heads_k or heads_q, seqlen, seqlen, head_dim,
                     head_dim, causal=causal, diagonal="top_left", api="sdpa", flex=flex)
    return [
        model("roberta-large", 512, 16, 384, 64),
        model("bert-large-uncased", 192, 16, 512, 64),
        model("distilbert-base-uncased", 384, 12, 512, 64),
        model("gpt2", 72, 12, 1024, 64, causal=True, flex=True),
        model("video-dit-s6630", 1, 32, 6630, 128),
        model("video-dit-s15300", 1, 32, 15300, 128),
        model("gqa-lm-s4096", 4, 32, 4096, 128, causal=True, heads_k=8),
    ]


def _training() -> list[Entry]:
    """Small calls where host time dominates, inputs requiring grad as in a training step."""
    def small(name, api, dtype, batch, heads, seqlen, head_dim, causal):
        return Entry(f"train-{name}", "training", dtype, batch, heads, heads, seqlen, seqlen, head_dim, head_dim,
                     causal=causal, diagonal="top_left" if api == "sdpa" else "bottom_right", api=api,
                     training=True, passes=("fwd", "fwdbwd"))
    return [
        small("tiny-sdpa", "sdpa", "bf16", 1, 1, 128, 64, False),
        small("tiny-causal", "flash", "bf16", 1, 1, 128, 64, True),
        small("small-fp16", "flash", "fp16", 2, 8, 256, 64, True),
        small("small-d128", "sdpa", "bf16", 4, 4, 512, 128, False),
    ]


def declared() -> list[Entry]:
    """Every entry, in a fixed order."""
    return _synthetic() + _models() + _training()


def select(entries: Iterable[Entry], patterns: Sequence[str] = (), groups: Sequence[str] = ()) -> list[Entry]:
    """Entries whose name matches any glob in ``patterns`` and whose group is in ``groups``
    (either filter empty: no restriction)."""
    chosen = [e for e in entries
              if (not patterns or any(fnmatch.fnmatchcase(e.name, p) for p in patterns))
              and (not groups or e.group in groups)]
    return chosen


def unmatched(entries: Iterable[Entry], patterns: Sequence[str] = (), groups: Sequence[str] = ()
              ) -> list[tuple[str, str]]:
    """The selectors that add nothing to :func:`select`'s choice, as ``("match", glob)`` or
    ``("group", name)``: a glob no entry of the groups matches, a group without an entry the
    globs match (with several, one that matched nothing was silently ignored)."""
    entries = list(entries)
    found = [("match", p) for p in patterns
             if not any(fnmatch.fnmatchcase(e.name, p) and (not groups or e.group in groups) for e in entries)]
    found += [("group", g) for g in groups
              if not any(e.group == g and (not patterns or any(fnmatch.fnmatchcase(e.name, p) for p in patterns))
                         for e in entries)]
    return found


def by_name(entries: Iterable[Entry]) -> dict[str, Entry]:
    return {e.name: e for e in entries}
