"""Prefill: what the save path adds to a forward, in paired rounds.

Each round runs forward, v1, forward, v2, ..., forward (the variants' order rotated from round
to round); a variant's sample is its time minus the mean of the two forwards beside it, so drift
(clocks, temperature) cancels; the same difference of inner forwards is the A/A noise. The
variants are coders the bench builds through ``make_coder``: per-layer launches (the product's
default), one launch in ``wait_for_save``, per-layer on a high-priority side stream, per-layer +
a host sync, per-layer on the forward's own stream, per-layer with the encoder capped at N
registers (``--encode-cap``) and the host coder (``encode_into`` per layer).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.gpu_path.rig import (
    DEVICE,
    SMOKE,
    Forward,
    bench_ms,
    save_meta,
    sync,
    time_once,
    use_coder,
)
from turbowire.connector import probe
from turbowire.connector.worker import TurboWireWorker
from turbowire.kernels import KernelConfig


@dataclass
class SaveRig:
    """The prefill worker, its forward and one coder per variant."""

    p: TurboWireWorker
    fwd: Forward
    rid: str
    block_ids: list[int]
    tokens: int
    coders: dict[str, Any]

    def step(self, variant: str) -> Callable[[], None]:
        """One step of ``variant``; its metadata is made here, outside the timing (a new object
        each step, as vLLM's scheduler sends)."""
        meta = save_meta(self.rid, self.block_ids, self.tokens)

        def run() -> None:
            if variant == "forward":
                self.fwd.run(None, None)
                return
            self.p.coder = self.coders[variant]
            self.fwd.run(self.p, meta)
            if variant == "layer+sync" and DEVICE == "cuda":
                torch.cuda.current_stream().synchronize()

        return run


def build(p: TurboWireWorker, fwd: Forward, rid: str, block_ids: list[int], tokens: int,
          encode_cap: int) -> SaveRig:
    """The variants' coders (see the module); the worker keeps the per-layer one."""
    coders: dict[str, Any] = {"batched": use_coder(p, "after_forward"),
                              "legacy": p.make_coder("host")}
    if encode_cap:
        cfg = dataclasses.replace(use_coder(p).kernel_config or KernelConfig(),
                                  encode_max_registers=encode_cap)
        coders[f"layer-cap{encode_cap}"] = use_coder(p, kernel_config=cfg)
    if DEVICE == "cuda":
        # the side stream runs at priority 0, the lowest CUDA has (the forward's too): the
        # high-priority one is the contrast; and no side stream at all
        hi = use_coder(p)
        hi.side = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
        coders["layer-hiprio"] = hi
        coders["layer-inline"] = inline = use_coder(p)
        inline.side = None
        coders["layer+sync"] = use_coder(p)
    coders["layer"] = use_coder(p)  # last: the worker's coder from here on
    return SaveRig(p, fwd, rid, block_ids, tokens, coders)


def variants(rig: SaveRig) -> list[str]:
    """The variants timed in the paired rounds (the host coder's are rarer, it is slow)."""
    return [v for v in rig.coders if v != "legacy"]


def paired_rounds(step: Callable[[str], Callable[[], None]], names: list[str],
                  rounds: int) -> dict[str, Any]:
    """See the module: per variant the differences, the A/A differences, the forwards."""
    diff: dict[str, list[float]] = {v: [] for v in names}
    aa: list[float] = []
    forwards: list[float] = []
    for k in range(rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        seq = ["forward"]
        for v in order:
            seq += [v, "forward"]
        fns = [step(v) for v in seq]
        t = [time_once(fn) for fn in fns]
        f = t[0::2]
        forwards += f
        for j, v in enumerate(order):
            diff[v].append(t[2 * j + 1] - (f[j] + f[j + 1]) / 2)
        aa += [f[j] - (f[j - 1] + f[j + 1]) / 2 for j in range(1, len(f) - 1)]
    return {"diff": diff, "aa": aa or [0.0], "forward": forwards}


def bootstrap_median(x: list[float], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median."""
    a = np.asarray(x, dtype=np.float64)
    if a.size < 2:
        return float(a.mean()), float(a.mean())
    meds = np.median(a[np.random.default_rng(0).integers(0, a.size, (n, a.size))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


class ClockSampler:
    """SM clock and board power through NVML (nvidia-ml-py) every 50 ms, in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        if DEVICE != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML: no clocks in the report
            self._nvml = None

    def __enter__(self) -> ClockSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.wait(0.05):
            try:
                self.samples.append((nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetPowerUsage(self._handle) / 1e3))
            except Exception:  # noqa: BLE001 - the sampler stops, the rounds go on
                return

    def summary(self) -> dict[str, Any] | None:
        if not self.samples:
            return None
        mhz = np.array([x[0] for x in self.samples])
        watts = np.array([x[1] for x in self.samples])
        return {"sm_mhz_p10_p50_p90": [int(np.percentile(mhz, q)) for q in (10, 50, 90)],
                "watts_p50_max": [round(float(np.median(watts))), round(float(watts.max()))]}


def run_save(rig: SaveRig, rounds: int) -> dict[str, Any]:
    """The paired rounds (host coder: a tenth of them), the save alone, the host time of a
    ``save_kv_layer`` (the coder's ``coder.save_layer`` marks). Steps must be warm already."""
    names = variants(rig)
    save_layer_us: list[float] = []

    def record(name: str, start: int, end: int) -> None:
        if name == "coder.save_layer":
            save_layer_us.append((end - start) / 1e3)

    with ClockSampler() as clocks, probe.recording(record):
        sv = paired_rounds(rig.step, names, rounds)
    lg = paired_rounds(rig.step, ["legacy"], max(2, rounds // 10))
    fw = statistics.median(sv["forward"])
    r: dict[str, Any] = {"forward_ms": fw, "rounds": rounds, "variants": names,
                         "spread_forward_ms": [min(sv["forward"]), max(sv["forward"])]}
    for v, diffs in [*sv["diff"].items(), ("legacy", lg["diff"]["legacy"])]:
        add = statistics.median(diffs)
        lo, hi = bootstrap_median(diffs)
        r[f"{v}_ms"] = fw + add
        r[f"{v}_pct"] = 100 * add / fw
        r[f"{v}_pct_ci95"] = [100 * lo / fw, 100 * hi / fw]
    aa = sv["aa"]
    r["aa_pct"] = 100 * statistics.median(aa) / fw
    r["aa_pct_ci95"] = [100 * x / fw for x in bootstrap_median(aa)]
    r["clocks"] = clocks.summary()
    r["host_us_save_kv_layer"] = (statistics.median(save_layer_us) if save_layer_us else None)
    r["host_us_max_save_kv_layer"] = max(save_layer_us) if save_layer_us else None
    # the encode alone: one step's wait_for_save on the one-launch coder (plan build included)
    # (not in the smoke mode: the interpreter's encode is slow and says nothing)
    r["save_alone_ms"] = r["save_alone_pct_of_forward"] = None
    if not SMOKE:
        p, meta = rig.p, save_meta(rig.rid, rig.block_ids, rig.tokens)
        p.coder = rig.coders["batched"]
        r["save_alone_ms"] = bench_ms(lambda: p.wait_for_save(meta))
        r["save_alone_pct_of_forward"] = 100 * r["save_alone_ms"] / fw
        p.coder = rig.coders["layer"]
    return r


def staging_equal(rig: SaveRig, reference: torch.Tensor) -> dict[str, bool]:
    """Each variant's staged bytes (staging poisoned first: padding is never written) equal to
    ``reference``, the per-layer launches' bytes of the first step."""
    out = {}
    assert rig.p.staging is not None
    for v in rig.coders:
        rig.p.staging.fill_(0xA5)
        rig.step(v)()
        sync()
        out[v] = bool(torch.equal(reference, rig.p.staging))
    rig.p.coder = rig.coders["layer"]
    return out
