"""The instruction templates the first shipped head was trained on (the `templates-v1` prompt source).

Kept unchanged so that runs 1-2 of specdec/training/LOG.md stay reproducible and the
shipped head's training set stays checkable: `training_prompts(n, seed)` fills a fixed set of
instruction templates (`_TEMPLATES`, written for this module) with subjects from this module's own
topic lists under a fixed seed; nothing is read from the evaluation suites. Plain strings:
specdec.training.prompts registers them as one-turn chats (this module imports nothing of the package).
"""

from __future__ import annotations

import random

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

