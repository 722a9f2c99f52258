"""A short deterministic slice of every fuzz target (tests/fuzz/targets.py) for CI.

The full fuzzer is ``make fuzz`` (tests/fuzz/run.py, a time budget, random seeds). Here each
target runs a fixed number of examples with a derandomized seed, no example database and no
deadline, so the run is the same on every machine and the whole file stays well under a minute
on two cores. A failure prints hypothesis' falsifying example and a ``@reproduce_failure`` blob.

``KNOWN_BUGS`` lists targets that fail on a bug reported but not fixed yet (issue 17's fuzzing
report): they are strict xfails, so the fix turns them into an XPASS failure that says to drop
the entry.
"""

from __future__ import annotations

import pytest
from fuzz.targets import TARGETS, single_threaded
from hypothesis import HealthCheck, Phase, settings

KNOWN_BUGS: dict[str, str] = {}

SLICE = [name for name, t in TARGETS.items() if t.ci_examples > 0]


def _param(name: str) -> object:
    if name in KNOWN_BUGS:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name]))
    return name


@pytest.mark.parametrize("name", [_param(n) for n in SLICE])
def test_fuzz_slice(name: str) -> None:
    t = TARGETS[name]
    # a known bug's regression example fails at once: no shrinking (it takes minutes on deep JSON)
    phases = (Phase.explicit, Phase.generate) if name in KNOWN_BUGS else (
        Phase.explicit, Phase.generate, Phase.shrink)
    run = settings(
        derandomize=True, max_examples=t.ci_examples, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), print_blob=True, phases=phases,
    )(t.hypothesis_test())
    with single_threaded():
        run()


def test_every_target_is_in_the_slice_or_says_why() -> None:
    """A target with ci_examples=0 runs only under run.py (the Triton interpreter is too slow)."""
    assert set(TARGETS) - set(SLICE) <= {"decode_triton"}
    assert set(KNOWN_BUGS) <= set(TARGETS)
