"""Measure entries: check what is timed, time every provider side by side, make records.

For each pass of an entry, every provider first runs once untimed and is checked against
the float64 reference on a slice (the first sequence, key head 0 and its query heads) and,
over the whole output and gradients, against aotattn's unforced result (the forced
backends and, without dropout, the peers); a provider that fails gets no figure, only
the reason. Then the providers are timed in interleaved rounds (the order rotates each
round), so a drifting clock or a neighbour's load falls on all of them alike: the median
of every sample is the figure, the largest minus the smallest round median the spread.
"""

from __future__ import annotations

import datetime
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

import aotattn
from aotattn.perfmon import providers as P
from aotattn.perfmon.budget import Plan
from aotattn.perfmon.entries import BACKWARD_PASSES, Entry
from aotattn.perfmon.perfdb import Perfdb, Record, tuning_revision
from aotattn.perfmon.provenance import Lookup, cell_of, recording_lookups
from aotattn.tune import timing
from aotattn.tune.candidates import config_name

GRAD_NAMES = ("dq", "dk", "dv", "dbias")


@dataclass(frozen=True)
class Options:
    """How a run measures. ``peers``: time PyTorch's backends; ``flex``: FlexAttention on
    the entries that ask for it (True), on every entry it supports (``"all"``) or none
    (False); ``seed``: inputs and dropout draws."""

    plan: Plan = Plan()
    peers: bool = True
    flex: bool | str = True
    seed: int = 0


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:120]


def _results(out: torch.Tensor, grads: Iterable[torch.Tensor] = ()) -> dict[str, torch.Tensor]:
    found = {"out": out.detach()}
    found.update({name: g for name, g in zip(GRAD_NAMES, grads)})
    return found


def evaluate(entry: Entry, x: P.Inputs, pass_: str, provider: str, dropout_p: float) -> dict[str, torch.Tensor]:
    """One untimed call (forward, plus backward for backward passes) and its results."""
    if pass_ == "fwd":
        with torch.set_grad_enabled(entry.training):
            return _results(P.call(entry, x, provider, dropout_p))
    out = P.call(entry, x, provider, dropout_p)
    return _results(out, torch.autograd.grad(out, x.leaves(), x.dout))


def _runner(entry: Entry, x: P.Inputs, pass_: str, provider: str) -> Callable[[], object]:
    """The call that is timed."""
    if pass_ == "fwd":
        if entry.training:
            return lambda: P.call(entry, x, provider)

        def inference():
            with torch.no_grad():
                return P.call(entry, x, provider)
        return inference
    leaves = x.leaves()
    if pass_ == "bwd":
        out = P.call(entry, x, provider)
        return lambda: torch.autograd.grad(out, leaves, x.dout, retain_graph=True)

    def step():
        out = P.call(entry, x, provider)
        return torch.autograd.grad(out, leaves, x.dout)
    return step


class _Reference:
    """Float64 slices, computed on first use: with aotattn's dropout mask, and without dropout.
    One per entry: its passes share it (gradients are computed when any pass is a backward)."""

    def __init__(self, entry: Entry, x: P.Inputs, seed: int):
        self.entry, self.x, self.seed = entry, x, seed
        self.backward = any(p in BACKWARD_PASSES for p in entry.passes)
        self.cache: dict[bool, dict[str, torch.Tensor]] = {}

    def get(self, with_dropout: bool, pass_: str) -> dict[str, torch.Tensor]:
        """The slices a pass checks: the output, and the gradients for backward passes."""
        with_dropout = with_dropout and self.entry.dropout_p > 0
        if with_dropout not in self.cache:
            mask = None
            if with_dropout:
                e = self.entry
                torch.manual_seed(self.seed)  # the state the checked call drew its Philox state from
                # the first sequence's mask does not depend on how many follow it
                mask = aotattn.dropout_mask(1, e.heads_q, e.seqlen_q, e.seqlen_k, e.dropout_p,
                                            self.x.q.device)[:, P.checked_heads(e)[0]]
            self.cache[with_dropout] = P.reference_slice(self.entry, self.x, self.x.dout if self.backward else None,
                                                         mask, self.entry.dropout_p if with_dropout else 0.0)
        found = self.cache[with_dropout]
        return found if pass_ in BACKWARD_PASSES else {"out": found["out"]}


def _check(entry: Entry, x: P.Inputs, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
           against: dict[str, torch.Tensor] | None, tolerance: float, against_name: str) -> str | None:
    """Why ``got`` is wrong, or None."""
    for name, expected in ref.items():
        err = P.rel_diff(P.result_slice(entry, x, name, got[name]), expected)
        if not err <= tolerance:
            return f"{name} relative error {err:.2e} > {tolerance:.0e} against the float64 reference"
    for name, tensor in (against or {}).items():
        if name in got:
            err = P.rel_diff(got[name], tensor)
            if not err <= tolerance:
                return f"{name} differs from {against_name} by {err:.2e} > {tolerance:.0e}"
    return None


def provenance_note(lookups: list[Lookup], pass_: str, arch: str | None) -> str:
    """``choice=... cell=... kernel=config ...``: what the unforced call chose and from where.

    ``arch`` None (CPU tensors, the interpreter): the backend choice only, no database cells.
    """
    backward = pass_ in BACKWARD_PASSES
    kernels = {lk.spec.name: lk for lk in lookups if hasattr(lk.spec, "arguments")
               and (lk.spec.name.startswith("attn_bwd") == backward)}
    tokens = []
    if backward:
        backend = "ws" if "attn_bwd_ws" in kernels else "fused" if "attn_bwd_fused" in kernels else "split"
        tokens.append(f"choice={backend}")
        operator = [lk for lk in lookups if not hasattr(lk.spec, "arguments")]
        if operator and arch is not None:
            tokens.append("cell=" + cell_of(arch, operator[-1].spec, operator[-1].functional, dict(operator[-1].sizes)))
    if arch is not None:
        tokens += [f"{name}={config_name(lk.config)}" for name, lk in sorted(kernels.items())]
    return " ".join(tokens)


def measure_pass(entry: Entry, x: P.Inputs, pass_: str, options: Options, device: torch.device,
                 arch: str | None, reference: _Reference) -> list[Record]:
    notes: dict[str, str] = {}
    runners: dict[str, Callable[[], object]] = {}
    baseline: dict[str, torch.Tensor] | None = None
    for provider in P.ALL:
        reason = P.unsupported(entry, provider, pass_, options.flex)
        if reason is None and provider in P.PEERS and not options.peers:
            reason = "peers not asked for (--no-peers)"
        if reason is None and P.FORCED.get(provider) == "ws" and not P.ws_backward_runs_on(arch):
            reason = f"the ws backend runs on sm_90 GPUs, not {arch or 'the interpreter'}"
        if reason is not None:
            notes[provider] = f"skipped: {reason}"
            continue
        ours = provider.startswith(P.AOTATTN)
        # peers draw dropout their own way: they are checked without it (the same kernels, p = 0)
        dropout = entry.dropout_p if ours else 0.0
        torch.manual_seed(options.seed)
        try:
            with P.quiet(), recording_lookups() as lookups:
                got = evaluate(entry, x, pass_, provider, dropout)
            if provider == P.AOTATTN:
                notes[provider] = provenance_note(lookups, pass_, arch)
            against = baseline if (provider != P.AOTATTN and (ours or not entry.dropout_p)) else None
            tolerance = (P.TOLERANCE if ours else P.PEER_TOLERANCE)[entry.dtype]
            error = _check(entry, x, got, reference.get(ours, pass_), against, tolerance, "aotattn")
            if provider == P.AOTATTN:
                baseline = got if error is None else None
            if error is not None:
                notes[provider] = f"wrong: {error}"
                continue
            with P.quiet():
                run = _runner(entry, x, pass_, provider)
                run()  # what is timed runs as checked (a peer may take p = 0 and refuse dropout)
            runners[provider] = run
        except Exception as exc:  # a peer without a kernel for this shape; a missing image
            notes[provider] = f"{'error' if ours else 'skipped'}: {_one_line(exc)}"
    del baseline
    timed, failed = _time(entry, runners, options.plan, device)
    for provider, error in failed.items():
        notes[provider] = f"{'error' if provider.startswith(P.AOTATTN) else 'skipped'}: while timing, {error}"
    records = []
    ours_ms = timed.get(P.AOTATTN, (None, None))[0]
    for provider in P.ALL:
        ms, spread = timed.get(provider, (None, None))
        records.append(Record(entry.name, pass_, provider, ms, spread,
                              None if ms is None else entry.flops(pass_) / ms / 1e9,
                              None if ms is None or ours_ms is None else ms / ours_ms, notes.get(provider, "")))
    return records


def _time(entry: Entry, runners: dict[str, Callable[[], object]], plan: Plan,
          device: torch.device) -> tuple[dict[str, tuple[float, float]], dict[str, str]]:
    """(median ms, spread ms) per provider, from interleaved rounds of :func:`aotattn.tune.timing.measure`,
    and the providers that raised meanwhile (out of memory, say), with the error.

    Training entries are timed without the cache flush: back to back, the host's time to
    issue a call shows whenever it exceeds the GPU's; with more calls a round (Plan.reps_for),
    as a host-bound call's time jitters with the host.
    """
    repeats = plan.reps_for(entry) if device.type == "cuda" else plan.reps  # the interpreter's clock: a code path
    samples: dict[str, list[float]] = {p: [] for p in runners}
    rounds: dict[str, list[float]] = {p: [] for p in runners}
    failed: dict[str, str] = {}
    order = list(runners)
    with P.quiet():
        for r in range(-1, plan.rounds):  # round -1: the warm-up calls
            for provider in order[r % len(order):] + order[:r % len(order)] if order else ():
                if provider in failed:
                    continue
                run = runners[provider]
                try:
                    if r < 0:
                        for _ in range(plan.warmup):
                            run()
                        continue
                    got = timing.measure(lambda _, run=run: run(), lambda: None, device=device, warmup=0,
                                         repeats=repeats, flush=not entry.training,
                                         hide_host_ms=0.0 if entry.training else plan.hide_host_ms)
                except Exception as exc:
                    failed[provider] = _one_line(exc)
                    continue
                samples[provider] += got.samples_ms
                rounds[provider].append(got.median_ms)
    timed = {p: (statistics.median(samples[p]), max(rounds[p]) - min(rounds[p])) for p in runners if p not in failed}
    return timed, failed


def measure_entry(entry: Entry, device: torch.device, options: Options) -> list[Record]:
    """Every pass of one entry on ``device``; returns its records."""
    arch = None
    if device.type == "cuda":
        from aotattn.runtime.device import arch_of

        arch = arch_of(device)
    try:
        x = P.make_inputs(entry, device, options.seed)
    except Exception as exc:  # out of memory, say: the entry is recorded as not measured
        return [Record(entry.name, pass_, provider, note=f"error: inputs: {_one_line(exc)}")
                for pass_ in entry.passes for provider in P.ALL]
    reference = _Reference(entry, x, options.seed)
    records = []
    for pass_ in entry.passes:
        records += measure_pass(entry, x, pass_, options, device, arch, reference)
    del x, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def shell_line(args: Iterable[str]) -> str:
    """``args`` as one shell line that runs them again: each word quoted where it needs it, and
    a word with a newline or another unprintable character written as bash's ``$'...'`` (a
    raw newline in ``#! command`` ended the header line, and the run failed at its first write)."""
    words = []
    for arg in args:
        if arg.isprintable():
            words.append(shlex.quote(arg))
        else:
            words.append("$'" + "".join(_ESCAPED.get(c) or (c if c.isprintable() else _escape(c)) for c in arg) + "'")
    return " ".join(words)


_ESCAPED = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(char: str) -> str:
    """bash's escape of one unprintable character: ``\\xHH`` is a byte, so ASCII, or the byte
    an argument that was not UTF-8 carries (Python holds it as a surrogate, U+DC80..U+DCFF)."""
    code = ord(char)
    if code < 0x80 or 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code & 0xFF:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def environment(device: torch.device, plan: Plan, command: str | None = None) -> dict[str, str]:
    """The header of a perfdb file: versions, tuning revision, GPU, date, timing method."""
    from aotattn import tuning
    from aotattn.runtime.launcher import mode

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    if device.type == "cuda":
        from aotattn.runtime.device import arch_of

        props = torch.cuda.get_device_properties(device)
        arch = arch_of(device)
        gpu = f"{props.name}, {arch}, {props.multi_processor_count} SMs"
        run_mode = mode()
        how = "CUDA events, L2 flushed before each (aotattn.tune.timing)"
    else:
        arch, gpu, run_mode = "cpu", f"none: Triton's interpreter on {platform.machine()}", "interpreter"
        how = "wall clock"
    return {
        "arch": arch,
        "aotattn": aotattn.__version__,
        "tuning": ("none: the interpreter runs fixed configurations" if arch == "cpu"
                   else tuning_revision(tuning.database().root, arch)),
        "triton": triton_version,
        "torch": torch.__version__,
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": run_mode,
        "timing": (f"median of {plan.rounds} interleaved rounds x {plan.reps} samples after {plan.warmup} warm-up "
                   f"calls ({how}"
                   + (f", each behind a {plan.hide_host_ms:g} ms GPU wait that hides the host's work"
                      if plan.hide_host_ms else "")
                   + f"; training entries: back to back, no flush, {plan.training_reps} samples a round); "
                   "spread = largest - smallest round median"),
        "command": command or shell_line(["aotattn", *sys.argv[1:]]),
    }


def run(entries: Iterable[Entry], device: torch.device, options: Options, tag: str,
        on_entry: Callable[[Entry, list[Record], float], None] = lambda e, r, s: None,
        command: str | None = None) -> Perfdb:
    """Measure ``entries`` one after another into a new :class:`Perfdb`."""
    db = Perfdb(header={"tag": tag, **environment(device, options.plan, command)})
    for entry in entries:
        start = time.monotonic()
        records = measure_entry(entry, device, options)
        db.add(entry, records)
        on_entry(entry, records, time.monotonic() - start)
    return db
