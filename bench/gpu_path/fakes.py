"""Stand-ins for what a connector worker talks to (NIXL transfers and transport, a prefill
engine's side channel, an executor), a worker built the way vLLM builds one, its loader rebuilt on
those stand-ins, and the save and load requests the scheduler hands it: one set, for the GPU path
bench (rig.py) and the connector's tests, which take them through tests/support/fakes.py. They
live here because the bench cannot import tests/ (in the venv, cufile-python installs a
top-level ``tests`` package that shadows the repository's), while the tests import ``bench``.

Importing it loads neither vLLM nor NIXL (the functions that need vLLM's names import them), so
the bench installs its stand-ins for them (stubs.py) first whatever imports this module first,
and the tests get vLLM itself. Only turbowire's public names are used.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from turbowire.connector.sidechannel.client import PeerInfo
from turbowire.connector.sidechannel.convert import StagingInfo
from turbowire.connector.transports.base import TransferState, TransportError

if TYPE_CHECKING:
    from turbowire.connector.metadata import LoadRequest, PeerAddress, SaveRequest
    from turbowire.connector.worker import TurboWireWorker


class FakeTransfer:
    """A READ: PENDING until it lands (a test sets ``current``, or the transport lands it).
    ``nbytes``: given, or summed from the READ's local descriptors ``local`` when first asked,
    so that posting one costs the same whatever its size (the bench times the path, not this)."""

    def __init__(self, nbytes: int | None = None, local: Any = None, remote: Any = None) -> None:
        self._nbytes = nbytes
        self.local = local
        self.remote = remote  # the peer's (addr, len, dev) rows
        self.current = TransferState.PENDING
        self.released = False

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = int(self.local[:, 1].sum())
        return self._nbytes

    def state(self) -> TransferState:
        return self.current

    def release(self) -> None:
        self.released = True


@dataclass
class FakeTransport:
    """NIXL for one worker: registers buffers, adds the prefill peer, records its READs; they land
    when told (``land``, or a test sets a READ's ``current``), or when posted with
    ``auto_land``. Their bytes are wherever the test or bench put them."""

    name: str = "fake"
    agent_name: str = "decode-agent"
    reads: list[FakeTransfer] = field(default_factory=list)
    fail_read: bool = False
    auto_land: bool = False

    def register(self, tensor: torch.Tensor) -> None:
        pass

    def local_metadata(self) -> bytes:
        return b"md"

    def add_peer(self, metadata: bytes) -> str:
        return "prefill-agent"

    def remove_peer(self, name: str) -> None:
        pass

    def read(self, peer, local, remote, mem_type, notif=b""):
        assert peer == "prefill-agent" and len(local) == len(remote)
        if self.fail_read:
            raise TransportError("the peer vanished")
        x = FakeTransfer(local=local, remote=remote)
        if self.auto_land:
            x.current = TransferState.DONE
        self.reads.append(x)
        return x

    def land(self, start: int = 0, stop: int | None = None) -> None:
        """The READs ``reads[start:stop]`` land (all posted so far, by default)."""
        for x in self.reads[start:stop]:
            x.current = TransferState.DONE

    def close(self) -> None:
        pass


class FakeClient:
    """A prefill engine's side channel: hands out the staging ``layout``; leases in ``expired``
    are gone, those in ``refused`` are held but named with a token that is not theirs (the real
    pool answers both ``unknown``, the refused ones ``refused`` too), every other is granted."""

    def __init__(self, layout, record, engine_id: str = "prefill-engine",
                 mem_type: str = "DRAM") -> None:
        self.layout, self.record, self.engine_id, self.mem_type = layout, record, engine_id, \
            mem_type
        self.expired: set[str] = set()
        self.refused: set[str] = set()
        self.released: list[str] = []
        self.calls: list[str] = []
        self.tokens: list[tuple[str, list[str] | None]] = []  # (call, lease_tokens presented)

    def handshake(self, record, engine_id, tp_rank):
        self.calls.append("handshake")
        staging = StagingInfo("prefill-agent", b"md", 1 << 20, self.layout.slot_bytes,
                              self.layout.num_slots, tuple(self.layout.layer_offsets), 0,
                              self.mem_type, head_groups=self.layout.head_groups)
        return PeerInfo(self.engine_id, self.record, staging)

    def _reply(self, ids):
        refused = [i for i in ids if i in self.refused]
        return SimpleNamespace(done=[i for i in ids if i not in self.expired | self.refused],
                               unknown=[i for i in ids if i in self.expired] + refused,
                               refused=refused)

    def heartbeat(self, ids, engine_id="", lease_tokens=None, **claim):
        self.calls.append("heartbeat")
        self.tokens.append(("heartbeat", lease_tokens))
        return self._reply(ids)

    def release(self, ids, engine_id="", tp_rank=0, lease_tokens=None, tp_size=0):
        self.calls.append("release")
        self.tokens.append(("release", lease_tokens))
        self.released.extend(ids)
        return self._reply(ids)


class InlineExecutor:
    """Runs each call at once: the state machine then advances deterministically (and a side
    channel's network time is not the path's)."""

    def submit(self, fn, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            f.set_exception(exc)
        return f


# ---- a worker, as vLLM builds one -----------------------------------------------------------
def stand_in_configs(extra: dict[str, Any], layer_names: list[str], *, block_size: int,
                     num_kv_heads: int, head_size: int, num_blocks: int, engine_id: str,
                     kv_role: str = "kv_both", dtype: torch.dtype = torch.bfloat16,
                     forward_context: dict[str, Any] | None = None,
                     sliding: tuple[str, ...] = (), state: tuple[str, ...] = (),
                     mla_rope_dim: int = 0, tp_size: int = 1):
    """(vllm_config, kv_cache_config) as vLLM hands them to a connector: the parts it reads.
    ``forward_context``: vLLM's attention layers by name (an fp8 cache's k/v scales).
    ``sliding``: layers in a second KV cache group of sliding-window layers (a window of two
    blocks), as vLLM's hybrid KV cache manager groups them. ``state``: Mamba / gated-delta-net
    layers in a group of their own (``STATE_SHAPES``, vLLM's mamba cache mode 'align').
    ``mla_rope_dim``: an MLA model (DeepSeek V2/V3): the attention group is an
    ``MLAAttentionSpec`` of rows ``head_size`` wide, the last ``mla_rope_dim`` the RoPE part.
    ``tp_size``: the engine's TP size (``num_kv_heads`` are one rank's)."""
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    ktc = KVTransferConfig(kv_connector="TurboWireConnector", kv_role=kv_role,
                           kv_connector_extra_config=extra, engine_id=engine_id)
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, data_parallel_index=0),
        model_config=SimpleNamespace(
            model="/m/tiny", served_model_name="tiny", use_mla=bool(mla_rope_dim),
            hf_text_config=SimpleNamespace(qk_rope_head_dim=mla_rope_dim)),
        speculative_config=None,
        compilation_config=SimpleNamespace(static_forward_context=forward_context or {}))
    spec: Any = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                                  head_size=head_size, dtype=dtype)
    if mla_rope_dim:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size,
                                dtype=dtype, cache_dtype_str="auto")
    groups = [KVCacheGroupSpec([n for n in layer_names if n not in sliding + state], spec)]
    if sliding:
        groups.append(KVCacheGroupSpec(list(sliding), SlidingWindowSpec(
            block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
            sliding_window=2 * block_size)))
    if state:
        groups.append(KVCacheGroupSpec(list(state), MambaSpec(
            block_size=block_size, shapes=STATE_SHAPES, dtypes=STATE_DTYPES,
            mamba_cache_mode="align")))
    kcfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return vcfg, kcfg


# a small gated-delta-net layer's state: a bf16 conv state and an fp32 recurrent state
STATE_SHAPES = ((3, 64), (2, 16, 16))
STATE_DTYPES = (torch.bfloat16, torch.float32)
STATE_BYTES = 3 * 64 * 2 + 2 * 16 * 16 * 4


def build_worker(extra: dict[str, Any], layer_names: list[str], *, engine_id: str,
                 **shape: Any) -> TurboWireWorker:
    """A TurboWireWorker from ``stand_in_configs`` (``shape``: their keyword arguments), through
    its own constructor, as vLLM builds one."""
    from turbowire.connector.config import TurboWireConfig
    from turbowire.connector.worker import TurboWireWorker

    vcfg, kcfg = stand_in_configs(extra, layer_names, engine_id=engine_id, **shape)
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    return TurboWireWorker(vcfg, kcfg, cfg, engine_id)


def attach_loader(worker: TurboWireWorker, client: Any,
                  transport: FakeTransport | None = None) -> FakeTransport:
    """Replace ``worker``'s loader by one built through ``KVLoader``'s constructor: it READs
    through ``transport`` (a new ``FakeTransport`` unless given), talks to ``client`` for every
    peer and makes its side-channel calls inline; the decode and its preparation are the
    worker's coder's. Returns the transport."""
    from turbowire.connector.loader import KVLoader, LocalEnd

    w = worker
    assert w.caches is not None and w.recv is not None and w.recv_ranges is not None
    assert w.coder is not None
    if w.loader is not None:
        w.loader.close()
    wire = transport if transport is not None else FakeTransport()
    local = LocalEnd(w.engine_id, w.tp_rank, w.record, w.mem_type, w.recv.data_ptr(),
                     max(w.caches.device.index or 0, 0), w.caches.num_blocks,
                     w.caches.dense_bytes_per_token(), w.record.tp_size)
    w.loader = KVLoader(w.config, w.geometry, w.layout, w.chunk_nbytes, local, wire,
                        SimpleNamespace(get=lambda host, port: client, close=lambda: None),
                        w.recv_ranges, w.coder.decode, InlineExecutor(), w.stats,
                        prepare=w.coder.prepare_load)
    return wire


# ---- the requests the scheduler hands a worker ----------------------------------------------
def save_request(rid: str, block_ids: list[int], num_tokens: int, block_size: int, *,
                 slot0: int = 0, first: int = 0) -> SaveRequest:
    """The save of request ``rid``'s ``num_tokens`` tokens in ``block_ids``: its blocks from
    ``first`` on (those before are vLLM's prefix-cache hits), block i into staging slot
    ``slot0 + i``, tagged as the scheduler tags them."""
    from turbowire.connector.geometry import block_tag
    from turbowire.connector.metadata import SaveBlock, SaveRequest

    n = -(-num_tokens // block_size)
    blocks = [SaveBlock(i, block_ids[i], min(block_size, num_tokens - i * block_size), slot0 + i,
                        block_tag(rid, i)) for i in range(first, n)]
    return SaveRequest(rid, list(block_ids), blocks)


def load_request(rid: str, save: SaveRequest, block_ids: list[int], preset: str,
                 peer: PeerAddress | None = None) -> LoadRequest:
    """The load, as request ``rid`` into ``block_ids`` (block i into ``block_ids[i]``), of what
    ``save`` staged on ``peer`` (the prefill engine "prefill" at 127.0.0.1 unless given)."""
    from turbowire.connector.metadata import LoadBlock, LoadRequest, PeerAddress

    blocks = [LoadBlock(b.index, block_ids[b.index], b.num_tokens, b.slot, b.tag)
              for b in save.blocks]
    return LoadRequest(rid, save.request_id, peer or PeerAddress("prefill", "127.0.0.1", 1, 1),
                       blocks, preset, list(block_ids))
