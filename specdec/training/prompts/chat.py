"""The `chat` prompt source: chat requests written for this project, filled from pools under a seed.

Every word here was written for this module: pools of topics, everyday situations, objects, people,
programming tasks and short texts, and per task type a set of phrasings (questions, instructions,
advice, coding, math, rewriting, extraction, creative writing, multi-turn follow-ups), each with
optional style and length constraints. Nothing is read from the evaluation suites; the n-gram
disjointness test in tests/test_eagle_training.py checks the output against them.
"""

from __future__ import annotations

import random

from specdec.training.prompts import Prompt, register

TOPICS = [
    "the carbon cycle", "neutron stars", "the Ottoman Empire", "mortgages", "the lymphatic system",
    "continental drift", "monsoons", "neural networks", "the Han dynasty", "opportunity cost",
    "ocean acidification", "allergies", "superconductors", "the blues", "movable type", "geysers",
    "ant colonies", "index funds", "tidal power", "the human kidney", "hydrogen fuel cells", "mangroves",
    "the spice trade", "community radio", "circadian rhythms", "tea ceremonies", "the Apollo programme",
    "landfills", "tsunamis", "the game of go", "the Paralympics", "savannas", "deflation", "RNA",
    "email", "the Maya civilisation", "mindfulness", "sourdough", "river deltas", "the Enlightenment",
    "batteries", "loneliness", "balcony gardening", "octopuses", "elections", "probiotics",
    "the noble gases", "permafrost", "card games", "negotiation", "procrastination", "aqueducts",
    "compasses", "skateboards", "the Nile", "vitamins", "drones", "paper airplanes", "heat pumps",
    "constellations", "charity work", "animal migration", "password managers", "zoos", "canyons",
    "worm farms", "the cello", "tablets", "rock climbing", "the steam engine", "auroras", "flamingos",
    "personal finance", "film cameras", "the Mongol Empire", "thunderstorms", "cooperative games",
    "cheese making", "radio telescopes", "dialects", "glaciers melting", "logic gates", "empathy",
    "street maps", "open source software", "traffic lights", "typography", "recycling plastics",
    "the metric system", "lighthouses", "wildfires", "earth's magnetic field", "bridges", "yoga",
    "spreadsheets", "podcasts", "electric scooters", "vertical farming", "time zones", "umbrellas",
]
SITUATIONS = [
    "moving into my first apartment", "training for a 10k run", "learning to play the guitar",
    "preparing for a job interview", "starting a small online shop", "organising a birthday party",
    "going back to school as an adult", "adopting a rescue dog", "working night shifts",
    "writing my first novel", "taking care of an elderly parent", "learning to swim at forty",
    "planning a road trip on a budget", "switching careers into programming", "living with roommates",
    "sleeping badly before exams", "keeping a sourdough starter alive", "managing a small team",
    "cutting down on sugar", "travelling alone for the first time",
]
PEOPLE = ["a pirate", "a medieval knight", "a sports commentator", "a weather forecaster", "a grumpy cat",
          "a museum guide", "a robot", "a kindergarten teacher", "a noir detective", "a stand-up comedian"]
AUDIENCES = ["a five-year-old", "a high-school student", "my grandmother", "a busy manager",
             "a university physics student", "someone who has never heard of it", "a non-native speaker"]
STYLES = ["", "", "", " Keep it short.", " Use bullet points.", " Answer in one paragraph.",
          " Be concise.", " Use simple words.", " Give an example.", " Answer in under fifty words.",
          " Be detailed.", " Use a friendly tone.", " Use numbered steps."]
LANGS = ["Python", "JavaScript", "TypeScript", "Java", "C++", "Rust", "Go", "Ruby", "bash", "SQL"]
CODE = [
    "parses a date string like 2024-05-17 into year, month and day", "reads a CSV file and prints the row count",
    "finds the second largest number in a list", "checks whether two strings are anagrams",
    "rotates a list by k positions", "computes the greatest common divisor of two numbers",
    "validates that brackets in a string are balanced", "converts a Roman numeral to an integer",
    "groups a list of words by their first letter", "returns the longest word in a sentence",
    "counts how many times each character appears", "implements binary search on a sorted list",
    "removes all whitespace from a string", "transposes a matrix given as a list of lists",
    "computes the running average of a stream of numbers", "generates all subsets of a small set",
    "converts a number of seconds to hours, minutes and seconds", "checks whether a year is a leap year",
    "capitalises the first letter of every word", "merges two dictionaries, summing shared keys",
]
OBJECTS = ["a paperclip", "an old umbrella", "a teacup", "a lost key", "a streetlamp", "a library card",
           "a wooden spoon", "a city pigeon", "a snow globe", "a broken clock", "a red balloon", "a tram"]
SNIPPETS = [
    "The meeting about the new parking rules has been moved to Wednesday at 3 pm in room 214. Please bring "
    "the survey results and let Maria know by Monday if you cannot attend.",
    "Our bakery will close early on the 24th and reopen on the 27th. Orders for cakes must be placed at least "
    "two days ahead; call 555-0192 or write to orders@sunnycrumb.test.",
    "Tomas Lindqvist, 52, a retired ferry captain from Gothenburg, has opened a small museum of ship models "
    "in his garage. Entry is free on Sundays.",
    "The new bike path connects the train station with the university campus. It is 4.2 km long, lit at night, "
    "and cost 1.8 million euros. Construction took eleven months.",
    "Reminder: the water supply in blocks C and D will be interrupted on Friday from 9:00 to 13:00 while "
    "engineers replace a valve. Residents are advised to store some water in advance.",
    "Kenji ordered two notebooks at 3.50 each, a fountain pen for 24 dollars and a bottle of ink for 8 dollars. "
    "Shipping was free because the total exceeded 30 dollars.",
    "The volunteer group planted 340 trees along the river last spring; 291 survived the dry summer. Next "
    "year they plan to add a drip irrigation system.",
    "dear support, i bought the blue kettle last week and it leaks from the bottom when i fill it above half. "
    "can i get a replacement or my money back? thanks, Ana",
]
FOLLOW_UPS = ["Can you shorten that?", "Could you give a concrete example?", "Please turn that into a list.",
              "Explain the second point in more detail.", "What would an expert add?", "Is there a simpler way?",
              "Why is that?", "Summarise your answer in one sentence.", "What are the risks?",
              "How would you explain that to a child?", "Can you write it as a short poem instead?"]
REPLIES = ["Here is a short overview of {topic}. It is a broad subject, so I focused on the basics and one "
           "practical example.", "Sure. {topic_cap} can be understood in three steps: what it is, how it works, "
           "and why people care about it.", "Good question! In short, {topic} matters because it affects "
           "everyday life in ways most people rarely notice."]


def _question(r: random.Random) -> str:
    t = r.choice(TOPICS)
    return r.choice([
        f"How does {t} work?", f"What is the history of {t}?", f"Why do people care about {t}?",
        f"What are some surprising facts about {t}?", f"Can you explain {t} to {r.choice(AUDIENCES)}?",
        f"What do most people get wrong about {t}?", f"How has {t} changed over the last hundred years?",
        f"Is {t} good or bad for the environment?", f"What would happen if {t} disappeared tomorrow?",
        f"What are the pros and cons of {t} compared with {r.choice(TOPICS)}?",
        f"I keep hearing about {t}. What is it, briefly?", f"what's the deal with {t}",
    ]) + r.choice(STYLES)


def _advice(r: random.Random) -> str:
    s = r.choice(SITUATIONS)
    return r.choice([
        f"I'm {s}. Any tips?", f"What should I know before {s}?", f"Help me make a plan for {s}.",
        f"I feel overwhelmed {s}. Where do I start?", f"What are common mistakes people make when {s}?",
        f"My friend is {s}. How can I support them?", f"Give me a checklist for {s}.",
    ]) + r.choice(STYLES)


def _instruction(r: random.Random) -> str:
    t = r.choice(TOPICS)
    return r.choice([
        f"Write a short introduction to {t} for {r.choice(AUDIENCES)}.", f"List {r.randint(3, 7)} key terms about {t} with definitions.",
        f"Create a quiz with {r.randint(3, 5)} questions about {t}.", f"Draft an outline for a talk on {t}.",
        f"Write a product description for a board game about {t}.", f"Plan a one-day lesson about {t}.",
        f"Describe {t} as {r.choice(PEOPLE)} would.", f"Write a blog post title and opening paragraph about {t}.",
        f"Make a table comparing {t} and {r.choice(TOPICS)}.", f"Give me a study plan to learn about {t} in a week.",
    ]) + r.choice(STYLES)


def _creative(r: random.Random) -> str:
    o, t = r.choice(OBJECTS), r.choice(TOPICS)
    return r.choice([
        f"Write a limerick about {o}.", f"Write a short story told from the point of view of {o}.",
        f"Compose a four-line poem about {t}.", f"Invent a myth that explains {t}.",
        f"Write a dialogue between {r.choice(PEOPLE)} and {r.choice(PEOPLE)} about {t}.",
        f"Write a diary entry of {r.choice(PEOPLE)} who just discovered {o}.",
        f"Give me five creative names for a cafe themed around {t}.", f"Write song lyrics about {o} and {t}.",
    ]) + r.choice(STYLES)


def _coding(r: random.Random) -> str:
    lang, task = r.choice(LANGS), r.choice(CODE)
    return r.choice([
        f"Write a {lang} function that {task}.", f"In {lang}, how do I write code that {task}?",
        f"Show me {lang} code that {task}, with comments.", f"Write a {lang} program that {task} and add tests.",
        f"What is the most efficient way in {lang} to write something that {task}?",
        f"Explain step by step how to implement a routine that {task} in {lang}.",
        f"My {lang} code that {task} is slow. What could I improve?",
    ])


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 250), r.randint(2, 60), r.randint(2, 9)
    return r.choice([
        f"What is {a} multiplied by {b}?", f"Divide {a * b} by {b} and explain each step.",
        f"What is {c * 5}% of {a * 4}?", f"Solve for y: {c}y - {b} = {a}.",
        f"A recipe needs {c} eggs for {b} cookies. How many eggs for {b * 3} cookies?",
        f"If I save {a} dollars a month, how much do I have after {b} months?",
        f"A car uses {c} litres of fuel per 100 km. How much fuel for {a * 10} km?",
        f"Is {a * 2 + 1} a prime number?", f"What is the area of a circle with radius {c} cm?",
        f"Convert {a} kilometres to miles.", f"What is the average of {a}, {b} and {c * 11}?",
        f"A shirt costs {a} euros and is discounted by {c * 5}%. What is the new price?",
    ]) + r.choice(["", " Show your work.", " Think step by step.", " Just give the answer."])


def _rewrite(r: random.Random) -> str:
    s = r.choice(SNIPPETS)
    return r.choice([
        f"Rewrite this in a more polite tone:\n\n{s}", f"Make this text easier to read:\n\n{s}",
        f"Rewrite the following as a short tweet:\n\n{s}", f"Fix the grammar and punctuation:\n\n{s}",
        f"Paraphrase this for {r.choice(AUDIENCES)}:\n\n{s}", f"Turn this into a formal notice:\n\n{s}",
        f"Condense this into one sentence:\n\n{s}",
    ])


def _extract(r: random.Random) -> str:
    s = r.choice(SNIPPETS)
    return r.choice([
        f"List all numbers in this text and what they refer to:\n\n{s}", f"Who is mentioned in this text?\n\n{s}",
        f"Extract the key facts as JSON:\n\n{s}", f"What action is the reader asked to take?\n\n{s}",
        f"Pull out every date, time and place from this:\n\n{s}", f"What is the main topic of this text?\n\n{s}",
    ])


def _translate(r: random.Random) -> str:
    lang = r.choice(["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"])
    return f"Translate into {lang}: {r.choice(SNIPPETS).split('. ')[0]}."


KINDS = [_question, _question, _advice, _instruction, _creative, _coding, _coding, _math, _math, _rewrite,
         _extract, _translate]


def _multi_turn(r: random.Random) -> Prompt:
    t = r.choice(TOPICS)
    first = r.choice([f"Tell me about {t}.", f"How does {t} work?", f"Why is {t} important?",
                      f"Give me a quick overview of {t}."]) + r.choice(STYLES)
    reply = r.choice(REPLIES).format(topic=t, topic_cap=t[0].upper() + t[1:])
    return ({"role": "user", "content": first}, {"role": "assistant", "content": reply},
            {"role": "user", "content": r.choice(FOLLOW_UPS)})


@register("chat")
def chat_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """Up to `n` distinct chat prompts (about one in eight multi-turn), deterministic per seed."""
    r = random.Random(f"chat-{seed}")
    out, seen = [], set()
    for _ in range(20 * n + 100):
        if len(out) >= n:
            break
        prompt = _multi_turn(r) if r.random() < 0.125 else ({"role": "user", "content": r.choice(KINDS)(r)},)
        key = "\n".join(m["content"] for m in prompt)
        if key not in seen:
            seen.add(key)
            out.append(prompt)
    return out
