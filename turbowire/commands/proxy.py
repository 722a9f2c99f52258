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
    ) -> None:
        """Serve /v1/completions and /v1/chat/completions (streaming or not), /health, /metrics.

        Each request is prefilled on a prefill engine (max_tokens=1, kv_transfer_params
        do_remote_decode) and finished on a decode engine with the returned params, which keep
        vLLM NixlConnector's field names (vLLM's toy proxy and other routers work too).

        Examples:

          turbowire proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

          turbowire proxy -p http://10.0.0.1:8100 -p http://10.0.0.2:8100 -d http://10.0.0.3:8200 --host 0.0.0.0
        """  # noqa: E501
        import uvicorn

        from turbowire.serving.proxy import ProxyConfigError, build_app

        try:
            application = build_app(prefill, decode, timeout)
        except ProxyConfigError as exc:
            raise typer.BadParameter(str(exc)) from exc
        uvicorn.run(application, host=host, port=port, log_level="warning", access_log=False)
