"""Whether sampling pays for a decode, from this worker's own timings.

Sampling costs a roughly fixed amount per (request, layer) (L bucket lookups per query head and
segment, the exact sinks and tail) plus a little per key; exact attention costs a little more
per key. Which is cheaper depends on the context length, the machine, the threads and the kernel,
so it is measured, not assumed: every decode step times

* the dense layers (and sparse layers whose batch was served by the platform kernel) in steps
  without a prefill chunk: exact attention over the batch's keys;
* in a step that samples some requests, the sparse layers' two parts apart
  (``backend_common.DecodeSplit``): the platform kernel's over the exact requests' keys, and
  sampling over the sampled requests', less any index building in the call (a one-off per
  segment, not a per-step cost).

Each is fitted as ``seconds = a * requests + b * keys`` (least squares, both non-negative, with
exponential forgetting per step, so a worker that warms up or changes load follows). Once both
have enough observations, a decode request is served exactly when sampling its context is
predicted to be slower than attending it exactly (stats: ``sampling_slower``). One decode step
in ``explore_every`` samples them all the same, so the sampling side keeps being measured near
the crossover. It explores a whole step, not one request in ``explore_every``: that was chosen
when a batch's exact requests went through the sampling kernel (slower than the platform's) and
such a step was not timed, so exploring single requests cost every such step and taught nothing.
Mixed steps are split and timed now; a whole exploring step still times sampling at the batch's
own contexts.

Whether a prompt's index pays: building it (every key hashed into L tables, in every sparse layer)
costs seconds of the worker's core, and a short answer can end before sampling has saved that
much (the cold 4K request of ``benchmarks/e2e_decode.py``, 64 tokens, ran at 0.86x CPU_ATTN, its
decodes 31% slower while the build shared their core, and it ended before sampling paid). So
a new prompt's build waits, ski-rental style, until its decodes served exactly meanwhile would
have saved as much by sampling as the build costs (stats: ``index_deferred``): then it is built.
A prompt that pays soon is built soon; one whose answers end first never costs its build; and
waiting never costs more than the build itself (at most 2x the best choice made in hindsight).
Decodes of other requests over the same prompt (a prefix-cache hit) add to the same account, so
a document many questions are asked about is indexed once they have paid for it. The build's
cost per token and layer is measured from this worker's own builds. A build pays back only over the
decodes after it, so where the request's remaining decodes are bounded (its ``max_tokens``, from
vLLM's runner: ``answer_bounds.py``) and could not save the build's cost, it is not built even once
the account has paid (stats: ``index_cannot_pay``; the account stays for the prompt's next
requests, which the planner then judges by the account alone). Waiting is the price of not
knowing how long the answer will run; where the answers this worker has seen say (``answer_lengths.py``:
how far requests asking as many tokens went, finished or still running), a prompt is built at its
first decode when that is expected to cost less than waiting (``_builds_now``; the snapshot's
``built_on_outlook`` counts them). Until a build is measured, and
until the decode costs are, a new prompt is built at once, as without this rule. So is a prompt
whose context lies in no power-of-2 range (4K-8K, 8K-16K, ...) that sampling was timed in: the
fit's sampled cost there is extrapolated, and only a build lets it be measured (a deferred prompt
is never sampled, not even in an exploring step, so a wrong extrapolation would never be
corrected: an 8K prompt after 4K ones was served exactly throughout, as ``sampling_slower``).
One build per such range explores it, not every prompt in it: a build's sampled decodes may go
untimed (while another build shares the core, or served exactly as ``sampling_slower`` between
exploring steps), and on an AMX machine (``results/e2e_decode_amx.md``) every new 8K and 16K
prompt was then built on arrival, 2-7 builds a row, each slowing the decodes beside it by half.
Other prompts in the range wait, ski-rental, on the extrapolated fit; the range is explored again
after ``reexplore_steps`` steps if sampling still was not timed there.

Start-up calibration (``cost_calibration.py``, ``calibrate``) gives both sides and the build their
first timings before any request, on synthetic inputs of the model's shape, at a few contexts
from the shortest sampled to the model's length (at most 32K); the ranges between the first and
the last count as timed. Then no prompt is indexed merely to measure a range there, and a fresh
engine's first prompts wait, ski-rental, as later ones do. The calibrated observations weigh as
``min_steps`` layer timings per side, so live steps (about one a layer each) outweigh them soon.

The calibration times both sides warm, one after the other; the engine runs them cold, between the
model's other layers, and there each costs ~2-2.5x its calibrated time (AMD: exact 430-450 us at 4K
live against 192 calibrated, sampling 145-196 against 85; AMX: 293 against ~120, sampling 315
against 140). So the calibration is right about the two sides' ratio and wrong about their level,
the same way for both. Live steps correct a side's level only where that side runs, and exact
attention runs from the first request (every dense layer, every deferred prompt) while sampling
runs only once a prompt is built: compared as they stand, a live exact cost against a warm sampling
cost makes sampling look ~2x cheaper than it is. On the AMX machine a 3000-token prompt was built on
that (exact 230 us live against sampling's 140 calibrated) and its decodes then measured sampling
at 315 us, slower than exact: the build was lost and the request served exactly after it. So while
one side has fewer than ``min_steps`` live timings and the other has more, the first side's prior
is scaled by the second's live-to-calibrated ratio at the same context (``predicted``; the snapshot's
``prior_scale``), until its own live timings arrive.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

from vllm_magicpig.answer_lengths import Outlook
from vllm_magicpig.stats import EXACT_INDEX_CANNOT_PAY, EXACT_INDEX_DEFERRED, EXACT_SAMPLING_SLOWER

KEY_SCALE = 1e-4  # keys in units of 10K: keeps the 2x2 system well conditioned
LONGEST_CONTEXT = 1 << 20  # where sampling_pays_from stops looking (keys, one request)
MAX_ACCOUNTS = 1 << 15  # deferred prompts whose savings are remembered (least recent forgotten)


def _octave(context: float) -> int:
    return int(math.log2(max(context, 1.0)))


def _pays_back(predicted: tuple[float, float], build: float, decodes: int) -> bool:
    """Whether ``decodes`` sampled instead of exact (``predicted``: seconds a layer each) save ``build``."""
    return decodes * max(predicted[0] - predicted[1], 0.0) >= build


def _builds_now(gain: float, build: float, saved: float, outlook: Outlook) -> bool:
    """Whether building a prompt's index now beats waiting for ski rental to build it, for a request
    whose answer goes on as ``outlook`` says (``answer_lengths.py``). ``gain``: seconds a layer each
    sampled decode saves; ``build``: the build's seconds a layer; ``saved``: the account so far.

    Ski rental builds after ``k`` more exact decodes (when the account reaches the build's cost), if
    the answer lasts that long. Against it, building now gains the samples of those ``k`` decodes
    (as many as are expected to happen) and risks the build on an answer that ends before them; and
    it must pay back in expectation at all (else neither should build)."""
    if gain <= 0:
        return False
    k = (build - saved) / gain
    if gain * outlook.expected() <= build:
        return False
    return gain * outlook.expected(0.0, k) > build * (1.0 - outlook.survives(k))


class LinearCost:
    """``seconds = a * requests + b * keys``, fitted with exponential forgetting per engine step.

    Forgetting is per step (``forget``), not per observation: a step brings one observation per
    layer, and forgetting 1% per observation kept only the last ~3 steps, nearly one context
    apart by a few keys, where noise alone set the slope (an end-to-end run's fit predicted
    -40 ms of exact attention per layer at 4K keys). ``steps`` counts observations."""

    def __init__(self, decay: float, shape: str = "requests") -> None:
        """``shape``: the one-term model a fit falls back to when the data would give a term a
        negative coefficient (``coefficients``): ``"keys"`` (cost in proportion to the keys, as
        exact attention's) or ``"requests"`` (a cost per request, as sampling's, which reads a
        fixed number of buckets)."""
        if shape not in ("keys", "requests"):
            raise ValueError(f"shape is 'keys' or 'requests', not {shape!r}")
        self.decay = decay
        self.shape = shape
        self.steps = 0
        # Weighted sums of x x^T (s00, s01, s11) and of x * seconds (t0, t1). Forgetting scales the
        # weight of new observations up instead of every sum down (the fit is the same, up to a
        # common factor): forget() runs every engine step, and this is one multiplication.
        self._s00 = self._s01 = self._s11 = self._t0 = self._t1 = 0.0
        self._w = 1.0

    def add(self, requests: int, keys: int, seconds: float, count: int = 1) -> None:
        """``count`` observations of this shape whose seconds average ``seconds`` (for least squares
        the same as adding them one by one)."""
        x0, x1, w = float(requests), keys * KEY_SCALE, self._w * count
        self._s00 += w * x0 * x0
        self._s01 += w * x0 * x1
        self._s11 += w * x1 * x1
        self._t0 += w * x0 * seconds
        self._t1 += w * x1 * seconds
        self.steps += count

    def forget(self) -> None:
        """A new step: earlier observations weigh ``decay`` times less than later ones."""
        self._w /= self.decay
        if self._w > 1e150:  # renormalise long before the weights overflow
            k = 1.0 / self._w
            self._s00, self._s01, self._s11, self._t0, self._t1 = (
                k * v for v in (self._s00, self._s01, self._s11, self._t0, self._t1))
            self._w = 1.0

    def coefficients(self) -> tuple[float, float] | None:
        """(seconds per request, seconds per 10K keys), or None while the fit is undetermined.
        A small ridge term keeps it defined when every step had the same shape; then the split
        between the two is arbitrary but their sum at the observed shape is right.

        Neither may be negative: no attention gets cheaper with more keys or requests. Steps of
        one engine run cluster at nearly one context (4096-4140 keys in the end-to-end benchmark),
        where noise alone sets the slope: an unconstrained fit there once predicted -45 ms for
        exact attention over 16K keys, so every 16K decode would have looked cheaper served exactly.
        Where the data would make a coefficient negative, it cannot tell the two terms apart, so
        the fit is the one-term model of this side's ``shape`` through the same data: exact
        attention over 4x the keys then costs 4x, not (as a constant would say) the same."""
        s00, s01, s11, t0, t1 = self._s00, self._s01, self._s11, self._t0, self._t1
        if s00 <= 0:
            return None
        ridge = 1e-6 * (s00 + s11)
        s00, s11 = s00 + ridge, s11 + ridge
        det = s00 * s11 - s01 * s01
        if det <= 0:
            return None
        a = (s11 * t0 - s01 * t1) / det
        b = (s00 * t1 - s01 * t0) / det
        if a >= 0 and b >= 0:
            return a, b
        return (0.0, max(t1 / s11, 0.0)) if self.shape == "keys" else (max(t0 / s00, 0.0), 0.0)

    def per_request(self, keys: int) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * keys * KEY_SCALE


class BuildCost:
    """Seconds to index one token in one layer, from this worker's builds, with forgetting."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.builds = 0
        self._seconds = 0.0
        self._tokens = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        self._seconds = self.decay * self._seconds + seconds
        self._tokens = self.decay * self._tokens + tokens
        self.builds += 1

    def per_token(self) -> float | None:
        return self._seconds / self._tokens if self.builds else None


class DecodeCostModel:
    def __init__(self, min_steps: int = 16, decay: float = 0.99, explore_every: int = 16,
                 reexplore_steps: int = 4096) -> None:
        self.min_steps = min_steps
        self.explore_every = explore_every
        self.reexplore_steps = reexplore_steps
        self.exact = LinearCost(decay, shape="keys")
        self.sparse = LinearCost(decay, shape="requests")
        self.build = BuildCost(decay)
        self._sampled_octaves: set[int] = set()  # floor(log2) of per-request contexts sampling was timed at
        self._explored: dict[int, int] = {}  # untimed octave -> the step its exploring build was granted at
        # prompt (centre id) whose build waits -> seconds per layer its exact decodes would have saved
        self._saved: OrderedDict[int, float] = OrderedDict()
        self._steps_planned = 0
        self.built_on_outlook = 0  # prompts built before their account paid, on an answer's outlook
        self._explore = False
        self._lock = threading.Lock()
        self.calibration: dict | None = None  # what start-up calibration measured (None: not run)
        # The calibration's fits alone, and each side's observation count once calibrated: what live
        # timings have moved each side from its prior (the module docs' last paragraph).
        self._prior: tuple[LinearCost, LinearCost] | None = None
        self._prior_steps = (0, 0)

    def observe_exact(self, requests: int, keys: int, seconds: float, layers: int = 1) -> None:
        """Exact attention over ``requests`` requests of ``keys`` keys in all took ``seconds`` per
        layer, averaged over ``layers`` layers of one step."""
        with self._lock:
            self.exact.add(requests, keys, seconds, layers)

    def observe_sparse(self, requests: int, keys: int, seconds: float, layers: int = 1) -> None:
        """Sampled attention over ``requests`` requests of ``keys`` keys in all took ``seconds`` per
        layer, averaged over ``layers`` layers of one step."""
        with self._lock:
            self.sparse.add(requests, keys, seconds, layers)
            self._sampled_octaves.add(_octave(keys / max(requests, 1)))

    def observe_build(self, tokens: int, seconds: float) -> None:
        """A build indexed ``tokens`` (tokens x layers) in ``seconds`` of the worker's CPU."""
        with self._lock:
            self.build.add(tokens, seconds)

    def calibrate(self, exact: list[tuple[int, int, float]], sampled: list[tuple[int, int, float]],
                  build: tuple[int, float], record: dict) -> None:
        """Start-up timings (``cost_calibration.py``): ``(requests, keys, seconds per layer)`` points of
        exact attention and of sampling, and a build's ``(tokens x layers, seconds)``. Each side's
        points weigh ``min_steps`` observations together, so decisions are made by measured costs
        from the first request; the power-of-2 ranges from the first sampled point's to the last's
        count as timed (between points the fit interpolates). ``record`` is kept for the stats."""
        with self._lock:
            prior = (LinearCost(1.0, shape="keys"), LinearCost(1.0, shape="requests"))
            for fit, alone, points in ((self.exact, prior[0], exact), (self.sparse, prior[1], sampled)):
                count = -(-self.min_steps // max(len(points), 1))
                for requests, keys, seconds in points:
                    fit.add(requests, keys, seconds, count)
                    alone.add(requests, keys, seconds)
            if sampled:
                octaves = [_octave(keys / requests) for requests, keys, _ in sampled]
                self._sampled_octaves.update(range(min(octaves), max(octaves) + 1))
            self.build.add(*build)
            self.calibration = record
            if exact and sampled:
                self._prior = prior
                self._prior_steps = (self.exact.steps, self.sparse.steps)

    def predicted(self, context: int) -> tuple[float, float] | None:
        """(exact, sampled) seconds per layer for one request of ``context`` keys, once both
        sides have ``min_steps`` steps."""
        with self._lock:
            p = self._predict(context)
        return None if p is None else (p[0] * p[2][0], p[1] * p[2][1])

    def sampling_pays_from(self, longest: int = LONGEST_CONTEXT) -> int | None:
        """The shortest context (keys, one request) from which sampling is predicted no slower than
        exact attention at every longer context up to ``longest``, as the fits stand: shorter ones are
        served exactly as ``sampling_slower`` (outside exploring steps). None until both sides are
        measured, or where sampling is predicted slower at ``longest``.

        Each side's prediction is linear in the context, or one side's scaled prior (a linear fit
        times the other side's live-to-calibrated ratio), which compares with the other as its prior
        with the other's calibration: linear against linear either way, so whether sampling pays
        changes at most once along the context, and a bisection finds where."""
        def pays(n: int) -> bool:  # as sampling_pays judges outside exploring steps
            p = self.predicted(n)
            return p is not None and p[1] <= p[0]

        if not pays(longest):
            return None
        lo, hi = 0, longest  # pays(hi); lo: none shorter than 1 key
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if pays(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def _predict(self, context: int) -> tuple[float, float, tuple[float, float]] | None:
        """(exact, sampled, their prior scales) as the fits stand; the caller holds the lock."""
        if self.exact.steps < self.min_steps or self.sparse.steps < self.min_steps:
            return None
        e, s = self.exact.per_request(context), self.sparse.per_request(context)
        if e is None or s is None:
            return None
        return e, s, self._prior_scale(context, e, s)

    def _prior_scale(self, context: int, e: float, s: float) -> tuple[float, float]:
        """Factors for (exact, sampled) at ``context``: 1, or for a side still on its calibration
        while the other has live timings, the other's live-to-calibrated ratio (module docs). Called
        for every decode request's prediction: the priors are fitted only where a side is scaled."""
        if self._prior is None:
            return 1.0, 1.0
        live = (self.exact.steps - self._prior_steps[0], self.sparse.steps - self._prior_steps[1])
        exact_scaled = live[0] < self.min_steps <= live[1]
        if not exact_scaled and not live[1] < self.min_steps <= live[0]:
            return 1.0, 1.0
        prior = (self._prior[0].per_request(context), self._prior[1].per_request(context))
        if not all(p is not None and p > 0 for p in prior):
            return 1.0, 1.0
        return (s / prior[1], 1.0) if exact_scaled else (1.0, e / prior[0])

    def begin_step(self) -> None:
        """A decode step is being planned: the fits forget a little, and every ``explore_every``-th
        step explores (module docs)."""
        with self._lock:
            self.exact.forget()
            self.sparse.forget()
        self._steps_planned += 1
        self._explore = self._steps_planned % self.explore_every == 0

    def sampling_pays(self, context: int) -> bool:
        """Sample this request? True until both sides are measured; then when sampling is
        predicted no slower than exact, and in an exploring step."""
        p = self.predicted(context)
        return p is None or p[1] <= p[0] or self._explore

    def index_pays(self, cid: int, context: int, remaining: int | None = None, outlook: Outlook | None = None) -> bool:
        """Build prompt ``cid``'s index now? :meth:`index_decision` is None."""
        return self.index_decision(cid, context, remaining, outlook) is None

    def index_decision(self, cid: int, context: int, remaining: int | None = None,
                       outlook: Outlook | None = None) -> str | None:
        """Whether to build prompt ``cid``'s index now (None), or why not (``index_deferred``,
        ``index_cannot_pay``, or ``sampling_slower`` where sampling is predicted no faster than exact,
        asked in an exploring step). Called once per step for a decode over a prompt that has no index
        (module docs): adds what sampling this decode would have saved, and builds once the
        prompt's decodes have saved the build's cost and, given the decodes the request may still
        take (``remaining``, None: unbounded), the build can still pay back (sampling those decodes
        saves its cost; if not, ``index_cannot_pay``, the account kept for the prompt's later requests). Builds
        while the decode or the build costs are unmeasured, and for one prompt per
        ``reexplore_steps`` steps in a power-of-2 range of contexts sampling was not timed in.
        ``outlook``: how the request's answer will likely go on (``answer_lengths.py``; None: unknown);
        where it says building now beats waiting (:func:`_builds_now`), the prompt is built before
        its account has paid (counted in ``built_on_outlook``)."""
        p = self.predicted(context)
        octave = _octave(context)
        with self._lock:
            per_token = self.build.per_token()
            timed_here = octave in self._sampled_octaves
            if not timed_here and p is not None and per_token is not None:
                granted = self._explored.get(octave)
                if granted is None or self._steps_planned - granted >= self.reexplore_steps:
                    self._explored[octave] = self._steps_planned
                    self._saved.pop(cid, None)
                    return None  # this build explores the range
        if p is None or per_token is None:
            return None
        if p[1] >= p[0]:
            # Sampling is predicted no faster (asked in an exploring step): no build could pay, and
            # that is why; the prompt's account stays as it was, for when the costs move.
            return EXACT_SAMPLING_SLOWER
        saved = self._saved.pop(cid, 0.0) + p[0] - p[1]
        build = per_token * context
        can_pay = remaining is None or _pays_back(p, build, remaining)
        if saved >= build and can_pay:
            return None  # forgotten: built now
        if can_pay and outlook is not None and _builds_now(p[0] - p[1], build, saved, outlook):
            self.built_on_outlook += 1
            return None
        self._saved[cid] = saved
        while len(self._saved) > MAX_ACCOUNTS:
            self._saved.popitem(last=False)
        return EXACT_INDEX_DEFERRED if can_pay else EXACT_INDEX_CANNOT_PAY

    def forget_prompts(self) -> None:
        """The index was cleared: the deferred prompts' centres are gone (measured costs stay)."""
        self._saved.clear()

    def summary(self) -> str:
        """The stats log line's part: what the model believes now, so a log shows why decodes were
        served exactly (``sampling_slower``, ``index_deferred``); empty until it predicts anything."""
        parts = []
        for n in (4096, 16384):
            p = self.predicted(n)
            if p is not None:
                parts.append(f"{n // 1024}K exact/sampled us {p[0] * 1e6:.0f}/{p[1] * 1e6:.0f}")
        if parts:
            start = self.sampling_pays_from()
            parts.append("sampled from " + (f"{start} keys" if start is not None else "no context"))
        with self._lock:
            per_token = self.build.per_token()
            deferred = len(self._saved)
        if per_token is not None:
            parts.append(f"build ms/1K tokens {per_token * 1e6:.1f}")
        if not parts:
            return ""
        return "cost_model[" + ", ".join(parts + [f"deferred prompts {deferred}"]) + "]"

    def snapshot(self) -> dict:
        """What the model believes (for the stats): per-request seconds per layer at 4K/16K/64K keys,
        the context from which sampling is predicted to pay (``sampling_pays_from_keys``, None: at no
        context up to 1M keys), and a build's seconds per 1K tokens and layer."""
        out = {"exact_steps": self.exact.steps, "sparse_steps": self.sparse.steps, "builds": self.build.builds,
               "deferred_prompts": len(self._saved), "built_on_outlook": self.built_on_outlook,
               "sampled_octaves": sorted(1 << o for o in self._sampled_octaves),
               "explored_untimed": sorted(1 << o for o in self._explored if o not in self._sampled_octaves)}
        if self.calibration is not None:
            out["calibration"] = self.calibration
        per_token = self.build.per_token()
        if per_token is not None:
            out["build_ms_per_1k_tokens"] = round(per_token * 1e6, 2)
        for n in (4096, 16384, 65536):
            with self._lock:
                p = self._predict(n)
            if p is not None:
                e, s, scale = p
                out[f"exact_us@{n}"] = round(e * scale[0] * 1e6, 1)
                out[f"sparse_us@{n}"] = round(s * scale[1] * 1e6, 1)
                if n == 4096:
                    out["prior_scale@4096"] = [round(f, 2) for f in scale]
        if "exact_us@4096" in out:
            out["sampling_pays_from_keys"] = self.sampling_pays_from()
        return out
