"""Benchmarks of turbowire, run from the repository root as modules (``python -m bench.kernels``).

They import the installed package (``pip install -e .``, or ``make gpu-install`` on a machine
without a venv: bench/README.md) and each other as ``bench.*``; ``bench/e2e`` ships in the package
as ``turbowire.bench_e2e``. Results and their commands: bench/RESULTS.md.
"""
