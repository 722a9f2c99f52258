"""Run every fuzz target of tests/fuzz/targets.py for a time budget (``make fuzz``).

    PYTHONPATH=tests .venv/bin/python -m fuzz.run --seconds 300   # all targets, 300 s in total
    PYTHONPATH=tests .venv/bin/python -m fuzz.run --seconds 60 --target decode_forged
    PYTHONPATH=tests .venv/bin/python -m fuzz.run --list

(``tests/`` on the path, as pytest puts it there for the CI slice: ``fuzz.targets``, ``support``.)

The budget is split across the chosen targets by their weights (time a failing target leaves
unused goes to further passes over the others). Each target runs in batches of random examples
(a fresh seed per batch) until its share is spent or it fails; a failure is
shrunk by hypothesis, saved to hypothesis' example database (``.hypothesis/fuzz-db``: the next
run replays it first) and written out, with its falsifying example, traceback and reproduce blob,
to ``--failures-dir`` (``.hypothesis/fuzz-failures/<target>.txt``). An example that runs longer
than ``--hang-seconds`` is a failure (a hang); one stuck in C code past three times that ends the
process with every thread's traceback written to the target's failure file.

Prints a table (target, examples, failures, seconds) and exits 1 when any target failed. The
first example of each target, which imports what it needs (vLLM, LMCache), is not counted
against the budget, so a run takes that much longer than ``--seconds``.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPO = TESTS.parent

os.environ.setdefault("TRITON_INTERPRET", "1")

from fuzz.targets import TARGETS, FuzzTimeout, Target, single_threaded  # noqa: E402
from hypothesis import HealthCheck, Phase, Verbosity, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

MAX_BATCH = 2000


@dataclass
class Result:
    name: str
    examples: int = 0
    failures: int = 0
    seconds: float = 0.0
    batches: int = 0
    report: Path | None = None
    errors: list[str] = field(default_factory=list)


def _split(exc: BaseException) -> list[BaseException]:
    """The distinct failures hypothesis reports (an ExceptionGroup holds several)."""
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for sub in exc.exceptions:
            out.extend(_split(sub))
        return out
    return [exc]


def _describe(exc: BaseException) -> str:
    notes = "\n".join(getattr(exc, "__notes__", []) or [])
    tb = "".join(traceback.format_exception(exc))
    return f"{notes}\n\n{tb}"


class Watchdog:
    """SIGALRM inside an example that runs past ``seconds`` (a Python-level hang), and
    faulthandler's hard exit at 3x that (stuck in C code, where no signal handler runs), which
    writes every thread's traceback to the target's ``.hang.txt`` first."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.enabled = seconds > 0 and hasattr(signal, "setitimer")
        self._file: Any = None
        self._path: Path | None = None
        if self.enabled:
            signal.signal(signal.SIGALRM, self._fire)

    def _fire(self, signum: int, frame: object) -> None:
        # the signal may land in a gc or weakref callback, which swallows the exception: fire
        # again shortly until it lands in the example's own code
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        raise FuzzTimeout(f"example ran longer than {self.seconds:g} s (hang)")

    def start(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._file = open(path, "w")  # noqa: SIM115 - faulthandler writes here on a hard hang

    def stop(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._path is not None and self._path.exists() and self._path.stat().st_size == 0:
            self._path.unlink()

    def arm(self) -> None:
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
            if self._file is not None:
                faulthandler.dump_traceback_later(self.seconds * 3, exit=True, file=self._file)

    def disarm(self) -> None:
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, 0)
            faulthandler.cancel_dump_traceback_later()


def run_target(t: Target, budget: float, db: DirectoryBasedExampleDatabase, failures_dir: Path,
               watchdog: Watchdog, console: Console, base_seed: int | None = None) -> Result:
    res = Result(t.name)
    count = [0]
    first_call = [0.0]

    @functools.wraps(t.fn)
    def body(**kwargs: object) -> None:
        count[0] += 1
        # The first example imports what the target needs (vLLM alone takes 10 s and more on a
        # busy machine): no watchdog, and its time is not taken from the target's budget.
        armed = count[0] > 1
        t0 = time.monotonic()
        if armed:
            watchdog.arm()
        try:
            t.fn(**kwargs)
        finally:
            if armed:
                watchdog.disarm()
            else:
                first_call[0] = time.monotonic() - t0

    watchdog.start(failures_dir / f"{t.name}.hang.txt")
    start = time.monotonic()
    end = start + budget
    batch, per_example = 5, None
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if per_example is not None:
            batch = int(max(1, min(MAX_BATCH, (end - now) / max(per_example, 1e-4) * 0.9)))
        before, t0 = count[0], time.monotonic()
        test = t.hypothesis_test(body)
        if base_seed is not None:
            test = hypothesis_seed(base_seed * 100_003 + res.batches)(test)
        configured = settings(
            max_examples=batch, deadline=None, database=db, derandomize=False,
            suppress_health_check=list(HealthCheck), print_blob=True, report_multiple_bugs=True,
            phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
            verbosity=Verbosity.normal,
        )(test)
        try:
            configured()
        except Exception as exc:  # noqa: BLE001 - reported and saved; this target stops here
            failures = _split(exc)
            res.failures += len(failures)
            report = failures_dir / f"{t.name}.txt"
            report.parent.mkdir(parents=True, exist_ok=True)
            text = [f"target {t.name}: {t.prop}\n", f"{len(failures)} distinct failure(s)\n"]
            for i, f in enumerate(failures, 1):
                text.append(f"\n===== failure {i}: {type(f).__name__}: {f}\n")
                text.append(_describe(f))
                res.errors.append(f"{type(f).__name__}: {str(f).splitlines()[0][:160]}"
                                  if str(f) else type(f).__name__)
            report.write_text("".join(text))
            res.report = report
            console.print(f"[red]{t.name}: {len(failures)} failure(s), see {report}[/red]")
            break
        finally:
            res.batches += 1
        done = count[0] - before
        spent = time.monotonic() - t0
        if before == 0:
            end += first_call[0]
            spent -= first_call[0]
            done -= 1
        if done > 0:
            per_example = spent / done
    watchdog.stop()
    res.examples = count[0]
    res.seconds = time.monotonic() - start
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0,
                    help="total time budget, split across the targets by weight (default 60)")
    ap.add_argument("--target", action="append", default=[], metavar="NAME",
                    help="run only this target (repeatable); --list shows the names")
    ap.add_argument("--list", action="store_true", help="list the targets and their properties")
    ap.add_argument("--failures-dir", type=Path, default=REPO / ".hypothesis" / "fuzz-failures")
    ap.add_argument("--database", type=Path, default=REPO / ".hypothesis" / "fuzz-db",
                    help="hypothesis example database (failures are replayed from it first)")
    ap.add_argument("--hang-seconds", type=float, default=30.0,
                    help="an example running longer than this is a failure (0: no watchdog)")
    ap.add_argument("--seed", type=int, default=None,
                    help="derive every batch's hypothesis seed from this (default: random)")
    args = ap.parse_args(argv)
    console = Console()
    # the code under test logs every refusal (a refused handshake, a corrupt blob): thousands of
    # lines of expected noise
    logging.disable(logging.CRITICAL)
    if args.list:
        table = Table("target", "weight", "CI examples", "property")
        for t in TARGETS.values():
            table.add_row(t.name, f"{t.weight:g}", str(t.ci_examples), t.prop)
        console.print(table)
        return 0
    unknown = [n for n in args.target if n not in TARGETS]
    if unknown:
        console.print(f"[red]unknown target(s) {unknown}; known: {', '.join(TARGETS)}[/red]")
        return 2
    chosen = [TARGETS[n] for n in (args.target or list(TARGETS))]
    for t in chosen:  # a report left by an earlier run must not outlive a fix
        (args.failures_dir / f"{t.name}.txt").unlink(missing_ok=True)
    db = DirectoryBasedExampleDatabase(str(args.database))
    watchdog = Watchdog(args.hang_seconds)
    results = {t.name: Result(t.name) for t in chosen}
    started = time.monotonic()
    active, first = list(chosen), True
    while active:
        # Pass over the targets still passing; what a pass leaves unused (a target that fails
        # stops early) goes to another pass, until the budget is spent.
        for i, t in enumerate(active):
            left = args.seconds - (time.monotonic() - started)
            if not first and left < 2.0:
                break
            budget = max(1.0, left * t.weight / sum(x.weight for x in active[i:]))
            console.print(f"[bold]{t.name}[/bold]: {budget:.0f} s")
            r = run_target(t, budget, db, args.failures_dir, watchdog, console, args.seed)
            acc = results[t.name]
            acc.examples += r.examples
            acc.failures += r.failures
            acc.seconds += r.seconds
            acc.errors += r.errors
            acc.report = r.report or acc.report
        first = False
        active = [t for t in active if not results[t.name].failures]
        if args.seconds - (time.monotonic() - started) < 2.0:
            break
    table = Table(title=f"turbowire fuzz: {args.seconds:g} s budget")
    for col in ("target", "examples", "failures", "seconds"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for r in results.values():
        style = "red" if r.failures else None
        table.add_row(r.name, str(r.examples), str(r.failures), f"{r.seconds:.1f}", style=style)
    table.add_row("total", str(sum(r.examples for r in results.values())),
                  str(sum(r.failures for r in results.values())),
                  f"{time.monotonic() - started:.1f}", style="bold")
    console.print(table)
    for r in results.values():
        for e in r.errors:
            console.print(f"[red]{r.name}[/red]: {e}")
        if r.report is not None:
            console.print(f"  failing example and traceback: {r.report}")
    return 1 if any(r.failures for r in results.values()) else 0


if __name__ == "__main__":
    with single_threaded():
        sys.exit(main())
