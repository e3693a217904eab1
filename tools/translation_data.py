"""A small parallel corpus made here: English sentences and their translation into a toy Romance language, built from
a fixed lexicon with the grammar a translator has to learn beyond word substitution: the adjective follows the noun
("the red house" -> "la casa roja"), articles and adjectives agree in gender with their noun, and a plural takes an
-s on every word of its phrase.

Training and held-out sentences are disjoint (the held-out set holds combinations the training set never shows).
``tools/evalsets/translation.jsonl`` is the held-out set (``python tools/translation_data.py`` writes it);
``tools/reference_models.py marian-toy-mt`` trains a small Marian model on the training set.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# english -> (toy word, gender): "a" masculine, "o" feminine endings agree below
NOUNS = {"house": ("casa", "f"), "dog": ("perro", "m"), "cat": ("gato", "m"), "book": ("libro", "m"),
         "table": ("mesa", "f"), "car": ("coche", "m"), "city": ("ciudad", "f"), "river": ("rio", "m"),
         "garden": ("jardin", "m"), "door": ("puerta", "f"), "window": ("ventana", "f"), "tree": ("arbol", "m"),
         "bird": ("pajaro", "m"), "song": ("cancion", "f"), "letter": ("carta", "f"), "friend": ("amigo", "m"),
         "road": ("camino", "m"), "boat": ("barco", "m"), "flower": ("flor", "f"), "lamp": ("lampara", "f")}
ADJECTIVES = {"red": "roj", "small": "pequen", "old": "viej", "new": "nuev", "black": "negr", "white": "blanc",
              "tall": "alt", "quiet": "tranquil", "beautiful": "bonit", "cold": "fri"}
VERBS = {"sees": "ve", "likes": "quiere", "finds": "encuentra", "follows": "sigue", "paints": "pinta",
         "remembers": "recuerda"}
ARTICLES = {("the", "m"): "el", ("the", "f"): "la", ("a", "m"): "un", ("a", "f"): "una"}


def phrase(rng: random.Random) -> tuple[str, str]:
    noun = rng.choice(list(NOUNS))
    adj = rng.choice(list(ADJECTIVES)) if rng.random() < 0.7 else None
    plural = rng.random() < 0.3
    art = "the" if plural or rng.random() < 0.6 else "a"
    word, gender = NOUNS[noun]
    s = "s" if plural else ""
    en = " ".join(w for w in (art, adj, noun + s) if w)
    toy_art = ARTICLES[(art, gender)] + ("s" if plural and art == "the" else "")
    if plural and toy_art == "el":
        toy_art = "los"
    toy = [toy_art, word + ("es" if plural and word[-1] not in "aeiou" else s)]
    if adj:
        toy.append(ADJECTIVES[adj] + ("o" if gender == "m" else "a") + s)
    return en, " ".join(toy)


def sentence(rng: random.Random) -> dict[str, str]:
    (s1, t1), (s2, t2) = phrase(rng), phrase(rng)
    verb = rng.choice(list(VERBS))
    return {"source": f"{s1} {verb} {s2}", "reference": f"{t1} {VERBS[verb]} {t2}"}


def examples(split: str, count: int, seed: int = 0) -> list[dict[str, str]]:
    """``count`` distinct sentences; a held-out sentence never occurs in training (its hash decides the split)."""
    rng = random.Random(f"{split}-{seed}")
    out, seen = [], set()
    while len(out) < count:
        e = sentence(rng)
        held = hash_split(e["source"])
        if e["source"] not in seen and held == (split != "train"):
            seen.add(e["source"])
            out.append(e)
    return out


def hash_split(text: str) -> bool:
    import hashlib

    return hashlib.sha256(text.encode()).digest()[0] < 32  # an eighth of all sentences is held out


def vocabulary() -> list[str]:
    words = {w for n in NOUNS for w in (n, n + "s")} | set(ADJECTIVES) | set(VERBS) | {"the", "a"}
    toy = set()
    for word, _ in NOUNS.values():
        toy |= {word, word + "s", word + "es"}
    for stem in ADJECTIVES.values():
        toy |= {stem + e for e in ("o", "a", "os", "as")}
    toy |= set(VERBS.values()) | set(ARTICLES.values()) | {"los", "las", "els", "unas", "unos"}
    return sorted(words | toy)


HELDOUT = Path(__file__).resolve().parent / "evalsets" / "translation.jsonl"


def main() -> int:
    HELDOUT.write_text("".join(json.dumps(e) + "\n" for e in examples("heldout", 120)))
    print(HELDOUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
