"""Every exception turbowire defines derives from TurboWireError, and the reason a failed load is
counted by comes from the exception's class, never from builtin types."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import turbowire
from turbowire.errors import INTERNAL, TurboWireError, failure_reason

PACKAGES = ["turbowire", "turbowire.codec", "turbowire.kernels", "turbowire.connector",
            "turbowire.bench_e2e"]
SKIP = {"turbowire.kernels.triton_codec"}  # needs triton's GPU backend at import


def all_modules() -> list[str]:
    names = set()
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        names.add(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            if not info.name.endswith(("_pb2", "_pb2_grpc")) and info.name not in SKIP:
                names.add(info.name)
    return sorted(names)


def test_every_exception_class_has_the_common_base():
    orphans = []
    for name in all_modules():
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (triton on CPU, ...)
            continue
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != name or not issubclass(cls, BaseException):
                continue
            if not issubclass(cls, TurboWireError):
                orphans.append(f"{name}.{cls_name}")
    assert not orphans, f"exceptions without TurboWireError: {orphans}"
    assert turbowire.__name__ == "turbowire"


@pytest.mark.parametrize("exc,reason", [
    ("turbowire.codec:ChecksumError", "checksum"),
    ("turbowire.codec:FormatError", "format"),
    ("turbowire.kernels:BlockIndexError", "bounds"),
    ("turbowire.connector.compat:IncompatiblePeerError", "incompatible"),
    ("turbowire.connector.sidechannel.client:PeerUnreachableError", "peer_unreachable"),
    ("turbowire.connector.sidechannel.client:SideChannelAuthError", "handshake"),
    ("turbowire.connector.transports.base:TransportError", "transport"),
    ("turbowire.connector.loader:LeaseRefusedError", "lease_refused"),
])
def test_reasons_come_from_the_class(exc, reason):
    module, name = exc.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert failure_reason(cls.__new__(cls)) == reason


def test_builtin_errors_are_internal():
    assert failure_reason(IndexError("a bug")) == INTERNAL
    assert failure_reason(KeyError("x")) == INTERNAL
