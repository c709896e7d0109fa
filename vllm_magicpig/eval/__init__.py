"""Offline evaluation helpers: RULER-style synthetic tasks (``tasks``) and fidelity
metrics (``metrics``). Importing this package imports neither vllm nor torch."""

from .tasks import (
                    MAX_NEW_TOKENS,
                    RULER_PRESETS,
                    SOURCES,
                    TASKS,
                    Sample,
                    format_for_model,
                    generate,
                    long_text,
                    score,
                    score_samples,
)

__all__ = ["Sample", "TASKS", "RULER_PRESETS", "MAX_NEW_TOKENS", "SOURCES", "generate", "score",
           "score_samples", "format_for_model", "long_text"]
