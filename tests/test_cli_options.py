"""Nonsense options of the tools' command lines end in one line naming the option, before
any work: each case was accepted (or ended as an internal error) until the fortieth
session's hostile pass. No database and no GPU is needed: every check comes first."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from aotattn.cli import app


@pytest.mark.parametrize("args, words", [
    # the tuner: a device it cannot use, a deadline that is no time, a database that is not there
    (["tune", "run", "/dev/null", "--results", "{tmp}/r", "--device", "gpu"], "--device"),
    (["tune", "run", "/dev/null", "--results", "{tmp}/r", "--deadline-s", "nan"], "--deadline-s"),
    (["tune", "run", "/dev/null", "--results", "{tmp}/r", "--deadline-s", "-5"], "--deadline-s"),
    (["tune", "plan", "-c", "flash,attn_fwd", "--tuning-db", "{tmp}/nowhere"], "no tuning database at"),
    (["tune", "plan", "-c", "flash,attn_fwd", "--tuning-db", "/etc/passwd"], "no tuning database at"),
    (["tune", "checkout", "-o", "{tmp}/b.json", "--minutes", "nan"], "--minutes"),  # claimed every task
    (["tune", "checkout", "-o", "{tmp}/b.json", "--minutes", "-5"], "--minutes"),
    (["tune", "checkout", "-o", "{tmp}/b.json", "--gpus", "0"], "--gpus"),
    (["tune", "checkout", "-o", "{tmp}/b.json", "--max-kernels", "-1"], "--max-kernels"),
    # the tuner's selection: an empty list selected every value; an output that is a folder
    (["tune", "plan", "-c", "flash,attn_fwd", "--seqlen", ",,,"], "--seqlen"),
    (["tune", "plan", "-c", "flash,attn_fwd_ws", "--arch", "sm_80"], "run only on other architectures"),
    # a batch's settings were fixed at dispatch: checkout has no --limit or --tokens to ignore
    (["tune", "checkout", "-o", "{tmp}/b.json", "--limit", "1"], "--limit"),
    (["tune", "checkout", "-o", "{tmp}/b.json", "--tokens", "4096"], "--tokens"),
    (["tune", "plan", "-c", "flash,attn_fwd", "--head-dim", ""], "--head-dim"),
    (["tune", "plan", "-c", "flash,attn_fwd", "--seqlen", "1024", "--head-dim", "64", "--out", "{tmp}"],
     "a folder, not a file"),
    # perfmon: a budget that is no time, GPU lists that start no worker or two on one GPU
    (["perfmon", "list", "--budget", "nan"], "--budget"),
    (["perfmon", "list", "--budget", "-5"], "--budget"),
    (["perfmon", "worker", "--gpus", ""], "--gpus"),
    (["perfmon", "worker", "--gpus", "0,0"], "each GPU once"),
    (["perfmon", "worker", "--gpus", "a"], "--gpus"),
    (["perfmon", "dispatch", "--tag", "t", "--arch", "sm_1000"], "unknown architecture 'sm_1000'"),
    # plots: a dtype or group that is a path
    (["perfdb", "plot", "x", "--dtype", "a/b"], "--dtype"),
    (["perfdb", "plot", "x", "--group", "../up"], "--group"),
])
def test_bad_options_are_refused_in_one_line(args, words, tmp_path):
    result = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert result.exit_code in (1, 2) and words in result.output, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "r").exists()


def test_a_plot_is_written_where_it_says(tmp_path):
    """savefig added ".png" to a name without it (and "wrote" named the other path); a folder
    takes the default name inside it; a one-head-dim run gets a figure its title fits."""
    from matplotlib.image import imread

    for out, expected in ((tmp_path / "plain", tmp_path / "plain"),
                          (tmp_path, tmp_path / "h200-20261130-tuned-badpatch.dense-bf16.png")):
        result = CliRunner().invoke(app, ["perfdb", "plot", "h200-20261130-tuned-badpatch", "--out", str(out)])
        assert result.exit_code == 0 and f"wrote {expected}" in result.output.replace("\n", ""), result.output
        assert expected.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert imread(expected, format="png").shape[1] >= 900  # 8.5 inches at 110 dpi
    assert not (tmp_path / "plain.png").exists()


@pytest.mark.parametrize("value", ["2", "maybe", ""])
def test_an_odd_aotattn_debug_value_stops_no_command(value):
    """click parsed AOTATTN_DEBUG as --debug's flag and refused 2 with a usage error for every
    subcommand; the variable is read as documented (1/true/yes/on turn tracebacks on)."""
    result = CliRunner().invoke(app, ["tuning", "lint"], env={"AOTATTN_DEBUG": value})
    assert result.exit_code == 0 and "problem(s)" in result.output, result.output
