"""The mutant catalogue stays applicable, and every mutant is caught (CPU, in CI).

The full CPU run takes about three minutes on two cores (20 mutants, each a pytest
subprocess that stops at its first failure). The GPU run (28 mutants, the Gluon kernels' included) is the coordinator's:
``AOTATTN_MODE=jit python -m tests.mutants --device cuda``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.adiffs.cases import CASES
from tests.mutants import MUTANTS
from tests.mutants.loader import ROOT, VAR, MutantError, install, mutated_source

LESSONS = ROOT / "docs" / "numerical-lessons.md"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_snippet_matches_once_and_the_mutant_compiles(mutant):
    """A rewrite of the kernels that moves a snippet fails here, naming the mutant to update."""
    source = mutated_source(mutant)  # raises unless the snippet occurs exactly once
    assert source != (ROOT / mutant.path).read_text()
    compile(source, mutant.path, "exec")


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_killer_tests_exist(mutant):
    case_ids = {c.id for c in CASES}
    for node in mutant.node_ids("cpu"):
        file, _, test = node.partition("::")
        assert (ROOT / file).is_file(), f"{mutant.name}: no test file {file}"
        if not test:
            continue
        name, _, params = test.partition("[")
        assert re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.MULTILINE), f"{mutant.name}: no {test}"
        if name == "test_within_floor":
            assert params.removesuffix("-cpu]") in case_ids, f"{mutant.name}: no accuracy case {params}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_has_its_lesson(mutant):
    assert f"`{mutant.name}`" in LESSONS.read_text(), f"docs/numerical-lessons.md does not name mutant {mutant.name}"


def test_unknown_and_late_mutants_are_refused():
    with pytest.raises(MutantError, match="expected one of"):
        install("no-such-mistake")
    import aotattn.families.flash.checks  # noqa: F401  (already imported: too late to mutate)

    with pytest.raises(MutantError, match="was imported before"):
        install("window-right-minus-2")


# A cell of each Gluon kernel under a bottom-right mask: masked and unmasked blocks, both
# signs of the scale (a runtime branch), the forward's register store.
_DENSE = "dtype='fp16', BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=True, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0"
GLUON_JOBS = {
    "aotattn/families/flash/kernels/forward_ws.py": (
        "flash.attn_fwd_ws", _DENSE,
        "BLOCK_M=128, BLOCK_N=64, STAGES=2, PINGPONG=1, PERSISTENT=0, Q_SLOTS=1, TMA_STORE=0, num_warps=4, num_stages=1"),
    "aotattn/families/flash/kernels/backward_ws.py": (
        "flash.attn_bwd_ws", _DENSE + ", GROUPED=True, WIDE_GROUPS=False",
        "BLOCK_M=64, BLOCK_N=128, STAGES=2, num_warps=4, num_stages=1"),
}


def _compiled(path: str, mutant: str | None) -> str:
    """The sha256 of ``path``'s kernel compiled for sm_90 at its GLUON_JOBS cell (``mutant`` applied)."""
    kernel, functional, config = GLUON_JOBS[path]
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if mutant:
        env[VAR] = mutant
    # the hook goes in before aotattn is imported, as tests/conftest.py places it
    script = f"""
from tests.mutants.loader import install_from_environment
install_from_environment()
import hashlib
from aotattn.compiler.jobs import Job, compile_job
from aotattn.spec import Config, Functional
job = Job("sm_90", "{kernel}", Functional.of(dict({functional})), Config.of({config}))
print(hashlib.sha256(compile_job(job)[1]).hexdigest())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{mutant or path} does not compile for sm_90: {done.stderr[-3000:]}"
    return done.stdout.split()[-1]


@pytest.mark.parametrize("path", sorted(GLUON_JOBS), ids=lambda p: p.rsplit("/", 1)[-1])
def test_gluon_mutants_compile_for_sm_90_into_other_code(path):
    """The Gluon kernels' mutants run on GPUs only, where a mutant that failed to compile
    would count as caught: each compiles for sm_90 here, to another cubin than the real kernel's."""
    mutants = [m for m in MUTANTS if m.path == path]
    assert mutants, f"no mutant of {path}"
    real = _compiled(path, None)
    for mutant in mutants:
        assert _compiled(path, mutant.name) != real, f"{mutant.name} compiles to the real kernel's code"


def test_every_mutant_is_caught_on_cpu():
    """The mutation score is 100%: each mutant the CPU can run fails at least one of its
    killer tests (those of Gluon kernels run on GPUs only, and are counted as left).

    Without the unmutated baseline run: this suite's own run of the same tests is it."""
    done = subprocess.run([sys.executable, "-m", "tests.mutants", "--no-baseline"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    runs = sum(not m.gpu_only for m in MUTANTS)
    left = len(MUTANTS) - runs
    assert f"mutation score (cpu): {runs}/{runs} caught (100%); {left} mutants of Gluon kernels not run" in done.stdout


@pytest.mark.parametrize("jobs", [1, 3, 7, 500])
def test_baseline_names_the_group_that_fails(monkeypatch, jobs):
    """The baseline runs its (device, engine) groups at once, dealt into pieces for ``jobs``
    workers, runs every killer test once on its group's device and engine, and still reports the
    group whose killer tests fail unmutated, or None when all pass."""
    from tests.mutants import __main__ as cli

    engines = sorted({m.forward_engine for m in MUTANTS}, key=str)
    assert len(engines) > 1, "one group only: this test needs mutants that force different engines"
    broken = engines[-1]
    calls = []

    def fake_run(command, mutant, device, timeout, engine=None):
        at = max(i for i, arg in enumerate(command) if arg == "-m")  # ... -m <marker> ids...
        ids = command[at + 2:]
        calls.append(((device, engine), ids))
        assert mutant is None
        return (cli.FAILED, "FAILED tests/x.py::y - boom") if engine == broken else (cli.PASSED, "")

    monkeypatch.setattr(cli, "_run", fake_run)
    failure = cli.baseline(list(MUTANTS), "cpu", 60, jobs)
    assert failure is not None and f"forward engine {broken}" in failure and "boom" in failure
    expected = {}
    for m in MUTANTS:
        expected.setdefault(("cpu", m.forward_engine), set()).update(m.node_ids("cpu"))
    ran = [(group, i) for group, ids in calls for i in ids]
    assert len(ran) == len(set(ran)), "a killer test ran twice"
    assert {group: {i for g, i in ran if g == group} for group, _ in ran} == expected
    assert len(calls) >= min(jobs, len(ran)), f"{len(calls)} pieces for {jobs} jobs"
    monkeypatch.setattr(cli, "_run", lambda *a, **k: (cli.PASSED, ""))
    assert cli.baseline(list(MUTANTS), "cpu", 60, jobs) is None
