"""Find the line that says why a vLLM engine failed to start, in the engine's log.

A failed engine start ends its log with vLLM's generic wrappers ("Engine core initialization
failed. See root cause above") and the API server's traceback; the real cause (an exception in
the engine core process, often one of ours) is tens of lines higher, printed once by vLLM's
logger (every line prefixed ``(EngineCore_DP0 pid=N) ERROR <date> [core.py:N] ``) and once by
``multiprocessing`` (no prefix). :func:`find_root_cause` reads such a log the way a person
would: per process, tracebacks and their final exception lines; turbowire's own exceptions first
(they say what to change), then the first real exception, then vLLM ``ERROR`` records, then an
argparse ``error:`` line. No vLLM import: the launchers and the CLI use it after the fact.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["find_root_cause", "log_tail", "read_root_cause", "strip_ansi"]

#: Packages whose source files count as turbowire frames (package-dir maps them to repo folders).
TURBOWIRE_PACKAGES = (
    "turbowire", "turbowire.codec", "turbowire.kernels", "turbowire.connector",
    "turbowire.bench_e2e",
)

#: Lines that only point elsewhere ("see above"): never a root cause.
GENERIC_PATTERNS = (
    "Engine core initialization failed",
    "See root cause above",
    "Failed core proc(s)",
    "EngineCore failed to start",
    "EngineCore encountered a fatal error",
    "EngineCore encountered an issue",
    "WorkerProc failed to start",
    "WorkerProc initialization failed",
    "See stack trace for root cause",
    "stack trace above for the root cause",
    "Frontend process failed during engine core initialization",
)

#: Exceptions that mean "was stopped", not "failed": a consequence, not a cause.
STOP_EXCEPTIONS = frozenset({
    "SystemExit", "KeyboardInterrupt", "GeneratorExit", "CancelledError",
    "asyncio.CancelledError", "asyncio.exceptions.CancelledError",
})

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# "(EngineCore_DP0 pid=1234) " (vLLM's process tag), then optionally vLLM's record header
# "ERROR 12-01 10:00:00 [core.py:700] " (repeated on every line of a multi-line record).
_PREFIX_RE = re.compile(
    r"^(?:\((?P<proc>[^()\s]+ pid=\d+)\) ?)?"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? "
    r"\[[^\]]*\] ?)?"
)
_TRACEBACK = "Traceback (most recent call last):"
_FRAME_RE = re.compile(r'^\s+File "(?P<path>[^"]+)", line \d+')
_EXC_RE = re.compile(r"^(?P<type>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::(?: .*)?)?$")
_CHAIN_MARKERS = (
    "The above exception was the direct cause of the following exception",
    "During handling of the above exception, another exception occurred",
)
# Output that follows a traceback but is not its message: a Python warning, multiprocessing's
# "Process EngineCore_DP0:" header.
_NOT_MESSAGE_RE = re.compile(r"^(?:\S+\.py:\d+: \w*Warning:|Process [\w.-]+:$)")
_ARGPARSE_RE = re.compile(r"^\S+(?: \S+)?: error: \S")
_ERROR_LEVELS = frozenset({None, "ERROR", "CRITICAL"})  # None: raw stderr (unlogged)


def strip_ansi(text: str) -> str:
    """``text`` without ANSI colour/cursor escapes (vLLM colours its prefixes on a terminal)."""
    return _ANSI_RE.sub("", text)


def log_tail(text: str, n: int) -> str:
    """The last ``n`` lines of a log, without ANSI escapes (readable in an exception message)."""
    return "\n".join(strip_ansi(line).rstrip() for line in text.splitlines()[-n:])


@functools.cache
def _turbowire_roots() -> tuple[str, ...]:
    """Source folders of turbowire's packages (editable installs map them to repo folders)."""
    roots: list[str] = []
    for name in TURBOWIRE_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            roots.append(os.path.realpath(loc).rstrip(os.sep) + os.sep)
    return tuple(roots)


def _is_turbowire_file(path: str) -> bool:
    """A frame's file is turbowire's: installed package, or one of this install's source folders
    (not merely under a folder named turbowire: the venv of a checkout is, too)."""
    if re.search(r"[/\\](?:site|dist)-packages[/\\]turbowire[/\\]", path):
        return True
    real = os.path.realpath(path)
    return any(p.startswith(root) for p in (path, real) for root in _turbowire_roots())


def _is_generic(text: str) -> bool:
    return any(p in text for p in GENERIC_PATTERNS)


@dataclass
class _Found:
    """One candidate: an exception (or log record) and its message lines."""

    index: int  # line number in the log: earlier wins within a tier
    lines: list[str]
    exc_type: str = ""
    turbowire: bool = False
    error_level: bool = True

    def text(self, max_lines: int) -> str:
        out = [ln.rstrip() for ln in self.lines]
        while out and not out[-1].strip():
            out.pop()
        if len(out) > max_lines:
            out = out[:max_lines]
            out[-1] += " [...]"
        return "\n".join(out)


@dataclass
class _Stream:
    """Parser state of one writer (a process tag + record header, or raw stderr)."""

    level: str | None
    state: str = "idle"  # "frames": inside a traceback; "message"/"record": collecting lines
    last_frame: str | None = None
    current: _Found | None = None  # the candidate whose lines are being collected

    def close(self) -> None:
        self.current = None
        self.state = "idle"


@dataclass
class _Scan:
    exceptions: list[_Found] = field(default_factory=list)
    records: list[_Found] = field(default_factory=list)
    argparse: list[_Found] = field(default_factory=list)


def _feed(stream: _Stream, index: int, body: str, scan: _Scan, keep: int) -> bool:
    """Advance one writer's state by one line; True while a multi-line message stays open."""
    if body.startswith(_TRACEBACK):
        stream.close()
        stream.state, stream.last_frame = "frames", None
        return False
    if stream.state == "frames":
        if body[:1] in (" ", "\t"):
            m = _FRAME_RE.match(body)
            if m:
                stream.last_frame = m.group("path")
            return False
        m = _EXC_RE.match(body)
        if not m:
            stream.state = "idle"
            return False
        exc_type = m.group("type")
        stream.current = _Found(
            index, [body.strip()], exc_type,
            turbowire=exc_type.startswith("turbowire.")
            or (stream.last_frame is not None and _is_turbowire_file(stream.last_frame)),
            error_level=stream.level in _ERROR_LEVELS,
        )
        stream.state = "message"
        scan.exceptions.append(stream.current)
        return True
    if stream.state in ("message", "record"):
        if (not body.strip() or body.startswith(_CHAIN_MARKERS)
                or (stream.state == "message" and _NOT_MESSAGE_RE.match(body))):
            stream.close()
            return False
        assert stream.current is not None
        if len(stream.current.lines) < keep:
            stream.current.lines.append(body.rstrip())
        return True
    if stream.level in ("ERROR", "CRITICAL") and body.strip():
        stream.current = _Found(index, [body.strip()])
        stream.state = "record"
        scan.records.append(stream.current)
        return True
    if stream.level is None and _ARGPARSE_RE.match(body):
        scan.argparse.append(_Found(index, [body.strip()]))
    return False


def _scan(text: str, keep: int) -> _Scan:
    """Split the log into writers and collect every candidate line."""
    scan = _Scan()
    streams: dict[str, _Stream] = {}
    open_key: str | None = None  # the writer whose multi-line message the previous line continued
    for index, raw in enumerate(text.splitlines()):
        line = strip_ansi(raw).rstrip("\r\n")
        m = _PREFIX_RE.match(line)  # always matches (both parts optional)
        assert m is not None
        prefix = m.group(0)
        key, body = prefix.rstrip(), line[len(prefix):]
        if open_key is not None and key != open_key:
            streams[open_key].close()  # a message's continuation lines are contiguous
        stream = streams.get(key)
        if stream is None:
            stream = streams[key] = _Stream(m.group("level"))
        open_key = key if _feed(stream, index, body, scan, keep) else None
        if stream.state == "idle" and stream.level is not None:
            del streams[key]  # a finished record: its header (time, file:line) will not recur
    return scan


def find_root_cause(text: str, max_lines: int = 5) -> str | None:
    """The error line of an engine log that names the cause, with up to ``max_lines`` - 1 of its
    continuation lines; prefixes and ANSI codes removed. None when the log shows no error.

    Order: an exception raised by turbowire (type ``turbowire.*`` or innermost frame in a
    turbowire file), else the first other exception (in a chain Python prints the innermost cause
    first), else the first vLLM ``ERROR`` record, else an argparse ``error:`` line, else an
    exception logged at WARNING or below. vLLM's "see root cause above" wrappers and
    SystemExit/KeyboardInterrupt never count.
    """
    scan = _scan(text, keep=max_lines + 1)

    def real(f: _Found) -> bool:
        return f.exc_type not in STOP_EXCEPTIONS and not _is_generic("\n".join(f.lines))

    excs = [f for f in scan.exceptions if real(f)]
    tiers = (
        [f for f in excs if f.error_level and f.turbowire],
        [f for f in excs if f.error_level],
        [f for f in scan.records if real(f)],
        scan.argparse,
        excs,
    )
    for tier in tiers:
        if tier:
            return min(tier, key=lambda f: f.index).text(max_lines)
    return None


def read_root_cause(path: Path, max_lines: int = 5) -> str | None:
    """:func:`find_root_cause` of a log file; None when it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return find_root_cause(text, max_lines)
