"""``turbowire models``: prepare the offline models used by eval and the demo."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    models = typer.Typer(help="Offline models (converted once, cached under ~/.cache/turbowire).")

    @models.command("prepare")
    def prepare() -> None:
        """Convert the bundled SmolLM2-135M-Instruct GGUF to bf16 safetensors (once).

        Example: turbowire models prepare
        """
        from turbowire.models import ensure_smollm2

        typer.echo(str(ensure_smollm2()))

    app.add_typer(models, name="models")
