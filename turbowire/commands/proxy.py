"""``turbowire proxy``: the OpenAI-compatible P/D proxy (prefill engine -> decode engine)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("proxy")
    def proxy(
        prefill: list[str] = typer.Option(
            ..., "--prefill", "-p", help="Prefill engine URL (repeat for several, round-robin)."
        ),
        decode: list[str] = typer.Option(
            ..., "--decode", "-d", help="Decode engine URL (repeat for several, round-robin)."
        ),
        host: str = typer.Option("127.0.0.1", help="Address to listen on."),
        port: int = typer.Option(8000, help="Port to listen on."),
        timeout: float = typer.Option(600.0, help="Seconds to wait for an engine answer."),
        directory: str | None = typer.Option(
            None,
            "--directory",
            help="Store directory (redis://HOST:PORT, redis://HOST:PORT/DB, rediss://...) of "
            "engines running the store transport: requests whose whole prompt prefix is stored "
            "skip prefill and go to the decode engine alone. Unset: plain P/D.",
        ),
        store_namespace: str = typer.Option(
            "turbowire",
            "--store-namespace",
            help="Store namespace the engines register in (their store_namespace setting).",
        ),
        store_ttl_seconds: float = typer.Option(
            3600.0,
            "--store-ttl-seconds",
            help="The engines' store_ttl_seconds: a lookup that hits refreshes the directory "
            "entries to this lifetime, as an engine's lookup does.",
        ),
        max_body_bytes: int = typer.Option(
            16 << 20,
            "--max-body-bytes",
            help="Largest request body accepted; a larger one gets HTTP 413 before it is read.",
        ),
    ) -> None:
        """Serve /v1/completions and /v1/chat/completions (streaming or not), /health, /metrics.

        Each request is prefilled on a prefill engine (max_tokens=1, kv_transfer_params
        do_remote_decode) and finished on a decode engine with the returned params, which keep
        vLLM NixlConnector's field names (vLLM's toy proxy and other routers work too).

        With --directory, the proxy tokenizes each prompt on the chosen decode engine (its
        /tokenize), asks the store directory how many of the prompt's chunks are stored, and
        when all are, sends the request to the decode engine only (it loads the KV from the
        store). Anything wrong on that path (Redis down, tokenizer error) falls back to P/D. The
        decision is in the X-TurboWire-Route header, /turbowire/requests/{id} and
        turbowire_proxy_routes_total.

        The proxy forwards a client's prompt and sampling fields, its X-Request-Id (when it is
        a short plain token) and Authorization header, never a client's own kv_transfer_params.

        Examples:

          turbowire proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

          turbowire proxy -p http://10.0.0.1:8100 -p http://10.0.0.2:8100 -d http://10.0.0.3:8200 --host 0.0.0.0

          turbowire proxy -p http://127.0.0.1:8100 -d http://127.0.0.1:8200 --directory redis://127.0.0.1:6379
        """  # noqa: E501
        import uvicorn

        from turbowire.serving.proxy import ProxyConfigError, build_app

        try:
            application = build_app(
                prefill, decode, timeout, directory_url=directory,
                store_namespace=store_namespace, directory_ttl_seconds=store_ttl_seconds,
                max_body_bytes=max_body_bytes,
            )
        except ProxyConfigError as exc:
            raise typer.BadParameter(str(exc)) from exc
        uvicorn.run(application, host=host, port=port, log_level="warning", access_log=False)
