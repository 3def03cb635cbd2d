# SPDX-License-Identifier: MIT
"""Writes corpus/instructions.jsonl: the instruction set whose greedy answers, by the target model itself,
become Cacheback's natural-language frozen table (`python tools/build_frozen.py --corpus selfchat`).

Written for this project (templates x topics below, no outside text), deterministic, and disjoint from the
benchmark prompts in prompts/prompts.jsonl (tests/test_cacheback.py checks that no instruction is a bench
prompt). Every combination of a template with the topics it fits, in a fixed order.

    python corpus/make_instructions.py        # rewrites corpus/instructions.jsonl
"""

import json
import os

TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "volcanoes", "the printing press", "vaccines",
    "black holes", "recycling", "the stock market", "honeybees", "electric cars", "the Roman Empire",
    "machine learning", "coral reefs", "the human heart", "inflation", "solar panels", "earthquakes",
    "the internet", "chess", "climate change", "public libraries", "the moon landing", "sleep",
    "renewable energy", "ancient Egypt", "bicycles", "rainforests", "the immune system", "coffee",
]
ACTIVITIES = [
    "learning a new language", "saving money", "running a first marathon", "keeping houseplants alive",
    "studying for exams", "cooking for a large group", "starting a small business", "travelling on a budget",
    "public speaking", "organising a closet", "training a puppy", "working from home", "writing a novel",
    "getting better sleep", "learning to swim",
]
TASKS = [
    "reverses a linked list", "counts the vowels in a string", "merges two sorted lists",
    "checks whether a number is prime", "finds the largest element of a list", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "computes the nth Fibonacci number", "flattens a nested list",
    "counts word frequencies in a text", "validates an email address", "computes the average of a list",
    "sorts a list of dictionaries by a key", "reads a CSV file and sums a column", "finds the median of a list",
]
SENTENCES = [
    "The library opens at nine in the morning.", "My brother plays the guitar every evening.",
    "We are planning a trip to the mountains next summer.", "Please close the window before you leave.",
    "The children are playing in the park.", "This soup needs a little more salt.",
    "The train was delayed by twenty minutes.", "She bought a new umbrella yesterday.",
    "Our neighbours have a very friendly dog.", "I would like a cup of tea, please.",
]
LANGUAGES = ["French", "German", "Spanish"]

TEMPLATES = [
    ("topic", "Explain {} in simple terms."),
    ("topic", "What are the main advantages and disadvantages of {}?"),
    ("topic", "Write a short paragraph about {} for a school newsletter."),
    ("topic", "Give me five interesting facts about {}."),
    ("topic", "Write a haiku about {}."),
    ("activity", "What are some tips for {}?"),
    ("activity", "Write a short motivational message for someone who is {}."),
    ("activity", "Make a simple step-by-step plan for {}."),
    ("task", "Write a Python function that {}."),
    ("task", "Explain how you would write a program that {}, then show the code."),
    ("sentence", "Translate into {lang}: {}"),
    ("math", "{}"),
]
MATH = [
    "A shop sells pencils at 3 for 75 cents. How much do 12 pencils cost?",
    "If a car travels 180 km in 2.5 hours, what is its average speed?",
    "What is 15% of 240? Show your steps.",
    "A rectangle is 8 cm long and 5 cm wide. What are its area and perimeter?",
    "Tom has twice as many apples as Sara. Together they have 27. How many does each have?",
    "Solve for x: 3x + 7 = 25.",
    "A recipe needs 250 g of flour for 4 people. How much flour is needed for 10 people?",
    "What is the sum of the angles in a hexagon?",
    "A bank account pays 4% interest per year. How much is 500 dollars worth after two years?",
    "If 5 workers build a wall in 12 days, how long would 6 workers take?",
    "Convert 3.5 hours into minutes and seconds.",
    "What is the least common multiple of 12 and 18?",
]


def instructions() -> list[str]:
    out = []
    for kind, template in TEMPLATES:
        if kind == "topic":
            out += [template.format(t) for t in TOPICS]
        elif kind == "activity":
            out += [template.format(a) for a in ACTIVITIES]
        elif kind == "task":
            out += [template.format(t) for t in TASKS]
        elif kind == "sentence":
            out += [template.format(s, lang=LANGUAGES[i % len(LANGUAGES)]) for i, s in enumerate(SENTENCES)]
        else:
            out += list(MATH)
    return out


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "instructions.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(instructions()):
            f.write(json.dumps({"id": i, "instruction": text}) + "\n")
    print(f"wrote {path}: {len(instructions())} instructions")
