"""E2E fixtures: real vLLM CPU engines with TurboWireConnector, pinned to separate cores, and the
real proxy. One P/D pair runs at a time (module scope: the raw-preset module, then the
compressed one), under the machine-wide engine lock; everything is stopped by process group."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from turbowire.models import ensure_tiny_llama
from turbowire.serving.launch import (
    EngineSpec,
    ManagedProcess,
    ProcessGroup,
    engine_lock,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)
from turbowire.serving.soak import metric_sum, scrape_metrics  # noqa: F401 (tests import them from here)

# proxies of these tests show their routes, records and load reports (hidden by default: the
# tenancy tests check that default with a proxy of their own)
os.environ.setdefault("TURBOWIRE_PROXY_EXPOSE_INTERNALS", "1")

BLOCK_SIZE = 32
VLLM_CPU_DEFAULT_BLOCK_SIZE = 128
MODEL_NAME = "tiny"



@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_llama()


@pytest.fixture(scope="session")
def engine_slot() -> Iterator[None]:
    """The whole e2e session holds the machine-wide engine lock (one engine workload at a time)."""
    with engine_lock():
        yield


@dataclass
class PDStack:
    preset: str
    prefill: ManagedProcess
    decode: ManagedProcess
    proxy: ManagedProcess
    staging_bytes: int
    prefill_side_port: int
    side_channel: dict = field(default_factory=dict)  # auth_token, side_channel_tls_* of the pair

    def pool_status(self):
        """The prefill engine's staging pool now, over its real side channel (with the pair's
        token and TLS material, as a peer engine calls it)."""
        from turbowire.connector.sidechannel.client import SideChannelClient
        from turbowire.connector.sidechannel.server import SideChannelTLS

        sc = self.side_channel
        tls = SideChannelTLS.from_files(sc.get("side_channel_tls_cert"),
                                        sc.get("side_channel_tls_key"),
                                        sc.get("side_channel_tls_ca"))
        client = SideChannelClient("127.0.0.1", self.prefill_side_port, sc.get("auth_token"),
                                   timeout=10, tls=tls)
        try:
            return client.pool_status()
        finally:
            client.close()

    def wait_pool_empty(self, timeout: float = 30.0):
        import time

        deadline = time.monotonic() + timeout
        while True:
            status = self.pool_status()
            if (status.used_slots == 0 and status.leases == 0) or time.monotonic() > deadline:
                return status
            time.sleep(0.2)

    def complete(self, url: str, prompt: str | list[int], max_tokens: int = 16, **kw) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, **kw}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300,
                       headers=kw.pop("headers", None) or {})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self, url: str) -> dict[str, float]:
        return scrape_metrics(url)


def start_stack(model: Path, preset: str, log_dir: Path, staging_bytes: int,
                extra: dict | None = None, block_size: int = BLOCK_SIZE,
                dtype: str = "bfloat16", env: dict[str, str] | None = None,
                extra_args: tuple[str, ...] = (),
                tp: tuple[int, int] = (1, 1),
                ) -> tuple[ProcessGroup, PDStack]:
    """A prefill engine (core 0, ``kv_producer``), a decode engine (core 1, ``kv_consumer``)
    and the proxy, warmed up: the roles of a normal P/D deployment. ``dtype``
    is the engines' ``--dtype``; ``env`` is added to both engines' environment, ``extra_args``
    to both command lines. ``tp``: the (prefill, decode) TP sizes; an engine of TP 2 spans both
    cores, one rank on each (vLLM CPU binds one rank per ``|``-separated core list)."""
    group = ProcessGroup()
    try:
        cfg = {"preset": preset, "staging_bytes": staging_bytes, "lease_seconds": 10,
               **(extra or {})}

        def spec(name: str, role: str, cpu: int, size: int) -> EngineSpec:
            ranks = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c % 2) for c in range(size))}
            return EngineSpec(
                name, model, free_port(), cpu=cpu,
                kv_transfer_config=turbowire_kv_config(role, side_channel_port=free_port(),
                                                       **cfg),
                kvcache_gib=1, block_size=block_size, max_model_len=2048, max_num_seqs=8,
                max_num_batched_tokens=1024, served_model_name=MODEL_NAME, dtype=dtype,
                env={**(env or {}), **(ranks if size > 1 else {})},
                extra_args=tuple(extra_args) + (
                    ("--tensor-parallel-size", str(size)) if size > 1 else ()))

        p = group.add(start_engine(spec("prefill", "kv_producer", 0, tp[0]), log_dir))
        d = group.add(start_engine(spec("decode", "kv_consumer", 1, tp[1]), log_dir))
        p.wait_healthy(900)
        d.wait_healthy(900)
        x = group.add(start_proxy([p.url], [d.url], free_port(), log_dir))
        x.wait_healthy(120)
        side_keys = ("auth_token", "side_channel_tls_cert", "side_channel_tls_key",
                     "side_channel_tls_ca")
        assert p.spec is not None and p.spec.side_channel_port is not None
        stack = PDStack(preset, p, d, x, staging_bytes, p.spec.side_channel_port,
                        {k: cfg[k] for k in side_keys if k in cfg})
        # Warm-up: handshake + NIXL connection before any timed or compared request.
        stack.complete(x.url, "warm up the connection please", max_tokens=2)
        return group, stack
    except BaseException:
        group.stop()
        raise
