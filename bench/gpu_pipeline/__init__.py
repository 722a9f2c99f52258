"""The two-process P/D pipeline on the connector's GPU path, with real NIXL agents, against
NixlConnector-style and contiguous dense READs (``python -m bench.gpu_pipeline``; issue 38;
see __main__.py)."""
