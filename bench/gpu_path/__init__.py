"""The GPU connector path benchmark (``python -m bench.gpu_path``; see __main__.py)."""
