"""The README's Hugging Face recipe (issue 16, item 4), run as written: its code block is
executed, then a tiny randomly initialised Llama (no download) runs with
``attn_implementation="aotattn"`` against transformers' eager attention, with padding,
grouped-query heads, generation and a training step."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # the [test] extra installs it

README = Path(__file__).resolve().parents[1] / "README.md"


def recipe() -> str:
    text = README.read_text()
    found = re.search(r"<!-- the block below is executed by tests/test_readme.py -->\n```python\n(.*?)```", text,
                      re.DOTALL)
    assert found, "the README lost its marked transformers recipe"
    return found.group(1)


@pytest.fixture(scope="module")
def models():
    """(aotattn model, eager model) with the same random weights, and the calls to aotattn."""
    namespace: dict = {}
    exec(compile(recipe(), str(README), "exec"), namespace)
    calls = []
    registered = namespace["aotattn_attention"]

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return registered(*args, **kwargs)

    transformers.AttentionInterface.register("aotattn", counted)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    eager = transformers.LlamaForCausalLM(copy.deepcopy(config))
    eager.set_attn_implementation("eager")
    ours = transformers.LlamaForCausalLM(copy.deepcopy(config))
    ours.load_state_dict(eager.state_dict())
    ours.set_attn_implementation("aotattn")
    return ours, eager, calls


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 11 tokens, the second left-padded by 3."""
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask


def test_the_recipe_matches_eager_attention_with_and_without_padding(models):
    ours, eager, calls = models
    ids, mask = inputs(torch.seed() % 2**31)
    with torch.no_grad():
        for m in (ours, eager):
            m.eval()
        del calls[:]
        assert torch.allclose(ours(ids).logits, eager(ids).logits, atol=1e-5, rtol=1e-5)
        assert len(calls) == 2 and calls[0] == (2, 4, 11, 16)  # both layers ran through aotattn
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
        assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
        assert torch.allclose(got[1, 3:], want[1, 3:], atol=1e-5, rtol=1e-5)  # padded rows: see the README
        new = [m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)[:, 11:] for m in (ours, eager)]
    assert torch.equal(new[0], new[1])


def test_the_recipe_trains_like_eager_attention(models):
    ours, eager, _ = models
    ids, mask = inputs(torch.seed() % 2**31)
    labels = ids.clone()
    labels[1, :4] = -100  # no loss on what a padded position predicts (eager spreads its row)
    for m in (ours, eager):
        m.train()
        m.zero_grad()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_the_versions_the_readme_names_are_the_ones_installed_and_pinned():
    """"Tested together" stays true: the README's torch and Triton are CI's and the pins."""
    text = README.read_text()
    project = README.with_name("pyproject.toml").read_text()
    ci = README.parent.joinpath(".ci", "run").read_text()
    triton_pin = re.search(r'"triton==([\d.]+)"', project).group(1)
    torch_pin = re.search(r"torch==([\d.]+)", ci).group(1)
    assert f"Triton {triton_pin}" in text and f"pinned to {triton_pin}" in text
    assert f"torch {torch_pin} (CPU)" in text and text.count(f"pip install torch=={torch_pin} ") == 2
    # numpy: the installed minor is one the line names (CI's 2.3; 2.4 by hand, RESULTS.md
    # fifty-seventh session), and no upper pin is left to contradict it
    tested = re.search(r"Tested together:(.*?)\n\n", text, re.S).group(1)
    named = re.search(r"numpy ([\d.]+(?: and [\d.]+)*)", tested).group(1).split(" and ")
    assert ".".join(np.__version__.split(".")[:2]) in named, (np.__version__, named)
    assert not re.search(r'"numpy\s*<', project)


def _registered():
    namespace: dict = {}
    exec(compile(recipe(), str(README), "exec"), namespace)
    return namespace["aotattn_attention"]


def test_the_recipe_refuses_softcapping_instead_of_dropping_it():
    """Gemma 2 passes softcap: the recipe dropped it (1.9e-3 off eager at a cap of 0.02);
    transformers' own SDPA refuses it, and so does the recipe now, as it does sinks."""
    transformers.AttentionInterface.register("aotattn", _registered())
    config = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       attn_logit_softcapping=0.02, max_position_embeddings=64)
    model = transformers.Gemma2ForCausalLM(config)
    model.set_attn_implementation("aotattn")
    with torch.no_grad(), pytest.raises(ValueError, match="no logit softcapping or attention sinks"):
        model(torch.randint(0, 97, (1, 7)))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_the_recipe_adds_a_position_bias_to_the_scores(mask_kind):
    """transformers' SDPA adds ``position_bias`` (T5-like relative positions) to the scores,
    with the padding mask and causality: so does the recipe (it dropped it before)."""
    attend = _registered()
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(2, 4, 9, 16, dtype=torch.float64).float() for _ in range(3))
    bias = torch.randn(1, 4, 9, 9)
    keep = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    keep[1, :, :, :2] = False  # left padding of the second sequence
    mask = {"none": None, "bool": keep, "float": torch.zeros(2, 1, 9, 9).masked_fill(~keep, float("-inf"))}[mask_kind]
    out, _ = attend(module, q, k, v, mask, position_bias=bias)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 4.0 + bias.double()
    visible = keep if mask is not None else torch.ones(9, 9, dtype=torch.bool).tril()
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    want = (weights @ v.double()).transpose(1, 2)
    rows = slice(2, None) if mask is not None else slice(None)  # rows that see no key: 0 here, see the README
    assert torch.allclose(out[1, rows].double(), want[1, rows], atol=1e-5)
    assert torch.allclose(out[0].double(), want[0], atol=1e-5)
