"""Authenticated kv_transfer_params (issue 33, H3): the MAC's canonical form and key, its check,
the ``remote_host`` rule and the ``prefill_peers`` allowlist parser."""

from __future__ import annotations

import copy
import hashlib
import hmac
import json

import pytest

from turbowire.connector.params import (
    MAC_FIELDS,
    PARAMS_MAC_FIELD,
    RemotePrefill,
    TransferParamsError,
    UnauthenticatedParamsError,
    canonical_params,
    mac_fields,
    params_mac,
    params_mac_key,
    prefill_result,
    prompt_digest,
)
from turbowire.connector.peers import PeerAllowlist, PeerAllowlistError, is_valid_host

TOKEN = "shared-token-123"
LEASE = "ab" * 16
BS = 32


def signed(auth_token: str | None = TOKEN, **over) -> dict:
    """What a prefill engine with ``auth_token`` returns (format 2, a lease, 3 slots)."""
    p = prefill_result(
        engine_id="eng-p", request_id="req-1", host="10.0.0.5", port=5700, slots=[4, 5, 6],
        num_tokens=70, tp_size=1, preset="tq4", format_version=2,
        prompt_hash=prompt_digest(list(range(70)), 70), lease_seconds=30.0, dense_bytes=1000,
        wire_bytes=250, lease_token=LEASE,
        mac_key=params_mac_key(auth_token) if auth_token else None,
    )
    p.update(over)
    return p


def test_the_canonical_form_is_pinned():
    """The encoding both engines MAC (documented in params.py): JSON of exactly MAC_FIELDS,
    keys sorted, no spaces, ASCII, block ids flat, lease seconds a float. A change here breaks
    every mixed-version pair: it needs a new key label (params-mac/v2)."""
    fields = mac_fields(
        engine_id="eng-p", request_id="req-1", host="10.0.0.5", port=5700, slots=[4, 5, 6],
        num_tokens=70, tp_size=1, preset="tq4", format_version=2, prompt_hash="00ff" * 6,
        lease_seconds=30, lease_token=LEASE, fallback=None,
    )
    assert canonical_params(fields) == (
        b'{"remote_block_ids":[4,5,6],"remote_engine_id":"eng-p","remote_host":"10.0.0.5",'
        b'"remote_num_tokens":70,"remote_port":5700,"remote_request_id":"req-1","tp_size":1,'
        b'"turbowire_fallback":null,"turbowire_format_version":2,"turbowire_lease_seconds":30.0,'
        b'"turbowire_lease_token":"abababababababababababababababab","turbowire_preset":"tq4",'
        b'"turbowire_prompt_hash":"00ff00ff00ff00ff00ff00ff"}'
    )
    # K = HMAC-SHA256(auth_token, "turbowire/params-mac/v1"); MAC = HMAC-SHA256(K, canonical)
    key = hmac.new(TOKEN.encode(), b"turbowire/params-mac/v1", hashlib.sha256).digest()
    assert params_mac_key(TOKEN) == key and key != TOKEN.encode()
    want = hmac.new(key, canonical_params(fields), hashlib.sha256).hexdigest()
    assert params_mac(key, fields) == want
    assert want == "6926ffbeaf1a1b5fa9a0fa441291f552779f0c3c6c342252669710fb1b70eb99"
    assert set(json.loads(canonical_params(fields))) == set(MAC_FIELDS)
    with pytest.raises(ValueError, match="lack"):
        canonical_params({k: v for k, v in fields.items() if k != "tp_size"})
    non_ascii = dict(fields, remote_engine_id="é")
    assert canonical_params(non_ascii).isascii()


def test_signed_params_verify_and_survive_a_router_round_trip():
    """A router that re-serializes the params (json, an int lease, tp_size dropped as default,
    the HMA nesting of block ids) forwards the same values: the MAC still verifies."""
    p = signed()
    assert len(p[PARAMS_MAC_FIELD]) == 64
    key = params_mac_key(TOKEN)
    RemotePrefill.parse(p, BS).verify_mac(key)
    again = json.loads(json.dumps(p))
    again["turbowire_lease_seconds"] = 30  # an int now
    again["remote_block_ids"] = [again["remote_block_ids"]]  # NixlConnector's [[...]]
    again["foo"] = "bar"  # unknown fields are not covered
    RemotePrefill.parse(again, BS).verify_mac(key)
    assert PARAMS_MAC_FIELD not in repr(RemotePrefill.parse(p, BS))
    assert p[PARAMS_MAC_FIELD] not in repr(RemotePrefill.parse(p, BS))


def _tampered() -> list[tuple[str, object]]:
    return [
        ("remote_engine_id", "eng-q"), ("remote_request_id", "req-2"),
        ("remote_host", "10.0.0.6"), ("remote_port", 5701), ("remote_block_ids", [6, 5, 4]),
        ("remote_num_tokens", 65), ("tp_size", 2), ("turbowire_preset", "raw"),
        ("turbowire_format_version", 3), ("turbowire_prompt_hash", "0" * 24),
        ("turbowire_lease_seconds", 3000.0), ("turbowire_lease_token", "cd" * 16),
        ("turbowire_fallback", "staging_full"),
    ]


def test_every_field_the_decode_engine_acts_on_is_covered():
    assert [name for name, _ in _tampered()] == list(MAC_FIELDS)


@pytest.mark.parametrize(("name", "value"), _tampered(), ids=lambda v: str(v)[:20])
def test_any_tampered_field_is_refused(name, value):
    p = signed(**{name: value})
    remote = RemotePrefill.parse(p, BS)
    with pytest.raises(UnauthenticatedParamsError, match="does not match") as info:
        remote.verify_mac(params_mac_key(TOKEN))
    assert info.value.reason == "unauthenticated_params"
    assert TOKEN not in str(info.value)


def test_unsigned_or_wrongly_signed_params_are_refused():
    key = params_mac_key(TOKEN)
    with pytest.raises(UnauthenticatedParamsError, match="carry no turbowire_params_mac"):
        RemotePrefill.parse(signed(auth_token=None), BS).verify_mac(key)
    with pytest.raises(UnauthenticatedParamsError, match="does not match"):
        RemotePrefill.parse(signed(auth_token="another-token-9"), BS).verify_mac(key)
    # a MAC of another request's params, copied over
    other = signed(remote_request_id="req-2")
    other[PARAMS_MAC_FIELD] = params_mac(key, RemotePrefill.parse(other, BS).mac_fields())
    mine = signed()
    mine[PARAMS_MAC_FIELD] = other[PARAMS_MAC_FIELD]
    with pytest.raises(UnauthenticatedParamsError):
        RemotePrefill.parse(mine, BS).verify_mac(key)


@pytest.mark.parametrize("mac", ["", "0" * 63, "0" * 65, "A" * 64, "g" * 64, 7, ["0" * 64],
                                 "0" * 100_000])
def test_a_malformed_mac_is_bad_params(mac):
    with pytest.raises(TransferParamsError, match="turbowire_params_mac must be 64") as info:
        RemotePrefill.parse(signed(**{PARAMS_MAC_FIELD: mac}), BS)
    assert info.value.reason == "bad_params"


def test_the_forged_hash_case_is_caught_by_the_mac():
    """Params of prompt P' with turbowire_prompt_hash replaced by prompt P's digest."""
    p_prime = signed()
    forged = copy.deepcopy(p_prime)
    forged["turbowire_prompt_hash"] = prompt_digest(list(range(100, 170)), 70)
    remote = RemotePrefill.parse(forged, BS)  # parses: only the MAC tells
    with pytest.raises(UnauthenticatedParamsError):
        remote.verify_mac(params_mac_key(TOKEN))


# ---- remote_host ------------------------------------------------------------------------------
@pytest.mark.parametrize("host", [
    "10.0.0.5", "::1", "[::1]", "fe80::1", "localhost", "prefill-0.prefill.ns.svc",
    "Prefill-0.SVC.", "a" * 63 + ".b",
])
def test_valid_hosts(host):
    assert is_valid_host(host)
    assert RemotePrefill.parse(signed(remote_host=host), BS).host == host


@pytest.mark.parametrize("host", [
    "", " ", "a b", "dns:///10.0.0.5", "unix:/tmp/sock", "unix-abstract:x", "ipv4:10.0.0.5",
    "10.0.0.5:5700", "h/path", "fe80::1%eth0", "[10.0.0.5]", "127.1", "2130706433",
    "0x7f.0.0.1", "h_1", "-h", "h-", "a..b", "a" * 64 + ".b", ("a" * 60 + ".") * 5, "h\n",
    "héllo", "[::1", "::1]",
])
def test_invalid_hosts_are_bad_params(host):
    assert not is_valid_host(host)
    with pytest.raises(TransferParamsError, match="remote_host must be a host name or an IP"):
        RemotePrefill.parse(signed(remote_host=host), BS)


# ---- prefill_peers ----------------------------------------------------------------------------
def test_allowlist_entries_and_matching():
    a = PeerAllowlist.parse([
        "10.0.0.0/8", "fd00::/8", "192.168.1.7", "192.168.1.8:5700", "[::1]:5700", "::2",
        "prefill-0.svc", "Prefill-1.SVC.:5600",
    ])
    allowed = [
        ("10.1.2.3", 1), ("fd00::9", 5700), ("192.168.1.7", 9), ("192.168.1.8", 5700),
        ("::1", 5700), ("[::1]", 5700), ("::2", 1), ("[::2]", 1), ("prefill-0.svc", 1),
        ("PREFILL-0.svc.", 2), ("prefill-1.svc", 5600), ("::ffff:10.0.0.1", 5),
    ]
    refused = [
        ("11.0.0.1", 1), ("192.168.1.8", 5701), ("::1", 5701), ("prefill-1.svc", 5601),
        ("prefill-2.svc", 1), ("10.0.0.1.nip.io", 1), ("127.0.0.1", 5700), ("fe00::1", 1),
        ("bad host", 1), ("127.1", 1),
    ]
    assert [h for h in allowed if not a.allows(*h)] == []
    assert [h for h in refused if a.allows(*h)] == []
    assert PeerAllowlist.parse([]).allows("anything.example", 1)
    assert PeerAllowlist.parse(()).empty


@pytest.mark.parametrize(("entries", "needle"), [
    (["10.0.0.1/8"], "not a CIDR"), (["10.0.0.0/33"], "not a CIDR"),
    (["h:0"], "not a TCP port"), (["h:65536"], "not a TCP port"), (["h:x"], "not a TCP port"),
    (["[::1"], "unclosed"), (["[::1]x"], "expected"), (["[host]:1"], "not a CIDR, an IP"),
    (["a b"], "not a CIDR, an IP"), (["dns://x"], "not a CIDR"), ([""], "non-empty"),
    ([7], "non-empty string"), (["x" * 301], "at most 300"), ("10.0.0.0/8", "list of strings"),
    (["h"] * 1025, "at most 1024"), (["h:1:2"], "not a CIDR, an IP"),
])
def test_bad_allowlist_entries_are_named(entries, needle):
    with pytest.raises(PeerAllowlistError, match=needle):
        PeerAllowlist.parse(entries)


def test_allowlist_config_key_is_checked_at_start():
    from turbowire.connector.config import ConnectorConfigError, TurboWireConfig

    cfg = TurboWireConfig.from_extra_config({"prefill_peers": "10.0.0.0/8, p-0.svc:5700"},
                                            environ={})
    assert cfg.prefill_peers == ("10.0.0.0/8", "p-0.svc:5700")
    with pytest.raises(ConnectorConfigError, match="prefill_peers: prefill_peers entry 'a b'"):
        TurboWireConfig.from_extra_config({"prefill_peers": ["a b"]}, environ={})
    with pytest.raises(ConnectorConfigError, match="prefill_peers must be a list"):
        TurboWireConfig.from_extra_config({"prefill_peers": 7}, environ={})
