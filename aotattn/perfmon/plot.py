"""TFLOP/s against sequence length, per head dim and pass, aotattn beside its peers (PNG)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from aotattn.perfmon.perfdb import Perfdb, PerfdbError
from aotattn.perfmon.providers import ALL

_COLORS = {"aotattn": "#d62728", "aotattn:split": "#ff9896", "aotattn:fused": "#9467bd", "aotattn:ws": "#8c564b",
           "sdpa-flash": "#1f77b4", "sdpa-cudnn": "#2ca02c", "sdpa-efficient": "#7f7f7f", "flex": "#ff7f0e"}
_SPARE = ("#e377c2", "#bcbd22", "#17becf", "#000000")  # a provider named nowhere above, in order of appearance
_STYLES = {"none": "-", "causal": "--"}


def _order(provider: str) -> int:
    """Where a provider's lines and legend entries go: providers.ALL's order, others after."""
    return ALL.index(provider) if provider in ALL else len(ALL)


def colors(providers: Iterable[str]) -> dict[str, str]:
    """One color per provider, the same for its causal and unmasked lines; none shared while the spares last."""
    spare = iter(c for c in _SPARE if c not in _COLORS.values())
    found = {}
    for provider in providers:
        if provider not in found:
            found[provider] = _COLORS.get(provider) or next(spare, "#000000")
    return found


def series(db: Perfdb, group: str, dtype: str) -> dict[tuple[int, str], dict[tuple[str, str], list[tuple[int, float]]]]:
    """(head dim, pass) -> (provider, mask) -> [(seqlen, TFLOP/s)], square entries of one
    group and dtype with no mask or a causal one."""
    found: dict = defaultdict(lambda: defaultdict(list))
    for r in db.records:
        e = db.entries[r.entry]
        if (not r.ok or e.group != group or e.dtype != dtype or e.seqlen_q != e.seqlen_k
                or e.mask_name not in _STYLES or r.tflops is None):
            continue
        found[(e.head_dim, r.pass_)][(r.provider, e.mask_name)].append((e.seqlen_q, r.tflops))
    return {k: {s: sorted(points) for s, points in v.items()} for k, v in sorted(found.items())}


def plot(db: Perfdb, out: Path | str, group: str = "dense", dtype: str = "bf16", title: str | None = None) -> Path:
    """Write the PNG; raises :class:`PerfdbError` when the run has nothing to draw."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PerfdbError("plotting needs matplotlib: pip install 'aotattn[perf]'") from exc

    data = series(db, group, dtype)
    if not data:
        raise PerfdbError(f"nothing to plot: no measured square {group} entries in {dtype} "
                          f"(pick another with --group/--dtype)")
    dims = sorted({d for d, _ in data})
    color = colors(sorted({provider for lines in data.values() for provider, _ in lines}, key=lambda p: (_order(p), p)))
    passes = [p for p in ("fwd", "bwd", "fwdbwd") if any(q == p for _, q in data)]
    # at least 8.5 inches wide: the title and the legend's four columns fit one head dim's panel too
    fig = Figure(figsize=(max(4.2 * len(dims), 8.5), 3.4 * len(passes) + 0.8), layout="constrained")
    axes = fig.subplots(len(passes), len(dims), squeeze=False, sharex=True)
    for row, pass_ in enumerate(passes):
        for col, dim in enumerate(dims):
            ax = axes[row][col]
            for (provider, mask), points in sorted(data.get((dim, pass_), {}).items(),
                                                   key=lambda item: (_order(item[0][0]), item[0][1])):
                xs, ys = zip(*points)
                ax.plot(xs, ys, _STYLES[mask], marker="o", markersize=3, color=color[provider],
                        linewidth=2.2 if provider == "aotattn" else 1.2, label=f"{provider} ({mask})")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{pass_}, head dim {dim}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("TFLOP/s")
            if row == len(passes) - 1:
                ax.set_xlabel("sequence length")
    handles, labels = {}, []
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="outside lower center", ncol=4, fontsize=8)
    header = db.header
    fig.suptitle(title or f"{group}, {dtype}: {header.get('gpu', '?')}; aotattn {header.get('aotattn', '?')}, "
                 f"tuning {header.get('tuning', '?').split(' ')[0]}, {header.get('date', '?')[:10]}", fontsize=10)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, format="png")  # at ``out`` as named (savefig added ".png" to a name without it)
    return out
