"""What a bench process sets up before turbowire, torch or NIXL is imported.

The smoke switch (``TW_BENCH_SMOKE=1``: CPU tensors, Triton's interpreter, NIXL on DRAM) is read
here, at import. UCX reads its environment when the first agent starts, so each process applies
its case's ``UCX_*`` settings first. Where vLLM is missing (the GPU machine), vLLM's names come
from bench/gpu_path/stubs.py's stand-ins; NIXL is never stood in for: this bench moves bytes
with real agents. That is also why it does not import bench/gpu_path/rig.py, whose import
installs a registering-only NIXL stand-in: it builds on the same constructors (fakes.py).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

SMOKE = os.environ.get("TW_BENCH_SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

UCX_DEFAULT = "default"  # --ucx-tls value that leaves UCX_TLS unset (UCX picks its transports)


def ucx_environment(ucx_tls: str, proto_info: bool) -> dict[str, str]:
    """The ``UCX_*`` variables of a case (``ucx_tls``: a UCX_TLS list, or ``default``)."""
    env: dict[str, str] = {}
    if ucx_tls != UCX_DEFAULT:
        env["UCX_TLS"] = ucx_tls
    if proto_info:
        env["UCX_PROTO_INFO"] = "y"  # UCX prints the protocols it picks per endpoint
    return env


def log_to(log_dir: str, role: str, title: str) -> None:
    """This process's stdout and stderr (UCX's and NIXL's C-level output too) into
    ``<log_dir>/<role>.log``, appended."""
    path = os.path.join(log_dir, f"{role}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"=== {role}: {title}", flush=True)


def prepare_process(env: Mapping[str, str]) -> list[str]:
    """Apply ``env`` (a child process's first act), then install vLLM's stand-ins where vLLM is
    missing; returns the names stood in for."""
    os.environ.pop("UCX_TLS", None)  # a case without UCX_TLS runs UCX's default
    os.environ.update(env)
    try:
        import vllm  # noqa: F401
    except ImportError:
        from bench.gpu_path import stubs

        stubs.stub_vllm()
        return ["vllm"]
    return []


def nixl_api() -> ModuleType:
    """NIXL's Python API as the connector imports it (``nixl._api``); the error says how to
    get it onto a machine without a registry."""
    try:
        return importlib.import_module("nixl._api")
    except ImportError as exc:
        raise SystemExit(
            "NIXL is not importable (nixl._api). Install nixl and the nixl_cu12/nixl_cu13 "
            "variant matching this process's CUDA; on the GPU machine: unpack the nixl_cu13 "
            "wheel (without nixl_ep_cu13) and the nixl meta wheel into a folder on "
            f"PYTHONPATH (make bench-gpu-pipeline does it from .whl/): {exc}") from exc


def process_main(role: str, run: Callable[[Any, Any, Callable[[str, Any], None]], dict[str, Any]],
                 conn: Any, results: Any, case: Any) -> None:
    """A producer or consumer process: prepare its environment, ``run(conn, case, part)``, send
    the driver each finished phase (``part``) and the result; an error goes to the driver and to
    the peer (which would otherwise wait on ``conn`` until its time limit)."""
    log_to(case.log_dir, role, f"{case.model.name} {case.tokens} tokens, UCX_TLS={case.ucx_tls}")
    stand_ins = prepare_process(case.env)
    try:
        out = run(conn, case, lambda key, value: results.send(("part", key, value)))
        out["stand_ins"] = stand_ins
        results.send(("ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver and the peer
        text = f"{type(exc).__name__}: {exc}"
        print(traceback.format_exc(), flush=True)
        for c, msg in ((conn, ("error", text)), (results, ("error", text))):
            try:
                c.send(msg)
            except Exception:  # noqa: BLE001 - the other end may be gone already
                pass
