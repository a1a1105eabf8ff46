"""The mutant catalogue stays applicable, and every mutant is caught (CPU, in CI).

The full CPU run takes about three minutes on two cores (19 mutants, each a pytest
subprocess that stops at its first failure). The GPU run is the coordinator's:
``AOTATTN_MODE=jit python -m tests.mutants --device cuda``.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.adiffs.cases import CASES
from tests.mutants import MUTANTS
from tests.mutants.loader import ROOT, MutantError, install, mutated_source

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


def test_every_mutant_is_caught_on_cpu():
    """The mutation score is 100%: each mutant fails at least one of its killer tests.

    Without the unmutated baseline run: this suite's own run of the same tests is it."""
    done = subprocess.run([sys.executable, "-m", "tests.mutants", "--no-baseline"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"mutation score (cpu): {len(MUTANTS)}/{len(MUTANTS)} caught (100%)" in done.stdout
