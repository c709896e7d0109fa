"""The package's layering: production modules never import evaluation code, and production
works with no extension installed."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_magicpig"
# Top-level modules that are not the serving path: the demo and its helpers.
APPS = {"demo.py", "models.py", "passkey.py"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_production_module_imports_evaluation_code():
    production = [p for p in PACKAGE.glob("*.py") if p.name not in APPS]
    assert len(production) > 10, production  # the glob found the package
    bad = {p.name: sorted(n for n in _imports(p) if n.startswith("vllm_magicpig.eval") or n == "vllm_magicpig.eval")
           for p in production}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_production_runs_without_extensions():
    code = """
import torch
from vllm_magicpig import config, decode_methods
from vllm_magicpig.config import MagicPigConfigError, parse_config
assert config.decode_method_names() == ("magicpig", "exact"), config.decode_method_names()
try:
    parse_config({"magicpig": {"budget_fraction": 0.1}})
    raise SystemExit("an extension key was accepted without the extension")
except MagicPigConfigError as e:
    assert "unknown key(s) 'budget_fraction'" in str(e), e
from vllm_magicpig.runtime import MagicPigRuntime
rt = MagicPigRuntime(parse_config({}), num_layers=4)
assert rt.step_settings().method == "magicpig" and rt.extension_state == {}
import vllm_magicpig.layer
assert decode_methods.get_method("magicpig").name == "magicpig"
assert not any(m.startswith("vllm_magicpig.eval") for m in sys.modules), sorted(sys.modules)
print("OK")
"""
    env = dict(os.environ, VLLM_MAGICPIG_EXTENSIONS="0")
    res = subprocess.run([sys.executable, "-c", "import sys\n" + code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]
