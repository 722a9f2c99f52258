"""Secrets read from files (mounted Kubernetes Secrets): one reader for the connector's auth
token and the store's Redis password, so both refuse a wrong mount the same way and no error
ever shows what the file holds."""

from __future__ import annotations

from turbowire.errors import TurboWireError

#: A secret file holds one token or password; anything larger is a wrong mount.
MAX_SECRET_FILE_BYTES = 4096


def read_secret_file(path: str, *, key: str, holds: str, error: type[TurboWireError]) -> str:
    """The text in ``path`` with surrounding whitespace stripped ("" when there is none).
    Errors (``error``) name ``key`` and the path, never the content."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise error(
            f"{key}={path!r} cannot be read ({exc.strerror or type(exc).__name__}): mount the "
            f"Secret holding {holds} there, readable by this process's user"
        ) from exc
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise error(
            f"{key}={path!r} is larger than {MAX_SECRET_FILE_BYTES} bytes: it must hold only "
            f"{holds}"
        )
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise error(f"{key}={path!r} is not UTF-8 text") from exc
