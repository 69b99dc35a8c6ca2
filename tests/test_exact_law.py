"""The exact law of one verification step, with no sampling noise.

For random small vocabularies, random tree structures and random target / draft distributions
(generated with `hypothesis`), the law of the tokens one step commits is computed by enumerating
every draft the drafter can sample and every branch of the random draws of the real verifier
(`acceptance.accept` runs once per branch, its uniform and multinomial draws scripted and weighed
by their probabilities), so a bug in the acceptance walk itself moves the law: every acceptance
mutant of the certificate (`specdec.certify.mutants`) is shown to.
Continued by plain target sampling to a fixed length, that law must equal the target's own law of
the same token sequences to 1e-12. Covers point-mass siblings (deterministic tokens, duplicates
allowed) and sampled siblings with draft probabilities, i.i.d. or without replacement (the recorded
distribution of a later sibling is then the conditional one given the earlier siblings). The
chi-square tests in test_exactness.py remain the end-to-end check through the loop.
"""

from __future__ import annotations

import zlib
from collections import defaultdict

import torch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core import acceptance
from specdec.core.acceptance import acceptance_probability
from specdec.core import tree as tree_ops
from specdec.core.draft import Draft
from specdec.core.sampling import SamplingConfig
from specdec.certify.mutants import MUTANTS, mutated


class World:
    """Target and draft distributions as fixed functions of the context (a token tuple)."""

    def __init__(self, vocab: int, seed: int, zeros: bool):
        self.vocab, self.seed, self.zeros = vocab, seed, zeros
        self._cache: dict = {}

    def _dist(self, kind: str, context: tuple[int, ...]) -> torch.Tensor:
        key = (kind, context)
        if key not in self._cache:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, kind, context)).encode()))  # stable
            # across processes, unlike hash() of a str, which PYTHONHASHSEED randomizes
            probs = (3.0 * torch.randn(self.vocab, generator=g, dtype=torch.float64)).softmax(-1)
            if self.zeros:  # a top-k-like target or draft: some tokens impossible
                probs[torch.rand(self.vocab, generator=g) < 0.3] = 0.0
                probs[int(torch.randint(self.vocab, (), generator=g))] += 0.5  # never all zero
                probs = probs / probs.sum()
            self._cache[key] = probs
        return self._cache[key]

    def target(self, context):
        return self._dist("target", context)

    def draft(self, context):
        return self._dist("draft", context)


class _Draw:
    """A uniform draw U (times `scale`) the walk compares with an acceptance probability a: the
    comparison takes the scripted branch and weighs it by P(scale * U < a) or its complement."""

    def __init__(self, replay: "_Replay", scale: float = 1.0):
        self.replay, self.scale = replay, scale

    def __rmul__(self, other):
        return _Draw(self.replay, float(other) * self.scale)

    def __lt__(self, a):
        a = float(a)
        accept = min(1.0, a / self.scale) if self.scale > 0 else float(a > 0)
        return self.replay.choose([accept, 1.0 - accept]) == 0


class _Replay:
    """Stands in for `torch` inside the acceptance module: every random draw follows a script of
    branch choices (extending it with the first possible branch and queueing the others), and the
    run's weight is the product of the chosen branches' probabilities. Everything else is torch."""

    def __init__(self, script: list[int], queue: list[list[int]]):
        self.script, self.queue, self.taken, self.weight = script, queue, 0, 1.0

    def __getattr__(self, name):
        return getattr(torch, name)

    def choose(self, weights: list[float]) -> int:
        if self.taken < len(self.script):
            choice = self.script[self.taken]
        else:
            possible = [i for i, w in enumerate(weights) if w > 0]
            choice = possible[0]
            self.queue += [self.script[: self.taken] + [i] for i in possible[1:]]
            self.script = self.script + [choice]
        self.taken += 1
        self.weight *= weights[choice]
        return choice

    def rand(self, *args, **kwargs):
        return _Draw(self)

    def multinomial(self, probs, num_samples, **kwargs):
        weights = (probs / probs.sum()).tolist()
        return torch.tensor([self.choose(weights)])


def step_law(tokens: list[int], parents: list[int], draft_probs: list[torch.Tensor] | None,
             target_rows: list[torch.Tensor]) -> dict[tuple[int, ...], float]:
    """P(the step commits exactly this token sequence) for one fixed draft, by running the real
    `acceptance.accept` (T = 1 on logits log(target)) once per branch of its random draws.
    target_rows[i + 1] is the target after node i, row 0 after the root."""
    draft = Draft(torch.tensor([tokens]), torch.tensor(parents, dtype=torch.long),
                  None if draft_probs is None else torch.stack(draft_probs)[None])
    logits = torch.stack(target_rows).log()[None]  # [1, N + 1, V]: softmax(log target) = target
    law: dict[tuple[int, ...], float] = defaultdict(float)
    queue: list[list[int]] = [[]]
    saved = acceptance.torch
    try:
        while queue:
            replay = _Replay(queue.pop(), queue)
            acceptance.torch = replay
            decision = acceptance.accept(draft, logits, SamplingConfig(temperature=1.0), None)
            acceptance.torch = saved
            law[(*(tokens[i] for i in decision.path), decision.next_token)] += replay.weight
    finally:
        acceptance.torch = saved
    return law


def drafts(world: World, root: tuple[int, ...], parents: list[int], mode: str, fixed: list[int]):
    """Every draft the drafter can produce for this tree: (tokens, draft_probs or None, probability).
    point-mass: the one draft `fixed`; iid / without: each node's token sampled from the draft
    distribution after its path (without: earlier siblings' tokens removed, renormalised)."""
    if mode == "point-mass":
        yield fixed, None, 1.0
        return
    kids = tree_ops.children(torch.tensor(parents, dtype=torch.long))

    def extend(i: int, tokens: list[int], probs: list[torch.Tensor], weight: float):
        if i == len(parents):
            yield list(tokens), list(probs), weight
            return
        path, node = [], parents[i]
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        q = world.draft((*root, *reversed(path))).clone()
        if mode == "without":
            for sibling in kids[parents[i]]:
                if sibling == i:
                    break
                q[tokens[sibling]] = 0.0
            if q.sum() <= 0:
                return  # no token left for this sibling: the drafter would stop (not generated here)
            q = q / q.sum()
        for x in torch.nonzero(q).flatten().tolist():
            yield from extend(i + 1, [*tokens, x], [*probs, q], weight * float(q[x]))

    yield from extend(0, [], [], 1.0)


def target_rows(world: World, root: tuple[int, ...], tokens: list[int], parents: list[int]) -> list[torch.Tensor]:
    rows = [world.target(root)]
    for i in range(len(parents)):
        path, node = [], i
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        rows.append(world.target((*root, *reversed(path))))
    return rows


def continued(world: World, root: tuple[int, ...], law: dict, length: int) -> dict[tuple[int, ...], float]:
    """A law of variable-length prefixes, each continued by target sampling to `length` tokens."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    frontier = dict(law)
    while frontier:
        nxt: dict[tuple[int, ...], float] = defaultdict(float)
        for seq, p in frontier.items():
            if len(seq) == length:
                out[seq] += p
                continue
            for tok, q in enumerate(world.target((*root, *seq)).tolist()):
                if q > 0:
                    nxt[(*seq, tok)] += p * q
        frontier = nxt
    return out


@st.composite
def cases(draw):
    vocab = draw(st.integers(2, 4))
    n = draw(st.integers(1, 5))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
    mode = draw(st.sampled_from(["point-mass", "iid", "without"]))
    if mode != "point-mass":  # keep the enumeration small: V^N drafts
        parents = parents[: max(1, 4 if vocab <= 3 else 3)]
    fixed = [draw(st.integers(0, vocab - 1)) for _ in parents]
    return vocab, parents, mode, fixed, draw(st.integers(0, 2**31)), draw(st.booleans())


@settings(max_examples=120, deadline=None)
@given(cases())
def test_one_step_law_equals_the_target_law(case):
    vocab, parents, mode, fixed, seed, zeros = case
    world, root = World(vocab, seed, zeros), (0,)
    depth = int(tree_ops.depths(torch.tensor(parents, dtype=torch.long)).max())
    length = depth + 1  # the longest sequence one step can commit
    spec: dict[tuple[int, ...], float] = defaultdict(float)
    total = 0.0
    for tokens, probs, weight in drafts(world, root, parents, mode, fixed):
        total += weight
        for seq, p in step_law(tokens, parents, probs, target_rows(world, root, tokens, parents)).items():
            spec[seq] += weight * p
    if mode == "without" and total < 1 - 1e-12:
        return  # a sibling ran out of tokens in some draft (more siblings than the draft's support)
    spec = continued(world, root, spec, length)
    exact = continued(world, root, {(): 1.0}, length)
    for seq in set(spec) | set(exact):
        assert abs(spec.get(seq, 0.0) - exact.get(seq, 0.0)) < 1e-12, (seq, spec.get(seq), exact.get(seq))


def one_step_deviation(world: World, parents: list[int], mode: str, fixed: list[int]) -> float:
    """Largest |law - target law| over token sequences of one step continued to its full length."""
    root = (0,)
    length = int(tree_ops.depths(torch.tensor(parents, dtype=torch.long)).max()) + 1
    spec: dict[tuple[int, ...], float] = defaultdict(float)
    for tokens, probs, weight in drafts(world, root, parents, mode, fixed):
        for seq, p in step_law(tokens, parents, probs, target_rows(world, root, tokens, parents)).items():
            spec[seq] += weight * p
    spec = continued(world, root, spec, length)
    exact = continued(world, root, {(): 1.0}, length)
    return max(abs(spec.get(s, 0.0) - exact.get(s, 0.0)) for s in set(spec) | set(exact))


POWER_WORLDS = [(World(vocab, seed, zeros), parents, mode)
                for vocab, seed, zeros in ((3, 5, False), (4, 1, False), (3, 2, True))
                for parents, mode in (([-1, -1, -1], "point-mass"), ([-1, -1, 0], "without"))]
"""Fixed small worlds with siblings, point-mass and sampled without replacement."""


@pytest.mark.parametrize("m", [m for m in MUTANTS if m.module == acceptance.__name__], ids=lambda m: m.name)
def test_the_law_catches_every_mutant_of_the_acceptance_code(m):
    """The enumeration runs the real acceptance code, so an edit of it moves the exact law (no
    sampling noise): every acceptance mutant of the certificate moves it by > 1e-3 in some world."""
    assert max(one_step_deviation(w, p, mode, [0, 1, 2]) for w, p, mode in POWER_WORLDS) < 1e-12
    with mutated(m):
        moved = max(one_step_deviation(w, p, mode, [0, 1, 2]) for w, p, mode in POWER_WORLDS)
    assert moved > 1e-3, f"{m.name} leaves the one-step law within {moved:.2e}"


def test_enumerated_drafts_are_a_distribution():
    world, parents = World(3, 2, True), [-1, -1, 0]
    for mode in ("iid", "without"):
        total = sum(w for *_, w in drafts(world, (0,), parents, mode, [0, 1, 2]))
        assert abs(total - 1.0) < 1e-12



def test_verify_names_what_is_wrong_with_its_input():
    draft = Draft(torch.tensor([[1]]), torch.tensor([-1]), torch.full((1, 1, 3), 1 / 3))
    sampling, generator = SamplingConfig(temperature=1.0), torch.Generator()
    with pytest.raises(NotImplementedError, match=r"^accept supports batch size 1 only, got 2$"):
        acceptance.accept(draft, torch.zeros(2, 3, 4), sampling, generator)
    with pytest.raises(ValueError, match=r"^target_logits has 3 rows, expected N \+ 1 = 2$"):
        acceptance.accept(draft, torch.zeros(1, 3, 4), sampling, generator)
    with pytest.raises(ValueError, match=r"^draft_probs cover 3 tokens, the target's vocabulary has 4"):
        acceptance.accept(draft, torch.zeros(1, 2, 4), sampling, generator)


def test_acceptance_probability_is_a_probability():
    assert float(acceptance_probability(torch.tensor(0.8), torch.tensor(0.2))) == 1.0
    assert float(acceptance_probability(torch.tensor(0.1), torch.tensor(0.4))) == pytest.approx(0.25)


def test_sampled_acceptance_marks_the_bonus_token_only_past_a_leaf():
    """`bonus` (the next token came from the distribution after a leaf) at T > 0: a chain the target
    takes whole ends in a bonus token; a rejection at the root does not (a mutant negating it survived
    every other test)."""

    def onehot(i, v=4):
        return torch.nn.functional.one_hot(torch.tensor(i), v).double()

    chain = Draft(torch.tensor([[1, 2]]), torch.tensor([-1, 0]), None)  # point-mass drafts
    g = torch.Generator().manual_seed(0)
    whole = acceptance.accept_sampling(chain, torch.stack([onehot(1), onehot(2), torch.full((4,), 0.25).double()]), g)
    assert whole.path == [0, 1] and whole.bonus
    rejected = acceptance.accept_sampling(chain, torch.stack([onehot(0), onehot(2), onehot(3)]), g)
    assert rejected.path == [] and rejected.next_token == 0 and not rejected.bonus


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 300), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       st.integers(0, 2**31 - 1))
def test_greedy_argmax_on_cpu_is_torchs_first_maximum(rows, vocab, dtype, seed):
    """Greedy acceptance reads each row's argmax through numpy on CPU (torch's CPU argmax is a scalar loop); with
    ties (logits drawn from 4 values) and in every dtype, it must pick torch's index: the first maximum."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (rows, vocab), generator=g).to(dtype)
    logits[:, torch.randint(0, vocab, (1,), generator=g)] = 3  # every row has a tie at the top, mostly
    assert torch.equal(acceptance.argmax_rows(logits), logits.argmax(-1))
