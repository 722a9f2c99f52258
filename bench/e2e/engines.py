"""Start and stop the two vLLM CPU engines and the proxy of one benchmark configuration.

The prefill engine runs in the root namespace, the decode engine inside the link's namespace
(``ip netns exec``); each is pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``), UCX is told to
use TCP over the veth end of its own side (``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES``), and each
engine's side channel listens on its own link address, so every KV byte crosses the shaped link.
Processes are started, health-checked and stopped (by process group) through
``turbowire.serving.launch``, the launcher of the demo and the e2e tests too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turbowire.bench_e2e.link import EmulatedLink
from turbowire.serving.launch import (  # one launcher, one EngineStartError for every caller
    EngineSpec,
    EngineStartError,
    ManagedProcess,
    ProcessGroup,
    free_port,
    proxy_command,
    spawn,
)

__all__ = [
    "ConnectorConfig", "EnginePair", "EngineSettings", "EngineStartError", "kv_transfer_config",
]


@dataclass(frozen=True)
class ConnectorConfig:
    """One connector configuration of the benchmark (a column of the result tables)."""

    label: str  # e.g. "nixl", "tw-raw", "tw-tq4"
    kind: str  # "nixl" or "turbowire"
    preset: str | None = None  # turbowire codec preset
    extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config keys

    def __post_init__(self) -> None:
        if self.kind not in ("nixl", "turbowire"):
            raise ValueError(f"kind must be 'nixl' or 'turbowire', got {self.kind!r}")
        if self.kind == "turbowire" and not self.preset:
            raise ValueError(f"turbowire config {self.label!r} needs a preset (e.g. 'raw', 'tq4')")

    @classmethod
    def parse(cls, spec: str) -> "ConnectorConfig":
        """``nixl`` or ``tw:<preset>`` (e.g. ``tw:raw``, ``tw:tq4``)."""
        if spec == "nixl":
            return cls("nixl", "nixl")
        if spec.startswith("tw:") and len(spec) > 3:
            return cls(f"tw-{spec[3:]}", "turbowire", preset=spec[3:])
        raise ValueError(f"connector spec must be 'nixl' or 'tw:<preset>', got {spec!r}")


@dataclass(frozen=True)
class EngineSettings:
    """Engine flags shared by both sides."""

    model: Path
    max_model_len: int = 8704
    block_size: int = 128  # vLLM's CPU default
    prefill_kvcache_gib: int = 4
    decode_kvcache_gib: int = 3
    prefill_prefix_caching: bool = True  # primed mode: the base prompts stay cached on P
    max_num_batched_tokens: int = 2048  # also the size of vLLM's start-up dummy run
    max_num_seqs: int = 8
    startup_timeout_s: float = 420.0

    def __post_init__(self) -> None:
        if self.block_size % 32:
            raise ValueError(
                f"vLLM's CPU attention needs block_size % 32 == 0, got {self.block_size}")
        if min(self.prefill_kvcache_gib, self.decode_kvcache_gib) < 1:
            raise ValueError("prefill_kvcache_gib and decode_kvcache_gib must be >= 1 (GiB)")


def kv_transfer_config(conn: ConnectorConfig, role: str, side_host: str, side_port: int,
                       ucx_dev: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of one engine (role: "prefill" or "decode")."""
    if conn.kind == "nixl":
        return {
            "kv_connector": "TimedNixlConnector",
            "kv_connector_module_path": "turbowire.bench_e2e.timed",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"backends": ["UCX"], **conn.extra},
        }
    # staging/receive pools sized for 4 concurrent 8k-token prompts even with preset "raw"
    extra: dict[str, Any] = {"preset": conn.preset, "side_channel_host": side_host,
                             "side_channel_port": side_port, "nixl_backends": ["UCX"],
                             "staging_bytes": "1280MiB", "recv_bytes": "1280MiB",
                             **conn.extra}
    return {
        "kv_connector": "TimedTurboWireConnector",
        "kv_connector_module_path": "turbowire.bench_e2e.timed",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": extra,
    }


@dataclass
class EnginePair:
    """Prefill engine + decode engine + proxy of one connector configuration, over one link."""

    link: EmulatedLink
    conn: ConnectorConfig
    settings: EngineSettings
    workdir: Path
    events_path: Path
    # the prefill engine and the proxy live in the root namespace, beside everything else on
    # the machine: their ports come from the allocator; the decode engine's namespace is its own
    prefill_port: int = field(default_factory=free_port)
    decode_port: int = 8200
    proxy_port: int = field(default_factory=free_port)
    prefill_nixl_side_port: int = field(default_factory=free_port)  # NixlConnector's
    prefill_side_port: int = field(default_factory=free_port)  # turbowire's
    decode_nixl_side_port: int = 5601
    decode_side_port: int = 5611
    group: ProcessGroup = field(default_factory=ProcessGroup)

    @property
    def prefill_url(self) -> str:
        return f"http://{self.link.config.root_addr}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{self.link.config.ns_addr}:{self.decode_port}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def engine_spec(self, role: str) -> EngineSpec:
        """The vLLM server of one side (role: "prefill" or "decode"), on its own link address."""
        c = self.link.config
        s = self.settings
        prefill = role == "prefill"
        host = c.root_addr if prefill else c.ns_addr
        dev = c.root_if if prefill else c.ns_if
        nixl_side = self.prefill_nixl_side_port if prefill else self.decode_nixl_side_port
        side_port = self.prefill_side_port if prefill else self.decode_side_port
        return EngineSpec(
            name=f"{role}-{self.conn.label}",
            model=s.model,
            host=host,
            port=self.prefill_port if prefill else self.decode_port,
            cpu=0 if prefill else 1,
            kv_transfer_config=kv_transfer_config(self.conn, role, host, side_port, dev),
            kvcache_gib=s.prefill_kvcache_gib if prefill else s.decode_kvcache_gib,
            block_size=s.block_size,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            served_model_name="bench",
            # P may keep prompts cached (primed mode); D never does, so every request is a full
            # KV transfer
            extra_args=["--enable-prefix-caching" if prefill and s.prefill_prefix_caching
                        else "--no-enable-prefix-caching"],
            env={
                "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": dev,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_side),
                "TW_BENCH_EVENTS": str(self.events_path), "TW_BENCH_ROLE": "P" if prefill else "D",
                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
            },
        )

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], url: str,
               log_name: str, label: str) -> ManagedProcess:
        # cwd: the caller's, as before the launcher was shared (--out, --model and the events
        # file may be relative paths)
        return self.group.add(spawn(name, cmd, env, self.workdir, url, label,
                                    log_name=log_name, cwd=Path.cwd()))

    def _engine(self, role: str) -> ManagedProcess:
        spec = self.engine_spec(role)
        cmd = spec.command() if role == "prefill" else self.link.netns_cmd(spec.command())
        return self._spawn(spec.name, cmd, spec.environment(), spec.url,
                           f"{self.conn.label}-{role}.log", f"{role} engine ({self.conn.label})")

    def start(self) -> None:
        """Start both engines (in parallel), wait until healthy, then the proxy."""
        try:
            p = self._engine("prefill")
            d = self._engine("decode")
            p.wait_healthy(self.settings.startup_timeout_s)
            d.wait_healthy(self.settings.startup_timeout_s)
            # turbowire's own P/D proxy (vLLM toy-proxy flow; per-request records)
            proxy = self._spawn(f"proxy-{self.conn.label}",
                                proxy_command([self.prefill_url], [self.decode_url],
                                              self.proxy_port, ["--expose-internals"]),
                                dict(os.environ), self.proxy_url,
                                f"{self.conn.label}-proxy.log", f"proxy ({self.conn.label})")
            proxy.wait_healthy(60.0)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.group.stop()

    def __enter__(self) -> "EnginePair":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metrics(self, role: str) -> str:
        """The engine's Prometheus text (connector stats included)."""
        url = self.prefill_url if role == "prefill" else self.decode_url
        return httpx.get(f"{url}/metrics", timeout=10.0).text
