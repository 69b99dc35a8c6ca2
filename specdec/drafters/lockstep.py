"""One draft per batch row from the batch-of-one grower, with one batched model call per depth.

Owns `grow_rows`: every row of a batch grows its own draft with `specdec.core.shapes.grow_tree` (the
very code a batch of one runs, so a row's draft equals the one it would get alone, its randomness
drawn only from its own generator), while the rows' `score` calls are answered together: when
every row still growing waits on a score, one `score_rows` call runs all of them in one forward.
Rows of one shape ask at the same depths with the same node counts (a grower's structure depends
on the shape, not on the logits), so each depth costs one forward for the batch; a row that asks
less often simply sits out a call. Each row's grower runs in a thread of its own only to be
suspended at its score calls; the model runs in the caller's thread, one call at a time.
Knows nothing about any model or cache: the drafter's `score_rows` does the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import torch

from specdec.core.draft import Draft
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import Shape, SubVocab, grow_tree

Ask = tuple[list[int], torch.Tensor, list[int]]
"""One row's score call: (node ids, tokens [1, n], parent ids), as `grow_tree`'s ScoreFn receives them."""
ScoreRows = Callable[[dict[int, Ask]], dict[int, torch.Tensor]]
"""{row: ask} -> {row: logits [1, n, Vd]}: one batched forward for every row that asked."""


def grow_rows(shape: Shape, root_logits: list[torch.Tensor | None], score_rows: ScoreRows,
              sampling: SamplingConfig, generators: list[torch.Generator], max_depth: int,
              vocab: SubVocab | None = None) -> list[Draft]:
    """One draft per row: row b grows from `root_logits[b]` ([1, Vd]; None = nothing to draft from,
    an empty draft) with `generators[b]`, as `grow_tree` would alone; `score_rows` answers each round
    of the rows' score calls at once (see the module docstring). An error in a row's grower or in
    `score_rows` is raised here once every row has stopped."""
    drafts = [Draft.empty() for _ in root_logits]  # a row with no root logits keeps its empty draft
    lock = threading.Condition()
    asks: dict[int, Ask] = {}
    answers: dict[int, torch.Tensor | BaseException] = {}
    errors: list[BaseException] = []
    growing = sum(r is not None for r in root_logits)

    def ask(row: int, node_ids: list[int], tokens: torch.Tensor, parent_ids: list[int]) -> torch.Tensor:
        with lock:
            asks[row] = (node_ids, tokens, parent_ids)
            lock.notify_all()
            lock.wait_for(lambda: row in answers)
            answer = answers.pop(row)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def grow(row: int) -> None:
        nonlocal growing
        try:
            with torch.inference_mode():  # inference mode is per thread
                drafts[row] = grow_tree(shape, root_logits[row], partial(ask, row), sampling, generators[row],
                                        max_depth, vocab)
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread below
            errors.append(err)
        finally:
            with lock:
                growing -= 1
                lock.notify_all()

    threads = [threading.Thread(target=grow, args=(b,), daemon=True)
               for b, r in enumerate(root_logits) if r is not None]
    for thread in threads:
        thread.start()
    with lock:
        while True:
            lock.wait_for(lambda: len(asks) == growing)  # every row still growing waits on a score
            if not asks:
                break
            try:
                answered = score_rows(dict(asks))
                if set(answered) != set(asks):
                    raise ValueError(f"score_rows answered rows {sorted(answered)}, asked by rows {sorted(asks)}")
                answers.update(answered)
            except BaseException as err:  # noqa: BLE001 -- every waiting row stops with it
                answers.update({row: err for row in asks})
            asks.clear()
            lock.notify_all()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return drafts
