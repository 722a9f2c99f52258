"""A case (one process pair's work) and what the driver makes of its two results. Imports
neither torch nor turbowire: the driver process builds cases and tables only."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bench.gpu_pipeline import report
from bench.gpu_pipeline.models import BLOCK, MODELS, Model


@dataclass(frozen=True)
class Case:
    """A geometry and a request length, the paths to run, the UCX settings."""

    model: Model
    tokens: int
    presets: tuple[str, ...]
    devices: tuple[int, int]  # producer, consumer (CUDA indices; CPU in the smoke mode)
    ucx_tls: str
    env: dict[str, str]
    warmup: int
    iters: int
    anchors: tuple[str, ...]  # "a" (NixlConnector-style), "b" (contiguous)
    contig_descs: tuple[int, ...]
    check_layers: tuple[int, ...]
    groups: int  # decode_pipeline_groups
    progress_delay_us: int
    timeout_s: float  # a load or READ
    case_timeout_s: float  # the whole pair
    log_dir: str

    @property
    def num_blocks(self) -> int:
        """Blocks of the request."""
        return -(-self.tokens // BLOCK)

    @property
    def cache_blocks(self) -> int:
        return self.num_blocks + 64

    @property
    def rounds(self) -> int:
        return self.warmup + self.iters

    @property
    def model_id(self) -> str:
        """The --models name (8b, 70b), or the model's name (the smoke model's)."""
        return next((k for k, m in MODELS.items() if m == self.model), self.model.name)


def result(case: Case, producer: dict[str, Any], consumer: dict[str, Any],
           error: str) -> dict[str, Any]:
    """The case's JSON entry: its settings, both processes' results, the rows of every phase
    both finished."""
    entry: dict[str, Any] = {"ucx_tls": case.ucx_tls, "model": case.model.name,
                             "model_id": case.model_id, "tokens": case.tokens,
                             "case": asdict(case), "error": error,
                             "producer": producer, "consumer": consumer}
    m = case.model
    info = {"model_id": case.model_id, "tokens": case.tokens, "warmup": case.warmup,
            "dense_bytes": case.tokens * m.dense_bytes_per_token(),
            "block_bytes": case.num_blocks * BLOCK * m.dense_bytes_per_token()}
    entry["rows"] = report.case_rows(info, producer, consumer)
    return entry
