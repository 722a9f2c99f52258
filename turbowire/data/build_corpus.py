"""Rebuild turbowire/data/corpus_en.txt from texts that ship with Python and Debian.

The corpus is committed; this script documents where it came from. Run with the Python 3.11 of
the project's venv on Debian 12 (pydoc topics differ between Python versions):

    python turbowire/data/build_corpus.py && sha256sum turbowire/data/corpus_en.txt
"""

from __future__ import annotations

from pathlib import Path

LICENSES = ["Apache-2.0", "GPL-3", "MPL-2.0", "GFDL-1.3", "LGPL-2.1"]


def build() -> str:
    import pydoc_data.topics as topics

    parts = [topics.topics[name].strip() for name in sorted(topics.topics)]
    for name in LICENSES:
        parts.append(Path("/usr/share/common-licenses", name).read_text(encoding="utf-8").strip())
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    out = Path(__file__).with_name("corpus_en.txt")
    out.write_text(build(), encoding="utf-8")
