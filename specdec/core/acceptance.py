"""Exact acceptance: which draft nodes the target keeps, and which token it adds after them.

Owns the acceptance math as pure functions of (draft, target distributions, torch.Generator): greedy (the longest path
of argmax tokens, then the argmax) and multi-candidate recursive rejection sampling (accept x_i with probability
min(1, target(x_i) / draft_i(x_i)), else go on with the residual max(0, target - draft_i); point-mass drafts have
draft_i = one_hot(x_i)). Knows nothing about models or caches. `specdec.certify.mutants` edits lines of this
source: a changed line makes `python -m specdec.certify --self-test` fail, naming the mutant to update.
"""

from __future__ import annotations

import torch

from specdec.core import tree as tree_ops
from specdec.core.draft import Acceptance, Draft
from specdec.core.sampling import SamplingConfig, target_probs_from_logits


def accept(
    draft: Draft,
    target_logits: torch.Tensor,  # [B, N + 1, V]: row 0 = after the root, row i + 1 = after node i
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> Acceptance:
    """Decide the accepted path and the next token for one step (greedy or sampling)."""
    if target_logits.shape[0] != 1:
        raise NotImplementedError(f"accept supports batch size 1 only, got {target_logits.shape[0]}")
    if target_logits.shape[1] != draft.num_nodes + 1:
        raise ValueError(f"target_logits has {target_logits.shape[1]} rows, expected N + 1 = {draft.num_nodes + 1}")
    if draft.draft_probs is not None and draft.draft_probs.shape[-1] != target_logits.shape[-1]:
        raise ValueError(f"draft_probs cover {draft.draft_probs.shape[-1]} tokens, the target's vocabulary has "
                         f"{target_logits.shape[-1]}: a drafter records [B, N, V] over the target's vocabulary")
    if sampling.greedy:
        return accept_greedy(draft, argmax_rows(target_logits[0]))
    return accept_sampling(draft, target_probs_from_logits(target_logits[0], sampling), generator)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first maximum as torch's: [N, V] -> [N] long. On CPU through numpy, whose argmax is
    vectorized (torch's CPU argmax is a scalar loop, an order of magnitude slower over a 49,152-token vocabulary)."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    return torch.from_numpy(logits.detach().float().numpy().argmax(-1))


def accept_greedy(draft: Draft, target_argmax: torch.Tensor) -> Acceptance:
    """target_argmax [N + 1]: the target's argmax after the root (row 0) and after node i (row i+1)."""
    argmax = target_argmax.tolist()
    tokens = draft.tokens[0].tolist()
    kids = tree_ops.children(draft.parents)
    path: list[int] = []
    node = -1
    while True:
        best = argmax[node + 1]
        match = next((c for c in kids[node] if tokens[c] == best), None)
        if match is None:
            return Acceptance(path=path, next_token=best, bonus=not kids[node])
        path.append(match)
        node = match


def acceptance_probability(target_prob: torch.Tensor, draft_prob: torch.Tensor) -> torch.Tensor:
    """min(1, target(x) / draft(x)) for a candidate x with draft(x) > 0."""
    return (target_prob / draft_prob).clamp(max=1.0)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)) [V]: the distribution to sample from after a rejection (the target itself
    when the residual has no mass: rejection then had probability ~0, and the target is the exact conditional)."""
    residual = (target_probs - draft_probs).clamp(min=0.0)
    mass = residual.sum()
    return residual / mass if mass > 0 else target_probs


def accept_sampling(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """Recursive rejection sampling down the tree. target_probs [N + 1, V] rows as in `accept`."""
    tokens = draft.tokens[0].tolist()
    kids = tree_ops.children(draft.parents)
    device = target_probs.device
    path: list[int] = []
    node = -1
    while True:
        probs = target_probs[node + 1]  # [V] the current (residual) target distribution
        accepted = None
        for child in kids[node]:
            x = tokens[child]
            if draft.draft_probs is None:
                child_draft = torch.zeros_like(probs)
                child_draft[x] = 1.0
            else:
                child_draft = draft.draft_probs[0, child].to(probs.dtype)
            u = torch.rand((), generator=generator, device=device)
            if bool(u < acceptance_probability(probs[x], child_draft[x])):
                accepted = child
                break
            probs = residual_probs(probs, child_draft)
        if accepted is None:
            token = int(torch.multinomial(probs, 1, generator=generator))
            return Acceptance(path=path, next_token=token, bonus=not kids[node])
        path.append(accepted)
        node = accepted


def total_variation(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """0.5 * sum |target - draft| over the last dim [...]: the distance between two laws, and the chance
    that one drafted token is rejected (1 - TV is its acceptance probability). The one definition."""
    return 0.5 * (target_probs - draft_probs).abs().sum(-1)
