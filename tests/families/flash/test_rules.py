"""The declarative kernel descriptions agree with the Triton sources they describe."""

from __future__ import annotations

import importlib
import inspect

import pytest

from aotattn.families.flash import rules
from aotattn.spec import Config


@pytest.mark.parametrize("spec", list(rules.KERNELS.values()), ids=lambda s: s.name)
def test_arguments_and_constexprs_match_the_source(spec):
    params = list(inspect.signature(getattr(importlib.import_module(spec.module), spec.function).fn).parameters)
    runtime = [a.name for a in spec.arguments]
    assert params[:len(runtime)] == runtime
    functional = next(spec.enumerate_functionals())
    config = Config.of({name: choices[0] for name, choices in spec.tuning_space})
    assert set(params[len(runtime):]) == set(spec.constexprs(functional, config))


@pytest.mark.parametrize("spec", list(rules.KERNELS.values()), ids=lambda s: s.name)
def test_every_functional_has_a_signature(spec):
    for functional in spec.enumerate_functionals():
        sig = spec.signature(functional)
        assert all("{" not in t for t in sig.values())


def test_disabled_combinations():
    f = dict(dtype="bf16", BLOCK_D=64, BLOCK_DV=32, PAD_HEAD=True, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0)
    with pytest.raises(ValueError, match="disabled"):
        rules.ATTN_FWD.check_functional(f)
    with pytest.raises(ValueError, match="disabled"):
        rules.ATTN_FWD.check_functional({**f, "BLOCK_DV": 64, "VARLEN": True, "BIAS": 1})
    rules.ATTN_FWD.check_functional({**f, "BLOCK_DV": 64})
