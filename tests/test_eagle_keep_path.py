"""EAGLE's keep-path rollback (`refresh=False`) over multi-token accepted paths.

The random head on the tiny test models never gets more than one token accepted per step, so this
runs the embedded target with its shipped head, which accepts several: greedy output equals the
plain loop token for token, steps accepting >= 2 draft tokens occur (so the keep-path gathered
several block entries), and after every commit the head's cache holds exactly the pairs it has
consumed while the pairs still queued make up the rest of the committed sequence (L committed tokens
= L - 1 pairs), i.e. the kept entries are the accepted path's and nothing of a rejected sibling.
"""

import pytest

import specdec
from specdec.drafters.eagle import DEFAULT_DRAFT_VOCAB, EagleDrafter

pytestmark = pytest.mark.slow
PROMPTS = ["List the first ten prime numbers.", "Repeat after me: one two three, one two three, one two three."]


class Checked(EagleDrafter):
    """The shipped-head drafter, checking its own pair accounting after every commit."""

    def commit(self, step):
        super().commit(step)
        committed = step.token_ids.shape[1]
        assert self.cache.length == self.consumed
        assert self.consumed + self.features.shape[1] == committed - 1
        self.accepted_per_step.append(0 if step.is_prefill else step.acceptance.num_accepted)


@pytest.mark.parametrize("shape", ["chain(4)", "tree(3,2,2)"])
def test_keep_path_over_multi_token_paths_is_exact(embedded, shape):
    base = specdec.drafters.build("eagle", target=embedded, refresh=False)
    drafter = Checked(base.head, target=embedded, draft_vocab=DEFAULT_DRAFT_VOCAB, refresh=False)
    drafter.accepted_per_step = []
    for prompt in PROMPTS:
        plain = specdec.generate(embedded, None, prompt, max_new_tokens=24)
        out = specdec.generate(embedded, drafter, prompt, shape=shape, max_new_tokens=24)
        assert out.token_ids == plain.token_ids, f"{shape}: {prompt!r}"
    multi = sum(a >= 2 for a in drafter.accepted_per_step)
    print(f"{shape}: {multi} steps accepted >= 2 tokens, max {max(drafter.accepted_per_step)}")
    assert multi >= 3
