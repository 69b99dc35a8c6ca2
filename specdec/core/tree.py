"""Draft-tree geometry derived from one `parents` array: validation, depths, the ancestor (tree-attention) mask,
root-to-node paths and children. `parents[i]` is node i's parent, -1 the *root* (the last committed token); parents
precede children; a chain of k is [-1, 0, ..., k-2]. Knows nothing about models, tokens or probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_parents(parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Return `parents` as a validated 1-D long CPU tensor; raise ValueError if it is not a tree."""
    p = torch.as_tensor(parents, dtype=torch.long).cpu()
    if p.dim() != 1:
        raise ValueError(f"parents must be 1-D (one entry per draft node), got shape {tuple(p.shape)}")
    idx = torch.arange(p.numel())
    bad = (p < -1) | (p >= idx)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"parents is not a tree: parents[{i}] = {int(p[i])}; each entry must be -1 (child of the "
            f"root) or the index of an earlier node (0..{i - 1})"
        )
    return p


def chain_parents(k: int) -> torch.Tensor:
    """Parents of a chain of k nodes: [-1, 0, 1, ..., k-2]."""
    return torch.arange(k, dtype=torch.long) - 1


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, 1 for children of the root. [N] long (= ancestors including itself). Host parents (every
    draft's) are walked once in order, since parents precede children; device ones by the ancestor mask."""
    if parents.device.type != "cpu":
        return ancestor_mask(parents).sum(1)
    out: list[int] = []
    for parent in parents.tolist():
        out.append(1 if parent < 0 else out[parent] + 1)
    return torch.tensor(out, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """`mask[i, j]` is True when node j is node i or one of its ancestors. [N, N] bool, on the
    device of `parents`; vectorized by pointer jumping (ceil(log2 depth) rounds)."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    up = parents
    for _ in range(max(1, n).bit_length()):  # 2^rounds >= n >= depth: no host sync needed
        has = up >= 0
        mask |= mask[up.clamp(min=0)] & has[:, None]
        up = torch.where(has, up[up.clamp(min=0)], up)
        up = torch.where(has, up, torch.full_like(up, -1))
    return mask


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (inclusive); [] for node = -1."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def children(parents: torch.Tensor) -> list[list[int]]:
    """children[i] lists node i's children in index order; the root's children are children[-1]
    i.e. the extra last entry (index N)."""
    out: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, p in enumerate(parents.tolist()):
        out[p].append(i)  # p = -1 lands in the last slot, the root's
    return out


def prune_to_depth(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Indices of the nodes whose depth is <= max_depth, in order (a valid sub-tree). [M] long."""
    return (depths(parents) <= max_depth).nonzero().flatten()


def reindex(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Parents of the sub-tree made of nodes `keep` (ascending, ancestor-closed), renumbered 0..M-1."""
    new_index = torch.full((parents.numel(),), -1, dtype=torch.long)
    new_index[keep] = torch.arange(keep.numel())
    old = parents[keep]
    return torch.where(old >= 0, new_index[old.clamp(min=0)], old)
