"""side_channel_tls_cert/_key/_ca: checked when the config is built, each error naming the key
and what to put there; SideChannelTLS reads what the config names and never shows the key."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from turbowire.connector.config import (
    CONFIG_KEYS_BY_NAME,
    ConnectorConfigError,
    TurboWireConfig,
    render_markdown_table,
)
from turbowire.connector.sidechannel.server import SideChannelTLS

KEYS = ("side_channel_tls_cert", "side_channel_tls_key", "side_channel_tls_ca")


def _pem_key(key: ec.EllipticCurvePrivateKey, password: bytes | None = None,
             traditional: bool = False) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL if traditional
        else serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password) if password
        else serialization.NoEncryption(),
    )


def _self_signed(key: ec.EllipticCurvePrivateKey) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "unit")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tls-config")
    key, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    cert = _self_signed(key)
    body = cert.decode().splitlines()
    contents = {
        "cert": cert,
        "key": _pem_key(key),
        "other_key": _pem_key(other),
        "encrypted_key": _pem_key(key, b"passphrase"),
        "encrypted_traditional_key": _pem_key(key, b"passphrase", traditional=True),
        "garbage_cert": b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        "truncated_cert": ("\n".join(body[:3]) + "\n").encode(),
        "truncated_key": b"-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n",
        "der_cert": x509.load_pem_x509_certificate(cert).public_bytes(
            serialization.Encoding.DER
        ),
        "empty": b"",
    }
    paths = {}
    for name, data in contents.items():
        (root / name).write_bytes(data)
        paths[name] = str(root / name)
    paths["missing"] = str(root / "nope.pem")
    paths["dir"] = str(root)
    return paths


def build(**given: Any) -> TurboWireConfig:
    return TurboWireConfig.from_extra_config(given, environ={})


def test_keys_are_in_the_table_unset_by_default() -> None:
    table = render_markdown_table()
    for name in KEYS:
        key = CONFIG_KEYS_BY_NAME[name]
        assert key.default_value() is None and key.stored
        assert f"| `{name}` | `None` | a path to a PEM file (" in table
    assert "subject alternative names must cover" in CONFIG_KEYS_BY_NAME[KEYS[0]].doc
    assert "mTLS" in CONFIG_KEYS_BY_NAME[KEYS[2]].doc
    cfg = TurboWireConfig()
    assert (cfg.side_channel_tls_cert, cfg.side_channel_tls_key, cfg.side_channel_tls_ca) == (
        None, None, None,
    )
    assert SideChannelTLS.from_config(cfg) is None


def test_valid_files_are_kept_and_read(files: dict[str, str]) -> None:
    cfg = build(side_channel_tls_cert=files["cert"], side_channel_tls_key=files["key"],
                side_channel_tls_ca=files["cert"])
    assert cfg.side_channel_tls_cert == files["cert"] and cfg.side_channel_tls_ca == files["cert"]
    tls = SideChannelTLS.from_config(cfg)
    assert tls is not None and tls.mode == "mTLS"
    assert tls.key == Path(files["key"]).read_bytes()
    assert tls.cert == tls.ca == Path(files["cert"]).read_bytes()
    assert b"PRIVATE" not in repr(tls).encode() and "True" in repr(tls)
    only_ca = SideChannelTLS.from_config(build(side_channel_tls_ca=files["cert"]))
    assert only_ca is not None and only_ca.cert is None and only_ca.ca is not None
    assert build(side_channel_tls_ca="") == build()  # "" means unset, as for the other paths


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({"side_channel_tls_cert": "cert"},
         "side_channel_tls_cert is set but side_channel_tls_key is not: set both"),
        ({"side_channel_tls_key": "key"},
         "side_channel_tls_key is set but side_channel_tls_cert is not: set both"),
        ({"side_channel_tls_ca": "missing"},
         r"side_channel_tls_ca='.*nope.pem' does not exist: give the path of the PEM CA bundle"),
        ({"side_channel_tls_cert": "missing", "side_channel_tls_key": "key"},
         "side_channel_tls_cert='.*' does not exist.* or leave side_channel_tls_cert unset"),
        ({"side_channel_tls_cert": "dir", "side_channel_tls_key": "key"},
         "side_channel_tls_cert='.*' is not a file: give the path of the PEM certificate chain"),
        ({"side_channel_tls_cert": "key", "side_channel_tls_key": "key"},
         "side_channel_tls_cert='.*' holds no PEM certificate"),
        ({"side_channel_tls_cert": "empty", "side_channel_tls_key": "key"},
         "side_channel_tls_cert='.*' holds no PEM certificate"),
        ({"side_channel_tls_cert": "der_cert", "side_channel_tls_key": "key"},
         "side_channel_tls_cert='.*' holds no PEM certificate"),
        ({"side_channel_tls_cert": "garbage_cert", "side_channel_tls_key": "key"},
         r"side_channel_tls_cert='.*' does not parse as PEM certificates \(OpenSSL: .*DER form"),
        ({"side_channel_tls_cert": "truncated_cert", "side_channel_tls_key": "key"},
         "side_channel_tls_cert='.*' does not parse as PEM certificates"),
        ({"side_channel_tls_cert": "cert", "side_channel_tls_key": "cert"},
         "side_channel_tls_key='.*' holds no PEM private key"),
        ({"side_channel_tls_cert": "cert", "side_channel_tls_key": "truncated_key"},
         "side_channel_tls_key='.*' does not parse as a PEM private key"),
        ({"side_channel_tls_cert": "cert", "side_channel_tls_key": "other_key"},
         "side_channel_tls_key='.*' is not the private key of side_channel_tls_cert="),
        ({"side_channel_tls_cert": "cert", "side_channel_tls_key": "encrypted_key"},
         "side_channel_tls_key is an encrypted private key: gRPC needs it unencrypted"),
        ({"side_channel_tls_cert": "cert", "side_channel_tls_key": "encrypted_traditional_key"},
         "side_channel_tls_key is an encrypted private key"),
        ({"side_channel_tls_ca": "key"}, "side_channel_tls_ca='.*' holds no PEM certificate"),
        ({"side_channel_tls_ca": "garbage_cert"},
         "side_channel_tls_ca='.*' does not parse as PEM certificates"),
        ({"side_channel_tls_ca": 7}, "side_channel_tls_ca must be a path to a PEM file"),
    ],
)
def test_bad_tls_settings_say_what_to_change(
    files: dict[str, str], given: dict[str, Any], needle: str
) -> None:
    given = {k: files.get(v, v) if isinstance(v, str) else v for k, v in given.items()}
    with pytest.raises(ConnectorConfigError, match=needle):
        build(**given)
    with pytest.raises(ConnectorConfigError, match=needle):  # direct construction too
        TurboWireConfig(**given)
    with pytest.raises(ConnectorConfigError, match=needle):  # and the server/client material
        SideChannelTLS.from_files(*(given.get(k) for k in KEYS))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_named(files: dict[str, str], tmp_path: Path) -> None:
    locked = tmp_path / "locked.pem"
    locked.write_bytes(Path(files["cert"]).read_bytes())
    locked.chmod(0)
    with pytest.raises(ConnectorConfigError, match="is not readable by this process"):
        build(side_channel_tls_ca=str(locked))


def test_material_must_pair_cert_and_key_and_a_server_needs_a_cert() -> None:
    with pytest.raises(ConnectorConfigError, match="set both or neither"):
        SideChannelTLS(cert=b"x")
    with pytest.raises(ConnectorConfigError, match="needs its own certificate"):
        SideChannelTLS(ca=b"ca").server_credentials()
    with pytest.raises(ConnectorConfigError, match="need side_channel_tls_ca"):
        SideChannelTLS(cert=b"c", key=b"k").channel_credentials()
