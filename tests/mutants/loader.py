"""Loading a mutant: ``AOTATTN_MUTANT=<name>`` puts the mutated source in place of the module.

The mutated file is written to a temporary folder and an import hook placed first on
``sys.meta_path`` answers for the module's name with it, before anything imports
aotattn. Everything that loads the module by name then gets the mutant: the operators
(``from aotattn.families.flash.checks import ...``), Triton's JIT through
``aotattn.runtime.launcher.jit_function`` (``importlib.import_module``) and the
interpreter's second copy (``aotattn.runtime.interpreter`` loads the file that
``importlib.util.find_spec`` names). A mutant exists only as source, so a run with one
compiles with the JIT on GPUs (``AOTATTN_MODE=jit``); prebuilt images hold the real kernels.
A mutant of a forward kernel also makes every forward that kernel serves run it
(:func:`force_forward_engine`): on GPUs the ``flash.forward`` table would otherwise choose
the other kernel at most of the tests' cells, and the mistake would go unseen.

Used from ``tests/conftest.py`` only; nothing under ``aotattn/`` knows about mutants.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tests.mutants import BY_NAME, Mutant

VAR = "AOTATTN_MUTANT"
# The forward engine to force without a mutant: the mutation run's baseline, which runs the
# killer tests unmutated on the engine their mutants will force.
ENGINE_VAR = "AOTATTN_MUTANT_ENGINE"
ROOT = Path(__file__).resolve().parents[2]


class MutantError(RuntimeError):
    """A mutant that cannot be applied: unknown, or its anchor drifted."""


def mutated_source(mutant: Mutant) -> str:
    """The file's source with the mutant's edits applied (each snippet must occur once)."""
    source = (ROOT / mutant.path).read_text()
    for snippet, replacement in mutant.edits:
        count = source.count(snippet)
        if count != 1:
            raise MutantError(f"mutant {mutant.name}: {snippet!r} occurs {count} times in {mutant.path}, expected 1; "
                              f"update it in tests/mutants/__init__.py to match the code")
        source = source.replace(snippet, replacement)
    return source


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, path: Path) -> None:
        self.module = module
        self.path = path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path)


def install(name: str) -> Mutant:
    """Make later imports of the mutant's module load its mutated source."""
    mutant = BY_NAME.get(name)
    if mutant is None:
        raise MutantError(f"{VAR}: expected one of {sorted(BY_NAME)}, got {name!r}")
    if mutant.module in sys.modules:
        raise MutantError(f"{VAR}={name}: {mutant.module} was imported before the mutant could be installed")
    folder = Path(tempfile.mkdtemp(prefix=f"aotattn-mutant-{name}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / Path(mutant.path).name
    path.write_text(mutated_source(mutant))
    sys.meta_path.insert(0, _Finder(mutant.module, path))
    os.environ["AOTATTN_MODE"] = "jit"
    return mutant


def force_forward_engine(engine: str) -> None:
    """From now on, every forward runs ``engine``'s kernel wherever it serves the call
    (``triton`` serves every call; ``ws`` the ones :func:`rules.ws_serves` names, on sm_90),
    whatever the ``flash.forward`` table says."""
    from aotattn.families.flash import planning, rules
    from aotattn.runtime.device import arch_of

    table_choice = planning.choose_engine

    def choose_engine(c, device, functional=None):
        if engine == "triton":
            return "triton"
        functional = c.functional() if functional is None else functional
        if device.type == "cuda" and rules.ws_serves(functional, arch_of(device)):
            return engine
        return table_choice(c, device, functional)

    planning.choose_engine = choose_engine


def install_from_environment() -> Mutant | None:
    name = os.environ.get(VAR)
    mutant = install(name) if name else None
    engine = mutant.forward_engine if mutant else os.environ.get(ENGINE_VAR)
    if engine:
        force_forward_engine(engine)
    return mutant
