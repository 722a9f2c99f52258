"""Start, watch and stop vLLM engines and the proxy: the one launcher of the demo, the e2e tests and
the benchmarks (``bench/metrics_run.py``, ``turbowire.bench_e2e.engines``).

Each process gets its own process group, so stopping kills every child it spawned, and stays in
the launcher's session. With a session per engine (Linux schedules each session as one group,
"autogroup"), the ranks of a TP > 1 engine, which busy-wait with ``sched_yield`` while a request
waits for its KV, starved the other engine's threads for 30 s to minutes on a 2-core machine; in
one session no such stall was seen. Engines are pinned to their own core
(``VLLM_CPU_OMP_THREADS_BIND``) with a small KV cache (``VLLM_CPU_KVCACHE_SPACE``); a machine-wide
``flock`` serializes engine workloads of people sharing a machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turbowire.engine_log import find_root_cause, log_tail
from turbowire.errors import TurboWireError
from turbowire.serving.ports import free_port  # noqa: F401 (the launchers' callers take it from here)

logger = logging.getLogger(__name__)

ENGINE_LOCK = Path("/tmp/tw-engine.lock")
HTTP_GUARD = "turbowire.connector.http_guard.TransferParamsGuard"


class EngineStartError(TurboWireError, RuntimeError):
    """A process did not become healthy.

    The message leads with the root cause found in its log (vLLM's last lines only say "see root
    cause above") and the log's path, then a short tail for context. One class for the demo, the
    e2e tests and the e2e benchmark (``turbowire.bench_e2e.engines`` re-exports it).
    """

    def __init__(
        self,
        label: str,
        reason: str,
        *,
        log_path: Path | None = None,
        root_cause: str | None = None,
        tail: str = "",
    ) -> None:
        self.label = label  # "prefill engine", "proxy", ...
        self.what = reason  # "exited with code 1", "not healthy after 600 s"
        self.log_path = log_path
        self.root_cause = root_cause
        self.tail = tail
        message = self.summary()
        if tail:
            message += f"\nlast {len(tail.splitlines())} lines of the log:\n{tail}"
        super().__init__(message)

    @classmethod
    def from_log(
        cls, label: str, reason: str, log_path: Path, tail_lines: int = 15
    ) -> EngineStartError:
        """Read ``log_path`` for the root cause and the tail (a longer tail when no cause)."""
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            text = ""
        cause = find_root_cause(text)
        tail = log_tail(text, tail_lines if cause else max(tail_lines, 40)) if text else "(no log)"
        return cls(label, reason, log_path=log_path, root_cause=cause, tail=tail)

    def summary(self) -> str:
        """Cause, log path and reason, without the tail (for one-line reports and the CLI)."""
        if self.root_cause:
            head = f"{self.label} failed to start: {self.root_cause}"
        else:
            head = f"{self.label} failed to start ({self.what}); no error line found in its log"
        lines = [head]
        if self.log_path is not None:
            lines.append(f"  full log: {self.log_path}")
        if self.root_cause:
            lines.append(f"  ({self.what})")
        return "\n".join(lines)


@contextlib.contextmanager
def engine_lock(path: Path = ENGINE_LOCK, wait_log_s: float = 5.0) -> Iterator[None]:
    """Hold the machine-wide engine lock (same file as ``flock /tmp/tw-engine.lock``)."""
    if os.environ.get("TW_ENGINE_LOCK_HELD") == "1":  # already inside `flock` (make demo)
        yield
        return
    with open(path, "a+") as fh:
        t0 = time.monotonic()
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for %s (another engine workload is running)", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
            logger.info("got %s after %.0f s", path, time.monotonic() - t0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def turbowire_kv_config(
    role: str = "kv_both", connector_module: str = "turbowire.connector", **extra: Any
) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for TurboWireConnector with these extra-config keys."""
    return {
        "kv_connector": "TurboWireConnector",
        "kv_connector_module_path": connector_module,
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


@dataclass
class EngineSpec:
    """One vLLM OpenAI server (on localhost unless ``host`` says otherwise)."""

    name: str
    model: Path
    port: int
    cpu: int | None
    host: str = "127.0.0.1"
    kv_transfer_config: dict[str, Any] | None = None
    dtype: str = "bfloat16"  # the model's (and so the KV cache's) dtype: vLLM's --dtype
    kvcache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    served_model_name: str | None = None
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype,
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--enforce-eager",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config),
                    # transfer params smuggled in vllm_xargs get a 400 (connector/http_guard.py)
                    "--middleware", HTTP_GUARD]
        cmd += list(self.extra_args)
        return cmd

    @property
    def side_channel_port(self) -> int | None:
        """The turbowire side-channel port in its ``--kv-transfer-config``, if any."""
        extra = (self.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        port = extra.get("side_channel_port")
        return int(port) if port is not None else None

    def take_fresh_ports(self) -> None:
        """Move the HTTP port and the side-channel port (if set) to newly reserved ones."""
        self.port = free_port()
        extra = (self.kv_transfer_config or {}).get("kv_connector_extra_config")
        if extra is not None and extra.get("side_channel_port") is not None:
            extra["side_channel_port"] = free_port()

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_KVCACHE_SPACE": str(int(self.kvcache_gib)),
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu) if self.cpu is not None else "all",
            }
        )
        env.update(self.env)
        return env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


#: What a server prints when another process holds its port (uvicorn's errno 98, the side
#: channel's own message, redis-server's).
PORT_CLASH_RE = re.compile(r"address already in use|the port is in use|\[Errno 98\]", re.I)

Relaunch = Callable[[], tuple[list[str], dict[str, str], str]]
"""Moves a process to fresh ports: returns its new command, environment and URL."""


@dataclass
class ManagedProcess:
    """A child in its own process group, logging to a file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    url: str
    label: str = ""  # for messages: "prefill engine", "proxy"; default: name
    cwd: Path | None = None
    #: called once if the process dies because a port it was given is taken: the launcher
    #: starts it again on fresh ports (the spec behind it is updated in place)
    on_port_clash: Relaunch | None = None
    spec: EngineSpec | None = None  # the engine's spec (ports as finally used), None for others

    def start_error(self, reason: str) -> EngineStartError:
        """An EngineStartError with this process's root cause, log path and log tail."""
        return EngineStartError.from_log(self.label or self.name, reason, self.log_path)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_healthy(self, timeout: float, path: str = "/health") -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                if self._relaunch_after_port_clash():
                    continue
                raise self.start_error(f"exited with code {self.popen.returncode} while starting")
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise self.start_error(f"not healthy at {self.url}{path} after {timeout:.0f} s")

    def _relaunch_after_port_clash(self) -> bool:
        """Start a process that died on a taken port again on fresh ports, once, saying so."""
        if self.on_port_clash is None or not PORT_CLASH_RE.search(self.log_text()):
            return False
        relaunch, self.on_port_clash = self.on_port_clash, None
        self.stop()
        old_url = self.url
        cmd, env, self.url = relaunch()
        with contextlib.suppress(OSError):
            self.log_path.replace(self.log_path.with_name(self.log_path.name + ".port-clash"))
        logger.warning("%s could not bind its port at %s (in use): retrying once at %s",
                       self.label or self.name, old_url, self.url)
        self.popen = _popen(cmd, env, self.log_path, self.cwd)
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL it if it lingers."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0f s: SIGKILL", self.name, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # stragglers in the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


def spawn(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    log_dir: Path,
    url: str,
    label: str = "",
    *,
    log_name: str | None = None,
    cwd: Path | None = None,
) -> ManagedProcess:
    """Start ``cmd`` in its own process group (the launcher's session, above), stdout and stderr to
    ``log_dir/<log_name>``.

    ``log_name`` defaults to ``<name>.log``. ``cwd`` defaults to ``log_dir``: not the repository
    root, whose top-level folders (kernels/, codec/) would shadow PyPI packages of the same name
    (transformers probes ``import kernels``); a caller whose command or environment holds paths
    relative to its own working directory passes ``cwd=Path.cwd()``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (log_name or f"{name}.log")
    cwd = log_dir if cwd is None else cwd
    popen = _popen(cmd, env, log_path, cwd)
    logger.info("started %s (pid %d), log %s", name, popen.pid, log_path)
    logger.debug("%s: %s", name, " ".join(cmd))
    return ManagedProcess(name, popen, log_path, url, label, cwd=cwd)


def _popen(cmd: list[str], env: dict[str, str], log_path: Path,
           cwd: Path | None) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            process_group=0,
            cwd=None if cwd is None else str(cwd),
        )


def start_engine(spec: EngineSpec, log_dir: Path, *, fresh_ports_on_clash: bool = True,
                 ) -> ManagedProcess:
    """Start a vLLM server for ``spec``. If it dies because a port it was given is taken (another
    program bound it first), :meth:`ManagedProcess.wait_healthy` moves ``spec`` to fresh ports
    and starts it once more; ``fresh_ports_on_clash=False`` for a restart that must keep its
    ports (peers know them)."""
    proc = spawn(
        spec.name, spec.command(), spec.environment(), log_dir, spec.url, f"{spec.name} engine"
    )
    proc.spec = spec

    def relaunch() -> tuple[list[str], dict[str, str], str]:
        spec.take_fresh_ports()
        return spec.command(), spec.environment(), spec.url

    if fresh_ports_on_clash:
        proc.on_port_clash = relaunch
    return proc


def proxy_command(prefill_urls: Sequence[str], decode_urls: Sequence[str], port: int,
                  extra_args: Sequence[str] = ()) -> list[str]:
    """``turbowire proxy`` on 127.0.0.1:``port`` in front of these engines (``extra_args``: e.g.
    ``--directory redis://...`` for cache-aware routing)."""
    cmd = [sys.executable, "-m", "turbowire.cli", "proxy", "--port", str(port)]
    for url in prefill_urls:
        cmd += ["--prefill", url]
    for url in decode_urls:
        cmd += ["--decode", url]
    return cmd + list(extra_args)


def start_proxy(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], port: int, log_dir: Path,
    extra_args: Sequence[str] = (),
) -> ManagedProcess:
    cmd = proxy_command(prefill_urls, decode_urls, port, extra_args)
    proc = spawn("proxy", cmd, dict(os.environ), log_dir, f"http://127.0.0.1:{port}")

    def relaunch() -> tuple[list[str], dict[str, str], str]:
        fresh = free_port()
        return (proxy_command(prefill_urls, decode_urls, fresh, extra_args), dict(os.environ),
                f"http://127.0.0.1:{fresh}")

    proc.on_port_clash = relaunch
    return proc


class ProcessGroup:
    """Several managed processes stopped together (reverse start order)."""

    def __init__(self) -> None:
        self.procs: list[ManagedProcess] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
