"""The side channel's TLS keys: the PEM files are read and parsed at start, so a missing,
unreadable or malformed certificate stops the engine with the key's name instead of failing the
first handshake."""

from __future__ import annotations

import os
import re
import ssl

from turbowire.connector.config_kinds import ConnectorConfigError, Text

__all__ = [
    "check_side_channel_tls", "pem_file", "read_pem",
]


_PEM_CERT = b"-----BEGIN CERTIFICATE-----"
_PEM_KEY_RE = re.compile(rb"-----BEGIN (RSA |EC )?PRIVATE KEY-----")
_PEM_ENCRYPTED = (b"-----BEGIN ENCRYPTED PRIVATE KEY-----", b"Proc-Type: 4,ENCRYPTED")


def pem_file(what: str) -> Text:
    """The kind of a PEM file path key: unset, or a readable regular file (checked at start)."""
    return Text(
        f"a path to a PEM file ({what})",
        (
            (bool, "{key} must be the path of a PEM file (got an empty string)"),
            (
                os.path.exists,
                "{key}={value!r} does not exist: give the path of the PEM " + what
                + " (is its Secret or volume mounted into the container?) or leave {key} unset",
            ),
            (os.path.isfile, "{key}={value!r} is not a file: give the path of the PEM " + what),
            (
                lambda s: os.access(s, os.R_OK),
                "{key}={value!r} is not readable by this process: make it readable by the "
                "engine's user",
            ),
        ),
        nullable=True,
    )


def read_pem(key: str, path: str) -> bytes:
    """The bytes of the PEM file of ``key`` (one error message for every way reading fails)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConnectorConfigError(
            f"{key}={path!r} cannot be read ({exc.strerror or exc}): make it a file readable by "
            "the engine's user"
        ) from exc


def _no_password() -> bytes:
    # OpenSSL would otherwise prompt on the terminal for the passphrase of an encrypted key
    raise ConnectorConfigError(
        "side_channel_tls_key is an encrypted private key: gRPC needs it unencrypted "
        "(openssl pkey -in KEY -out PLAIN); protect the file by its permissions instead"
    )


def _check_certs(key: str, path: str, what: str) -> None:
    """``path`` holds PEM certificates that OpenSSL parses, else the error naming ``key``."""
    if _PEM_CERT not in read_pem(key, path):
        raise ConnectorConfigError(
            f"{key}={path!r} holds no PEM certificate (-----BEGIN CERTIFICATE-----): give {what} "
            "in PEM"
        )
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConnectorConfigError(
            f"{key}={path!r} does not parse as PEM certificates (OpenSSL: {exc}): check that the "
            "file is complete and not in DER form (openssl x509 -in FILE -noout -text)"
        ) from exc


def check_side_channel_tls(cert: str | None, key: str | None, ca: str | None) -> None:
    """Refuse a half-set certificate pair and PEM files that gRPC could not use, naming the key.

    gRPC itself reports bad credentials only at the first connection (and then vaguely), so the
    files are parsed here, with the interpreter's OpenSSL, when the engine starts.
    """
    if (cert is None) != (key is None):
        given, missing = (
            ("side_channel_tls_cert", "side_channel_tls_key")
            if key is None
            else ("side_channel_tls_key", "side_channel_tls_cert")
        )
        raise ConnectorConfigError(
            f"{given} is set but {missing} is not: set both (the PEM certificate chain and its "
            "private key) or neither"
        )
    if cert is not None and key is not None:
        _check_certs("side_channel_tls_cert", cert, "this engine's certificate chain, leaf first,")
        key_pem = read_pem("side_channel_tls_key", key)
        if any(marker in key_pem for marker in _PEM_ENCRYPTED):
            _no_password()
        if not _PEM_KEY_RE.search(key_pem):
            raise ConnectorConfigError(
                f"side_channel_tls_key={key!r} holds no PEM private key "
                "(-----BEGIN PRIVATE KEY-----): give the unencrypted private key of "
                "side_channel_tls_cert in PEM"
            )
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, _no_password)
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ConnectorConfigError(
                    f"side_channel_tls_key={key!r} is not the private key of "
                    f"side_channel_tls_cert={cert!r}: give the key the certificate was issued for"
                ) from exc
            raise ConnectorConfigError(
                f"side_channel_tls_key={key!r} does not parse as a PEM private key (OpenSSL: "
                f"{exc}): check that the file is complete and not in DER form "
                "(openssl pkey -in FILE -noout)"
            ) from exc
    if ca is not None:
        _check_certs(
            "side_channel_tls_ca", ca, "the CA certificate(s) that signed the peers' certificates"
        )
