"""Shared fixtures. End-to-end tests run real vLLM on SmolLM2-135M-Instruct.

The model folder is prepared by ./setup.sh (python -m vllm_magicpig.models smollm2);
a missing model is an error, never a skip, so CI cannot pass without running them.
"""
from __future__ import annotations

import os

import pytest

# vLLM reserves this share of the machine's RAM for the KV cache (24 GB machines).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


@pytest.fixture(scope="session")
def model_path() -> str:
    from vllm_magicpig.models import prepare_smollm2

    return str(prepare_smollm2())


def make_llm(model_path: str, backend: str = "MAGICPIG", magicpig: dict | None = None, **kwargs):
    """An LLM with test-friendly defaults (eager mode: compile warm-up takes ~70 s)."""
    from vllm import LLM

    args = dict(
        model=model_path,
        attention_backend=backend,
        enforce_eager=True,
        max_model_len=8192,
        seed=0,
    )
    if magicpig is not None:
        # These tests check the sampled path at contexts where, on this machine, sampling may be
        # slower than exact attention: keep the cost model from serving them exactly. They count
        # sampled decodes from the first one: the background indexer (timing-dependent exact first
        # decodes) is off unless a test turns it on (test_background_index.py).
        args["additional_config"] = {"magicpig": {"cost_model": False, "background_index": False, **magicpig}}
    args.update(kwargs)
    return LLM(**args)


def stats(llm) -> dict:
    (snap,) = llm.collective_rpc("magicpig_stats")
    return snap
