"""gRPC side channel between engines: handshake (compatibility, NIXL metadata, staging geometry)
and lease release/heartbeat. Protobuf only on the wire; nothing is unpickled."""

from turbowire.connector.sidechannel.convert import (
    StagingInfo,
    record_from_proto,
    record_to_proto,
)

__all__ = ["StagingInfo", "record_from_proto", "record_to_proto"]
