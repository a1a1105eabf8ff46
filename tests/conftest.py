"""pytest wiring: a mutant when ``AOTATTN_MUTANT`` names one, the GPU marker, hypothesis
profiles, NaN-poisoned allocations. Helpers live in :mod:`tests.helpers`."""

from __future__ import annotations

# Before anything imports aotattn: with AOTATTN_MUTANT set, the named mutant's module
# source replaces the real one for this whole run (tests/mutants; never shipped).
from tests.mutants.loader import install_from_environment

install_from_environment()

import gc  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from tests.helpers import HAS_CUDA  # noqa: E402

# Fuzzing budgets (tests/test_fuzz.py). "ci" is the default: a fixed, small set of
# examples (derandomized, so CI is reproducible). "long" explores: run it with
# `python -m pytest tests/test_fuzz.py --hypothesis-profile=long` (add `-m gpu` with
# AOTATTN_MODE=jit on the GPU, and AOTATTN_FUZZ_SHARDS=8 -n 8 to share each property's
# examples among eight workers).
_FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                   HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=12, derandomize=True, print_blob=True, **_FUZZ)
settings.register_profile("long", max_examples=400, print_blob=True, **_FUZZ)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_FACTORIES = ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"), (torch.Tensor, "new_empty"))


def _poisoned(factory):
    def allocate(*args, **kwargs):
        t = factory(*args, **kwargs)
        if t.dtype.is_floating_point or t.dtype.is_complex:
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    return allocate


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """Every float tensor from ``torch.empty``, ``empty_like``, ``empty_strided`` and
    ``Tensor.new_empty`` starts as NaN, in the operators and in the tests alike, so an
    element a kernel leaves unwritten fails loudly instead of passing on stale zeros."""
    for owner, name in _FACTORIES:
        monkeypatch.setattr(owner, name, _poisoned(getattr(owner, name)))


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """After each test, the memory its process's caching allocator keeps goes back to the
    GPU: eight workers share one, and blocks cached by one worker's large test made
    another's allocation fail (CUDA out of memory with 1-2 GiB allocated, H200 suite)."""
    yield
    if HAS_CUDA:
        gc.collect()
        torch.cuda.empty_cache()
