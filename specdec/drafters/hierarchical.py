"""Hierarchical drafting (SpecMQuant): a tree drafter's tree, verified by a cheaper intermediate model, becomes the
chain the target verifies.

Owns `HierarchicalDrafter` (`hierarchical`): the *top* drafter (default `eagle`) proposes a tree, the *intermediate*
(default a `torchao_int4` copy) accepts greedily in one tree forward, and the loop verifies that path plus the
intermediate's next token as a point-mass chain. The top drafter hears that token as one extra leaf (`EXTRA_NODE_ID`).
Knows nothing about how the top drafter drafts or how the target verifies.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.core import tree as tree_ops
from specdec.runtime.cache import KVCache
from specdec.core.draft import Acceptance, Draft, Drafter, DraftRequest, Step
from specdec.drafters.registry import build, register
from specdec.runtime.model import Target
from specdec.core.acceptance import accept_greedy, argmax_rows

EXTRA_NODE_ID = -1
"""Node id of the intermediate's own next token in the top drafter's Step: a node the top drafter
never proposed (drafters keep state only for ids they issued, so they skip it)."""


class HierarchicalDrafter:
    """A top drafter whose trees an intermediate model verifies (see the module docstring)."""

    def __init__(self, top: Drafter, mid: Target, *, target: Target) -> None:
        if mid.vocab_size != target.vocab_size:
            raise ValueError(f"intermediate model {mid.label!r} has vocabulary {mid.vocab_size}, target "
                             f"{target.label!r} has {target.vocab_size}: it must share the target's vocabulary")
        self.name = "hierarchical"
        self.top = top
        self.mid = mid
        self.batchable = bool(getattr(top, "batchable", False))
        """True when the top drafter batches (the intermediate always does)."""
        self.reset()

    def reset(self) -> None:
        self.top.reset()
        self.cache = KVCache()  # the intermediate's: committed tokens but the root, then this step's block
        self.consumed = 0  # committed tokens in self.cache
        self.root_position = 0  # where this step's root entry sits in self.cache
        self.tree: Draft | None = None  # the top drafter's draft of this step (None: not asked this step)
        self.path: list[int] = []  # tree nodes the intermediate accepted
        self.mid_token: int | None = None
        self.rows: list[_Row] = []  # batches: each row's state (B = 1 runs on the fields above)
        self.block_begin = 0  # batches: stored index of this step's first entry in self.cache

    def propose(self, request: DraftRequest) -> Draft:
        ids = request.token_ids[0].tolist()
        self.tree = tree = self.top.propose(request)
        # One tree forward: the pending committed tokens and the root as a chain, then the tree.
        #   pending + root = m tokens at block slots 0..m-1; tree node i at slot m + i, its parent
        #   -1 (the root) at slot m - 1. E.g. m = 2, tree parents [-1, 0, -1] -> [-1, 0, 1, 2, 1].
        pending = ids[self.consumed:]
        m = len(pending)
        parents = torch.cat([torch.arange(m) - 1, torch.where(tree.parents < 0, m - 1, tree.parents + m)])
        tokens = torch.cat([torch.tensor([pending]), tree.tokens.cpu()], 1)  # [B, m + N]
        logits = self.mid.forward(tokens, self.cache, parents, logits_rows=slice(m - 1, None)).logits  # [B, 1 + N, V]
        self.root_position = self.consumed + m - 1
        mid = accept_greedy(tree, argmax_rows(logits[0]))
        self.path, self.mid_token = mid.path, mid.next_token
        chain = tree.tokens[0, mid.path].tolist() + [mid.next_token]
        chain = chain[:max(request.max_depth, 0)]
        if not chain:
            return Draft.empty(device=request.token_ids.device)
        return Draft(torch.tensor([chain], device=request.token_ids.device), tree_ops.chain_parents(len(chain)))

    def commit(self, step: Step) -> None:
        if step.kept is not None:
            self._commit_rows(step)
            return
        if step.is_prefill or self.tree is None:  # the prefill, or a step that asked for no draft:
            self.top.commit(step)  # the intermediate runs the new tokens with the next request
            return
        accepted = step.acceptance.num_accepted  # chain nodes the target accepted
        tree_path = self.path[:accepted]
        # The intermediate keeps the root and the accepted tree nodes (offsets from the root's entry:
        # tree node i is at 1 + i); a committed token it never ran is fed with the next request.
        self.cache.keep(self.root_position, [0] + [1 + i for i in tree_path])
        self.consumed = self.root_position + 1 + len(tree_path)
        self.top.commit(self._top_step(step, tree_path, accepted > len(self.path)))
        self.tree = None

    def _top_step(self, step: Step, tree_path: list[int], took_extra: bool) -> Step:
        """`step` re-expressed in the top drafter's draft (see the module docstring)."""
        tree, acceptance = top_acceptance(self.tree, self.path, self.mid_token, tree_path, took_extra,
                                          step.acceptance.next_token)
        return Step(token_ids=step.token_ids, num_new=step.num_new, draft=tree, acceptances=[acceptance],
                    positions=step.positions, target_hidden=step.target_hidden,
                    target_aux=step.target_aux, _kv=step.target_kv)

    # ---- batches ------------------------------------------------------------------------------
    def propose_batch(self, request: DraftRequest) -> list[Draft]:
        rows, width = request.token_ids.shape
        lengths = request.lengths or [width] * rows
        if len(self.rows) != rows:
            raise RuntimeError(f"hierarchical: holds {len(self.rows)} batch rows, the request {rows}; every Step "
                               "must reach commit() and finished rows leave by select_rows()")
        trees = self.top.propose_batch(request)
        # One tree forward for all rows: row b's pending tokens and root as a chain (slots 0..m_b-1),
        # then its tree (node i at slot m_b + i), right-padded to the widest row (padding: holes).
        blocks, pendings = [], []
        for b, (row, tree, length) in enumerate(zip(self.rows, trees, lengths)):
            pending = request.token_ids[b, width - length + row.consumed:].cpu()  # [m_b], ends with the root
            m = pending.numel()
            parents = torch.cat([torch.arange(m) - 1, torch.where(tree.parents < 0, m - 1, tree.parents + m)])
            blocks.append((torch.cat([pending, tree.tokens[0].cpu()]), parents))
            pendings.append(m)
        n = max(tokens.numel() for tokens, _ in blocks)
        tokens = torch.zeros(rows, n, dtype=torch.long)  # [B, n]
        parents = torch.full((rows, n), -1, dtype=torch.long)  # [B, n] padding: children of the block's start
        valid = torch.zeros(rows, n, dtype=torch.bool)  # [B, n]
        for b, (row_tokens, row_parents) in enumerate(blocks):
            tokens[b, : row_tokens.numel()], parents[b, : row_tokens.numel()] = row_tokens, row_parents
            valid[b, : row_tokens.numel()] = True
        self.block_begin = self.cache.length
        logits = self.mid.forward(tokens, self.cache, parents, valid=None if bool(valid.all()) else valid).logits
        drafts = []
        for b, (row, tree, m) in enumerate(zip(self.rows, trees, pendings)):
            mid = accept_greedy(tree, argmax_rows(logits[b, m - 1: m + tree.num_nodes]))
            row.tree, row.pending, row.path, row.mid_token = tree, m, mid.path, mid.next_token
            chain = (tree.tokens[0, mid.path].tolist() + [mid.next_token])[:max(request.row(b).max_depth, 0)]
            device = request.token_ids.device
            drafts.append(Draft(torch.tensor([chain], device=device), tree_ops.chain_parents(len(chain)))
                          if chain else Draft.empty(device=device))
        return drafts

    def _commit_rows(self, step: Step) -> None:
        """`commit` for a batch: each row keeps its pending tokens, root and target-accepted tree nodes
        (`keep_rows`); the top drafter hears the B-row step in its own node ids."""
        if step.is_prefill or not self.rows or self.rows[0].tree is None:
            if step.is_prefill:
                self.rows = [_Row() for _ in range(step.batch)]
            self.top.commit(step)
            return
        kept, trees, acceptances = [], [], []
        for row, acceptance in zip(self.rows, step.acceptances):
            tree_path = row.path[:acceptance.num_accepted]
            kept.append(list(range(row.pending)) + [row.pending + i for i in tree_path])
            row.consumed += row.pending + len(tree_path)
            tree, top = top_acceptance(row.tree, row.path, row.mid_token, tree_path,
                                       acceptance.num_accepted > len(row.path), acceptance.next_token)
            trees.append(tree)
            acceptances.append(top)
            row.tree = None
        self.cache.keep_rows(self.block_begin, kept)
        self.top.commit(Step(token_ids=step.token_ids, num_new=step.num_new, draft=trees[0], acceptances=acceptances,
                             positions=step.positions, target_hidden=step.target_hidden, target_aux=step.target_aux,
                             _kv=step.target_kv, drafts=trees, lengths=step.lengths, kept=step.kept))

    def select_rows(self, rows: list[int]) -> None:
        self.cache.select_rows(rows)
        self.rows = [self.rows[b] for b in rows]
        self.top.select_rows(rows)


class _Row:
    """One batch row's state: committed tokens in the intermediate's cache, this step's tree,
    pending count (its tokens fed this step, the root last), intermediate path and next token."""

    def __init__(self) -> None:
        self.consumed = 0
        self.tree: Draft | None = None
        self.pending = 0
        self.path: list[int] = []
        self.mid_token: int | None = None


def top_acceptance(tree: Draft, mid_path: list[int], mid_token: int | None, tree_path: list[int],
                   took_extra: bool, next_token: int) -> tuple[Draft, Acceptance]:
    """The top drafter's draft and acceptance of a step (see the module docstring): `tree` extended by
    the intermediate's token as leaf EXTRA_NODE_ID when the target took it (`took_extra`)."""
    path = list(tree_path)
    if took_extra:
        last = mid_path[-1] if mid_path else -1
        tree = Draft(torch.cat([tree.tokens, torch.tensor([[mid_token]], device=tree.tokens.device)], 1),
                     torch.cat([tree.parents, torch.tensor([last])]), None,
                     torch.cat([tree.node_ids, torch.tensor([EXTRA_NODE_ID])]))
        path.append(tree.num_nodes - 1)
    kids = tree_ops.children(tree.parents)
    return tree, Acceptance(path=path, next_token=next_token, bonus=not kids[path[-1] if path else -1])


DEFAULT_MID_QUANT = "torchao_int4"
"""The intermediate model by default: the low-bit self-draft's spec (`lowbit.DEFAULT_QUANT`)."""


@register("hierarchical")
def build_hierarchical(*, target: Target, top: str = "eagle", top_options: dict[str, Any] | None = None,
                       mid: Target | None = None, mid_quant: str = DEFAULT_MID_QUANT) -> HierarchicalDrafter:
    """top: the tree drafter's registered name, built with `top_options`; mid: the intermediate
    model (a Target sharing the vocabulary), by default `quantized_copy(target, mid_quant)`."""
    if top == "hierarchical":
        raise ValueError("the top drafter of a hierarchical drafter cannot be 'hierarchical' itself")
    if mid is None:
        from specdec.quant import quantized_copy

        mid = quantized_copy(target, mid_quant)
    return HierarchicalDrafter(build(top, target=target, **(top_options or {})), mid, target=target)


build_hierarchical.test_options = {"top_options": {"head": "random"}, "mid_quant": "rtn8_pc"}
