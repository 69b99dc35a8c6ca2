"""Bookkeeping more than one drafter shares: `BlockSlots` (node id -> slot of a drafter's own cache), `early_exit_copy`
(a Target of the target's first k layers) and `PerRow` (one drafter copy per batch row, for drafters without a model).
Knows nothing about any one drafter, the loop or acceptance.
"""

from __future__ import annotations

import copy

import torch

from specdec.core.draft import Draft, DraftRequest, Step
from specdec.runtime.model import Target


class BlockSlots:
    """Where a drafter's cache holds the draft nodes it ran this step: node id -> block slot.

    The *block* is the entries appended while growing a draft; `parents` holds each entry's parent slot
    (-1 = the root); `accepted(step)` gathers the accepted path's slots by node id."""

    def __init__(self) -> None:
        self.parents: list[int] = []  # parent slot per block entry, -1 = the root
        self.slot: dict[int, int] = {}  # node id -> block slot

    def add(self, node_ids: list[int], parent_ids: list[int]) -> torch.Tensor:
        """Record nodes about to be run; returns the block's parents [M] for the tree forward."""
        for node, parent in zip(node_ids, parent_ids):
            self.slot[node] = len(self.parents)
            self.parents.append(self.slot[parent] if parent >= 0 else -1)
        return torch.tensor(self.parents, dtype=torch.long)

    def accepted(self, step: Step) -> list[int]:
        """Block slots of the accepted path's nodes that were run, root's child first."""
        kept = []
        for node in step.accepted_node_ids().tolist():
            if node not in self.slot:  # a node that was never run has no run descendants either
                break
            kept.append(self.slot[node])
        return kept


def early_exit_copy(target: Target, layers: int) -> Target:
    """A Target that runs the target's first `layers` decoder layers, then its final norm and
    lm_head. Shares every weight with the target."""
    total = target.model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise ValueError(f"early-exit draft needs 1 <= layers <= {total}, got {layers}")
    shallow = copy.copy(target.model)  # shallow: modules are shared, only containers differ
    shallow._modules = dict(target.model._modules)  # copy.copy shares the submodule dict: unshare it,
    shallow.model = copy.copy(target.model.model)  # or the assignments below would truncate the target
    shallow.model._modules = dict(target.model.model._modules)
    shallow.model.layers = target.model.model.layers[:layers]
    shallow.config = copy.copy(target.model.config)
    shallow.config.num_hidden_layers = layers
    shallow.model.config = shallow.config
    return Target(shallow, target.tokenizer, name=f"{target.name}[:{layers} layers]", quant=target.quant,
                  kernel=target.kernel, info=target.info)


class PerRow:
    """Batches for a drafter that runs no model: each row is drafted by its own copy (`row_copy`), so no row
    depends on its neighbours. A subclass implements the batch-of-one `propose` and `commit_one`."""

    batchable = True
    rows: list = []

    def row_copy(self, row: int):
        """A fresh copy of this drafter for batch row `row` (its per-sequence state reset)."""
        copy_ = copy.copy(self)
        copy_.rows = []
        copy_.reset()
        return copy_

    def commit(self, step: Step) -> None:
        if step.kept is None:  # a batch of one (`generate`)
            self.commit_one(step)
            return
        if step.is_prefill:
            self.rows = [self.row_copy(b) for b in range(step.batch)]
        for b, drafter in enumerate(self.rows):
            drafter.commit_one(step.row(b))

    def propose_batch(self, request: DraftRequest) -> list[Draft]:
        return [drafter.propose(request.row(b)) for b, drafter in enumerate(self.rows)]

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]

    def commit_one(self, step: Step) -> None:
        """`commit` for one sequence."""
        raise NotImplementedError
