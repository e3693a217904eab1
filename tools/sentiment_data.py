"""A small labelled sentiment set made here: short English reviews built from templates, with negation ("was not
great") and contrast ("was dull, but the service was lovely": the clause after "but" decides), so a classifier has
to read word order and not only count words.

Training and held-out examples use disjoint nouns (the held-out set is about things the training set never
mentions), and the held-out set also uses adjectives the training set never shows (the last three of each list), so
a model trained here cannot score them all. ``tools/evalsets/sentiment.jsonl`` is the held-out set (``python tools/sentiment_data.py`` writes it);
``tools/reference_models.py`` trains the ``sentiment-tiny`` classifier on the training set.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

LABELS = ("negative", "positive")
POSITIVE = ["great", "excellent", "wonderful", "delightful", "superb", "charming", "brilliant", "lovely", "fantastic",
            "enjoyable", "pleasant", "impressive"]
NEGATIVE = ["terrible", "awful", "dreadful", "boring", "disappointing", "poor", "dull", "horrible", "bland",
            "annoying", "mediocre", "unpleasant"]
TRAIN_NOUNS = ["film", "movie", "book", "meal", "hotel", "concert", "phone", "game", "show", "album", "class",
               "trip", "novel", "lecture", "museum", "restaurant", "laptop", "series"]
HELDOUT_NOUNS = ["play", "festival", "podcast", "camera", "bakery", "opera", "course", "garden"]
SIMPLE = ["The {n} was {a}.", "I thought the {n} was {a}.", "What a {a} {n}!", "Honestly, the {n} felt {a}.",
          "Our {n} turned out {a}.", "This {n} is {a}."]
NEGATED = ["The {n} was not {a}.", "I would not call the {n} {a}.", "The {n} was never {a}."]
CONTRAST = "The {n} was {a}, but the {m} was {b}."


def example(rng: random.Random, nouns: list[str], unseen: bool) -> dict[str, str]:
    label = rng.randrange(2)
    words = (NEGATIVE, POSITIVE) if unseen else (NEGATIVE[:-3], POSITIVE[:-3])
    kind = rng.random()
    if kind < 0.5:
        text = rng.choice(SIMPLE).format(n=rng.choice(nouns), a=rng.choice(words[label]))
    elif kind < 0.75:  # "not great" is negative
        text = rng.choice(NEGATED).format(n=rng.choice(nouns), a=rng.choice(words[1 - label]))
    else:  # the clause after "but" decides
        n, m = rng.sample(nouns, 2)
        text = CONTRAST.format(n=n, a=rng.choice(words[1 - label]), m=m, b=rng.choice(words[label]))
    return {"text": text, "label": LABELS[label]}


def examples(split: str, count: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(f"{split}-{seed}")
    nouns = TRAIN_NOUNS if split == "train" else HELDOUT_NOUNS
    seen: set[str] = set()
    out = []
    while len(out) < count:
        e = example(rng, nouns, split != "train")
        if e["text"] not in seen:
            seen.add(e["text"])
            out.append(e)
    return out


HELDOUT = Path(__file__).resolve().parent / "evalsets" / "sentiment.jsonl"


def main() -> int:
    HELDOUT.write_text("".join(json.dumps(e) + "\n" for e in examples("heldout", 160)))
    print(HELDOUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
