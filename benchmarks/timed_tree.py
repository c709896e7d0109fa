"""Which checkout's vllm_magicpig a benchmark times: this one, or another built checkout named by
``--tree DIR`` (a git worktree of an earlier commit, say), so two commits can be compared in turn
through the machine's drift. Read from ``sys.argv`` before the benchmark imports vllm_magicpig,
since it decides which package those imports find."""

from __future__ import annotations

import sys
from pathlib import Path


def use_tree_from_argv() -> Path:
    """Put the timed checkout first on ``sys.path`` and return it."""
    args = sys.argv[1:]
    if "--tree" in args[:-1]:
        tree = Path(args[args.index("--tree") + 1]).resolve()
    else:
        tree = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(tree))
    return tree
