"""The pass-key retrieval prompt used by the demo, the tests and the benchmarks.

A random pass key is hidden at a chosen depth inside a filler haystack; the model is
asked to repeat it. Deterministic for a seed; no downloads.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. "
    "Here we go. There and back again. "
)
_TASK = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n\n"
)
_QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PassKeyPrompt:
    text: str  # the prompt, ready for LLM.generate
    pass_key: str
    num_tokens: int


def build(tokenizer, context_tokens: int, seed: int = 0, depth: float = 0.5,
          chat: bool = False) -> PassKeyPrompt:
    """A prompt of about ``context_tokens`` tokens with the needle at ``depth`` (0..1).

    Plain text by default: SmolLM2-135M-Instruct answers it reliably up to its 8K
    context, but not inside its chat template (measured: 1 of 8 at 1.4K-5.7K tokens).
    """
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "

    def render(reps: int) -> str:
        before = int(reps * depth)
        body = _TASK + FILLER * before + needle + FILLER * (reps - before) + _QUESTION
        if chat and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
            )
        return body

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    # Token cost per filler repetition, measured on the real text (merges at the seams
    # make it differ from the filler's own length), then sized to the target.
    base, probe = count(render(0)), count(render(100))
    per_rep = (probe - base) / 100
    reps = max(1, int((context_tokens - base) / per_rep))
    text = render(reps)
    n = count(text)
    return PassKeyPrompt(text=text, pass_key=key, num_tokens=n)
