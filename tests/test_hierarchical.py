"""The hierarchical drafter: exact for the target (greedy identity, T > 0 chi-square), and what the
top drafter and the intermediate model are told. The registry-wide invariants (tests/test_exactness.py,
test_seams.py) cover it too, through its `test_options`."""

import pytest
import torch

import specdec
from specdec.drafters import build, build_for_tests
from specdec.drafters.hierarchical import EXTRA_NODE_ID
from specdec.loop.reference import reference_generate
from specdec import certify
from specdec.certify import ALPHA, distribution_case
from specdec.certify import GREEDY_PROMPTS as PROMPTS

SHAPES = ["chain(3)", "tree(3,2,2)", "dynamic(top_k=3,depth=4,budget=10)"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("top,top_options", [("eagle", {"head": "random"}), ("small", {}), ("ngram", {})])
def test_greedy_output_equals_reference(tiny_llama64, shape, top, top_options):
    drafter = build("hierarchical", target=tiny_llama64, top=top, top_options=top_options, mid_quant="rtn4_g16")
    for prompt in PROMPTS:
        ref = reference_generate(tiny_llama64, prompt, max_new_tokens=20, stop_on_eos=False)
        out = specdec.generate(tiny_llama64, drafter, prompt, shape=shape, max_new_tokens=20, stop_on_eos=False)
        assert out.token_ids == ref, f"hierarchical({top}) {shape} diverged from greedy on {prompt}"
        assert all(s.draft_depth == s.drafted for s in out.stats.steps), "the target must see a chain"


def test_an_intermediate_equal_to_the_target_is_always_accepted(tiny_llama64):
    """With the target itself as the intermediate, the target accepts every chain node."""
    drafter = build("hierarchical", target=tiny_llama64, top="small", mid=tiny_llama64)
    out = specdec.generate(tiny_llama64, drafter, PROMPTS[0], shape="tree(2,2)", max_new_tokens=20,
                           stop_on_eos=False)
    assert all(s.accepted == s.drafted for s in out.stats.steps)
    assert out.stats.mean_acceptance_length > 1.0


class RecordingTop:
    """Test-only top drafter: the `small` drafter, recording every Step it is told."""

    def __init__(self, inner):
        self.inner, self.name, self.steps = inner, "recording", []
        self.reset, self.propose = inner.reset, inner.propose

    def commit(self, step):
        self.steps.append(step)
        self.inner.commit(step)


def test_top_drafter_hears_steps_in_its_own_node_ids(tiny_llama64):
    top = RecordingTop(build("small", target=tiny_llama64))
    drafter = specdec.drafters.hierarchical.HierarchicalDrafter(top, tiny_llama64, target=tiny_llama64)
    out = specdec.generate(tiny_llama64, drafter, PROMPTS[1], shape="tree(2,2)", max_new_tokens=16,
                           stop_on_eos=False)
    committed = PROMPTS[1] + out.token_ids
    extra = 0
    for step in top.steps[1:]:
        path, draft = step.acceptance.path, step.draft
        length = step.token_ids.shape[1]
        # The path's tokens and the next token are exactly what the target committed.
        new = draft.tokens[0, path].tolist() + [step.acceptance.next_token]
        assert new == committed[length - len(new):length] and step.num_new == [len(new)]
        assert step.target_hidden.shape[1] == step.positions.shape[1] == len(path) + 1
        ids = step.accepted_node_ids().tolist()
        assert ids[:-1] == [int(draft.node_ids[i]) for i in path[:-1]] and EXTRA_NODE_ID not in ids[:-1]
        extra += ids[-1:] == [EXTRA_NODE_ID]
    assert extra > 0  # the intermediate's own next token was committed at least once


def test_options_are_checked(tiny_llama64):
    with pytest.raises(ValueError, match="cannot be 'hierarchical'"):
        build("hierarchical", target=tiny_llama64, top="hierarchical")
    with pytest.raises(KeyError, match="unknown drafter"):
        build("hierarchical", target=tiny_llama64, top="nope", mid_quant="rtn8_pc")
    other = specdec.tiny_target("llama", vocab_size=32, dtype=torch.float64)
    with pytest.raises(ValueError, match="vocabulary"):
        build("hierarchical", target=tiny_llama64, top="ngram", mid=other)
    assert build_for_tests("hierarchical", target=tiny_llama64).name == "hierarchical"


def test_sampling_matches_the_target_distribution():
    """T > 0: a different tiny model as the intermediate (so its chains are often rejected) under
    garbage `random` trees; the harness of `specdec.certify` (1000 samples of the first 3 tokens)."""
    world = certify.tiny_world()
    drafter = build("hierarchical", target=world.target, top="random", mid=world.draft_model)
    result = distribution_case(world.target, drafter, "tree(2,2)", "plain", n=1000)
    assert result.rejections > 0 and result.p_value >= ALPHA, f"hierarchical: chi-square p = {result.p_value:.2e}"
