from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompatibilityRecord(_message.Message):
    __slots__ = ("model", "num_layers", "num_draft_layers", "kv_heads", "head_dim", "block_size", "dtype", "preset", "format_version", "codec_format_version", "tp_size", "speculative_config", "weights", "model_kv_heads", "rope_dim")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_draft_layers: int
    kv_heads: _containers.RepeatedScalarFieldContainer[int]
    head_dim: int
    block_size: int
    dtype: str
    preset: str
    format_version: int
    codec_format_version: int
    tp_size: int
    speculative_config: str
    weights: str
    model_kv_heads: _containers.RepeatedScalarFieldContainer[int]
    rope_dim: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_draft_layers: _Optional[int] = ..., kv_heads: _Optional[_Iterable[int]] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., preset: _Optional[str] = ..., format_version: _Optional[int] = ..., codec_format_version: _Optional[int] = ..., tp_size: _Optional[int] = ..., speculative_config: _Optional[str] = ..., weights: _Optional[str] = ..., model_kv_heads: _Optional[_Iterable[int]] = ..., rope_dim: _Optional[int] = ...) -> None: ...

class StagingGeometry(_message.Message):
    __slots__ = ("base_addr", "slot_bytes", "num_slots", "layer_offsets", "device_id", "mem_type", "head_groups")
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYER_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_GROUPS_FIELD_NUMBER: _ClassVar[int]
    base_addr: int
    slot_bytes: int
    num_slots: int
    layer_offsets: _containers.RepeatedScalarFieldContainer[int]
    device_id: int
    mem_type: str
    head_groups: int
    def __init__(self, base_addr: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., layer_offsets: _Optional[_Iterable[int]] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ..., head_groups: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("record", "engine_id", "tp_rank")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    record: CompatibilityRecord
    engine_id: str
    tp_rank: int
    def __init__(self, record: _Optional[_Union[CompatibilityRecord, _Mapping]] = ..., engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "record", "agent_metadata", "agent_name", "staging")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    record: CompatibilityRecord
    agent_metadata: bytes
    agent_name: str
    staging: StagingGeometry
    def __init__(self, engine_id: _Optional[str] = ..., record: _Optional[_Union[CompatibilityRecord, _Mapping]] = ..., agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., staging: _Optional[_Union[StagingGeometry, _Mapping]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("request_ids", "engine_id", "tp_rank", "lease_tokens", "prompt_digests", "prompt_tokens", "tp_size")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    engine_id: str
    tp_rank: int
    lease_tokens: _containers.RepeatedScalarFieldContainer[str]
    prompt_digests: _containers.RepeatedScalarFieldContainer[str]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., lease_tokens: _Optional[_Iterable[str]] = ..., prompt_digests: _Optional[_Iterable[str]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("done", "unknown", "refused", "prompt_mismatch")
    DONE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    done: _containers.RepeatedScalarFieldContainer[str]
    unknown: _containers.RepeatedScalarFieldContainer[str]
    refused: _containers.RepeatedScalarFieldContainer[str]
    prompt_mismatch: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, done: _Optional[_Iterable[str]] = ..., unknown: _Optional[_Iterable[str]] = ..., refused: _Optional[_Iterable[str]] = ..., prompt_mismatch: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatusReply(_message.Message):
    __slots__ = ("capacity_slots", "used_slots", "leases", "reserved_requests", "slot_bytes")
    CAPACITY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    capacity_slots: int
    used_slots: int
    leases: int
    reserved_requests: int
    slot_bytes: int
    def __init__(self, capacity_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., leases: _Optional[int] = ..., reserved_requests: _Optional[int] = ..., slot_bytes: _Optional[int] = ...) -> None: ...
