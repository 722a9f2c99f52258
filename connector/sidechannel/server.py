"""The side-channel gRPC server of one engine (runs in the scheduler process, like NIXL's).

It answers handshakes only for compatible peers (the refusal names the differing field), hands
out the NIXL agent metadata and staging geometry of the requested worker, and releases/extends
leases in the prefill engine's :class:`~turbowire.connector.staging.StagingPool`. With an auth
token configured, every call must carry ``authorization: Bearer <token>``. A release or heartbeat
must also present each lease's own capability (``lease_tokens``, issued in the request's
``kv_transfer_params``): the auth token admits a peer engine, the lease token proves the call
comes from the holder of that request's params. A lease named without its token is answered
``unknown`` and ``refused`` (held, but not the caller's), so the decode engine reports a
refusal, not an expiry.

With :class:`SideChannelTLS` (``side_channel_tls_cert``/``_key``) the server speaks TLS only; with
a CA bundle too (``side_channel_tls_ca``) it also requires client certificates signed by that CA
(mTLS), refused in the TLS handshake before any call reaches the token check or the service. The
token is checked over TLS as well. A heartbeat (the decode engine's claim) may also present the
caller's own prompt for each lease (``prompt_digests``/``prompt_tokens``): a lease staged for
another prompt is answered ``prompt_mismatch`` and not extended.

Bounds: the server receives at most ``MAX_REQUEST_BYTES`` (1 MiB: no caller, authenticated or
not, pins more per call while gRPC buffers it ahead of the token check), sends at most
``MAX_MESSAGE_BYTES`` (NIXL metadata), serves ``MAX_CONCURRENT_RPCS`` calls at once and at most
``MAX_IDS_PER_CALL`` request ids per call (each call walks its ids under the staging pool's lock,
which the engine loop takes too).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from turbowire.connector.compat import CompatibilityRecord
from turbowire.connector.config import (
    CONFIG_KEYS_BY_NAME,
    MAX_LEASE_TOKEN_CHARS,
    MAX_TP_SIZE,
    ConnectorConfigError,
    TurboWireConfig,
    check_side_channel_tls,
    read_pem,
)
from turbowire.connector.sidechannel import sidechannel_pb2 as pb
from turbowire.connector.sidechannel import sidechannel_pb2_grpc as pb_grpc
from turbowire.connector.sidechannel.convert import (
    SideChannelProtocolError,
    StagingInfo,
    record_from_proto,
    record_to_proto,
)

logger = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
FIELD_TRAILER = "turbowire-field"
MAX_IDS_PER_CALL = 4096
MAX_PROMPT_DIGEST_CHARS = 64
MAX_MESSAGE_BYTES = 32 << 20  # replies (handshake: NIXL metadata); what a client accepts
MAX_REQUEST_BYTES = 1 << 20  # requests: what the server accepts, what a client sends
MAX_CONCURRENT_RPCS = 64
UNKNOWN_LOG_PERIOD_S = 10.0  # at most one INFO line per period about releases of unknown leases
TLS_KEYS = ("side_channel_tls_cert", "side_channel_tls_key", "side_channel_tls_ca")


@dataclass(frozen=True, repr=False)
class SideChannelTLS:
    """The side channel's TLS material as PEM bytes, read once from the configured files.

    ``cert``/``key``: this engine's certificate chain and private key, the server's identity and
    the client certificate shown to peers that require mTLS. ``ca``: the bundle peers are verified
    with; calls to peers use TLS only when it is set, and a server with it requires client
    certificates signed by it. The host a client dials (``remote_host`` of the peer, i.e. the
    peer's ``side_channel_host``) must be covered by the subject alternative names of the peer's
    certificate: gRPC verifies it, and there is no name override.
    """

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConnectorConfigError(
                "side_channel_tls_cert and side_channel_tls_key go together: set both or neither"
            )

    def __repr__(self) -> str:  # never the key's bytes in a log line
        return (
            f"SideChannelTLS(cert={self.cert is not None}, key={self.key is not None}, "
            f"ca={self.ca is not None})"
        )

    @classmethod
    def from_files(
        cls, cert: str | None, key: str | None, ca: str | None
    ) -> SideChannelTLS | None:
        """Checked and read PEM files; None when none is given (plaintext side channel)."""
        for name, path in zip(TLS_KEYS, (cert, key, ca), strict=True):
            CONFIG_KEYS_BY_NAME[name].kind.check(name, path)
        check_side_channel_tls(cert, key, ca)
        if cert is None and key is None and ca is None:
            return None
        return cls(
            cert=read_pem("side_channel_tls_cert", cert) if cert is not None else None,
            key=read_pem("side_channel_tls_key", key) if key is not None else None,
            ca=read_pem("side_channel_tls_ca", ca) if ca is not None else None,
        )

    @classmethod
    def from_config(cls, config: TurboWireConfig) -> SideChannelTLS | None:
        """The TLS material of ``side_channel_tls_cert``/``_key``/``_ca`` (None: plaintext)."""
        return cls.from_files(
            config.side_channel_tls_cert, config.side_channel_tls_key, config.side_channel_tls_ca
        )

    @property
    def mode(self) -> str:
        """How a server with this material serves: ``TLS`` or ``mTLS``."""
        return "mTLS" if self.ca is not None else "TLS"

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS only; client certificates signed by ``ca`` required when ``ca`` is set."""
        if self.cert is None or self.key is None:
            raise ConnectorConfigError(
                "side_channel_tls_ca is set but side_channel_tls_cert and side_channel_tls_key "
                "are not: an engine that serves the side channel (kv_producer, kv_both) needs "
                "its own certificate to serve TLS; set both, or unset side_channel_tls_ca"
            )
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca,
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify the peer with ``ca`` (never the system roots); show ``cert`` when it asks."""
        if self.ca is None:
            raise ConnectorConfigError(
                "side-channel calls over TLS need side_channel_tls_ca, the CA bundle that "
                "signed the peers' certificates"
            )
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


class LeaseHandler(Protocol):
    """The prefill engine's leases; ``tokens[i]`` is the capability presented for
    ``request_ids[i]`` ("" when the caller sent none), ``prompts[i]`` the caller's prompt
    (digest, tokens). Returns (done, unknown, refused), refused a subset of unknown, and a
    heartbeat's answer may carry ``mismatched``, another subset of unknown
    (:class:`~turbowire.connector.staging.LeaseAnswer`)."""

    def release(
        self, request_ids: Sequence[str], consumer: int, tokens: Sequence[str],
        consumers: int = 0,
    ) -> tuple[list[str], list[str], list[str]]: ...

    def heartbeat(
        self, request_ids: Sequence[str], tokens: Sequence[str],
        prompts: Sequence[tuple[str, int]] | None = None, consumers: int = 0,
    ) -> tuple[list[str], list[str], list[str]]: ...

    def snapshot(self) -> Any: ...


class _AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the shared bearer token (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong side-channel token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
        return self._deny


@dataclass
class HandshakeCounters:
    accepted: int = 0
    refused: int = 0


class SideChannelHandler(pb_grpc.SideChannelServicer):
    """The side channel's RPCs (handshake, leases, pool status) over a ``SideChannelServer``;
    public so that tests and fuzz targets can drive it without a gRPC server."""

    def __init__(self, owner: SideChannelServer) -> None:
        self._owner = owner
        self._unknown_logged = 0.0  # monotonic time of the last "unknown leases" line
        self._unknown_quiet = 0  # such calls not logged since

    def Handshake(  # noqa: N802 (gRPC naming)
        self, request: pb.HandshakeRequest, context: grpc.ServicerContext
    ) -> pb.HandshakeResponse:
        owner = self._owner
        try:
            theirs = record_from_proto(request.record)
        except SideChannelProtocolError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        mismatch = owner.record.mismatch(theirs, ("prefill engine", "decode engine"))
        if mismatch is not None:
            owner.counters.refused += 1
            logger.warning(
                "refused handshake from engine %s: %s", request.engine_id or "?", mismatch
            )
            context.set_trailing_metadata(((FIELD_TRAILER, mismatch.field_name),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(mismatch))
        info = owner.staging.get(request.tp_rank)
        if info is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no prefill worker with tp_rank {request.tp_rank} on engine {owner.engine_id}",
            )
        owner.counters.accepted += 1
        logger.info("handshake from engine %s accepted", request.engine_id or "?")
        return pb.HandshakeResponse(
            engine_id=owner.engine_id,
            record=record_to_proto(owner.record),
            agent_metadata=info.agent_metadata,
            agent_name=info.agent_name,
            staging=info.to_proto(),
        )

    def _ids(
        self, request: pb.LeaseRequest, context: grpc.ServicerContext
    ) -> tuple[list[str], list[str]]:
        """(request ids, the lease token presented for each: "" where none was sent)."""
        if len(request.request_ids) > MAX_IDS_PER_CALL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too many request ids in one call")
        ids = list(request.request_ids)
        tokens = list(request.lease_tokens)
        if tokens and len(tokens) != len(ids):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(tokens)} lease tokens for {len(ids)} request ids (one per id, in order)",
            )
        if any(len(t) > MAX_LEASE_TOKEN_CHARS for t in tokens):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a lease token is longer than {MAX_LEASE_TOKEN_CHARS} characters",
            )
        return ids, tokens or [""] * len(ids)

    def _prompts(
        self, request: pb.LeaseRequest, n: int, context: grpc.ServicerContext
    ) -> list[tuple[str, int]] | None:
        """The (digest, token count) presented per id, or None when the caller sent none."""
        digests, counts = list(request.prompt_digests), list(request.prompt_tokens)
        if not digests and not counts:
            return None
        if len(digests) != n or len(counts) != n:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(digests)} prompt digests and {len(counts)} token counts for {n} request "
                "ids (one each per id, in order)",
            )
        if any(len(d) > MAX_PROMPT_DIGEST_CHARS for d in digests):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a prompt digest is longer than {MAX_PROMPT_DIGEST_CHARS} characters",
            )
        return list(zip(digests, counts, strict=True))

    @staticmethod
    def _tp_size(request: pb.LeaseRequest, context: grpc.ServicerContext) -> int:
        """The caller's TP size (0: an older caller), bounded: it sets how many releases free a
        lease."""
        if request.tp_size > MAX_TP_SIZE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"tp_size above {MAX_TP_SIZE}")
        return int(request.tp_size)

    def _log_unknown(self, unknown: list[str]) -> None:
        """Releases of leases this engine does not hold (expired, refused, a peer's retry):
        logged at most once per ``UNKNOWN_LOG_PERIOD_S``, a caller cannot flood the log."""
        now = time.monotonic()
        if now - self._unknown_logged < UNKNOWN_LOG_PERIOD_S:
            self._unknown_quiet += 1
            return
        quiet, self._unknown_quiet, self._unknown_logged = self._unknown_quiet, 0, now
        logger.info(
            "release for unknown/expired/refused leases %s%s", unknown[:5],
            f" ({quiet} more such calls not logged)" if quiet else "",
        )

    def ReleaseLease(  # noqa: N802
        self, request: pb.LeaseRequest, context: grpc.ServicerContext
    ) -> pb.LeaseReply:
        ids, tokens = self._ids(request, context)
        tp_size = self._tp_size(request, context)
        extra = {"consumers": tp_size} if tp_size else {}
        done, unknown, refused = self._owner.leases.release(ids, request.tp_rank, tokens, **extra)
        if unknown:
            self._log_unknown(unknown)
        return pb.LeaseReply(done=done, unknown=unknown, refused=refused)

    def Heartbeat(  # noqa: N802
        self, request: pb.LeaseRequest, context: grpc.ServicerContext
    ) -> pb.LeaseReply:
        ids, tokens = self._ids(request, context)
        prompts = self._prompts(request, len(ids), context)
        leases = self._owner.leases
        tp_size = self._tp_size(request, context)
        extra = {"consumers": tp_size} if tp_size else {}
        answer = leases.heartbeat(ids, tokens, **extra) if prompts is None else leases.heartbeat(
            ids, tokens, prompts, **extra)
        done, unknown, refused = answer
        mismatched = getattr(answer, "mismatched", [])
        return pb.LeaseReply(done=done, unknown=unknown, refused=refused,
                             prompt_mismatch=mismatched)

    def PoolStatus(  # noqa: N802
        self, request: pb.PoolStatusRequest, context: grpc.ServicerContext
    ) -> pb.PoolStatusReply:
        snap = self._owner.leases.snapshot()
        info = next(iter(self._owner.staging.values()), None)
        return pb.PoolStatusReply(
            capacity_slots=snap.capacity_slots,
            used_slots=snap.used_slots,
            leases=snap.leases,
            reserved_requests=snap.reserved_requests,
            slot_bytes=info.slot_bytes if info is not None else 0,
        )


class SideChannelServer:
    """One engine's side-channel endpoint; ``start`` binds, ``stop`` shuts down."""

    def __init__(
        self,
        *,
        engine_id: str,
        record: CompatibilityRecord,
        staging: Mapping[int, StagingInfo],
        leases: LeaseHandler,
        bind_host: str,
        port: int,
        auth_token: str | None,
        max_workers: int = 4,
        tls: SideChannelTLS | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.record = record
        self.staging = dict(staging)
        self.leases = leases
        self.counters = HandshakeCounters()
        interceptors = [_AuthInterceptor(auth_token)] if auth_token else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tw-sidechan"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        pb_grpc.add_SideChannelServicer_to_server(SideChannelHandler(self), self._server)
        address = f"[{bind_host}]:{port}" if ":" in bind_host else f"{bind_host}:{port}"
        self.tls_mode = tls.mode if tls is not None else "plaintext"
        cannot_bind = (
            f"side channel cannot bind {address}: the port is in use or the address is not "
            "local; set side_channel_port/side_channel_bind in kv_connector_extra_config"
        )
        try:
            if tls is None:
                bound = self._server.add_insecure_port(address)
            else:
                bound = self._server.add_secure_port(address, tls.server_credentials())
        except RuntimeError as exc:  # some gRPC versions raise instead of returning 0
            raise OSError(cannot_bind) from exc
        if bound == 0:
            raise OSError(cannot_bind)
        self.port = bound
        self.address = address

    def start(self) -> SideChannelServer:
        self._server.start()
        logger.info(
            "turbowire side channel of engine %s listening on %s (%s)",
            self.engine_id, self.address, self.tls_mode,
        )
        return self

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait(grace + 1.0)


def wait_port_free(host: str, port: int, timeout: float = 5.0) -> None:
    """Tests: wait until a server's port is released."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) != 0:
                return
        time.sleep(0.05)
