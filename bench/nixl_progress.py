"""NIXL progress thread: idle CPU cost and READ throughput per ``nixl_progress_delay_us``.

NIXL's Python API starts the agent's progress thread with a delay of 0 between polls, which keeps
one core busy even when nothing moves. On vLLM CPU engines (each pinned to one core) that thread
shares the core with the engine and the codec. This measures, for each delay, the idle CPU share
of one agent and the goodput of a READ of ``--mib`` MiB (``--descs`` descriptors) between two
processes over UCX (TCP loopback unless UCX_TLS says otherwise), reader and target on their own
cores, all in one run.

    UCX_TLS=tcp,self .venv/bin/python -m bench.nixl_progress --delays 0,100,1000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import torch

from turbowire.connector.transports.base import TransferState
from turbowire.connector.transports.nixl import NixlTransport


def _cpu_seconds() -> float:
    return time.process_time()


def idle_share(delay_us: int, seconds: float) -> float:
    transport = NixlTransport(agent_name=f"idle-{delay_us}-{os.getpid()}",
                              progress_delay_us=delay_us)
    try:
        time.sleep(0.2)
        c0, w0 = _cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        return (_cpu_seconds() - c0) / (time.monotonic() - w0)
    finally:
        transport.close()


def _target(queue: mp.Queue, stop: mp.Event, delay_us: int, nbytes: int, core: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    transport = NixlTransport(agent_name=f"target-{delay_us}", progress_delay_us=delay_us)
    buf = torch.full((nbytes,), 7, dtype=torch.uint8)
    transport.register(buf)
    queue.put((transport.local_metadata(), buf.data_ptr()))
    stop.wait()
    transport.close()


def read_goodput(delay_us: int, nbytes: int, descs: int, repeats: int) -> list[float]:
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    proc = ctx.Process(target=_target, args=(queue, stop, delay_us, nbytes, cores[0]))
    proc.start()
    try:
        if hasattr(os, "sched_setaffinity") and len(cores) > 1:
            os.sched_setaffinity(0, {cores[1]})
        metadata, remote_base = queue.get(timeout=120)
        reader = NixlTransport(agent_name=f"reader-{delay_us}", progress_delay_us=delay_us)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        reader.register(dst)
        peer = reader.add_peer(metadata)
        size = nbytes // descs
        local = np.array([(dst.data_ptr() + i * size, size, 0) for i in range(descs)], np.uint64)
        remote = np.array([(remote_base + i * size, size, 0) for i in range(descs)], np.uint64)
        rates = []
        for _ in range(repeats):
            dst.zero_()
            t0 = time.perf_counter()
            xfer = reader.read(peer, local, remote, "DRAM")
            while xfer.state() is TransferState.PENDING:
                pass
            elapsed = time.perf_counter() - t0
            xfer.release()
            if xfer.state() is not TransferState.DONE or not bool((dst == 7).all()):
                raise RuntimeError(f"READ with progress delay {delay_us} us did not land intact")
            rates.append(nbytes / elapsed / 1e9)
        reader.close()
        return rates
    finally:
        stop.set()
        proc.join(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--delays", default="0,100,1000",
                        help="progress delays in us (0 = NIXL default)")
    parser.add_argument("--mib", type=int, default=64, help="bytes per READ, MiB")
    parser.add_argument("--descs", type=int, default=512, help="descriptors per READ")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    args = parser.parse_args()
    delays = [int(d) for d in args.delays.split(",")]
    rows = []
    for delay in delays:
        share = idle_share(delay, args.idle_seconds)
        rates = read_goodput(delay, args.mib << 20, args.descs, args.repeats)
        rows.append((delay, share, statistics.median(rates), max(rates)))
    print(f"UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}, READ of {args.mib} MiB in "
          f"{args.descs} descriptors, {args.repeats} repeats")
    print()
    print("| progress delay us | idle agent CPU (cores) | READ GB/s median | READ GB/s best |")
    print("|---|---|---|---|")
    for delay, share, med, best in rows:
        label = f"{delay} (NIXL default)" if delay == 0 else str(delay)
        print(f"| {label} | {share:.3f} | {med:.2f} | {best:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
