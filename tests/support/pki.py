"""A throwaway PKI for the side-channel TLS tests: a CA that issues engine and client certificates
(EC P-256, one day), written as PEM files the ``side_channel_tls_*`` keys take."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ENGINE_EKU = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
LOOPBACK_SANS = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


@dataclass
class CA:
    name: str
    key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )

    def __post_init__(self) -> None:
        self.cert = (
            _builder(self.name, _name(self.name), self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def issue(self, cn: str, sans: list[x509.GeneralName], eku: list[Any]) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) of a leaf signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(cn, self.cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(eku), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def engine_pki(root: Path) -> dict[str, str]:
    """CA + one engine certificate (SAN 127.0.0.1, localhost; server and client auth) as files:
    the ``kv_connector_extra_config`` of an mTLS engine on loopback."""
    root.mkdir(parents=True, exist_ok=True)
    ca = CA("turbowire e2e CA")
    cert, key = ca.issue("engine", LOOPBACK_SANS, ENGINE_EKU)
    (root / "ca.crt").write_bytes(ca.pem)
    (root / "engine.crt").write_bytes(cert)
    (root / "engine.key").write_bytes(key)
    (root / "engine.key").chmod(0o600)
    return {
        "side_channel_tls_cert": str(root / "engine.crt"),
        "side_channel_tls_key": str(root / "engine.key"),
        "side_channel_tls_ca": str(root / "ca.crt"),
    }
