"""One draft per batch row from the batch-of-one grower, with one batched model call per depth.

Owns `grow_rows`: each row grows its own draft with `grow_tree` in a thread that is suspended at its score calls
(nothing runs concurrently), and `score_rows` answers them together. Knows nothing about any model or cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import torch

from specdec.core.draft import Draft
from specdec.core.sampling import SamplingConfig
from specdec.core.grow import SubVocab, grow_tree
from specdec.core.shapes import Shape

Ask = tuple[list[int], torch.Tensor, list[int]]
"""One row's score call: (node ids, tokens [1, n], parent ids), as `grow_tree`'s ScoreFn receives them."""
ScoreRows = Callable[[dict[int, Ask]], dict[int, torch.Tensor]]
"""{row: ask} -> {row: logits [1, n, Vd]}: one batched forward for every row that asked."""


def grow_rows(shape: Shape, root_logits: list[torch.Tensor | None], score_rows: ScoreRows,
              sampling: SamplingConfig, generators: list[torch.Generator], max_depths: list[int],
              vocab: SubVocab | None = None) -> list[Draft]:
    """One draft per row, as `grow_tree` would grow it alone (`root_logits[b]` None: an empty draft), with
    `score_rows` answering each round of the rows' score calls at once; a row's error is raised once all stop."""
    drafts = [Draft.empty() for _ in root_logits]  # a row with no root logits keeps its empty draft
    rows = [b for b, logits in enumerate(root_logits) if logits is not None]
    turn = {row: threading.Semaphore(0) for row in rows}  # released: the row runs (one row at a time)
    stopped = threading.Semaphore(0)  # released by the running row when it asks a score or finishes
    asks: dict[int, Ask] = {}
    answers: dict[int, torch.Tensor | BaseException] = {}
    errors: list[BaseException] = []

    def ask(row: int, node_ids: list[int], tokens: torch.Tensor, parent_ids: list[int]) -> torch.Tensor:
        asks[row] = (node_ids, tokens, parent_ids)
        stopped.release()
        turn[row].acquire()
        answer = answers.pop(row)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def grow(row: int) -> None:
        turn[row].acquire()
        try:
            with torch.inference_mode():  # inference mode is per thread
                drafts[row] = grow_tree(shape, root_logits[row], partial(ask, row), sampling, generators[row],
                                        max_depths[row], vocab)
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread below
            errors.append(err)
        finally:
            stopped.release()

    threads = [threading.Thread(target=grow, args=(row,), daemon=True) for row in rows]
    for thread in threads:
        thread.start()
    running = rows  # rows to run on, each until it asks a score or finishes
    while running:
        for row in running:
            turn[row].release()
            stopped.acquire()
        if not asks:
            break
        try:
            answered = score_rows(dict(asks))
            if set(answered) != set(asks):
                raise ValueError(f"score_rows answered rows {sorted(answered)}, asked by rows {sorted(asks)}")
        except BaseException as err:  # noqa: BLE001 -- every asking row stops with it
            answered = {row: err for row in asks}
        answers.update(answered)
        running = sorted(asks)
        asks.clear()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return drafts
