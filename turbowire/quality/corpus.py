"""The bundled English corpus (pydoc topics + Debian license texts), checked by sha256."""

from __future__ import annotations

import hashlib
from importlib import resources

from turbowire.errors import TurboWireError

CORPUS_FILE = "corpus_en.txt"
CORPUS_SHA256 = "77cfeb30ba1ba40cdbe0b8dc5123e7611bbfc62199c48a6c0966f522206c52a2"


class CorpusError(TurboWireError, RuntimeError):
    """The bundled corpus is missing or was modified."""


def load_corpus() -> str:
    data = resources.files("turbowire.data").joinpath(CORPUS_FILE).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise CorpusError(
            f"{CORPUS_FILE} has sha256 {digest}, expected {CORPUS_SHA256}: results would not be "
            "comparable with the recorded ones (rebuild it with turbowire/data/build_corpus.py)"
        )
    return data.decode("utf-8")
