"""How long a perfmon run takes on an H200, estimated before it starts.

No timing on the CPU machine says anything about the GPU, so the estimate is FLOPs over
the throughputs measured on the H200 (/work/shared/FACTS.md, bf16, 2026-11-29/30),
plus a fixed cost per call. It sizes the repetitions of a run to a time budget; the run
itself measures, it never trusts these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from aotattn.perfmon.entries import Entry

# TFLOP/s by (provider, pass, head-dim bucket), no mask / causal; from the FACTS tables
_RATES = {
    ("aotattn", "fwd"): {64: (400, 270), 128: (480, 370), 256: (450, 300)},
    ("aotattn:split", "bwd"): {64: (290, 210), 128: (320, 270), 256: (100, 90)},
    ("aotattn:fused", "bwd"): {64: (170, 160), 128: (180, 165), 256: (78, 75)},
    ("sdpa-flash", "fwd"): {64: (300, 285), 128: (340, 305), 256: (320, 285)},
    ("sdpa-flash", "bwd"): {64: (270, 235), 128: (295, 255), 256: (245, 220)},
    ("sdpa-cudnn", "fwd"): {64: (450, 415), 128: (600, 535), 256: (650, 560)},
    ("sdpa-cudnn", "bwd"): {64: (430, 370), 128: (510, 450), 256: (370, 345)},
    ("sdpa-efficient", "fwd"): {64: (130, 129), 128: (170, 160), 256: (150, 140)},
    ("sdpa-efficient", "bwd"): {64: (110, 99), 128: (135, 118), 256: (44, 40)},
    ("flex", "fwd"): {64: (360, 260), 128: (470, 365), 256: (400, 300)},
    ("flex", "bwd"): {64: (280, 195), 128: (400, 355), 256: (250, 220)},
}
MAX_SEED = 2**63 - 1  # a run's seed: what torch's generators and a JSON payload's bigint both hold
CALL_MS = 0.03  # launch and autograd bookkeeping of one call on the GPU's critical path
TRAINING_CALL_MS = {"fwd": 0.13, "fwdbwd": 0.8}  # host time per small training call (FACTS)
# A training entry's call is host-bound, so one sample moves with the host's jitter: at 5 a
# round, its round medians spread 20-85% on the H200 host (run s35-dense), too much to rank
# providers 10% apart. Forty calls of at most a millisecond cost little.
TRAINING_REPS = 40
FLUSH_MS = 0.07  # zeroing a 256 MB buffer at ~4 TB/s between timed calls
# inputs, reference check, first calls; FlexAttention's compile in the timing process, or,
# after `run --flex-jobs` compiled it ahead, its trace and cache load there (H200 host,
# thirtieth session: 79 entries compiled in 75-107 s by 14 processes, ~20 s each)
SETUP_S = {"entry": 0.25, "flex": 20.0, "flex_cached": 1.0}


def _bucket(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def rate(entry: Entry, pass_: str, provider: str) -> float:
    """Estimated TFLOP/s of one provider on one pass of an entry."""
    base = "aotattn:split" if provider == "aotattn" and pass_ != "fwd" else provider
    base = "aotattn" if base.startswith("aotattn") and pass_ == "fwd" else base
    key_pass = "fwd" if pass_ == "fwd" else "bwd"
    table = _RATES.get((base, key_pass)) or _RATES[("aotattn", "fwd")]
    dim = max(entry.head_dim, entry.head_dim_v)
    full, causal = table[_bucket(dim)]
    tflops = causal if entry.masked else full
    tflops *= dim / _bucket(dim)  # padded heads compute the whole bucket
    if entry.window[0] >= 0:
        tflops *= 0.6  # narrow bands: more partly masked tiles
    if entry.dtype == "fp32":
        tflops /= 10.0
    if entry.dropout_p or entry.bias != "none":
        tflops *= 0.7
    return tflops


def call_ms(entry: Entry, pass_: str, provider: str) -> float:
    """Estimated time of one call (ms)."""
    if entry.training:
        return TRAINING_CALL_MS.get(pass_, 0.8)
    factor = 1.0 if pass_ != "fwdbwd" else 3.5 / 2.5
    flops = entry.flops("bwd" if pass_ == "fwdbwd" else pass_) * factor
    return CALL_MS + flops / rate(entry, pass_, provider) / 1e9


@dataclass(frozen=True)
class Plan:
    """Repetitions of a run: ``rounds`` interleaved rounds of ``reps`` timed calls per
    provider, after ``warmup`` untimed calls each; ``hide_host_ms``: a GPU wait queued
    before each timed call but the training entries' (:func:`aotattn.tune.timing.measure`),
    so that a call's host work does not show in its time (0: none)."""

    rounds: int = 3
    reps: int = 5
    warmup: int = 2
    hide_host_ms: float = 0.0

    @property
    def training_reps(self) -> int:
        """Timed calls per round for a training entry, whose calls are host-bound and a
        tenth of a millisecond long: at least :data:`TRAINING_REPS`."""
        return max(self.reps, TRAINING_REPS)

    def reps_for(self, entry: Entry) -> int:
        """Timed calls per round for ``entry``."""
        return self.training_reps if entry.training else self.reps


def flex_setup_seconds(flex_jobs: int = 0) -> float:
    """FlexAttention's compile per entry: in the timing process, or spread over ``flex_jobs``
    processes ahead of it (``run --flex-jobs``) plus the cached load in the timing process."""
    if flex_jobs > 0:
        return SETUP_S["flex_cached"] + SETUP_S["flex"] / flex_jobs
    return SETUP_S["flex"]


def entry_seconds(entry: Entry, providers: dict[str, list[str]], plan: Plan, flex_jobs: int = 0) -> float:
    """Estimated wall time of one entry: setup, checks, warm-up and the timed rounds.

    ``providers``: per pass, the providers timed; ``flex_jobs``: see :func:`flex_setup_seconds`.
    """
    flex = any("flex" in names for names in providers.values())
    seconds = SETUP_S["entry"] + (flex_setup_seconds(flex_jobs) if flex else 0.0)
    for pass_, names in providers.items():
        for provider in names:
            one = call_ms(entry, pass_, provider)
            per_sample = one if entry.training else one + FLUSH_MS + plan.hide_host_ms
            calls = plan.rounds * plan.reps_for(entry)
            seconds += (calls * per_sample + (plan.warmup + 2) * one) / 1e3
    return seconds
