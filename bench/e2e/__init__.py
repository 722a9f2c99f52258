"""End-to-end P/D benchmark (imported as ``turbowire.bench_e2e``).

Two vLLM CPU engines (prefill in the root network namespace, decode in a namespace behind a
tbf-shaped veth link), vLLM's NixlConnector against turbowire's connector, plus the GPU-scale
projection model and the GPU pipeline script. See bench/RESULTS.md for results and commands.
"""
