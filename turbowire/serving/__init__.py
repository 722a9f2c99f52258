"""turbowire.serving: tools that run outside an engine.

The P/D proxy (``proxy``), the one launcher that starts, watches and stops engines and the proxy
(``launch``: the demo, the e2e tests and the benchmarks all use it) and ``turbowire demo``
(``demo``). The vLLM plugin (``turbowire.connector``) never imports this package.
"""
