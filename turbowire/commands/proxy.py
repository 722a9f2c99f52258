"""``turbowire proxy``: the OpenAI-compatible P/D proxy (prefill engine -> decode engine)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

#: Environment variables read when the matching --*-file option is not given.
ADMIN_TOKEN_ENV = "TURBOWIRE_PROXY_ADMIN_TOKEN"
TENANT_SECRET_ENV = "TURBOWIRE_TENANT_SALT_SECRET"
EXPOSE_INTERNALS_ENV = "TURBOWIRE_PROXY_EXPOSE_INTERNALS"
MAX_SECRET_FILE_BYTES = 64 << 10
#: turbowire.serving.proxy's DEFAULT_MAX_BODY_BYTES and DEFAULT_MAX_CONCURRENCY (not imported:
#: that pulls in FastAPI, seconds at every CLI start; a unit test keeps them equal)
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_CONCURRENCY = 512


def read_secret(path: Path | None, env: str, what: str) -> str | None:
    """A secret from a file (first line, whitespace stripped) or else the environment; None
    when neither is set. Never logged."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_SECRET_FILE_BYTES + 1)
        except OSError as exc:
            raise _config_error(f"{what} file {path}: {exc.strerror or exc}") from exc
        if len(raw) > MAX_SECRET_FILE_BYTES:
            raise _config_error(f"{what} file {path} is larger than {MAX_SECRET_FILE_BYTES} "
                                "bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _config_error(f"{what} file {path} is not UTF-8 text") from exc
        lines = text.strip().splitlines()
        return lines[0].strip() if lines else ""
    value = os.environ.get(env)
    return value.strip() if value else None


def _config_error(message: str) -> Exception:
    from turbowire.serving.proxy import ProxyConfigError

    return ProxyConfigError(message)


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
            "skip prefill and go to the decode engine alone. Unset: plain P/D. A Redis "
            "password comes from env TURBOWIRE_STORE_PASSWORD_FILE or TURBOWIRE_STORE_PASSWORD "
            "(never put it in the URL).",
        ),
        store_namespace: str = typer.Option(
            "turbowire",
            "--store-namespace",
            help="Store namespace the engines register in (their store_namespace setting).",
        ),
        store_ttl_seconds: float = typer.Option(
            3600.0,
            "--store-ttl-seconds",
            help="Accepted for compatibility and ignored: the proxy only reads the directory "
            "(its lookups never extend a stored chunk's lifetime; engines' loads do).",
        ),
        max_body_bytes: int = typer.Option(
            DEFAULT_MAX_BODY_BYTES,
            "--max-body-bytes",
            help="Largest request body accepted; a larger one gets HTTP 413 before it is read. "
            "A parsed body holds up to ~5x its size: the proxy's worst-case memory is about "
            "--max-concurrency x 5 x this.",
        ),
        max_concurrency: int = typer.Option(
            DEFAULT_MAX_CONCURRENCY,
            "--max-concurrency",
            help="Requests served at once (uvicorn's limit_concurrency; streams count until "
            "they end); beyond it, HTTP 503.",
        ),
        admin_token_file: Path | None = typer.Option(
            None,
            "--admin-token-file",
            help="File holding the admin token (16+ printable characters; else the "
            f"{ADMIN_TOKEN_ENV} variable). Callers presenting it in X-TurboWire-Admin-Token "
            "(or Authorization: Bearer on the proxy's own GET endpoints) see the "
            "X-TurboWire-Route and timing headers, /turbowire/requests/{id} and /health's "
            "engine list. Without it nobody does.",
        ),
        expose_internals: bool = typer.Option(
            False,
            "--expose-internals",
            envvar=EXPOSE_INTERNALS_ENV,
            help="Show the route and timing headers, the decode engine's kv_transfer_params "
            "(its load report), request records and /health's engine list to every client. "
            "Only for one user on a trusted host (demos, benchmarks, tests): they tell anyone "
            "how much of a guessed prompt is stored.",
        ),
        protect_metrics: bool = typer.Option(
            False,
            "--protect-metrics",
            help="Serve /metrics only with the admin token (Prometheus: authorization "
            "credentials_file). Its route counters say whether a probe was a store hit on a "
            "quiet proxy.",
        ),
        tenant_salt_from: str | None = typer.Option(
            None,
            "--tenant-salt-from",
            help="Keep tenants' KV apart: set every request's cache_salt to HMAC(secret, tenant "
            "id, client cache_salt). 'api-key': the Authorization: Bearer key names the tenant; "
            "'header:NAME': a header your gateway sets (e.g. header:X-Tenant-Id; strip it from "
            "client requests at the gateway). A request without it gets HTTP 401. The secret "
            f"comes from --tenant-salt-secret-file or {TENANT_SECRET_ENV}.",
        ),
        tenant_salt_secret_file: Path | None = typer.Option(
            None,
            "--tenant-salt-secret-file",
            help="File holding the tenant salt secret (16+ printable characters); every proxy "
            "replica must use the same one.",
        ),
    ) -> None:
        """Serve /v1/completions and /v1/chat/completions (streaming or not), /health, /metrics.

        Each request is prefilled on a prefill engine (max_tokens=1, kv_transfer_params
        do_remote_decode) and finished on a decode engine with the returned params, which keep
        vLLM NixlConnector's field names (vLLM's toy proxy and other routers work too).

        With --directory, the proxy tokenizes each prompt on the chosen decode engine (its
        /tokenize), asks the store directory how many of the prompt's chunks are stored under
        the request's cache_salt and LoRA adapter, and when all are, sends the request to the
        decode engine only (it loads the KV from the store). Prompts with images, audio, video
        or embeddings, and models the decode engine does not list, always go P/D. Anything
        wrong on that path (Redis down, tokenizer error) falls back to P/D. The decision is
        counted in turbowire_proxy_routes_total; the X-TurboWire-Route header and
        /turbowire/requests/{id} show it only to admins (--admin-token-file) or, with
        --expose-internals, to everyone.

        The proxy forwards a client's prompt and sampling fields, its X-Request-Id (when it is
        a short plain token) and Authorization header, never a client's own kv_transfer_params
        or ec_transfer_params; transfer params inside vllm_xargs get HTTP 400.

        Examples:

          turbowire proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

          turbowire proxy -p http://10.0.0.1:8100 -p http://10.0.0.2:8100 -d http://10.0.0.3:8200 --host 0.0.0.0

          turbowire proxy -p http://127.0.0.1:8100 -d http://127.0.0.1:8200 --directory redis://127.0.0.1:6379

          turbowire proxy -p ... -d ... --directory redis://redis:6379 --admin-token-file /run/secrets/tw-admin

          curl -H "X-TurboWire-Admin-Token: $(cat /run/secrets/tw-admin)" localhost:8000/turbowire/requests/REQ-ID

          turbowire proxy -p ... -d ... --tenant-salt-from api-key --tenant-salt-secret-file /run/secrets/tw-salt

          TURBOWIRE_TENANT_SALT_SECRET=... turbowire proxy -p ... -d ... --tenant-salt-from header:X-Tenant-Id

          turbowire proxy -p ... -d ... --expose-internals   # demo on localhost only
        """  # noqa: E501
        import uvicorn

        from turbowire.serving.proxy import ProxyConfigError, TenantSalt, Visibility, build_app

        try:
            if max_concurrency < 1:
                raise ProxyConfigError(f"--max-concurrency must be positive, got "
                                       f"{max_concurrency}")
            visibility = Visibility(
                admin_token=read_secret(admin_token_file, ADMIN_TOKEN_ENV, "--admin-token-file"),
                expose_internals=expose_internals, protect_metrics=protect_metrics,
            )
            tenant_salt = None
            if tenant_salt_from is not None:
                secret = read_secret(tenant_salt_secret_file, TENANT_SECRET_ENV,
                                     "--tenant-salt-secret-file")
                if secret is None:
                    raise ProxyConfigError(f"--tenant-salt-from needs a secret: "
                                           f"--tenant-salt-secret-file or {TENANT_SECRET_ENV}")
                tenant_salt = TenantSalt.parse(tenant_salt_from, secret)
            elif tenant_salt_secret_file is not None:
                raise ProxyConfigError("--tenant-salt-secret-file needs --tenant-salt-from")
            application = build_app(
                prefill, decode, timeout, directory_url=directory,
                store_namespace=store_namespace, directory_ttl_seconds=store_ttl_seconds,
                max_body_bytes=max_body_bytes, visibility=visibility, tenant_salt=tenant_salt,
            )
        except ProxyConfigError as exc:
            raise typer.BadParameter(str(exc)) from exc
        uvicorn.run(application, host=host, port=port, log_level="warning", access_log=False,
                    limit_concurrency=max_concurrency)
