"""Helpers for the tests and the benchmarks, not shipped in the ``turbowire`` package.

Importable as ``support`` once ``tests/`` is on ``sys.path``: ``tests/conftest.py`` puts it
there for pytest; the benchmarks import it as ``tests.support`` (``python -m bench.metrics_run``
from the repository root).
"""
