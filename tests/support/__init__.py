"""Helpers for the tests and the benchmarks, not shipped in the ``turbowire`` package.

Importable as ``support`` once ``tests/`` is on ``sys.path``: ``tests/conftest.py`` puts it
there for pytest; scripts under ``bench/`` insert it themselves (see ``bench/metrics_run.py``).
"""
