"""The ``turbowire`` LMCache serde through LMCache's real multi-process StorageManager (fs L2).

Chunks are written to L1, stored to the ``fs`` L2 adapter through the serde, evicted from L1 and
prefetched back (L2 load + deserialize), as the MP server does for an engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache.v1.distributed.storage_manager")

from lmcache.v1.distributed.api import (  # noqa: E402
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args  # noqa: E402
from lmcache.v1.distributed.serde import (  # noqa: E402
    create_serde_processor,
    get_registered_serde_types,
)
from lmcache.v1.distributed.serde.base import SerdeConfig  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.memory_management import (  # noqa: E402
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from turbowire.codec import ChecksumError, Codec, list_presets  # noqa: E402
from turbowire.integrations import lmcache_serde  # noqa: E402
from turbowire.integrations.lmcache_serde import (  # noqa: E402
    SerdeChecksumError,
    SerdeConfigError,
    SerdeFormatError,
    SerdeMismatchError,
    SerdeOptions,
    SerdeTruncatedError,
    TurboWireDeserializer,
    TurboWireSerializer,
    _TurboWireCodecs,
)

pytestmark = pytest.mark.integration

TOKENS = 256
MODEL = "org/model-tw"


# ---- helpers ------------------------------------------------------------------------------
def kv_layout(layers: int, heads: int, head_dim: int, dtype: torch.dtype,
              tokens: int = TOKENS) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(
        shapes=[torch.Size([2, layers, tokens, heads * head_dim])], dtypes=[dtype]
    )


def random_kv(layout: MemoryLayoutDesc, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = layout.shapes[0]
    kv = torch.randn(tuple(shape), generator=g) * 2
    kv[0] += torch.randn(shape[-1], generator=g) * 4  # key channel offsets, as real keys have
    return kv.to(layout.dtypes[0])


def make_keys(n: int, seed: int) -> list[ObjectKey]:
    g = torch.Generator().manual_seed(seed)
    return [
        ObjectKey(chunk_hash=bytes(torch.randint(0, 256, (16,), generator=g).tolist()),
                  model_name=MODEL, kv_rank=0)
        for _ in range(n)
    ]


def mem_obj(shape: torch.Size, dtype: torch.dtype) -> TensorMemoryObj:
    nbytes = shape.numel() * dtype.itemsize
    meta = MemoryObjMetadata(
        shape=shape, dtype=dtype, address=0, phy_size=nbytes, ref_count=1,
        fmt=MemoryFormat.KV_2LTD, shapes=[shape], dtypes=[dtype],
    )
    return TensorMemoryObj(torch.zeros(nbytes, dtype=torch.uint8), meta, None)


def reference(preset: str, kv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """What turbowire.codec itself gives back for a dense [2, L, T, hidden] chunk."""
    _, layers, tokens, hidden = kv.shape
    codec = Codec(preset, head_dim, layers)
    out = torch.empty_like(kv)
    for layer in range(layers):
        k = kv[0, layer].view(tokens, -1, head_dim)
        v = kv[1, layer].view(tokens, -1, head_dim)
        dk, dv = codec.decode(layer, codec.encode(layer, k, v))
        out[0, layer] = dk.reshape(tokens, hidden)
        out[1, layer] = dv.reshape(tokens, hidden)
    return out


class MP:
    """LMCache's in-process MP StorageManager with one fs L2 adapter using the turbowire serde."""

    def __init__(self, path: Path, serde: dict) -> None:
        self.path = path
        adapter = {"type": "fs", "base_path": str(path), "serde": {"type": "turbowire", **serde}}
        self.sm = StorageManager(parse_args([
            "--l1-size-gb", "0.5", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter),
        ]))

    def files(self) -> dict[str, Path]:
        return {p.name: p for p in self.path.glob("*.data")}

    def file_of(self, key: ObjectKey) -> Path:
        (path,) = [p for n, p in self.files().items() if key.chunk_hash.hex() in n]
        return path

    def store(self, keys: list[ObjectKey], kvs: list[torch.Tensor],
              layout: MemoryLayoutDesc) -> None:
        before = len(self.files())
        objs = self.sm.reserve_write(keys, layout)
        assert len(objs) == len(keys)
        for key, kv in zip(keys, kvs, strict=True):
            objs[key].tensor.copy_(kv)
        self.sm.finish_write(keys)
        deadline = time.monotonic() + 30
        while len(self.files()) < before + len(keys):  # fs writes a temp file, then renames
            assert time.monotonic() < deadline, "L2 store did not finish"
            time.sleep(0.02)
        # the file appears (rename) before the store thread drops its read lock on the L1
        # copy: a locked key is skipped, a deleted one is a no-op on the next call (idempotent)
        deleted = 0
        while True:
            gone, skipped = self.sm.delete_l1_keys(keys)
            deleted += gone
            if not skipped:
                break
            assert time.monotonic() < deadline, f"L1 copies still locked: {skipped}"
            time.sleep(0.02)
        assert deleted == len(keys)

    def load(self, keys: list[ObjectKey], layout: MemoryLayoutDesc
             ) -> tuple[list[bool], list[torch.Tensor | None]]:
        """Prefetch ``keys`` from L2 (nothing is in L1); hit flags and the loaded tensors."""
        spec = PrefetchTaskSpec(key_groups=[
            GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)
        ], fetching_policy="full")  # load every object found, not only a prefix
        handle = self.sm.submit_prefetch_task(spec)
        assert self.sm.wait_prefetch_status(handle, 60)
        result = self.sm.query_prefetch_status(handle)
        hits = [result.hit_cells[0].test(i) for i in range(len(keys))]
        assert [result.l2_hit_cells[0].test(i) for i in range(len(keys))] == hits
        hit_keys = [k for k, h in zip(keys, hits, strict=True) if h]
        out: list[torch.Tensor | None] = [None] * len(keys)
        if hit_keys:
            with self.sm.read_prefetched_results(hit_keys) as objs:
                assert objs is not None
                loaded = iter(o.tensor.clone() for o in objs)
                out = [next(loaded) if h else None for h in hits]
            self.sm.finish_read_prefetched(hit_keys)
            self.sm.delete_l1_keys(hit_keys)
        return hits, out

    def close(self) -> None:
        self.sm.close()


@pytest.fixture
def mp_factory(tmp_path):
    made: list[MP] = []

    def make(serde: dict, name: str = "l2") -> MP:
        path = tmp_path / name
        path.mkdir()
        made.append(MP(path, serde))
        return made[-1]

    yield make
    for mp in made:
        mp.close()


def estimate(serde: dict, layout: MemoryLayoutDesc) -> int:
    return create_serde_processor(SerdeConfig("turbowire", serde)).estimate_serialized_size(layout)


# ---- registration ---------------------------------------------------------------------------
def test_import_registers_the_serde_once():
    assert "turbowire" in get_registered_serde_types()
    assert lmcache_serde.register() is False  # idempotent: a second import or call is a no-op


def test_launcher_runs_the_lmcache_cli(capsys):
    with pytest.raises(SystemExit) as exit_info:
        lmcache_serde.main(["server", "--help"])
    assert exit_info.value.code == 0
    assert "--l2-adapter" in capsys.readouterr().out


# ---- (a) raw: bit-exact through L2 ----------------------------------------------------------
@pytest.mark.parametrize("layers,heads,head_dim,dtype,chunks", [
    (30, 3, 64, torch.bfloat16, 3),
    (4, 8, 128, torch.float16, 2),
])
def test_raw_roundtrip_is_bit_exact(mp_factory, layers, heads, head_dim, dtype, chunks):
    serde = {"preset": "raw", "head_dim": head_dim}
    mp = mp_factory(serde)
    layout = kv_layout(layers, heads, head_dim, dtype)
    keys = make_keys(chunks, seed=layers)
    kvs = [random_kv(layout, seed=i) for i in range(chunks)]
    mp.store(keys, kvs, layout)
    sizes = {p.stat().st_size for p in mp.files().values()}
    assert sizes == {estimate(serde, layout)}
    hits, got = mp.load(keys, layout)
    assert hits == [True] * chunks
    for kv, back in zip(kvs, got, strict=True):
        assert back.dtype == dtype and back.shape == kv.shape
        assert torch.equal(back.view(torch.int16), kv.view(torch.int16))


# ---- (b) tq4: equals the reference codec, files ~ dense / ratio ------------------------------
@pytest.mark.parametrize("layers,heads,head_dim,dtype,chunks", [
    (12, 3, 64, torch.bfloat16, 3),
    (4, 8, 128, torch.float16, 2),
])
def test_tq4_matches_the_reference_codec(mp_factory, layers, heads, head_dim, dtype, chunks):
    serde = {"preset": "tq4", "head_dim": head_dim, "max_workers": 2}
    mp = mp_factory(serde)
    layout = kv_layout(layers, heads, head_dim, dtype)
    keys = make_keys(chunks, seed=100 + layers)
    kvs = [random_kv(layout, seed=10 + i) for i in range(chunks)]
    mp.store(keys, kvs, layout)

    exact = estimate(serde, layout)
    dense = 2 * layers * TOKENS * heads * head_dim * dtype.itemsize
    codec = Codec("tq4", head_dim, layers)
    bpe = sum(codec.bits_per_element(layer, heads) for layer in range(layers)) / layers
    for path in mp.files().values():
        size = path.stat().st_size
        assert size == exact
        assert abs(size / (dense * bpe / 16) - 1) < 0.04  # the preset's ratio, sink row included
        assert size < 0.35 * dense

    hits, got = mp.load(keys, layout)
    assert hits == [True] * chunks
    for kv, back in zip(kvs, got, strict=True):
        ref = reference("tq4", kv, head_dim)
        assert back.dtype == dtype
        assert torch.equal(back.view(torch.int16), ref.view(torch.int16))
        assert not torch.equal(back, kv)  # lossy: it really went through the codec


# ---- (c) corrupt objects are misses, never wrong KV ------------------------------------------
def test_corrupt_or_misplaced_objects_are_refused(mp_factory):
    layers, heads, head_dim, dtype = 5, 3, 64, torch.bfloat16  # 5 layers: padding after the table
    serde = {"preset": "tq4", "head_dim": head_dim}
    mp = mp_factory(serde)
    layout = kv_layout(layers, heads, head_dim, dtype)
    keys = make_keys(3, seed=7)
    kvs = [random_kv(layout, seed=20 + i) for i in range(3)]
    refs = [reference("tq4", kv, head_dim) for kv in kvs]
    mp.store(keys, kvs, layout)
    victim = mp.file_of(keys[1])
    original = victim.read_bytes()
    size = len(original)
    chunk0 = 48 + ((4 * layers + 15) // 16) * 16  # the first chunk: after the table, 16-aligned
    assert 48 + 4 * layers < chunk0

    # Container header, size table, alignment padding, a chunk header, a chunk body, last byte.
    for pos in (2, 9, 30, 49, 48 + 4 * layers, chunk0 + 5, chunk0 + 48 + 100, size // 2, size - 1):
        broken = bytearray(original)
        broken[pos] ^= 0x10
        victim.write_bytes(bytes(broken))
        hits, got = mp.load(keys[1:2], layout)
        assert hits == [False] and got == [None], f"flipped byte {pos} was not refused"

    # A valid object of another key (a misplaced or renamed file) is refused too.
    victim.write_bytes(mp.file_of(keys[0]).read_bytes())
    assert mp.load(keys[1:2], layout) == ([False], [None])

    # One refused object fails its whole load batch (LMCache's serde wrapper is all-or-nothing);
    # whatever does load is right.
    victim.write_bytes(bytes(bytearray(original[:-1]) + bytes([original[-1] ^ 1])))
    hits, got = mp.load(keys, layout)
    assert not hits[1]
    for hit, back, ref in zip(hits, got, refs, strict=True):
        if hit:
            assert torch.equal(back.view(torch.int16), ref.view(torch.int16))

    # The refusal came from the damage alone: restored, every object loads.
    victim.write_bytes(original)
    hits, got = mp.load(keys, layout)
    assert hits == [True] * 3
    for back, ref in zip(got, refs, strict=True):
        assert torch.equal(back.view(torch.int16), ref.view(torch.int16))


# ---- (d) serialize emits exactly the estimate; the sync interface --------------------------
def sync_pair(preset: str, head_dim: int, **opts) -> tuple[TurboWireSerializer,
                                                           TurboWireDeserializer]:
    codecs = _TurboWireCodecs(SerdeOptions.from_kwargs(
        {"preset": preset, "head_dim": head_dim, **opts}))
    return TurboWireSerializer(codecs), TurboWireDeserializer(codecs)


def serialize(ser: TurboWireSerializer, kv: torch.Tensor, key: ObjectKey,
              layout: MemoryLayoutDesc) -> tuple[TensorMemoryObj, int]:
    src = mem_obj(kv.shape, kv.dtype)
    src.tensor.copy_(kv)
    size = ser.estimate_serialized_size(layout)
    dst = mem_obj(torch.Size([size]), torch.uint8)
    dst.tensor.fill_(0xAB)  # recycled buffers hold old bytes: every byte must be written
    return dst, ser.serialize(src, dst, key)


@pytest.mark.parametrize("preset", list_presets())
def test_serialized_size_is_the_estimate(preset):
    key = make_keys(1, seed=3)[0]
    for layers, heads, head_dim, tokens, dtype in [
        (5, 2, 64, 1, torch.bfloat16), (5, 2, 64, 17, torch.float16),
        (5, 2, 64, 255, torch.bfloat16), (5, 2, 64, 256, torch.bfloat16),
        (3, 1, 128, 100, torch.float16), (2, 2, 256, 33, torch.bfloat16),
    ]:
        ser, de = sync_pair(preset, head_dim)
        layout = kv_layout(layers, heads, head_dim, dtype, tokens)
        kv = random_kv(layout, seed=tokens)
        dst, n = serialize(ser, kv, key, layout)
        assert n == ser.estimate_serialized_size(layout) == dst.tensor.numel()
        out = mem_obj(kv.shape, dtype)
        de.deserialize(dst, out, key)
        assert torch.equal(out.tensor.view(torch.int16),
                           reference(preset, kv, head_dim).view(torch.int16))


def test_deserializer_refuses_what_is_not_its_object():
    layers, heads, head_dim = 3, 2, 64
    layout = kv_layout(layers, heads, head_dim, torch.bfloat16, 64)
    key, other_key = make_keys(2, seed=5)
    ser, de = sync_pair("tq4", head_dim)
    kv = random_kv(layout, seed=1)
    blob, n = serialize(ser, kv, key, layout)
    out = mem_obj(kv.shape, kv.dtype)
    out.tensor.fill_(7)
    untouched = out.tensor.clone()

    def refused(exc_type, src, dst=out, k=key, deser=de):
        with pytest.raises(exc_type):
            deser.deserialize(src, dst, k)
        assert torch.equal(dst.tensor, untouched)  # a refused object leaves the buffer as it was

    def mutated(pos: int, value: int) -> TensorMemoryObj:
        copy = mem_obj(torch.Size([n]), torch.uint8)
        copy.tensor.copy_(blob.tensor)
        copy.tensor[pos] = value
        return copy

    refused(SerdeFormatError, mutated(0, ord("X")))                 # magic
    refused(SerdeFormatError, mutated(4, 9))                        # version
    refused(SerdeChecksumError, mutated(8, layers + 1))             # header field
    refused(SerdeChecksumError, mutated(50, 1))                     # size table
    refused(SerdeFormatError, mutated(61, 1))                       # padding after it
    refused(ChecksumError, mutated(n - 1, int(blob.tensor[n - 1]) ^ 4))  # a chunk body
    refused(SerdeMismatchError, blob, k=other_key)                  # another key's object
    refused(SerdeMismatchError, blob, deser=sync_pair("tq3", head_dim)[1])  # another preset
    refused(SerdeMismatchError, blob, deser=sync_pair("tq4", head_dim, bind_key=False)[1])
    short = mem_obj(torch.Size([n - 16]), torch.uint8)
    short.tensor.copy_(blob.tensor[: n - 16])
    refused(SerdeTruncatedError, short)
    fp16 = mem_obj(kv.shape, torch.float16)
    with pytest.raises(SerdeFormatError):  # the dtype is not in the key: a bf16 object stays bf16
        de.deserialize(blob, fp16, key)
    de.deserialize(blob, out, key)
    assert torch.equal(out.tensor.view(torch.int16),
                       reference("tq4", kv, head_dim).view(torch.int16))


def test_bad_options_and_layouts_are_refused_clearly():
    for kwargs, words in [
        ({"preset": "tq4"}, "head_dim"),
        ({"preset": "tq4", "head_dim": 100}, "not supported"),  # no multiple of 8
        ({"preset": "tq9", "head_dim": 64}, "unknown preset"),
        ({"preset": "tq4", "head_dim": 64, "head-dim": 64}, "unknown turbowire serde option"),
        ({"preset": "tq4", "head_dim": "64"}, "integer"),
        ({"preset": "tq4", "head_dim": 64, "bind_key": "yes"}, "bind_key"),
    ]:
        with pytest.raises(SerdeConfigError, match=words):
            create_serde_processor(SerdeConfig("turbowire", kwargs))
    ser, _ = sync_pair("tq4", 128)
    for shapes, dtypes, words in [
        ([torch.Size([4, 256, 576])], [torch.bfloat16], "MLA"),          # MLA latent layout
        ([torch.Size([2, 4, 256, 192])], [torch.bfloat16], "multiple of head_dim"),
        ([torch.Size([2, 4, 256, 256])], [torch.float32], "dtype"),
        ([torch.Size([2, 4, 256, 256])] * 2, [torch.bfloat16] * 2, "one K/V group"),
    ]:
        with pytest.raises(SerdeConfigError, match=words):
            ser.estimate_serialized_size(MemoryLayoutDesc(shapes=shapes, dtypes=dtypes))


def test_reasons_are_metric_labels():
    from turbowire.errors import failure_reason

    assert failure_reason(SerdeChecksumError()) == "checksum"
    assert failure_reason(SerdeMismatchError()) == "incompatible"
    assert failure_reason(SerdeTruncatedError()) == "format"
    assert failure_reason(SerdeConfigError()) == "bad_params"
