"""A real Prometheus server on loopback, for tests, benchmarks and plots.

Why: the recording rules and dashboard queries are only trustworthy when a real Prometheus has
scraped real ``/metrics`` and evaluated them. This starts Debian's ``prometheus`` binary with a
temporary config (our rules loaded), waits until it is ready and wraps its HTTP API::

    with LocalPrometheus({"vllm": ["127.0.0.1:8100", "127.0.0.1:8200"]},
                         rule_files=[RULES_PATH], scrape_interval_s=1.0) as prom:
        prom.wait_for_targets_up()
        value = prom.query_scalar("sum(turbowire:kv_compression_ratio:rate1m)")
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turbowire.serving.ports import free_port

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
RULES_PATH = REPO_ROOT / "deploy" / "prometheus" / "rules.yaml"


class PrometheusError(RuntimeError):
    """Prometheus could not be started, or its API answered with an error."""


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise PrometheusError(
            "the prometheus binary is not on PATH: install Debian's 'prometheus' package "
            "(`make setup` does it)"
        )
    return path


@dataclass
class Sample:
    """One series of an instant query result."""

    labels: dict[str, str]
    value: float


@dataclass
class LocalPrometheus:
    """A Prometheus process scraping ``targets`` (job name -> ["host:port", ...])."""

    targets: Mapping[str, Sequence[str]]
    rule_files: Sequence[Path] = field(default_factory=lambda: [RULES_PATH])
    scrape_interval_s: float = 1.0
    evaluation_interval_s: float = 1.0
    port: int = 0
    metrics_path: str = "/metrics"
    ready_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.scrape_interval_s <= 0 or self.evaluation_interval_s <= 0:
            raise ValueError("scrape_interval_s and evaluation_interval_s must be positive")
        for job, addrs in self.targets.items():
            if not job or not addrs:
                raise ValueError(f"job {job!r} needs a name and at least one host:port target")
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._client: httpx.Client | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def config_text(self) -> str:
        """prometheus.yml for these targets (YAML is a superset of the JSON-ish lines used)."""
        lines = [
            "global:",
            f"  scrape_interval: {self._dur(self.scrape_interval_s)}",
            f"  evaluation_interval: {self._dur(self.evaluation_interval_s)}",
            f"  scrape_timeout: {self._dur(min(self.scrape_interval_s, 10.0))}",
            "rule_files:",
            *[f"  - {str(Path(p).resolve())!r}" for p in self.rule_files],
            "scrape_configs:",
        ]
        for job, addrs in self.targets.items():
            lines += [
                f"  - job_name: {job!r}",
                f"    metrics_path: {self.metrics_path!r}",
                "    static_configs:",
                f"      - targets: [{', '.join(repr(a) for a in addrs)}]",
            ]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _dur(seconds: float) -> str:
        return f"{int(round(seconds * 1000))}ms"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalPrometheus:
        if self._proc is not None:
            raise PrometheusError("already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="tw-prom-")
        tmp = Path(self._tmp.name)
        (tmp / "prometheus.yml").write_text(self.config_text())
        if not self.port:
            self.port = free_port()
        cmd = [
            prometheus_binary(),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        self._log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop())
        self._proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp
        )
        self._client = httpx.Client(base_url=self.url, timeout=10.0)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("prometheus ready on %s (pid %d)", self.url, self._proc.pid)
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._client is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._proc.returncode}: {self.log_tail()}"
                )
            try:
                if self._client.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise PrometheusError(
            f"prometheus not ready after {self.ready_timeout_s}s: {self.log_tail()}"
        )

    def log_tail(self, nbytes: int = 4000) -> str:
        if self._tmp is None:
            return ""
        path = Path(self._tmp.name) / "prometheus.log"
        return path.read_bytes()[-nbytes:].decode(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop the process group we started and remove the data directory."""
        if self._proc is not None:
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGTERM)
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait(timeout=10)
            self._proc = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- API ----------------------------------------------------------------------------------
    def _api(self, path: str, params: Mapping[str, Any]) -> Any:
        if self._client is None:
            raise PrometheusError("prometheus is not running")
        resp = self._client.get(f"/api/v1/{path}", params=dict(params))
        try:
            body = resp.json()
        except ValueError as exc:
            raise PrometheusError(f"{path}: HTTP {resp.status_code}, not JSON") from exc
        if body.get("status") != "success":
            raise PrometheusError(
                f"{path} {dict(params)}: {body.get('errorType')}: {body.get('error')}"
            )
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """Instant query; raises ``PrometheusError`` when the expression does not parse."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self._api("query", params)
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise PrometheusError(f"unexpected result type {data['resultType']} for {expr}")
        return [Sample(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_scalar(self, expr: str) -> float | None:
        """The single value of ``expr``, or None if it returns nothing."""
        samples = self.query(expr)
        if len(samples) > 1:
            raise PrometheusError(f"{expr} returned {len(samples)} series; aggregate it")
        return samples[0].value if samples else None

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        data = self._api("query_range", {"query": expr, "start": start, "end": end, "step": step_s})
        return [
            (r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]
        ]

    def targets_health(self) -> dict[str, str]:
        """scrape URL -> health ("up", "down", "unknown")."""
        data = self._api("targets", {})
        return {t["scrapeUrl"]: t["health"] for t in data["activeTargets"]}

    def rule_health(self) -> dict[str, str]:
        """rule name -> health, for every loaded recording/alerting rule."""
        data = self._api("rules", {})
        return {r["name"]: r["health"] for g in data["groups"] for r in g["rules"]}

    def wait_for_targets_up(self, timeout_s: float = 30.0) -> None:
        """Wait until every configured target has been scraped successfully at least once."""
        expected = sum(len(a) for a in self.targets.values())

        def all_up() -> bool:
            health = self.targets_health()
            return len(health) == expected and all(h == "up" for h in health.values())

        self.wait_for(all_up, timeout_s, f"all {expected} targets up")

    def wait_for(
        self, probe: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5
    ) -> Any:
        """Poll ``probe`` until it returns something not None/False; return that."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            last = probe()
            if last not in (None, False):
                return last
            time.sleep(poll_s)
        raise PrometheusError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
