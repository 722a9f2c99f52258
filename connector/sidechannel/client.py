"""Side-channel client: handshake with a peer engine and release/heartbeat its leases.

gRPC errors are mapped to specific exceptions so the connector can count them by reason
(``incompatible``, ``peer_unreachable``, ``handshake``) and say what to fix. Every call carries a
deadline (``handshake_timeout_seconds``), requests are bounded to ``MAX_REQUEST_BYTES`` and
replies to ``MAX_MESSAGE_BYTES``, and with a
:class:`~turbowire.connector.sidechannel.server.SideChannelTLS` holding a CA bundle the channel
is TLS, verifying the peer's certificate and host name against that CA only.

Peers are isolated from each other: :class:`ClientPool` keeps at most ``max_peers`` channels
(least recently used closed first) and :class:`PeerExecutors` runs each peer's calls on that
peer's own threads, so a peer that accepts connections and never answers holds up only the calls
to it, never a healthy peer's handshake, claim, release or heartbeat.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from turbowire.connector.compat import CompatibilityRecord, IncompatiblePeerError
from turbowire.connector.config import TurboWireConfig, format_size
from turbowire.connector.sidechannel import sidechannel_pb2 as pb
from turbowire.connector.sidechannel import sidechannel_pb2_grpc as pb_grpc
from turbowire.connector.sidechannel.convert import (
    StagingInfo,
    record_from_proto,
    record_to_proto,
)
from turbowire.connector.sidechannel.server import (
    AUTH_HEADER,
    FIELD_TRAILER,
    MAX_IDS_PER_CALL,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    SideChannelTLS,
)
from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)


class SideChannelError(TurboWireError, RuntimeError):
    """A side-channel call failed."""

    reason = "handshake"


class PeerUnreachableError(SideChannelError):
    """The peer's side channel did not answer (down, wrong host/port, timeout)."""

    reason = "peer_unreachable"


class PeerTimeoutError(PeerUnreachableError):
    """The peer's side channel did not answer within ``handshake_timeout_seconds``: down, hung,
    or only slow (a prefill engine starved of CPU answers late, not never)."""


class SideChannelAuthError(SideChannelError):
    """The peer refused our token (or we sent none): set the same auth_token on both engines."""


class SideChannelTLSError(SideChannelError):
    """The TLS handshake with the peer failed: certificates, CA or host name do not match."""


class SideChannelMessageTooLargeError(SideChannelError):
    """A message exceeded its bound (``MAX_REQUEST_BYTES`` for requests, ``MAX_MESSAGE_BYTES``
    for replies) and was not sent/accepted."""


_TLS_FAILURE_WORDS = ("ssl", "tls", "handshake", "certificate", "verification")


@dataclass(frozen=True)
class PeerInfo:
    """What a successful handshake tells us about a prefill engine."""

    engine_id: str
    record: CompatibilityRecord
    staging: StagingInfo


def _with_tokens(
    request_ids: Sequence[str], lease_tokens: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """The ids and the lease token presented for each ("" for none; no list when none has one)."""
    ids = [str(rid) for rid in request_ids]
    if lease_tokens is None:
        return ids, []
    tokens = [t or "" for t in lease_tokens]
    if len(tokens) != len(ids):
        raise ValueError(f"{len(tokens)} lease tokens for {len(ids)} request ids")
    return ids, tokens if any(tokens) else []


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class SideChannelClient:
    """A cached channel to one peer engine's side channel.

    ``timeout`` bounds every call (a deadline, never None). With ``tls`` holding a CA bundle the
    channel is TLS, the peer's certificate must be signed by that CA and name ``host`` in its
    subject alternative names, and ``tls.cert``/``tls.key`` are shown to peers requiring mTLS.
    ``stub``: the side channel's RPCs (``Handshake``, ``ReleaseLease``, ``Heartbeat``,
    ``PoolStatus``, called as the gRPC stub's are) answered without a channel, e.g. by a
    :class:`~turbowire.connector.sidechannel.server.SideChannelHandler` in this process (tests,
    fuzz targets); None: a channel to ``host:port`` and its stub.
    """

    def __init__(
        self,
        host: str,
        port: int,
        auth_token: str | None,
        timeout: float,
        tls: SideChannelTLS | None = None,
        stub: Any = None,
    ) -> None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(
                f"side-channel calls need a finite timeout > 0 seconds, got {timeout!r} "
                "(handshake_timeout_seconds)"
            )
        self.host = host
        self.port = port
        self.timeout = float(timeout)
        self.secure = tls is not None and tls.ca is not None
        self._metadata = ((AUTH_HEADER, f"Bearer {auth_token}"),) if auth_token else ()
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
            # gRPC's default reconnect backoff grows to 120 s: a restarted peer stayed
            # "connection refused" for 18-30 s after it was back; retry within a second (the
            # minimum, which is also gRPC's connect timeout, stays at its default)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.enable_http_proxy", 0),
        ]
        self._channel: grpc.Channel | None = None
        if stub is None:
            if tls is not None and self.secure:
                self._channel = grpc.secure_channel(
                    _target(host, port), tls.channel_credentials(), options=options
                )
            else:
                self._channel = grpc.insecure_channel(_target(host, port), options=options)
            stub = pb_grpc.SideChannelStub(self._channel)
        self._stub = stub

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def _fail(self, what: str, err: grpc.RpcError) -> SideChannelError:
        code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else str(err)
        where = f"{self.host}:{self.port}"
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return SideChannelAuthError(
                f"{what} refused by {where}: {details} (set the same auth_token on both engines)"
            )
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in (
            details or ""
        ):
            return SideChannelMessageTooLargeError(
                f"{what} to {where} refused: a side-channel message exceeds the limit of "
                f"{format_size(MAX_REQUEST_BYTES)} per request, {format_size(MAX_MESSAGE_BYTES)} "
                f"per reply ({details})"
            )
        lowered = (details or "").lower()
        tls_failed = any(word in lowered for word in _TLS_FAILURE_WORDS)
        if code == grpc.StatusCode.UNAVAILABLE and self.secure and tls_failed:
            return SideChannelTLSError(
                f"{what}: TLS handshake with {where} failed ({details}): the peer's certificate "
                f"must be signed by this engine's side_channel_tls_ca and name {self.host!r} in "
                "its subject alternative names; a peer serving plaintext fails this way too"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return PeerTimeoutError(
                f"{what}: side channel {where} did not answer within {self.timeout:g}s "
                f"(handshake_timeout_seconds) ({details})"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            hint = ""
            if "socket closed" in lowered:
                hint = (
                    "; the peer may require client certificates (mTLS: side_channel_tls_cert/key "
                    "signed by its side_channel_tls_ca)"
                    if self.secure
                    else "; if the peer serves TLS, set side_channel_tls_ca"
                )
            return PeerUnreachableError(
                f"{what}: side channel {where} unreachable ({details}){hint}"
            )
        return SideChannelError(f"{what} to {where} failed: {code} {details}")

    def handshake(self, record: CompatibilityRecord, engine_id: str, tp_rank: int) -> PeerInfo:
        """Exchange compatibility records; raises IncompatiblePeerError naming the field."""
        req = pb.HandshakeRequest(
            record=record_to_proto(record), engine_id=engine_id, tp_rank=tp_rank
        )
        try:
            resp = self._stub.Handshake(req, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                field_name = dict(err.trailing_metadata() or ()).get(FIELD_TRAILER, "unknown")
                raise IncompatiblePeerError(
                    field_name, None, None, message=f"handshake refused: {err.details()}"
                ) from err
            raise self._fail("handshake", err) from err
        theirs = record_from_proto(resp.record)
        record.check(theirs, ("decode engine", "prefill engine"))  # both sides check
        return PeerInfo(
            engine_id=resp.engine_id,
            record=theirs,
            staging=StagingInfo.from_response(resp),
        )

    def release(
        self,
        request_ids: Sequence[str],
        engine_id: str = "",
        tp_rank: int = 0,
        lease_tokens: Sequence[str] | None = None,
        tp_size: int = 0,
    ) -> pb.LeaseReply:
        """Release leases; ``lease_tokens[i]`` is the lease token presented for
        ``request_ids[i]`` (the ``turbowire_lease_token`` of its params). Without it the prefill
        engine frees nothing: the id comes back ``unknown`` (and ``refused`` if held).
        ``tp_size``: this engine's; each of its ranks releases once."""
        ids, tokens = _with_tokens(request_ids, lease_tokens)
        try:
            return self._stub.ReleaseLease(
                pb.LeaseRequest(request_ids=ids, engine_id=engine_id, tp_rank=tp_rank,
                                lease_tokens=tokens, tp_size=tp_size),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise self._fail("lease release", err) from err

    def heartbeat(
        self,
        request_ids: Sequence[str],
        engine_id: str = "",
        lease_tokens: Sequence[str] | None = None,
        prompts: Sequence[tuple[str, int]] | None = None,
        tp_size: int = 0,
    ) -> pb.LeaseReply:
        """Extend (or claim) leases, presenting each one's token like :meth:`release` and, in
        ``prompts[i]``, the (digest, token count) of this engine's own prompt for
        ``request_ids[i]``: the prefill engine answers a lease staged for another prompt in
        ``prompt_mismatch`` and extends nothing for it."""
        ids, tokens = _with_tokens(request_ids, lease_tokens)
        digests: list[str] = []
        counts: list[int] = []
        if prompts is not None:
            if len(prompts) != len(ids):
                raise ValueError(f"{len(prompts)} prompts for {len(ids)} request ids")
            digests = [d or "" for d, _ in prompts]
            counts = [max(0, int(n)) for _, n in prompts]
            if not any(digests):
                digests, counts = [], []
        try:
            return self._stub.Heartbeat(
                pb.LeaseRequest(request_ids=ids, engine_id=engine_id, lease_tokens=tokens,
                                prompt_digests=digests, prompt_tokens=counts, tp_size=tp_size),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise self._fail("heartbeat", err) from err

    def pool_status(self) -> pb.PoolStatusReply:
        """The peer's staging pool right now (slots used, leases outstanding)."""
        try:
            return self._stub.PoolStatus(
                pb.PoolStatusRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise self._fail("pool status", err) from err


class ClientPool:
    """One client per (host, port), shared by the threads of a process; at most ``max_clients``
    (the least recently used beyond it is closed: a channel to a dead host otherwise keeps
    reconnecting in the background for as long as the process lives)."""

    def __init__(
        self, auth_token: str | None, timeout: float, tls: SideChannelTLS | None = None,
        max_clients: int = 64,
    ) -> None:
        if max_clients < 1:
            raise ValueError("max_clients must be >= 1")
        self._auth_token = auth_token
        self._timeout = timeout
        self._tls = tls
        self.max_clients = max_clients
        self._clients: OrderedDict[tuple[str, int], SideChannelClient] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: TurboWireConfig) -> ClientPool:
        """Token, deadline and TLS material (``side_channel_tls_*``) of an engine's config."""
        return cls(
            config.auth_token, config.handshake_timeout_seconds, SideChannelTLS.from_config(config),
            max_clients=config.max_peers,
        )

    def get(self, host: str, port: int) -> SideChannelClient:
        evicted: list[SideChannelClient] = []
        with self._lock:
            client = self._clients.get((host, port))
            if client is None:
                client = SideChannelClient(
                    host, port, self._auth_token, self._timeout, self._tls
                )
                self._clients[(host, port)] = client
                while len(self._clients) > self.max_clients:
                    evicted.append(self._clients.popitem(last=False)[1])
            else:
                self._clients.move_to_end((host, port))
        for old in evicted:
            logger.info("closing the side-channel client of %s:%d (max_peers)", old.host, old.port)
            old.close()
        return client

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def batched(ids: Sequence[Any], size: int = MAX_IDS_PER_CALL) -> list[range]:
    """Index ranges of at most ``size`` ids: one side-channel call each (the server refuses
    more per call)."""
    return [range(i, min(i + size, len(ids))) for i in range(0, len(ids), size)]


class PeerExecutors:
    """A small thread pool per peer (any hashable key, e.g. ``(host, port)``), at most
    ``max_peers`` of them (the least recently used is shut down: its running calls finish, each
    bounded by its deadline). A peer that accepts connections and never answers ties up only its
    own ``threads_per_peer`` threads; with one pool for all peers, two such calls stalled every
    other peer's handshakes and claims for their whole deadline."""

    def __init__(
        self,
        max_peers: int,
        threads_per_peer: int = 2,
        thread_name_prefix: str = "tw-peer",
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        if max_peers < 1 or threads_per_peer < 1:
            raise ValueError("max_peers and threads_per_peer must be >= 1")
        self.max_peers = max_peers
        self.threads_per_peer = threads_per_peer
        self._prefix = thread_name_prefix
        self._initializer = initializer
        self._initargs = initargs
        self._lanes: OrderedDict[Hashable, ThreadPoolExecutor] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def submit_to(self, key: Hashable, fn: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Future:
        """Run ``fn`` on ``key``'s threads; raises RuntimeError once shut down."""
        evicted: list[ThreadPoolExecutor] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            lane = self._lanes.get(key)
            if lane is None:
                lane = ThreadPoolExecutor(
                    max_workers=self.threads_per_peer,
                    thread_name_prefix=f"{self._prefix}{len(self._lanes)}",
                    initializer=self._initializer, initargs=self._initargs,
                )
                self._lanes[key] = lane
                while len(self._lanes) > self.max_peers:
                    evicted.append(self._lanes.popitem(last=False)[1])
            else:
                self._lanes.move_to_end(key)
            future = lane.submit(fn, *args, **kwargs)
        for old in evicted:
            old.shutdown(wait=False, cancel_futures=False)
        return future

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn`` on the shared lane (calls not tied to one peer)."""
        return self.submit_to(None, fn, *args, **kwargs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            lane.shutdown(wait=wait, cancel_futures=cancel_futures)
