"""``turbowire presets``: the codec presets with their real bits per element."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("presets")
    def presets(
        num_heads: int = typer.Option(8, "--num-heads", help="KV heads per chunk (header share)."),
        chunk_tokens: int = typer.Option(256, "--chunk-tokens", help="Tokens per encoded chunk."),
        num_layers: int = typer.Option(32, "--num-layers", help="Model depth (boundary policies)."),
        head_dim: int | None = typer.Option(
            None, "--head-dim",
            help="Also show this head size (a multiple of 8: Phi-3's 96 pads to 128 to rotate)."),
    ) -> None:
        """List the codec presets: what K and V get, bits per element and ratio vs bf16.

        Bits per element count every byte on the wire (header, scales, means) for a full chunk.

        Examples:

          turbowire presets

          turbowire presets --num-heads 3 --num-layers 30   # SmolLM2-135M geometry

          turbowire presets --head-dim 96 --num-heads 32   # Phi-3-mini's heads
        """
        from rich.console import Console
        from rich.table import Table

        from turbowire.codec import Codec, CodecError, check_head_dim, get_preset, list_presets

        dims = [64, 128, 256]
        if head_dim is not None and head_dim not in dims:
            try:
                check_head_dim(head_dim)
            except CodecError as exc:
                raise typer.BadParameter(str(exc), param_hint="--head-dim") from None
            dims.append(head_dim)
        ratio_dim = head_dim if head_dim is not None else 128

        table = Table(title="turbowire codec presets", title_justify="left")
        for col in ["preset", "id", "K", "V", "boundary"]:
            table.add_column(col)
        for dim in dims:
            table.add_column(f"hd{dim}", justify="right")
        table.add_column("ratio", justify="right")
        for name in list_presets():
            p = get_preset(name)
            boundary = (
                f"{p.boundary_layers}+{p.boundary_layers}: "
                f"{p.boundary.k.short}/{p.boundary.v.short}"
                if p.boundary else "-"
            )
            body_layer = min(p.boundary_layers, num_layers - 1) if p.boundary else 0
            bpe = [Codec(name, d, num_layers, chunk_tokens).bits_per_element(body_layer, num_heads)
                   for d in dims]
            table.add_row(name, str(p.preset_id), p.body.k.short, p.body.v.short, boundary,
                          *[f"{b:.3f}" for b in bpe], f"{16 / bpe[dims.index(ratio_dim)]:.2f}x")
        console = Console()
        console.print(table)
        console.print(
            "hd<n>: bits per element at head_dim n, every wire byte counted "
            f"(full {chunk_tokens}-token chunk, {num_heads} KV heads); ratio vs bf16 at "
            f"hd{ratio_dim}. "
            "LM<b>: b-bit Lloyd-Max after a randomized Hadamard rotation; +mean: per-chunk "
            "channel mean removed; +sink: the sequence's first token kept exact."
        )
