"""answer_lengths: the Kaplan-Meier outlook of a request's answer, from finished answers (events) and
running requests (censored), against float64 references of the same estimator on seeded random inputs,
a worked example with censoring, and the grouping by max_tokens."""
from __future__ import annotations

import math
import random

import pytest

from vllm_magicpig.answer_lengths import AnswerLengths


def reference_uncensored(fractions, start, max_tokens, k):
    """Without censoring the curve is the empirical one over the answers past ``start``: the share that
    goes on past start + k / max_tokens, and the mean of what is left of them (in tokens)."""
    past = [f for f in fractions if f > start]
    t = start + k / max_tokens
    return sum(f > t for f in past) / len(past), sum(f - start for f in past) / len(past) * max_tokens


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_without_censoring_the_outlook_is_the_empirical_distribution(seed):
    rng = random.Random(seed)
    lengths = AnswerLengths(min_answers=1)
    max_tokens = rng.choice([64, 300, 512])
    fractions = []
    for _ in range(rng.randint(5, 60)):
        generated = rng.choice([max_tokens, rng.randint(1, max_tokens)])  # many answers run to their bound
        lengths.record(generated, max_tokens)
        fractions.append(generated / max_tokens)
    generated = rng.randint(0, max_tokens // 2)
    start = generated / max_tokens
    outlook = lengths.outlook(generated, max_tokens)
    if not any(f > start for f in fractions):
        assert outlook is None
        return
    for k in [0, 1, 5, max_tokens // 3, max_tokens]:
        p, mean = reference_uncensored(fractions, start, max_tokens, k)
        assert outlook.survives(k) == pytest.approx(p, abs=1e-12), (seed, k)
    assert outlook.expected() == pytest.approx(mean, rel=1e-9), seed
    # the integral splits: (0, k] + (k, inf) is the whole
    k = max_tokens / 4
    assert outlook.expected(0, k) + outlook.expected(k) == pytest.approx(outlook.expected(), rel=1e-9)


def test_censored_observations_follow_kaplan_meier():
    """Answers ended at 0.2, 0.5 and 0.8 of max_tokens; one request is running at 0.3. At 0.2: 4 at
    risk, 1 ends (S = 3/4); at 0.3 one leaves uncounted; at 0.5: 2 at risk, 1 ends (S = 3/8); at 0.8
    the last ends (S = 0)."""
    lengths = AnswerLengths(min_answers=4)
    for f in (0.2, 0.5, 0.8):
        lengths.record(int(f * 100), 100)
    outlook = lengths.outlook(0, 100, running=[(30, 100)])
    assert [outlook.survives(k) for k in (10, 20, 25, 40, 50, 70, 80)] == [1, 0.75, 0.75, 0.75, 0.375, 0.375, 0]
    assert outlook.expected() == pytest.approx(100 * (0.2 * 1 + 0.3 * 0.75 + 0.3 * 0.375))
    # past the last observation nothing is assumed: a run that is censored last ends the curve there
    lengths = AnswerLengths(min_answers=4)
    outlook = lengths.outlook(0, 100, running=[(60, 100)] * 4)
    assert outlook.survives(59) == 1 and outlook.survives(60) == 0 and outlook.expected() == pytest.approx(60)


def test_the_outlook_is_conditioned_on_what_the_request_has_generated():
    lengths = AnswerLengths(min_answers=2)
    for g in (5, 10, 400, 512):
        lengths.record(g, 512)
    early = lengths.outlook(1, 512)  # all four answers are ahead of it
    late = lengths.outlook(20, 512)  # only the two long ones are
    assert early.survives(50) == pytest.approx(0.5) and late.survives(50) == 1.0
    assert late.expected() == pytest.approx(((400 - 20) + (512 - 20)) / 2)
    assert lengths.outlook(450, 512) is None  # one answer reached past it: too few to say


def test_groups_by_max_tokens_fall_back_to_all_answers():
    lengths = AnswerLengths(min_answers=3)
    for _ in range(3):
        lengths.record(512, 512)  # long answers that asked for 512 tokens
    for _ in range(5):
        lengths.record(10, 8000)  # short answers that left max_tokens to the model's length
    assert lengths.outlook(1, 600).expected() == pytest.approx(600 - 1)  # 512-1023: its own group
    assert lengths.outlook(1, 6000).survives(100) == 0.0  # 4096-8191: its own group
    pooled = lengths.outlook(0, 100)  # 64-127: nobody asked for that: all eight answers
    assert pooled.survives(50) == pytest.approx(3 / 8)
    # fractions of max_tokens: 1 of 100 is past every short answer's 10 of 8000, so only the long ones remain
    assert lengths.outlook(1, 100) is not None and lengths.outlook(1, 100).survives(50) == 1.0
    assert lengths.snapshot() == {"answers_recorded": 8, "answer_groups": {512: 3, 4096: 5}}


def test_running_requests_count_in_their_own_group():
    lengths = AnswerLengths(min_answers=3)
    running = [(300, 512)] * 3 + [(5, 8000)]
    assert lengths.outlook(1, 512, running).survives(250) == 1.0
    assert lengths.outlook(1, 512, running[:2]) is None  # two of its group, one of another's: too few either way


def test_nothing_is_learned_without_a_bound_and_the_window_forgets():
    lengths = AnswerLengths(window=4, min_answers=1)
    lengths.record(5, None)
    lengths.record(5, 0)
    assert lengths.recorded == 0 and lengths.outlook(1, 512) is None and lengths.outlook(1, None) is None
    for g in (512, 512, 512, 512, 10, 10, 10, 10):
        lengths.record(g, 512)
    assert lengths.outlook(1, 512).survives(20) == 0.0  # the four long ones are forgotten
    assert math.isclose(lengths.outlook(1, 512).expected(), 9)
