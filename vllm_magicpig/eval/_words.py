"""Built-in word lists and word generators for the synthetic tasks.

Sources (see also ``tasks.SOURCES``):

* ``ADJECTIVES``, ``NOUNS``, ``VERBS``, ``NAMES``, ``PLACES``: short lists of
  common English words typed for this project (no external source; single
  dictionary words are not copyrightable material).
* ``pseudo_word``: pronounceable pseudo-words built from syllables, used when a
  task needs more distinct words than the lists hold.
* ``wonderwords`` (optional, MIT licence, PyPI): when installed and requested
  with ``word_source="wonderwords"``, its adjective/noun lists replace the
  built-in ones (this is what RULER uses).

Nothing here touches the network.
"""

from __future__ import annotations

import random
import string

ADJECTIVES: tuple[str, ...] = tuple("""
able absent active actual afraid agile alert alive ancient angry anxious aware
awful basic bitter blank bold boring brave brief bright broad broken busy calm
careful casual cheap chief civil clean clear clever close cloudy cold common
complex cool correct cozy crazy creative crisp crowded cruel curious daily damp
dark dear decent deep dense direct dirty distant dizzy double dry dull eager
early easy elegant empty endless equal exact excited extra faint fair false
famous fancy fast fierce final fine firm flat fluffy formal fragile free fresh
friendly frozen funny gentle giant glad global golden good grand grateful great
green grumpy guilty handsome happy hard harsh healthy heavy helpful hidden high
hollow honest hot huge humble hungry icy ideal idle immense jolly junior keen
kind large late lazy legal level light little lively local lonely long loose
loud lovely loyal lucky major mature mellow mighty mild minor modern modest
narrow nasty native neat nervous new nice noble noisy normal odd old open orange
ordinary pale patient perfect plain pleasant polite poor popular precise pretty
proper proud public purple quick quiet rapid rare raw ready real rich rigid
ripe rough round royal rude rural rusty sacred sad safe salty sandy scarce
secret secure serious sharp shiny short shy silent silly silver simple sincere
slim slow small smart smooth soft solid sour spare special spicy splendid
stable steady steep sticky stiff strange strict strong stupid subtle sudden
sunny super sweet swift tall tame tender thick thin tidy tiny tired total tough
tropical true ugly unique upper urban useful usual vague valid vast velvet
violet visible vital vivid warm weak wealthy weary wet white wicked wide wild
wise witty wooden young zealous
""".split())

NOUNS: tuple[str, ...] = tuple("""
access account acid actor adult advice agency airport alarm album alley anchor
angle animal answer apple apron arch area army arrow artist atom attic aunt
author autumn avenue baby bag bakery balance ball balloon band bank barn basket
battery beach beard bed bee bell belt bench bicycle bird blade blanket block
boat body bone book boot border bottle bowl box brain branch bread brick bridge
brush bubble bucket budget bull bus butter button cabin cable cake camera camp
canal candle canvas captain car card carpet cart castle cat cattle cave ceiling
cellar chain chair chalk channel chapter cheese cherry chest chicken child
chimney church circle city clay cliff clock cloud coach coast coat coffee coin
collar colony comb comet copper corner cottage cotton county cousin cow crab
crane crayon cream crew crowd crown cup curtain cushion dancer desert desk
diamond diary dinner doctor dog doll dolphin door dragon drawer dream dress
drum duck eagle earth editor egg elbow engine envelope eye fabric factory
falcon farm father feather fence ferry field finger fire fish flag flame flock
floor flower flute fog forest fork fountain fox frame friend frog fruit garden
gate gem ghost giraffe glass glove goat gold grain grape grass guitar hall
hammer harbor harvest hat hawk heart helmet hill hive hook horse hospital hotel
house island jacket jar jewel judge jungle kettle key king kitchen kite knee
knife ladder lake lamp lantern lawn leaf lemon letter library lion lizard lock
machine magnet mango map marble market meadow melon mirror monkey moon
mountain mouse museum needle nest net night ocean office onion orchard owl
paint palace panda paper parcel parrot path peach pearl pebble pencil pepper
piano picture pigeon pillow pilot pine planet plate pocket poem pond potato
puppy puzzle queen quilt rabbit radio rain ribbon river road robot rock roof
room rope rose sail salad salt sand saucer school scissors sea seed shadow
sheep shelf shell ship shirt shoe shore silk singer sister skirt sky snail
snake soap soldier song spider spoon spring square stable stage star station
statue stone storm stove stream street sugar sun swan table tailor teacher
temple tent thread thunder ticket tiger tower town toy tractor train tree
tunnel turtle umbrella valley vase village violin wagon wall wallet watch
water whale wheel window wing winter wolf wood wool yard zebra
""".split())

# (base, past, past participle)
VERBS: tuple[tuple[str, str, str], ...] = tuple(
    tuple(v.split("/"))  # type: ignore[misc]
    for v in """
build/built/built carry/carried/carried catch/caught/caught clean/cleaned/cleaned
collect/collected/collected cover/covered/covered draw/drew/drawn
find/found/found follow/followed/followed guard/guarded/guarded hide/hid/hidden
hold/held/held keep/kept/kept lift/lifted/lifted measure/measured/measured
mend/mended/mended move/moved/moved notice/noticed/noticed open/opened/opened
paint/painted/painted pull/pulled/pulled push/pushed/pushed repair/repaired/repaired
sell/sold/sold send/sent/sent share/shared/shared show/showed/shown study/studied/studied
take/took/taken visit/visited/visited wash/washed/washed watch/watched/watched
weigh/weighed/weighed wrap/wrapped/wrapped write/wrote/written
""".split()
)

INTRANSITIVE: tuple[tuple[str, str], ...] = tuple(
    tuple(v.split("/"))  # type: ignore[misc]
    for v in """
arrive/arrived laugh/laughed rest/rested sing/sang sleep/slept smile/smiled
wait/waited wander/wandered whisper/whispered work/worked travel/traveled
listen/listened return/returned remain/remained
""".split()
)

NAMES: tuple[str, ...] = tuple("""
Alice Arthur Beatrice Charles Clara Daniel Edith Edward Eleanor Frank George
Grace Harold Helen Henry Irene Jack James Jane John Laura Lucy Margaret Martha
Mary Oliver Peter Rose Samuel Sarah Thomas Walter William
""".split())

PLACES: tuple[str, ...] = tuple(p.strip() for p in """
the old mill|the river bank|the village square|the northern road|the harbor
wall|the hill farm|the town hall|the market hall|the east field|the stone
bridge|the little chapel|the railway station|the orchard gate|the long meadow
""".replace("\n", " ").split("|") if p.strip())

TIMES: tuple[str, ...] = (
    "in the morning", "at noon", "in the evening", "before dawn", "after supper",
    "on Sunday", "during the winter", "in early spring", "late at night",
    "the next day", "some years later", "that autumn",
)

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n",
           "p", "pl", "r", "s", "st", "t", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "th", "nd")


def pseudo_word(rng: random.Random, syllables: int = 3) -> str:
    """A pronounceable lowercase pseudo-word, e.g. ``'bralemor'``."""
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables))


def coded_word(rng: random.Random, length: int = 6) -> str:
    """A random lowercase letter string (RULER fwe's "coded words")."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))


def load_word_lists(word_source: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return ``(adjectives, nouns)`` for ``word_source`` ('builtin' | 'wonderwords')."""
    if word_source == "builtin":
        return ADJECTIVES, NOUNS
    if word_source == "wonderwords":
        from importlib import resources

        try:
            assets = resources.files("wonderwords") / "assets"
        except ModuleNotFoundError as e:  # pragma: no cover - depends on env
            raise RuntimeError("word_source='wonderwords' needs `pip install wonderwords`") from e

        def _read(name: str) -> tuple[str, ...]:
            words = (assets / name).read_text(encoding="utf-8").split("\n")
            # single lowercase alphabetic words only: keeps keys/answers tidy
            return tuple(sorted({w.strip() for w in words
                                 if w.strip().isalpha() and w.strip().islower()}))

        return _read("adjectivelist.txt"), _read("nounlist.txt")
    raise ValueError(f"unknown word_source {word_source!r} (use 'builtin' or 'wonderwords')")


def distinct_words(rng: random.Random, n: int, pool: tuple[str, ...],
                   exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """``n`` distinct words: a shuffled sample of ``pool`` first, then pseudo-words."""
    avail = [w for w in pool if w not in exclude]
    rng.shuffle(avail)
    out = avail[:n]
    seen = set(out) | set(exclude)
    while len(out) < n:
        w = pseudo_word(rng, rng.choice((2, 3)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out
