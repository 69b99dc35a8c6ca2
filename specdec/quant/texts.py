"""The fixed, project-written texts quantization uses: `CALIBRATION_PARAGRAPHS` (one sample each, `calibration_samples`)
and `EVAL_TEXT` (top-1 agreement and KL, never calibration), disjoint from the prompt suites and versioned by
`CALIBRATION_ID` / `EVAL_ID`.
"""

from __future__ import annotations

import hashlib
from typing import Any

CALIBRATION_ID = "specdec-calibration-v1"
EVAL_ID = "specdec-eval-v1"

CALIBRATION_PARAGRAPHS: tuple[str, ...] = (
    "Why does the sea have tides? The Moon pulls on the whole Earth, but it pulls hardest on the water "
    "nearest to it and least on the water on the far side, so the oceans bulge on both sides. As the "
    "Earth turns beneath these bulges, most coasts see two high tides and two low tides a day. When the "
    "Sun and the Moon line up, at new and full moon, their pulls add and the tides are largest.",
    "Write a Python function that finds a value in a sorted list using binary search.\n\n"
    "def binary_search(items: list[int], target: int) -> int:\n    lo, hi = 0, len(items) - 1\n"
    "    while lo <= hi:\n        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            lo = mid + 1\n"
    "        else:\n            hi = mid - 1\n    return -1\n\n"
    "Each step halves the part of the list that can still hold the value, so the search takes "
    "logarithmic time; it returns -1 when the value is absent.",
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven grams "
    "of dried yeast and about three hundred and fifty millilitres of warm water. Knead the dough for ten "
    "minutes until it is smooth and elastic, cover it, and let it rise for an hour in a warm place. Shape "
    "it, let it rise again, and bake it at two hundred and twenty degrees for thirty minutes.",
    "Summarize the causes of the First World War. Historians usually name four long-term causes: "
    "militarism, a network of alliances, imperial rivalry and nationalism. The assassination of Archduke "
    "Franz Ferdinand in Sarajevo in June 1914 set these forces in motion: Austria-Hungary declared war on "
    "Serbia, Russia mobilised, and within weeks Germany, France and Britain had joined the conflict.",
    "Speculative decoding speeds up text generation without changing its output. A cheap drafter "
    "proposes several tokens, and the large target model checks all of them in a single forward pass. "
    "Every proposed token that agrees with the target is kept; at the first disagreement the target's "
    "own choice is used instead. Because the target verifies every token, the result is exactly what "
    "the target alone would have produced, only faster when the drafter guesses well.",
    "Dear team, thank you for the progress report. Before Friday, please send me the updated budget, "
    "the list of open risks and the revised timeline for the second phase. I would also like a short "
    "note explaining why the test results changed after the last release, and what we will do to make "
    "sure it does not happen again. Best regards, Maria.",
    "Explain the difference between a list and a tuple in Python. Both are ordered sequences that can "
    "hold objects of any type. A list is mutable: items can be appended, removed or replaced after it "
    "is created. A tuple is immutable, which makes it hashable when its items are, so it can be used as "
    "a dictionary key or stored in a set. Tuples are often used for fixed records, lists for collections.",
    "What is photosynthesis? Plants, algae and some bacteria capture the energy of light with "
    "chlorophyll and use it to turn carbon dioxide and water into glucose, releasing oxygen as a by-"
    "product. The light-dependent reactions in the thylakoid membranes produce ATP and NADPH, which the "
    "Calvin cycle in the stroma then uses to fix carbon into sugars.",
)

EVAL_TEXT = (
    "A lighthouse keeper kept a notebook of every ship that passed the cape. In the spring most of them "
    "were fishing boats that left before dawn and came back heavy in the afternoon; in the summer came "
    "the sailing yachts, slow and bright, and in the autumn the cargo ships that rode low in the water. "
    "One evening a small boat appeared with no lights at all. The keeper signalled with the lamp, waited, "
    "and signalled again. When there was no answer he rowed out himself and found two children asleep "
    "under a sail, their oars tied neatly to the benches. They had meant to cross to the island to see "
    "the seals, they explained later, and had simply underestimated how far it was. The keeper wrote "
    "their names in the notebook, under the ships, and gave them tea. Questions to think about: why do "
    "ships keep to fixed routes, how does a lighthouse tell sailors where they are, and what should you "
    "do if you are caught at sea after dark? Answer in a few sentences, using simple words."
)


def calibration_samples(tokenizer: Any, max_tokens: int = 256) -> list[list[int]]:
    """Token ids of each calibration paragraph (plain text, no chat template), cut to `max_tokens`."""
    if tokenizer is None:
        raise ValueError("calibration needs the target's tokenizer; this target has none")
    return [list(tokenizer.encode(text))[:max_tokens] for text in CALIBRATION_PARAGRAPHS]


def text_fingerprint(text: str) -> str:
    """First 12 hex digits of the SHA-256 of `text`, to identify a text version in results."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def calibration_description() -> dict[str, Any]:
    """What a calibrated result was calibrated on, for reports."""
    joined = "\n\n".join(CALIBRATION_PARAGRAPHS)
    return {"id": CALIBRATION_ID, "paragraphs": len(CALIBRATION_PARAGRAPHS), "characters": len(joined),
            "sha256_12": text_fingerprint(joined), "source": "specdec.quant.texts.CALIBRATION_PARAGRAPHS"}
