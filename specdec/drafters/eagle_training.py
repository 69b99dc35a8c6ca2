"""Self-distillation data and loss for the EAGLE head: training prompts, target rollouts, the loss.

Owns `training_prompts` (the project's own training instructions), `build_dataset` (the target's
own continuations of those prompts and its final hidden states, i.e. what the head must imitate)
and `eagle_loss` (EAGLE's recipe: feature regression + cross-entropy against the target's
next-token distribution). Knows nothing about Hydra, files or drafting; scripts/train_eagle.py
drives it.

How training prompts stay disjoint from the evaluation suite (experiments/prompts/default.jsonl):
they come from a different generator. Every training prompt is produced here by filling a fixed
set of instruction templates (`_TEMPLATES`, written for this module) with subjects from this
module's own topic lists, under a fixed seed; nothing is read from the evaluation file or any
other prompt set. The evaluation prompts are hand-written by another author in a separate file.
tests/test_eagle.py checks the result: no training prompt shares a run of 8 consecutive words
(lowercased, punctuation stripped) with any evaluation prompt turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "vaccines",
    "plate tectonics", "the water cycle", "machine learning", "the Roman Empire", "supply and demand",
    "climate change", "the immune system", "quantum computing", "jazz music", "the printing press",
    "volcanoes", "honeybees", "the stock market", "renewable energy", "the human heart",
    "electric cars", "coral reefs", "the Silk Road", "public libraries", "sleep", "coffee",
    "the moon landing", "recycling", "earthquakes", "chess", "the Olympic Games", "rainforests",
    "inflation", "DNA", "the internet", "ancient Egypt", "meditation", "bread baking", "tides",
    "the Renaissance", "solar panels", "friendship", "urban gardening", "whales", "democracy",
    "antibiotics", "the periodic table", "glaciers", "board games", "public speaking",
    "time management", "the Great Wall of China", "magnets", "bicycles", "the Amazon river",
    "nutrition", "robots", "origami", "wind turbines", "the solar system", "volunteering",
    "migration of birds", "cryptography", "museums", "deserts", "composting", "the violin",
    "smartphones", "hiking", "the Industrial Revolution", "rainbows", "penguins", "budgeting",
    "photography", "the Byzantine Empire", "lightning", "team sports", "fermentation",
    "space telescopes", "languages", "mountains", "electric circuits", "kindness", "maps",
]
_SKILLS = [
    "learning to cook", "starting to run", "studying for exams", "keeping a journal",
    "learning a new language", "saving money", "staying focused at work", "making new friends",
    "writing clearly", "planting a garden", "moving to a new city", "learning to draw",
]
_CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "returns the largest element of a list", "merges two sorted lists", "computes a factorial",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "finds the median of a list",
    "checks whether a word is a palindrome", "sums the digits of an integer", "flattens a nested list",
    "counts word frequencies in a text", "computes the nth Fibonacci number",
    "sorts a list of tuples by the second item",
]
_LANGS = ["Python", "JavaScript", "C", "Rust", "Go"]
_PEOPLE = ["a pirate", "a detective", "a tour guide", "a chef", "a librarian", "an astronaut", "a gardener"]
_TEMPLATES = [
    "Explain {topic} to a ten-year-old.",
    "Give me three interesting facts about {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Summarize the history of {topic} in a short paragraph.",
    "Write a haiku about {topic}.",
    "Write a short poem about {topic}.",
    "Write a very short story that involves {topic}.",
    "List five questions a student might ask about {topic}.",
    "Why does {topic} matter today? Answer briefly.",
    "Describe {topic} in exactly three sentences.",
    "Compare {topic} and {topic2}. How are they alike and how do they differ?",
    "What is a common misconception about {topic}?",
    "Write a tweet announcing a new book about {topic}.",
    "Pretend you are {person} and describe {topic}.",
    "Give me a beginner's guide to {skill}.",
    "What mistakes do people often make when {skill}?",
    "Share some practical tips for {skill}.",
    "Write a {lang} function that {code}.",
    "Show how to write a program in {lang} that {code}, and explain it.",
    "What is {a} plus {b}? Explain step by step.",
    "If a shop sells {a} apples a day, how many apples does it sell in {b} days?",
    "Compute {a} times {b} and show your work.",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "Translate into French: 'I would like to learn more about {topic}.'",
    "Write an email to a friend inviting them to a talk on {topic}.",
]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct instructions made from this module's templates and topic lists (see the module
    docstring). Deterministic for a given (n, seed)."""
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < n:
        topic, topic2 = rng.sample(_TOPICS, 2)
        text = rng.choice(_TEMPLATES).format(
            topic=topic, topic2=topic2, person=rng.choice(_PEOPLE), skill=rng.choice(_SKILLS),
            lang=rng.choice(_LANGS), code=rng.choice(_CODE_TASKS), a=rng.randint(3, 99), b=rng.randint(2, 12),
        )
        if text not in seen:
            seen.add(text)
            prompts.append(text)
        if len(seen) > 50 * n + 10_000:
            raise ValueError(f"cannot make {n} distinct training prompts from the templates")
    return prompts


@dataclass
class Rollouts:
    """The target's own sequences and final hidden states (the training data)."""

    sequences: list[torch.Tensor]  # each [L] long: chat-formatted prompt + the target's continuation
    hidden: list[torch.Tensor]  # each [L, H] float32: target final hidden state at every position

    @property
    def num_tokens(self) -> int:
        return sum(s.numel() for s in self.sequences)


@torch.inference_mode()
def build_dataset(target, prompts: list[str], *, max_new_tokens: int, batch_size: int,
                  temperature: float, seed: int, progress=None) -> Rollouts:
    """Let `target` continue every prompt (temperature 0 = greedy) in left-padded batches with a KV
    cache, recording its final hidden state at every position it processes. A sequence ends at EOS
    or after `max_new_tokens`; its last token (whose hidden state was never computed) is dropped."""
    from transformers import DynamicCache

    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    eos = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    sequences, hidden = [], []
    for start in range(0, len(prompts), batch_size):
        encoded = [target.encode_prompt(p) for p in prompts[start:start + batch_size]]
        b, width = len(encoded), max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])  # [b, width] left padded
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(e) for e in encoded])[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, width]; pads get 0, never attended to
        cache = DynamicCache()
        h = target.base(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True).last_hidden_state  # [b, width, H]
        steps_h, steps_tok = [h], []  # hidden [b, 1, H] per processed step, tokens [b] per step
        done = torch.zeros(b, dtype=torch.bool)
        last = positions[:, -1]
        for _ in range(max_new_tokens):
            logits = target.lm_head(steps_h[-1][:, -1]).float()  # [b, V]
            if temperature > 0:
                nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(done, pad, nxt)
            steps_tok.append(nxt)
            done |= torch.isin(nxt, eos)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
            last = last + 1
            steps_h.append(target.base(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                                       cache=cache, use_cache=True).last_hidden_state)
        gen_tok = torch.stack(steps_tok, 1)  # [b, steps]
        gen_h = torch.cat(steps_h[1:], 1) if len(steps_h) > 1 else h[:, :0]  # [b, steps_with_hidden, H]
        for row, e in enumerate(encoded):
            toks = gen_tok[row].tolist()
            stop = next((i for i, t in enumerate(toks) if t in target.eos_token_ids), len(toks) - 1)
            keep = min(stop, gen_h.shape[1])  # generated tokens whose hidden state exists
            sequences.append(torch.tensor(e + toks[:keep]))
            hidden.append(torch.cat([h[row, width - len(e):], gen_h[row, :keep]]).float().clone())
        if progress is not None:
            progress.update(b)
    return Rollouts(sequences, hidden)


def eagle_loss(
    predicted: torch.Tensor,  # [B, n, H] head output at positions 0..n-1 (predicts h_1..h_n)
    next_hidden: torch.Tensor,  # [B, n, H] target features h_1..h_n
    valid: torch.Tensor,  # [B, n] bool, False on padding
    vocab_weight: torch.Tensor,  # [N, H] lm_head rows the cross-entropy runs over (draft vocabulary)
    ce_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss: SmoothL1(predicted, target feature) + ce_weight * CE(target probs, head probs),
    both averaged over valid positions; the target's distribution is its lm_head on the true next
    feature, restricted to the rows in `vocab_weight`."""
    p, h = predicted[valid], next_hidden[valid]  # [M, H]
    regression = F.smooth_l1_loss(p, h)
    with torch.no_grad():
        teacher = F.linear(h, vocab_weight).softmax(-1)  # [M, N]
    log_student = F.linear(p, vocab_weight).log_softmax(-1)
    ce = -(teacher * log_student).sum(-1).mean()
    with torch.no_grad():
        top1 = (log_student.argmax(-1) == teacher.argmax(-1)).float().mean()
    return regression + ce_weight * ce, {"regression": regression.item(), "ce": ce.item(), "top1": top1.item()}
