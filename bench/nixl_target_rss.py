"""Does a NIXL READ target grow? Two NIXL agents in two processes (turbowire's NixlTransport);
the initiator READs ``reads`` times ``descs`` x ``size`` bytes from a registered 64 MiB buffer of
the target, twice, and this prints the target's RSS growth per round (bench/RESULTS.md, "Soak").

    python -m bench.nixl_target_rss 500 64 2048      # reads, descriptors per read, bytes each
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os

import numpy as np
import torch

BUF = 64 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def target(q_meta: mp.Queue, q_cmd: mp.Queue, q_out: mp.Queue) -> None:
    from turbowire.connector.transports.nixl import NixlTransport

    t = NixlTransport(agent_name="target")
    buf = torch.ones(BUF, dtype=torch.uint8)
    t.register(buf)
    q_meta.put((t.local_metadata(), buf.data_ptr()))
    while True:
        cmd = q_cmd.get()
        q_out.put(rss())
        if cmd == "stop":
            break


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.nixl_target_rss",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("reads", type=int, help="READs per round")
    ap.add_argument("descs", type=int, help="descriptors per READ")
    ap.add_argument("size", type=int, help="bytes per descriptor")
    args = ap.parse_args()
    reads, descs, size = args.reads, args.descs, args.size
    mp.set_start_method("spawn")
    q_meta, q_cmd, q_out = mp.Queue(), mp.Queue(), mp.Queue()
    proc = mp.Process(target=target, args=(q_meta, q_cmd, q_out))
    proc.start()
    meta, addr = q_meta.get()
    from turbowire.connector.transports.nixl import NixlTransport

    a = NixlTransport(agent_name="initiator")
    local = torch.zeros(BUF, dtype=torch.uint8)
    a.register(local)
    peer = a.add_peer(meta)
    rng = np.random.default_rng(0)

    def batch(n: int) -> None:
        for _ in range(n):
            offs = rng.integers(0, BUF // size - 1, descs) * size
            lens, devs = np.full(descs, size), np.zeros(descs)
            ls = np.stack([local.data_ptr() + np.arange(descs) * size, lens, devs], 1)
            rs = np.stack([addr + offs, lens, devs], 1)
            x = a.read(peer, ls.astype(np.int64), rs.astype(np.int64), "DRAM")
            while x.state().name == "PENDING":
                pass
            x.release()

    batch(50)  # warm-up: connection, first allocations
    q_cmd.put("x")
    r0 = q_out.get()
    batch(reads)
    q_cmd.put("x")
    r1 = q_out.get()
    batch(reads)
    q_cmd.put("stop")
    r2 = q_out.get()
    proc.join()
    mib = 1 << 20
    print(f"UCX_TLS={os.environ.get('UCX_TLS', '-')}, {reads} reads of {descs} x {size} B: "
          f"target RSS +{(r1 - r0) / mib:.1f} MiB, then +{(r2 - r1) / mib:.1f} MiB")


if __name__ == "__main__":
    main()
