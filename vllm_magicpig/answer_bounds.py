"""How many tokens each request of a step may still decode, read from vLLM's model runner.

Why: the cost model defers a new prompt's index until its exact decodes would have saved what the
build costs (ski rental, ``cost_model.py``), then builds it. A build pays back only over the decodes
after it; when a request's answer ends sooner, the build was for nothing, and the request ran slower
than exact. Ski rental cannot know when an answer ends, but vLLM does know a bound: the request's
``max_tokens``. Under a load of 512-token answers (``benchmarks/load_split.py``: exact 452 and
sampled 313 us a request and layer at 4K, builds 7-10 ms per 1K tokens and layer) a 4K prompt's
build pays back after ~200-300 sampled decodes, so ski rental builds it after as many exact ones,
and at 10 ms per 1K tokens the ~220 decodes left save ~30 ms a layer of a ~41 ms build. With the
bound the planner serves such a request exactly to its end (stats: ``index_cannot_pay``).

The attention metadata carries no request ids, so the bound is read where the runner builds that
metadata (``GPUModelRunner._build_attention_metadata``, which vLLM's CPU runner inherits): one
number per batch row, in the batch's order, published on the worker's runtime (read from the runner
row by row, on demand) and taken by the MAGICPIG metadata builder of the same step. A bound is
``max_tokens`` less the tokens already decoded, or None where the request has no ``max_tokens``.
vLLM fills in ``max_tokens`` when a client leaves it out (the model length less the prompt), which
is a bound too, just a loose one: it changes nothing then.

The same patch records every finished request's answer (tokens generated of its ``max_tokens``,
from ``GPUModelRunner._on_request_state_removed``, vLLM's hook for a finished request's state) on
the runtime's ``answer_lengths``, and a row's outlook (``RowBounds.outlook``) adds the running
requests, so the cost model can build a prompt at once where answers like its request's run long
(``answer_lengths.py``).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from vllm_magicpig.answer_lengths import AnswerLengths, Outlook

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_MARK = "_magicpig_answer_bounds"


class AnswerBounds(Protocol):
    """What the planner asks of a step's bounds, by batch row (``StepPlanner.plan``)."""

    def __len__(self) -> int:
        """The rows bounded (a step with more decodes than that is planned unbounded)."""

    def __getitem__(self, row: int) -> int | None:
        """The decodes row ``row``'s request may still take (None: no bound)."""

    def outlook(self, row: int) -> Outlook | None:
        """How row ``row``'s answer will likely go on (None: nothing known)."""


class ListedBounds:
    """Bounds given one per row, with no outlook: for a caller that knows each request's remaining
    decodes but no past answers (tests, tools)."""

    __slots__ = ("_bounds",)

    def __init__(self, bounds: Sequence[int | None]) -> None:
        self._bounds = list(bounds)

    def __len__(self) -> int:
        return len(self._bounds)

    def __getitem__(self, row: int) -> int | None:
        return self._bounds[row]

    def outlook(self, row: int) -> Outlook | None:
        return None


class RowBounds:
    """The bounds of a step's first ``num_reqs`` rows, each read from the runner when the planner
    asks for it: only a decode over a prompt not yet indexed needs one, so most steps read none,
    where reading every row at every step cost a Python loop over the batch. Valid while the runner
    builds this step's metadata (the builder takes it then)."""

    __slots__ = ("_runner", "_num_reqs", "_lengths", "_running")

    def __init__(self, runner: Any, num_reqs: int, lengths: AnswerLengths | None = None) -> None:
        self._runner, self._num_reqs, self._lengths = runner, num_reqs, lengths
        self._running: list[tuple[int, int | None]] | None = None  # read at the first outlook asked

    def __len__(self) -> int:
        return self._num_reqs

    def __getitem__(self, row: int) -> int | None:
        """The decodes row ``row``'s request may still take (None: no bound)."""
        generated, max_tokens = self._progress(row)
        return None if max_tokens is None else max(max_tokens - generated, 0)

    def outlook(self, row: int) -> Outlook | None:
        """How row ``row``'s answer will likely go on (answer_lengths.py), from the answers finished
        and the requests running now; None without a bound or enough answers."""
        if self._lengths is None:
            return None
        generated, max_tokens = self._progress(row)
        if max_tokens is None:
            return None
        if self._running is None:
            self._running = [_progress_of(state) for state in self._runner.requests.values()]
        return self._lengths.outlook(generated, max_tokens, self._running)

    def _progress(self, row: int) -> tuple[int, int | None]:
        if not 0 <= row < self._num_reqs:
            raise IndexError(row)
        return _progress_of(self._runner.requests.get(self._runner.input_batch.req_ids[row]))


def _progress_of(state: Any) -> tuple[int, int | None]:
    """(tokens generated, max_tokens or None) of a runner's request state."""
    params = None if state is None else state.sampling_params
    max_tokens = None if params is None else params.max_tokens
    return (0, None) if max_tokens is None else (len(state.output_token_ids), int(max_tokens))


def bounds_of(runner: Any, num_reqs: int, lengths: AnswerLengths | None = None) -> RowBounds | None:
    """The bounds of the batch's first ``num_reqs`` rows, or None when the runner's batch does not
    name that many requests (a dummy or profiling run)."""
    if len(runner.input_batch.req_ids) < num_reqs:
        return None
    return RowBounds(runner, num_reqs, lengths)


def publish(runner: Any, num_reqs: int) -> None:
    """Put this step's bounds on the worker's MAGICPIG runtime, if it has one."""
    from vllm_magicpig import runtime

    rt = runtime.current()
    if rt is not None:
        rt.answer_bounds = bounds_of(runner, num_reqs, rt.answer_lengths)


def record_finished(state: Any) -> None:
    """A request finished: its answer's length goes to the worker's MAGICPIG runtime, if it has one."""
    from vllm_magicpig import runtime

    rt = runtime.current()
    if rt is not None and state is not None:
        rt.answer_lengths.record(*_progress_of(state))


def patch(runner_cls) -> None:
    """Make ``runner_cls`` (vLLM's GPUModelRunner, the CPU runner's base) publish the bounds before it
    builds a step's attention metadata, and record each finished request's answer. Idempotent."""
    build = runner_cls._build_attention_metadata
    if getattr(build, _MARK, False):
        return
    removed = runner_cls._on_request_state_removed

    def _on_request_state_removed(self, req_id, req_state):
        record_finished(req_state)
        return removed(self, req_id, req_state)

    runner_cls._on_request_state_removed = _on_request_state_removed

    def _build_attention_metadata(self, num_tokens, num_reqs, *args, **kwargs):
        publish(self, num_reqs)
        return build(self, num_tokens, num_reqs, *args, **kwargs)

    setattr(_build_attention_metadata, _MARK, True)
    runner_cls._build_attention_metadata = _build_attention_metadata
