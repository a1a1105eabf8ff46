"""The kernels a run needs (planned through the public operators), and the bad-patch demo."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotattn import families, tuning
from aotattn.cli import app as cli
from aotattn.families.flash import rules
from aotattn.perfmon import images
from aotattn.perfmon.demo import bad_patch
from aotattn.perfmon.entries import declared
from aotattn.runtime import interpreter
from aotattn.spec import Config
from aotattn.tuning import Database

PROJECT_TUNING = Path(__file__).resolve().parents[2] / "tuning"
BY_NAME = {e.name: e for e in declared()}
SMALL = Config.of(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)


def test_jobs_are_the_database_configurations_of_every_kernel_a_call_runs():
    entry = BY_NAME["dense-bf16-d128-s4096-causal"]
    jobs = images.needed_jobs([entry], "sm_90")
    db = tuning.database()
    # the forward's kernel is the flash.forward table's choice for the cell (the ws one, tuned on the H200)
    forward = db.lookup("sm_90", rules.FORWARD, next(j.functional for j in jobs if j.table == "flash.attn_bwd_dq"),
                        {"seqlen_q": 4096, "seqlen_k": 4096})["engine"]
    assert forward == "ws"
    # every backend's kernels (perfmon times each; the ws backend serves this dense bf16 d128 cell)
    assert {j.table for j in jobs} == {"flash.attn_fwd_ws", "flash.attn_bwd_preprocess", "flash.attn_bwd_dkdv",
                                       "flash.attn_bwd_dq", "flash.attn_bwd_fused", "flash.attn_bwd_ws"}
    # padded heads too (perfmon forces each backend), not where it does not serve (dropout),
    # nor on an architecture without the kernel
    d96 = images.needed_jobs([BY_NAME["odd-dim-bf16-d96-s4096-causal"]], "sm_90")
    assert {"flash.attn_bwd_ws", "flash.attn_bwd_fused"} <= {j.table for j in d96}
    dropout = images.needed_jobs([BY_NAME["dropout-bf16-d64-s1024-causal-p0.1"]], "sm_90")
    assert "flash.attn_bwd_ws" not in {j.table for j in dropout} and "flash.attn_bwd_fused" in {j.table for j in dropout}
    d256 = images.needed_jobs([BY_NAME["dense-bf16-d256-s4096-causal"]], "sm_90")
    assert "flash.attn_bwd_ws" in {j.table for j in d256}  # the column split
    assert "flash.attn_bwd_ws" not in {j.table for j in images.needed_jobs([entry], "sm_80")}
    for job in jobs:
        spec = families.tables()[job.table]
        assert job.arch == "sm_90"
        assert job.config == db.lookup("sm_90", spec, job.functional, {"seqlen_q": 4096, "seqlen_k": 4096})
    # planning touched nothing for good, and kept nothing it planned for another architecture
    from aotattn.families.flash import ops

    plans = ops._PLANS
    assert rules.config_for.__module__ == "aotattn.families.flash.rules"
    assert interpreter.interpreted_function.__module__ == "aotattn.runtime.interpreter"
    twice = images.needed_jobs([entry, entry], "sm_90")
    assert twice == jobs and ops._PLANS is plans


def test_a_bad_patch_changes_the_jobs_and_only_where_it_says(tmp_path):
    root = tmp_path / "tuning"
    shutil.copytree(PROJECT_TUNING, root)
    with pytest.raises(ValueError, match="dtype"):
        bad_patch(root, "sm_90", ["flash.attn_bwd_dq"], "dtype=bf17", "BLOCK_M=32 BLOCK_N=32 num_warps=4 num_stages=1")
    for typo in ("dtpye=bf16 BLOCK_D=128", "garbage"):  # an unknown axis matched every block: all were damaged
        with pytest.raises(ValueError, match="--where"):
            bad_patch(root, "sm_90", ["flash.attn_bwd_dq"], typo, "BLOCK_M=32 BLOCK_N=32 num_warps=4 num_stages=1")
    assert not list(root.rglob("*-bad.dbpatch"))
    with pytest.raises(ValueError, match="no block matches"):
        bad_patch(root, "sm_90", ["flash.attn_bwd_dq"], "dtype=fp32 BLOCK_D=16 BIAS=2 DROPOUT=True VARLEN=True",
                  "BLOCK_M=32 BLOCK_N=32 num_warps=4 num_stages=1")
    with pytest.raises(ValueError, match="tuning knob"):
        bad_patch(root, "sm_90", ["flash.attn_bwd_dq"], "dtype=bf16", "BLOCK_Q=32")
    written = bad_patch(root, "sm_90", ["flash.attn_bwd_dkdv", "flash.attn_bwd_dq"], "dtype=bf16 BLOCK_D=128",
                        "BLOCK_M=32 BLOCK_N=32 num_warps=4 num_stages=1")
    # numbered after the patches the tables already have (the shipped database may carry tuned ones)
    assert [p.name.split(".")[1] for p in written] == ["attn_bwd_dkdv", "attn_bwd_dq"]
    assert all(p.name.endswith("-bad.dbpatch") for p in written)
    patched = Database(root)
    assert patched.lint() == []
    hit = images.needed_jobs([BY_NAME["dense-bf16-d128-s4096-full"]], "sm_90", patched)
    assert {j.config for j in hit if j.table in ("flash.attn_bwd_dkdv", "flash.attn_bwd_dq")} == {SMALL}
    assert all(j.config != SMALL for j in hit if j.table not in ("flash.attn_bwd_dkdv", "flash.attn_bwd_dq"))
    spared = images.needed_jobs([BY_NAME["dense-fp16-d128-s4096-full"]], "sm_90", patched)
    assert spared == images.needed_jobs([BY_NAME["dense-fp16-d128-s4096-full"]], "sm_90")
    again = bad_patch(root, "sm_90", ["flash.attn_bwd_dq"], "dtype=bf16 BLOCK_D=64",
                      "BLOCK_M=32 BLOCK_N=32 num_warps=4 num_stages=1", what="worse")
    number = int(written[1].name.split(".")[2].split("-")[0])
    assert again[0].name == f"flash.attn_bwd_dq.{number + 1:04d}-worse.dbpatch"  # the next layer


def test_cli_images_dry_run_and_bad_patch_guard(tmp_path):
    runner = CliRunner()
    listed = runner.invoke(cli, ["perfmon", "images", "--dry-run", "--match", "model-gpt2"])
    assert listed.exit_code == 0, listed.output
    jobs = images.needed_jobs([BY_NAME["model-gpt2"]], "sm_90")
    assert f"{len(jobs)} kernel(s) for 1 entries on sm_90" in listed.output
    refused = runner.invoke(cli, ["perfmon", "bad-patch", "--tuning-db", str(PROJECT_TUNING)])
    assert refused.exit_code != 0 and "a copy" in refused.output
    nothing = runner.invoke(cli, ["perfmon", "images", "--dry-run", "--match", "no-such-entry"])
    assert nothing.exit_code != 0 and "no entry matches" in nothing.output


SESSION_SCRIPTS = {"perfmon_session.sh": {("perfmon", "images"), ("perfmon", "run"), ("perfdb", "faults"),
                                            ("perfdb", "plot"), ("perfdb", "compare"), ("perfmon", "bad-patch")},
                   "flex_session.sh": {("perfmon", "images"), ("perfmon", "run"), ("perfdb", "summary")},
                   "odd_dims_session.sh": {("perfmon", "images"), ("perfmon", "run"), ("perfdb", "summary"),
                                           ("perfdb", "compare")},
                   "tune_cells_session.sh": {("tune", "plan"), ("tune", "export"), ("tuning", "lint"),
                                             ("perfmon", "images"), ("perfmon", "run"), ("perfdb", "summary"),
                                             ("perfdb", "compare")},
                   "gqa_l2_session.sh": {("tuning", "lint")},
                   "ws_session.sh": {("tune", "plan"), ("tune", "export"), ("tuning", "lint"),
                                     ("perfmon", "images"), ("perfmon", "run"), ("perfdb", "summary")}}


@pytest.mark.parametrize("name", sorted(SESSION_SCRIPTS))
def test_the_session_script_calls_only_commands_and_options_that_exist(name):
    """The GPU session scripts run where no one can fix a typo: every `aot <group> <command>
    --option` (or `python -m aotattn.cli ...`) they write must be one the CLI declares."""
    import re

    import typer.main

    script = (Path(__file__).resolve().parents[2] / "benchmarks" / name).read_text()
    joined = script.replace("\\\n", " ")
    group = typer.main.get_command(cli)
    calls = re.findall(r"(?:\baot|python -m aotattn\.cli) (perfmon|perfdb|tune|tuning) ([a-z-]+)([^;\n}&|]*)", joined)
    assert {(g, c) for g, c, _ in calls} >= SESSION_SCRIPTS[name]
    for sub, command_name, rest in calls:
        command = group.commands[sub].commands[command_name]
        declared = {opt for param in command.params for opt in param.opts}
        for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
            assert option in declared, f"{name}: aot {sub} {command_name}: no option {option}"
