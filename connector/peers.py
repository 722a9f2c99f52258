"""Which prefill engines a decode engine may dial: host-name checks and ``prefill_peers``.

A host named in ``kv_transfer_params`` comes from the network (through the proxy): it must be
an IP literal or a plain DNS name (never anything gRPC would read as a scheme, a port or a path)
and, with ``prefill_peers`` set, one of the listed peers, before anything is dialed or resolved.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from turbowire.errors import TurboWireError

MAX_HOST_CHARS = 253  # a DNS name (RFC 1035), longer than any IP literal
_HOST_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def is_valid_host(host: str) -> bool:
    """An IP literal (IPv6 optionally in brackets) or a DNS host name of letters, digits and
    hyphens: never a scheme (``dns://``, ``unix:``), a port, a path, a zone id or a space, which
    gRPC would interpret. A name whose last label is all digits (``127.1``, ``2130706433``) is
    refused too: resolvers read those as IPv4 addresses."""
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS + 2:
        return False
    if ip_literal(host) is not None:
        return True
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > MAX_HOST_CHARS:
        return False
    labels = name.split(".")
    if labels[-1].isdigit():
        return False
    return all(_HOST_LABEL_RE.fullmatch(label) for label in labels)


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address of an IP literal host (``[v6]`` accepted, zone ids not), else None."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if "%" in text or not text or text != text.strip():
        return None
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if host.startswith("[") and addr.version != 6:
        return None
    return addr


# -- prefill_peers: which prefill engines a decode engine may dial ---------------------------------
MAX_PEER_ENTRIES = 1024
MAX_PEER_ENTRY_CHARS = 300
_PORT_RE = re.compile(r"[0-9]{1,5}")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class PeerAllowlistError(TurboWireError, ValueError):
    """A ``prefill_peers`` entry that is not a CIDR, an IP or a host name (each with an optional
    port)."""


def _port(entry: str, text: str) -> int:
    if not _PORT_RE.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise PeerAllowlistError(f"prefill_peers entry {entry!r}: {text!r} is not a TCP port")
    return int(text)


def _plain(addr: IPAddress) -> IPAddress:
    """IPv4-mapped IPv6 (``::ffff:10.0.0.1``) as the IPv4 address it is."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@dataclass(frozen=True)
class PeerAllowlist:
    """The prefill engines a decode engine may dial (``prefill_peers``); empty: any.

    Entries: a CIDR (``10.0.0.0/8``, ``fd00::/8``: any port), an IP (``10.0.0.5``, ``::1``,
    ``[::1]``), an IP with a port (``10.0.0.5:5700``, ``[::1]:5700``), a host name
    (``prefill-0.prefill.svc``: any port) or a host name with a port. A host name in the params
    matches only a listed name (case-insensitive, a trailing dot ignored); it is never resolved
    to be matched against an address or a CIDR, so nothing is looked up for params that are then
    refused.
    """

    networks: tuple[IPNetwork, ...] = ()
    addresses: frozenset[tuple[IPAddress, int]] = frozenset()
    names: frozenset[str] = frozenset()
    name_ports: frozenset[tuple[str, int]] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.networks or self.addresses or self.names or self.name_ports)

    @classmethod
    def parse(cls, entries: Sequence[str]) -> PeerAllowlist:
        """Parse ``prefill_peers``; raises :class:`PeerAllowlistError` naming the bad entry."""
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
            raise PeerAllowlistError("prefill_peers must be a list of strings")
        if len(entries) > MAX_PEER_ENTRIES:
            raise PeerAllowlistError(
                f"prefill_peers has {len(entries)} entries (at most {MAX_PEER_ENTRIES}): use CIDRs"
            )
        networks: list[IPNetwork] = []
        addresses: set[tuple[IPAddress, int]] = set()
        names: set[str] = set()
        name_ports: set[tuple[str, int]] = set()
        for entry in entries:
            if not isinstance(entry, str) or not entry or len(entry) > MAX_PEER_ENTRY_CHARS:
                raise PeerAllowlistError(
                    f"prefill_peers entry {str(entry)[:80]!r} must be a non-empty string of at "
                    f"most {MAX_PEER_ENTRY_CHARS} characters"
                )
            if "/" in entry:
                try:
                    net = ipaddress.ip_network(entry, strict=True)
                except ValueError as exc:
                    raise PeerAllowlistError(
                        f"prefill_peers entry {entry!r} is not a CIDR such as 10.0.0.0/8 ({exc})"
                    ) from exc
                networks.append(net)
                continue
            host, port = entry, None
            if entry.startswith("["):  # [v6] or [v6]:port
                end = entry.find("]")
                if end < 0:
                    raise PeerAllowlistError(f"prefill_peers entry {entry!r}: unclosed '['")
                host, rest = entry[: end + 1], entry[end + 1 :]
                if rest:
                    if not rest.startswith(":"):
                        raise PeerAllowlistError(
                            f"prefill_peers entry {entry!r}: expected [address]:port"
                        )
                    port = _port(entry, rest[1:])
            elif entry.count(":") == 1:  # v4:port or name:port (bare IPv6 has several colons)
                host, port_text = entry.split(":")
                port = _port(entry, port_text)
            addr = ip_literal(host)
            if addr is not None:
                addr = _plain(addr)
                if port is None:
                    networks.append(ipaddress.ip_network(addr))
                else:
                    addresses.add((addr, port))
                continue
            if host.startswith("[") or not is_valid_host(host):
                raise PeerAllowlistError(
                    f"prefill_peers entry {entry!r} is not a CIDR, an IP address or a host name "
                    "(each with an optional :port)"
                )
            name = host.lower().rstrip(".")
            if port is None:
                names.add(name)
            else:
                name_ports.add((name, port))
        return cls(tuple(networks), frozenset(addresses), frozenset(names),
                   frozenset(name_ports))

    def allows(self, host: str, port: int) -> bool:
        """Whether ``host:port`` (as the params name it) may be dialed."""
        if self.empty:
            return True
        addr = ip_literal(host)
        if addr is not None:
            addr = _plain(addr)
            if (addr, port) in self.addresses:
                return True
            return any(addr.version == net.version and addr in net for net in self.networks)
        if not is_valid_host(host):
            return False
        name = host.lower().rstrip(".")
        return name in self.names or (name, port) in self.name_ports
