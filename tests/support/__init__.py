"""Helpers for the tests and the benchmarks, not shipped in the ``turbowire`` package.

Importable as ``support`` once ``tests/`` is on ``sys.path``: ``tests/conftest.py`` puts it
there for pytest, and ``bench/metrics_run.py`` does the same (not ``tests.support``: a package of
vLLM's dependency tree installs a top-level ``tests`` package that shadows this folder).
"""
