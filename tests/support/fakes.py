"""The connector tests' fakes: stand-ins for what a worker talks to, a worker built the way vLLM
builds one, its loader rebuilt on the stand-ins, and the save and load requests it gets. They are
the GPU path bench's (bench/gpu_path/fakes.py: one set; the bench cannot import tests/); here is
what only the tests add: the worker's transport swapped through pytest's monkeypatch, and the CUDA
coder forced on CPU caches."""

from __future__ import annotations

from typing import Any

from bench.gpu_path.fakes import (
    FakeClient,
    FakeTransfer,
    FakeTransport,
    InlineExecutor,
    attach_loader,
    build_worker,
    load_request,
    save_request,
    stand_in_configs,
)

__all__ = [
    "FakeClient",
    "FakeTransfer",
    "FakeTransport",
    "InlineExecutor",
    "attach_loader",
    "build_worker",
    "load_request",
    "make_worker",
    "save_request",
    "stand_in_configs",
    "use_cuda_coder",
]


def make_worker(monkeypatch, extra: dict[str, Any], layer_names: list[str], *, engine_id: str,
                transport: Any = None, **shape: Any):
    """``build_worker``'s worker with its NIXL transport replaced by ``transport`` (a
    ``FakeTransport`` unless given)."""
    from turbowire.connector import worker as worker_mod

    wire = transport if transport is not None else FakeTransport()
    monkeypatch.setattr(worker_mod, "make_transport", lambda config, name: wire)
    return build_worker(extra, layer_names, engine_id=engine_id, **shape)


def use_cuda_coder(worker, kernel_config: Any = "auto") -> Any:
    """Give a worker with CPU caches the CUDA coder (Triton's interpreter: the same plans,
    launched inline without streams), where its loader and store path reach it too."""
    coder = worker.make_coder("cuda", kernel_config=kernel_config)
    worker.coder = coder
    if worker.loader is not None:
        worker.loader.decode = coder.decode
        worker.loader.prepare = coder.prepare_load
    if worker.store is not None:
        worker.store.coder = coder
    return coder
