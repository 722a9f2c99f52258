"""Subcommands of the ``turbowire`` CLI; each module exposes ``register(app)``."""
