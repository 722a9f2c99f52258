"""The store path's batched save (the CUDA coder's ``encode_chunks``, the CUDA engines' path:
every chunk of a step in one plan, stored by a background thread) writes the same blobs as the
host coder's chunk-by-chunk path, here on CPU under Triton's interpreter (forced; inline, no
streams)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by tests/conftest.py

import hashlib  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402

from turbowire.codec import Codec  # noqa: E402
from turbowire.connector.coder import make_coder  # noqa: E402
from turbowire.connector.config import TurboWireConfig  # noqa: E402
from turbowire.connector.geometry import KVGeometry, LayerSpec  # noqa: E402
from turbowire.connector.metadata import StoreChunk, StoreSave  # noqa: E402
from turbowire.connector.stats import TurboWireConnectorStats  # noqa: E402
from turbowire.connector.store_worker import StoreWorker  # noqa: E402
from turbowire.kernels import PagedKVLayout  # noqa: E402
from turbowire.store.keys import StoreScope  # noqa: E402

BS, CHUNK, LAYERS, HEADS, DIM, NB = 16, 32, 2, 1, 64, 16


class MemoryStore:
    def __init__(self) -> None:
        self.blobs: dict[tuple[bytes, int], bytes] = {}
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def put(self, scope, chunk_hash, rank, blob, on_done=None) -> bool:
        with self.lock:
            self.blobs[(chunk_hash, rank)] = bytes(blob)
            self.threads.add(threading.current_thread().name)
        if on_done is not None:
            on_done(True, None)
        return True

    def close(self) -> None:
        pass


class Caches:
    """vLLM's GPU cache layout [2, blocks, block_size, heads, head_dim] per layer, on CPU."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        self.tensors = [(torch.randn(2, NB, BS, HEADS, DIM, generator=g) * 2).to(torch.bfloat16)
                        for _ in range(LAYERS)]
        self.layouts = [PagedKVLayout.from_cache(t, head_dim=DIM) for t in self.tensors]
        self.device = torch.device("cpu")

    def dense_bytes_per_token(self) -> int:
        return LAYERS * 2 * HEADS * DIM * 2

    def kv_scales(self, layer: int):
        return None


def test_batched_store_save_writes_the_chunk_by_chunk_blobs():
    caches = Caches()
    geometry = KVGeometry(tuple(LayerSpec(f"l.{i}", HEADS, DIM) for i in range(LAYERS)), BS,
                          "bfloat16")
    cfg = TurboWireConfig(transport="store", store_local_cpu_bytes=1 << 20,
                          store_chunk_tokens=CHUNK, preset="tq4")
    scope = StoreScope("test", "tiny", "tq4", 1, CHUNK, 1)
    saves = [StoreSave("r", [5, 2, 9, 11, 0, 3],
                       [StoreChunk(t, hashlib.sha256(str(t).encode()).digest()[:16])
                        for t in (0, 2 * CHUNK)]),
             StoreSave("s", [7, 1], [StoreChunk(0, hashlib.sha256(b"s").digest()[:16])])]
    blobs = []
    for batched in (True, False):
        store = MemoryStore()
        codec = Codec("tq4", DIM, LAYERS)
        # the CUDA coder is what CUDA caches get (kernels under the interpreter here)
        coder = make_coder(codec, geometry, caches, kind="cuda" if batched else "host")
        w = StoreWorker(cfg, geometry, codec, scope, 0, caches, TurboWireConnectorStats(),
                        store=store, directory=None, coder=coder)
        w.save(saves)
        w.close()  # waits for the background stores
        blobs.append(store.blobs)
        if batched:
            assert store.threads and all(t.startswith("tw-store-d2h") for t in store.threads)
    assert len(blobs[0]) == 3 and blobs[0] == blobs[1]
