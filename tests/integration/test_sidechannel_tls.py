"""The side channel over TLS and mTLS, with real gRPC servers and clients and a throwaway PKI.

Every refusal is also checked for what did *not* happen: the call never reached the service (the
lease handler saw nothing, no handshake was counted) and nothing of the engine (agent metadata,
geometry) came back. Message bounds hold in all four directions, and every RPC of the service
gives up after the configured timeout against a peer that accepts TCP and never answers.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import connector_peer as peer  # tests/integration is on sys.path (pytest rootdir insertion)
import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from support.blackhole import BlackHole
from support.pki import CA, ENGINE_EKU, LOOPBACK_SANS

from turbowire.connector.config import ConnectorConfigError, TurboWireConfig
from turbowire.connector.sidechannel import sidechannel_pb2 as pb
from turbowire.connector.sidechannel import sidechannel_pb2_grpc as pb_grpc
from turbowire.connector.sidechannel.client import (
    ClientPool,
    PeerUnreachableError,
    SideChannelAuthError,
    SideChannelClient,
    SideChannelError,
    SideChannelMessageTooLargeError,
    SideChannelTLSError,
)
from turbowire.connector.sidechannel.convert import StagingInfo
from turbowire.connector.sidechannel.server import (
    AUTH_HEADER,
    FIELD_TRAILER,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    SideChannelServer,
    SideChannelTLS,
)
from turbowire.connector.staging import StagingPool

pytestmark = pytest.mark.integration
TOKEN = "tls-token-0123456"
AGENT = "agent-P-secret-name"
METADATA = b"fake-nixl-metadata-do-not-leak"
STAGING = StagingInfo(AGENT, METADATA, 0xABC000, 4096, 8, (0, 1024, 2048), 0, "DRAM")
SHORT = 0.6  # seconds: the deadline of the timeout tests


# -- a throwaway PKI (tests/support/pki.py) ----------------------------------------------------


@dataclass
class Pki:
    """Paths of the PEM files (as the config keys take them)."""

    dir: Path
    ca: str
    other_ca: str
    engine: tuple[str, str]  # SAN 127.0.0.1 + localhost, serverAuth + clientAuth
    client: tuple[str, str]  # signed by ca, clientAuth only
    foreign_client: tuple[str, str]  # signed by other_ca
    localhost_only: tuple[str, str]  # SAN localhost only (no IP SAN)

    def tls(self, cert: tuple[str, str] | None = None, ca: str | None = None) -> SideChannelTLS:
        got = SideChannelTLS.from_files(cert[0] if cert else None, cert[1] if cert else None, ca)
        assert got is not None
        return got


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = CA("turbowire test CA"), CA("some other CA")

    def write(name: str, pem: bytes) -> str:
        path = root / name
        path.write_bytes(pem)
        return str(path)

    def pair(name: str, issued: tuple[bytes, bytes]) -> tuple[str, str]:
        return write(f"{name}.crt", issued[0]), write(f"{name}.key", issued[1])

    return Pki(
        dir=root,
        ca=write("ca.crt", ca.pem),
        other_ca=write("other-ca.crt", other.pem),
        engine=pair("engine", ca.issue("engine", LOOPBACK_SANS, ENGINE_EKU)),
        client=pair("client", ca.issue("client", [], [ExtendedKeyUsageOID.CLIENT_AUTH])),
        foreign_client=pair(
            "foreign", other.issue("foreign", [], [ExtendedKeyUsageOID.CLIENT_AUTH])
        ),
        localhost_only=pair(
            "localhost-only", ca.issue("lh", [x509.DNSName("localhost")], ENGINE_EKU)
        ),
    )


# -- servers ---------------------------------------------------------------------------------------


class SpyLeases:
    """A real StagingPool that records every call reaching the service."""

    def __init__(self, block: threading.Event | None = None) -> None:
        self.pool = StagingPool(8, 30.0)
        self.calls: list[str] = []
        self._block = block

    def _wait(self) -> None:
        if self._block is not None:
            self._block.wait(30)

    def release(self, request_ids: Any, consumer: int = 0, tokens: Any = None,
                consumers: int = 0) -> tuple[list[str], list[str], list[str]]:
        self.calls.append("release")
        self._wait()
        return self.pool.release(request_ids, consumer, tokens, consumers)

    def heartbeat(self, request_ids: Any, tokens: Any = None, consumers: int = 0
                  ) -> tuple[list[str], list[str], list[str]]:
        self.calls.append("heartbeat")
        self._wait()
        return self.pool.heartbeat(request_ids, tokens, consumers=consumers)

    def snapshot(self) -> Any:
        self.calls.append("snapshot")
        self._wait()
        return self.pool.snapshot()


@dataclass
class Served:
    server: SideChannelServer
    leases: SpyLeases

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def accepted(self) -> int:
        return self.server.counters.accepted


def serve(
    tls: SideChannelTLS | None,
    token: str | None = TOKEN,
    staging: StagingInfo = STAGING,
    leases: SpyLeases | None = None,
) -> Served:
    spy = leases or SpyLeases()
    server = SideChannelServer(
        engine_id="engine-P",
        record=peer.record(),
        staging={0: staging},
        leases=spy,
        bind_host="127.0.0.1",
        port=0,
        auth_token=token,
        tls=tls,
    ).start()
    return Served(server, spy)


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[Served]:
    served = serve(pki.tls(pki.engine))
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[Served]:
    served = serve(pki.tls(pki.engine, pki.ca))
    yield served
    served.server.stop()


def client(port: int, tls: SideChannelTLS | None, token: str | None = TOKEN,
           host: str = "127.0.0.1", timeout: float = 5.0) -> SideChannelClient:
    return SideChannelClient(host, port, token, timeout=timeout, tls=tls)


def assert_untouched(served: Served, accepted: int, calls: int) -> None:
    """The refused call never reached the service."""
    assert served.accepted == accepted
    assert served.leases.calls[calls:] == []


# -- (a) TLS + token -------------------------------------------------------------------------------


def test_tls_with_token_handshakes_and_serves_every_call(pki: Pki, tls_server: Served) -> None:
    assert tls_server.server.tls_mode == "TLS"
    c = client(tls_server.port, pki.tls(ca=pki.ca))
    assert c.secure
    before = tls_server.accepted
    info = c.handshake(peer.record(), "engine-D", 0)
    assert info.staging.agent_metadata == METADATA and info.staging.agent_name == AGENT
    assert info.staging.layer_offsets == (0, 1024, 2048)
    assert tls_server.accepted == before + 1
    assert list(c.release(["nope"]).unknown) == ["nope"]
    assert list(c.heartbeat(["nope"]).unknown) == ["nope"]
    assert c.pool_status().capacity_slots == 8
    c.close()


def test_the_engine_certificate_serves_and_calls_with_the_same_config(
    pki: Pki, mtls_server: Served
) -> None:
    """kv_both: one cert/key/CA config is the server identity and the mTLS client certificate."""
    cfg = TurboWireConfig.from_extra_config(
        {
            "side_channel_tls_cert": pki.engine[0],
            "side_channel_tls_key": pki.engine[1],
            "side_channel_tls_ca": pki.ca,
        },
        environ={},
    )
    tls = SideChannelTLS.from_config(cfg)
    assert tls is not None and tls.mode == "mTLS"
    pool = ClientPool(TOKEN, 5.0, tls)
    try:
        assert pool.get("127.0.0.1", mtls_server.port).handshake(peer.record(), "D", 0).staging
    finally:
        pool.close()
    assert SideChannelTLS.from_config(TurboWireConfig()) is None


class _Relay:
    """A TCP relay between client and server that keeps a copy of every byte it forwards."""

    def __init__(self, target_port: int) -> None:
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self._target))
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls"])
def test_on_the_wire_tls_hides_the_token_and_the_agent_metadata(pki: Pki, secure: bool) -> None:
    """Control: in plaintext the token and NIXL metadata are readable on the link; over TLS not."""
    served = serve(pki.tls(pki.engine) if secure else None)
    relay = _Relay(served.port)
    try:
        c = client(relay.port, pki.tls(ca=pki.ca) if secure else None)
        assert c.handshake(peer.record(), "engine-D", 0).staging.agent_metadata == METADATA
        c.close()
        seen = bytes(relay.seen)
        assert len(seen) > 500
        if secure:  # nothing readable: not the NIXL metadata, the agent name, the token
            for secret in (METADATA, AGENT.encode(), TOKEN.encode()):
                assert secret not in seen, secret
        else:  # the control: the relay does see the reply (HPACK may encode the token header)
            assert METADATA in seen and AGENT.encode() in seen
    finally:
        relay.close()
        served.server.stop()


# -- (b) TLS without the token ---------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token-9876"])
def test_tls_without_the_token_is_unauthenticated_and_leaks_nothing(
    pki: Pki, tls_server: Served, token: str | None
) -> None:
    accepted, calls = tls_server.accepted, len(tls_server.leases.calls)
    channel = grpc.secure_channel(
        f"127.0.0.1:{tls_server.port}", pki.tls(ca=pki.ca).channel_credentials()
    )
    stub = pb_grpc.SideChannelStub(channel)
    metadata = ((AUTH_HEADER, f"Bearer {token}"),) if token else ()
    request = pb.HandshakeRequest(record=pb.CompatibilityRecord(), engine_id="D", tp_rank=0)
    with pytest.raises(grpc.RpcError) as info:
        stub.Handshake.with_call(request, timeout=5, metadata=metadata)
    err = info.value
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    everything = repr(
        (err.details(), err.debug_error_string(), err.initial_metadata(), err.trailing_metadata())
    )
    for leaked in (AGENT, METADATA.decode(), "0xabc000", str(0xABC000), FIELD_TRAILER, "engine-P"):
        assert leaked not in everything
    channel.close()
    # the client maps it, for every call, and the service never ran
    c = client(tls_server.port, pki.tls(ca=pki.ca), token=token)
    for call in (
        lambda: c.handshake(peer.record(), "D", 0),
        lambda: c.release(["x"]),
        lambda: c.heartbeat(["x"]),
        c.pool_status,
    ):
        with pytest.raises(SideChannelAuthError, match="same auth_token"):
            call()
    c.close()
    assert_untouched(tls_server, accepted, calls)


# -- (c) plaintext client, TLS server --------------------------------------------------------------


def test_plaintext_client_against_tls_server_fails(tls_server: Served) -> None:
    accepted, calls = tls_server.accepted, len(tls_server.leases.calls)
    c = client(tls_server.port, None)
    assert not c.secure
    with pytest.raises(PeerUnreachableError, match="set side_channel_tls_ca"):
        c.handshake(peer.record(), "D", 0)
    with pytest.raises(PeerUnreachableError):
        c.heartbeat(["x"])
    c.close()
    assert_untouched(tls_server, accepted, calls)


def test_tls_client_against_plaintext_server_fails(pki: Pki) -> None:
    """TLS on one side only never falls back to plaintext."""
    served = serve(None)
    try:
        c = client(served.port, pki.tls(pki.engine, pki.ca))
        with pytest.raises(SideChannelTLSError, match="side_channel_tls_ca"):
            c.handshake(peer.record(), "D", 0)
        c.close()
        assert_untouched(served, 0, 0)
    finally:
        served.server.stop()


# -- (d) mTLS --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cert", [None, "foreign_client"], ids=["no-client-cert", "other-ca"])
def test_mtls_refuses_clients_without_a_certificate_of_its_ca(
    pki: Pki, mtls_server: Served, cert: str | None
) -> None:
    assert mtls_server.server.tls_mode == "mTLS"
    accepted, calls = mtls_server.accepted, len(mtls_server.leases.calls)
    c = client(mtls_server.port, pki.tls(getattr(pki, cert) if cert else None, pki.ca))
    for call in (lambda: c.handshake(peer.record(), "D", 0), lambda: c.heartbeat(["x"])):
        # refused in the TLS handshake: the right token, yet no UNAUTHENTICATED, no service call
        with pytest.raises((PeerUnreachableError, SideChannelTLSError)) as info:
            call()
        assert not isinstance(info.value, SideChannelAuthError)
        assert "side_channel_tls" in str(info.value)
    c.close()
    assert_untouched(mtls_server, accepted, calls)


def test_mtls_accepts_a_client_certificate_of_its_ca_with_the_token(
    pki: Pki, mtls_server: Served
) -> None:
    accepted, calls = mtls_server.accepted, len(mtls_server.leases.calls)
    c = client(mtls_server.port, pki.tls(pki.client, pki.ca))
    assert c.handshake(peer.record(), "D", 0).staging.agent_metadata == METADATA
    assert list(c.heartbeat(["x"]).unknown) == ["x"]
    c.close()
    assert mtls_server.accepted == accepted + 1
    assert mtls_server.leases.calls[calls:] == ["heartbeat"]


def test_mtls_still_checks_the_token(pki: Pki, mtls_server: Served) -> None:
    accepted, calls = mtls_server.accepted, len(mtls_server.leases.calls)
    c = client(mtls_server.port, pki.tls(pki.client, pki.ca), token=None)
    with pytest.raises(SideChannelAuthError):
        c.handshake(peer.record(), "D", 0)
    c.close()
    assert_untouched(mtls_server, accepted, calls)


# -- (e) the client verifies the server ------------------------------------------------------------


def test_client_trusting_another_ca_refuses_the_server(pki: Pki, tls_server: Served) -> None:
    accepted, calls = tls_server.accepted, len(tls_server.leases.calls)
    c = client(tls_server.port, pki.tls(pki.client, pki.other_ca))
    with pytest.raises(SideChannelTLSError, match="signed by this engine's side_channel_tls_ca"):
        c.handshake(peer.record(), "D", 0)
    with pytest.raises(SideChannelTLSError):
        c.release(["x"])
    c.close()
    assert_untouched(tls_server, accepted, calls)


def test_server_certificate_must_name_the_dialed_host(pki: Pki) -> None:
    """The SAN must cover the address peers dial (side_channel_host): an IP needs an IP SAN."""
    served = serve(pki.tls(pki.localhost_only))
    try:
        by_ip = client(served.port, pki.tls(ca=pki.ca), host="127.0.0.1")
        with pytest.raises(SideChannelTLSError, match="'127.0.0.1' in its subject alternative"):
            by_ip.handshake(peer.record(), "D", 0)
        by_ip.close()
        assert served.accepted == 0
        by_name = client(served.port, pki.tls(ca=pki.ca), host="localhost")
        assert by_name.handshake(peer.record(), "D", 0).staging.agent_name == AGENT
        by_name.close()
        assert served.accepted == 1
    finally:
        served.server.stop()


def test_a_serving_engine_needs_its_own_certificate(pki: Pki) -> None:
    with pytest.raises(ConnectorConfigError, match="set both, or unset side_channel_tls_ca"):
        serve(pki.tls(ca=pki.ca))


# -- (f) message bounds ----------------------------------------------------------------------------

TOO_BIG = "x" * (MAX_MESSAGE_BYTES + 1024)  # a reply over the reply bound
TOO_BIG_REQUEST = "x" * (MAX_REQUEST_BYTES + 1024)  # over the request bound (L1); 4 bytes framing


def test_client_refuses_to_send_an_oversized_message(pki: Pki, tls_server: Served) -> None:
    calls = len(tls_server.leases.calls)
    c = client(tls_server.port, pki.tls(ca=pki.ca))
    with pytest.raises(SideChannelMessageTooLargeError, match=r"limit of 1MiB per request") as info:
        c.release([TOO_BIG_REQUEST])
    assert (f"CLIENT: Sent message larger than max ({len(TOO_BIG_REQUEST) + 4} vs. "
            f"{MAX_REQUEST_BYTES})") in str(info.value)
    assert tls_server.leases.calls[calls:] == []
    assert c.pool_status().capacity_slots == 8  # the channel and the server carry on
    c.close()


def test_server_refuses_to_receive_an_oversized_message(pki: Pki, tls_server: Served) -> None:
    calls = len(tls_server.leases.calls)
    channel = grpc.secure_channel(  # a client without our send bound
        f"127.0.0.1:{tls_server.port}",
        pki.tls(ca=pki.ca).channel_credentials(),
        options=[("grpc.max_send_message_length", -1)],
    )
    stub = pb_grpc.SideChannelStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(
            pb.LeaseRequest(request_ids=[TOO_BIG_REQUEST]),
            timeout=30,
            metadata=((AUTH_HEADER, f"Bearer {TOKEN}"),),
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # 1 MiB, not the 32 MiB of replies: no caller pins more per call (security review L1)
    assert (f"Received message larger than max ({len(TOO_BIG_REQUEST) + 4} vs. "
            f"{MAX_REQUEST_BYTES})") in info.value.details()
    channel.close()
    assert tls_server.leases.calls[calls:] == []
    c = client(tls_server.port, pki.tls(ca=pki.ca))
    assert list(c.heartbeat(["x"]).unknown) == ["x"]  # the server still serves
    c.close()


def test_server_refuses_to_send_an_oversized_reply(pki: Pki) -> None:
    huge = StagingInfo(AGENT, b"m" * (MAX_MESSAGE_BYTES + 1024), 0, 4096, 8, (0,), 0, "DRAM")
    served = serve(pki.tls(pki.engine), staging=huge)
    try:
        c = client(served.port, pki.tls(ca=pki.ca))
        with pytest.raises(SideChannelMessageTooLargeError, match="32MiB per reply") as info:
            c.handshake(peer.record(), "D", 0)
        assert "SERVER: Sent message larger than max (" in str(info.value)
        assert c.pool_status().capacity_slots == 8
        c.close()
    finally:
        served.server.stop()


UNDER = "u" * (MAX_MESSAGE_BYTES - (64 << 10))


class _BigReplies(pb_grpc.SideChannelServicer):
    """A peer that is not turbowire: no send bound, replies as large as asked for."""

    def Heartbeat(self, request: Any, context: Any) -> pb.LeaseReply:  # noqa: N802
        return pb.LeaseReply(done=[TOO_BIG if request.request_ids[0] == "over" else UNDER])


def test_client_receives_up_to_the_bound_and_refuses_more() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_SideChannelServicer_to_server(_BigReplies(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        c = client(port, None, timeout=30)
        assert len(c.heartbeat(["under"]).done[0]) == len(UNDER)  # gRPC's 4MiB default is raised
        with pytest.raises(SideChannelMessageTooLargeError) as info:
            c.heartbeat(["over"])
        assert f"Received message larger than max ({len(TOO_BIG) + 5} vs. {MAX_MESSAGE_BYTES})" in (
            str(info.value)
        )
        c.close()
    finally:
        server.stop(0)


def test_the_server_accepts_messages_up_to_the_bound(pki: Pki, tls_server: Served) -> None:
    c = client(tls_server.port, pki.tls(ca=pki.ca), timeout=30)
    under = "u" * (MAX_REQUEST_BYTES - (16 << 10))
    assert list(c.heartbeat([under]).unknown) == [under]  # a request under 1MiB, both ends
    c.close()


# -- (g) deadlines ---------------------------------------------------------------------------------


CALLS = {
    "Handshake": lambda c: c.handshake(peer.record(), "D", 0),
    "ReleaseLease": lambda c: c.release(["x"]),
    "Heartbeat": lambda c: c.heartbeat(["x"]),
    "PoolStatus": lambda c: c.pool_status(),
}


def test_every_rpc_of_the_service_is_covered() -> None:
    assert set(CALLS) == set(pb.DESCRIPTOR.services_by_name["SideChannel"].methods_by_name)


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls"])
@pytest.mark.parametrize("rpc", sorted(CALLS))
def test_every_call_times_out_against_a_peer_that_never_answers(
    pki: Pki, rpc: str, secure: bool
) -> None:
    hole = BlackHole()
    try:
        c = client(hole.port, pki.tls(pki.client, pki.ca) if secure else None, timeout=SHORT)
        start = time.monotonic()
        with pytest.raises(PeerUnreachableError, match=rf"did not answer within {SHORT:g}s"):
            CALLS[rpc](c)
        elapsed = time.monotonic() - start
        c.close()
        assert SHORT * 0.8 <= elapsed < SHORT + 5.0  # the deadline, not a hang (slack: load)
        assert hole.accepted, "the peer accepted TCP (the test exercised the deadline)"
    finally:
        hole.close()


def test_a_call_the_service_never_answers_times_out(pki: Pki) -> None:
    stuck = threading.Event()
    served = serve(pki.tls(pki.engine), leases=SpyLeases(block=stuck))
    try:
        c = client(served.port, pki.tls(ca=pki.ca), timeout=SHORT)
        for call in (lambda: c.heartbeat(["x"]), lambda: c.release(["x"]), c.pool_status):
            start = time.monotonic()
            with pytest.raises(PeerUnreachableError, match="handshake_timeout_seconds"):
                call()
            assert time.monotonic() - start < SHORT + 5.0
        assert served.leases.calls == ["heartbeat", "release", "snapshot"]  # it did reach it
        c.close()
    finally:
        stuck.set()
        served.server.stop()


@pytest.mark.parametrize("timeout", [None, 0, -1.0, float("inf"), float("nan"), True])
def test_a_client_without_a_finite_deadline_is_refused(timeout: Any) -> None:
    with pytest.raises(ValueError, match="finite timeout > 0"):
        SideChannelClient("127.0.0.1", 1, TOKEN, timeout=timeout)


def test_errors_are_side_channel_errors() -> None:
    for cls in (SideChannelTLSError, SideChannelMessageTooLargeError):
        assert issubclass(cls, SideChannelError) and cls.reason == "handshake"
