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
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")  # one per line of a provider and mask


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


def _call_fields(entry) -> tuple[tuple[str, object], ...]:
    """What stays the same along one line: the call but its sequence length, the batch the
    grid derives from it (B = 16384 / S), its mask (the line's style) and head dim (the panel).
    The tokens per call tell models apart (bert-large and distilbert at the same S and D);
    varlen packs about 16k tokens whatever its longest sequence."""
    return (("Hq", entry.heads_q), ("g", entry.group_size), ("Dv", entry.head_dim_v), ("api", entry.api),
            ("dropout", entry.dropout_p), ("bias", entry.bias), ("det", int(entry.deterministic)),
            ("training", int(entry.training)),
            ("tokens", None if entry.api == "varlen" else entry.batch * entry.seqlen_q))


def series(db: Perfdb, group: str, dtype: str
           ) -> dict[tuple[int, str], dict[tuple[str, str, str], list[tuple[int, float]]]]:
    """(head dim, pass) -> (provider, mask, line) -> [(seqlen, TFLOP/s)], square entries of
    one group and dtype with no mask or a causal one.

    One line per distinct call: entries that differ in more than the sequence length (group
    size, Dv, bias kind, model) each get their own, never one zigzag over both. ``line`` tells
    a panel's lines apart: '' where one line per provider and mask is all there is, the
    entry's name where every line is one entry (models), else the fields that differ
    (``g=4``, ``Dv=128``, ``bias=bias-grad``).
    """
    found: dict = defaultdict(lambda: defaultdict(list))
    for r in db.records:
        e = db.entries[r.entry]
        if (not r.ok or e.group != group or e.dtype != dtype or e.seqlen_q != e.seqlen_k
                or e.mask_name not in _STYLES or r.tflops is None):
            continue
        found[(e.head_dim, r.pass_)][(r.provider, e.mask_name, _call_fields(e))].append((e.seqlen_q, r.tflops, e.name))
    out = {}
    for panel, lines in sorted(found.items()):
        apart: dict = {}
        for (provider, mask, fields), points in lines.items():
            if len({x for x, _, _ in points}) < len(points):  # the same call under two names: one line each
                for point in points:
                    apart.setdefault((provider, mask, fields + (("entry", point[2]),)), []).append(point)
            else:
                apart[(provider, mask, fields)] = points
        named = [dict(fields) for _, _, fields in apart]
        differ = [k for k in dict.fromkeys(k for fields in named for k in fields)
                  if len({repr(fields.get(k)) for fields in named}) > 1]
        several = len({(provider, mask) for provider, mask, _ in apart}) < len(apart)
        by_entry = all(len({name for _, _, name in points}) == 1 for points in apart.values())

        def label(fields, points) -> str:
            if not several:
                return ""
            if by_entry:
                return points[0][2]
            values = dict(fields)
            return " ".join(f"{k}={values[k]}" for k in differ if values.get(k) is not None)

        out[panel] = {(provider, mask, label(fields, points)): sorted((x, y) for x, y, _ in points)
                      for (provider, mask, fields), points in apart.items()}
    return out


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
    color = colors(sorted({provider for lines in data.values() for provider, _, _ in lines},
                          key=lambda p: (_order(p), p)))
    kinds = sorted({line for lines in data.values() for _, _, line in lines})
    marker = {line: _MARKERS[i % len(_MARKERS)] for i, line in enumerate(kinds)}
    passes = [p for p in ("fwd", "bwd", "fwdbwd") if any(q == p for _, q in data)]
    # at least 8.5 inches wide: the title and the legend's four columns fit one head dim's panel too
    fig = Figure(figsize=(max(4.2 * len(dims), 8.5), 3.4 * len(passes) + 0.8), layout="constrained")
    axes = fig.subplots(len(passes), len(dims), squeeze=False, sharex=True)
    for row, pass_ in enumerate(passes):
        for col, dim in enumerate(dims):
            ax = axes[row][col]
            for (provider, mask, line), points in sorted(data.get((dim, pass_), {}).items(),
                                                         key=lambda item: (_order(item[0][0]), *item[0][1:])):
                xs, ys = zip(*points)
                ax.plot(xs, ys, _STYLES[mask], marker=marker[line], markersize=3 if not line else 4,
                        color=color[provider], linewidth=2.2 if provider == "aotattn" else 1.2,
                        label=f"{provider} ({mask}{', ' + line if line else ''})")
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
    if any(kinds):  # a provider x mask x line legend would outgrow the figure: one key for each
        from matplotlib.lines import Line2D

        masks = [m for m in _STYLES if any(m == mask for lines in data.values() for _, mask, _ in lines)]
        handles = {**{p: Line2D([], [], color=c, linewidth=2.2 if p == "aotattn" else 1.2) for p, c in color.items()},
                   **{m: Line2D([], [], color="0.4", linestyle=_STYLES[m]) for m in masks},
                   **{k: Line2D([], [], color="0.4", marker=marker[k], linestyle="none") for k in kinds if k}}
        labels = list(handles)
    width = fig.get_figwidth()
    columns = max(1, min(4, int(width / (0.06 * max(map(len, labels)) + 0.7))))  # about 0.06 in a character
    fig.legend([handles[label] for label in labels], labels, loc="outside lower center", ncol=columns, fontsize=8)
    header = db.header
    apart = sorted({token.split("=")[0] for line in kinds for token in line.split() if "=" in token})
    lines = ("\none line per entry (markers)" if any(line and "=" not in line for line in kinds) else
             f"\none line per {', '.join(apart)} (markers)" if apart else "")
    fig.suptitle(title or f"{group}, {dtype}: {header.get('gpu', '?')}; aotattn {header.get('aotattn', '?')}, "
                 f"tuning {header.get('tuning', '?').split(' ')[0]}, {header.get('date', '?')[:10]}{lines}",
                 fontsize=10)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, format="png")  # at ``out`` as named (savefig added ".png" to a name without it)
    return out
