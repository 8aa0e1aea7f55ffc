"""Task families of the generated quick-start suite: each draws one (instruction, answer) from an RNG.

Eight families with distinct phrasings and short, rule-determined answers, so a LoRA on a 135M model
learns each one in minutes on a CPU, and a client's local adapter clearly beats the base model on its
own family (the FedDPA setting of one task per client, paper 000 section 5.1, without a download).
"""

from __future__ import annotations

import random
from collections.abc import Callable

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
DAYS_IN = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Portugal": "Lisbon",
    "Greece": "Athens", "Austria": "Vienna", "Poland": "Warsaw", "Sweden": "Stockholm", "Norway": "Oslo",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Ireland": "Dublin", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Hungary": "Budapest", "Czechia": "Prague", "Romania": "Bucharest",
    "Bulgaria": "Sofia", "Croatia": "Zagreb", "Serbia": "Belgrade", "Ukraine": "Kyiv", "Turkey": "Ankara",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Nigeria": "Abuja", "Ghana": "Accra", "Morocco": "Rabat",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Indonesia": "Jakarta", "Australia": "Canberra", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Chile": "Santiago", "Peru": "Lima", "Cuba": "Havana",
}
NOUNS = ["cat", "dog", "bird", "teacher", "farmer", "child", "doctor", "river", "train", "garden", "window",
         "letter", "apple", "house", "friend", "storm", "song", "boat", "book", "city"]
VERBS = ["sees", "finds", "likes", "paints", "follows", "visits", "carries", "opens", "watches", "helps"]
ADJS = ["small", "old", "bright", "quiet", "green", "happy", "cold", "tall", "red", "busy"]
WORDS = ["apple", "river", "stone", "maple", "cloud", "tiger", "lemon", "piano", "zebra", "candle", "garden",
         "orange", "violet", "hammer", "island", "jacket", "kettle", "ladder", "mirror", "needle", "pepper",
         "rocket", "silver", "turtle", "walnut", "yellow", "basket", "dragon", "feather", "harbor"]
POSITIVE = ["wonderful", "excellent", "delightful", "fantastic", "great", "lovely", "superb", "amazing"]
NEGATIVE = ["terrible", "awful", "disappointing", "horrible", "poor", "dreadful", "boring", "broken"]
THINGS = ["phone", "movie", "restaurant", "hotel", "book", "laptop", "concert", "jacket", "game", "coffee"]
NAMES = ["Anna", "Ben", "Carla", "David", "Ema", "Felix", "Grace", "Hugo", "Iris", "Jonas"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "coins", "books", "shells"]


def date_format(rng: random.Random) -> tuple[str, str]:
    y, m = rng.randint(1950, 2049), rng.randint(1, 12)
    d = rng.randint(1, DAYS_IN[m - 1])
    return (f"Rewrite the date {y:04d}-{m:02d}-{d:02d} in words.", f"{MONTHS[m - 1]} {d}, {y}")


def unit_conversion(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice([("kilometers", "meters", 1000), ("kilograms", "grams", 1000), ("hours", "minutes", 60),
                       ("meters", "centimeters", 100), ("minutes", "seconds", 60), ("liters", "milliliters", 1000)])
    value = rng.randint(1, 99)
    return (f"Convert {value} {kind[0]} to {kind[1]}.", f"{value * kind[2]} {kind[1]}")


def arithmetic(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    # single-digit operands: two-digit sums were beyond a 135M model's small-budget LoRA (0% exact)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        return (f"Word problem: {name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
                str(a + b))
    a = a + b
    return (f"Word problem: {name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
            str(a - b))


def punctuation(rng: random.Random) -> tuple[str, str]:
    subj, obj = rng.sample(NOUNS, 2)
    words = ["the", rng.choice(ADJS), subj, rng.choice(VERBS), "the", obj]
    if rng.random() < 0.5:
        words += ["near", "the", rng.choice(NOUNS)]
    plain = " ".join(words)
    fixed = plain[0].upper() + plain[1:] + "."
    return (f"Fix the capitalization and punctuation: {plain}", fixed)


def segmentation(rng: random.Random) -> tuple[str, str]:
    words = ["the", rng.choice(ADJS), rng.choice(NOUNS), rng.choice(VERBS), "a", rng.choice(NOUNS)]
    return (f"Insert spaces between the words: {''.join(words)}", " ".join(words))


def sorting(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 5))
    return (f"Sort these words alphabetically: {', '.join(words)}", ", ".join(sorted(words)))


def capitals(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    if rng.random() < 0.5:
        template = rng.choice(["Name the capital city of {c}.", "Which city is the capital of {c}?",
                               "Capital of {c}?", "What is the capital of {c}?", "Tell me the capital of {c}.",
                               "{c}: what is its capital city?"])
        return (template.format(c=country), CAPITALS[country])
    template = rng.choice(["{k} is the capital of which country?", "Which country has {k} as its capital?",
                           "Country whose capital is {k}?", "{k} is the capital city of what country?",
                           "Name the country with the capital {k}.", "In which country is the capital {k}?"])
    return (template.format(k=CAPITALS[country]), country)


def sentiment(rng: random.Random) -> tuple[str, str]:
    positive = rng.random() < 0.5
    adj = rng.choice(POSITIVE if positive else NEGATIVE)
    thing = rng.choice(THINGS)
    review = rng.choice([f"The {thing} was {adj}.", f"What a {adj} {thing}!", f"I found this {thing} {adj}."])
    return (f"Classify the sentiment of this review as positive or negative. Review: {review}",
            "positive" if positive else "negative")


FAMILIES: dict[str, tuple[str, Callable[[random.Random], tuple[str, str]]]] = {
    "date_format": ("text_formatting", date_format),
    "unit_conversion": ("math", unit_conversion),
    "arithmetic": ("math", arithmetic),
    "punctuation": ("text_formatting", punctuation),
    "segmentation": ("text_formatting", segmentation),
    "sorting": ("ordering", sorting),
    "capitals": ("open_domain_qa", capitals),
    "sentiment": ("sentiment", sentiment),
}
