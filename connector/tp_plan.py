"""Which prefill ranks a decode rank reads, and which heads of their chunks it keeps, when the
two engines run at different tensor-parallel sizes (P TP=1 / D TP=2, the reverse, wider).

vLLM shards a layer's KV heads over the TP ranks in order: with ``tp <= H`` heads rank ``r``
holds heads ``[r*H/tp, (r+1)*H/tp)``; with ``tp > H`` each head is replicated on ``tp/H``
consecutive ranks (rank ``r`` holds head ``r // (tp/H)``). A prefill rank stages chunks of its
own heads (one chunk per layer and block, every head of that rank inside), so a decode rank:

- with fewer heads than a prefill rank (D TP > P TP) reads the one prefill rank holding its
  heads and keeps its share of each chunk. A prefill engine told the decode engines' TP size
  (``decode_tp_size``) stages each chunk cut into ``head_groups`` chunks of consecutive heads
  (``staged_head_groups``), so a decode rank reads only the cut chunks of its heads
  (:class:`ChunkCut`); otherwise the whole chunk crosses the wire and the rest of it is
  dropped;
- with more heads (D TP < P TP) reads each of the prefill ranks holding them and writes each
  one's chunk at its heads' offset;
- with an MLA model (the latent is the same on every rank) reads one prefill rank, whole.

Every plan is a list of :class:`HeadSource`; equal TP sizes give ``[HeadSource.same_rank(rank)]``,
the one-peer load of the same rank's whole chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from turbowire.errors import TurboWireError
from turbowire.kernels import HeadWindow

if TYPE_CHECKING:
    from turbowire.connector.compat import CompatibilityRecord
    from turbowire.connector.geometry import KVGeometry


class TensorParallelError(TurboWireError, ValueError):
    """The two engines' TP sizes cannot be mapped onto each other for this model."""

    reason = "incompatible"


@dataclass(frozen=True)
class HeadSource:
    """Read ``prefill_rank``'s chunks; keep their local heads ``[src_start, src_start + count)``
    (of ``src_heads`` in each chunk) and write them at this rank's local head ``dst_start`` (of
    its ``dst_heads``)."""

    prefill_rank: int
    src_heads: int  # 0: the chunks hold this rank's heads (equal TP sizes, ``same_rank``)
    src_start: int
    count: int
    dst_start: int
    dst_heads: int = 0

    @classmethod
    def same_rank(cls, rank: int) -> HeadSource:
        """Equal TP sizes: the prefill rank of the same index, its chunks whole."""
        return cls(rank, 0, 0, 0, 0, 0)

    @property
    def whole(self) -> bool:
        """The chunk's heads are this rank's heads, all of them, in place."""
        return self.src_start == 0 and self.dst_start == 0 and \
            self.count == self.src_heads == self.dst_heads


def check_split(total_heads: int, tp_size: int, side: str = "this engine") -> None:
    """vLLM's own rule: the heads split evenly over the ranks or the ranks over the heads."""
    if total_heads < 1 or tp_size < 1:
        raise TensorParallelError(f"{side}: {total_heads} KV heads over TP {tp_size}")
    if total_heads % tp_size and tp_size % total_heads:
        raise TensorParallelError(
            f"{side}: {total_heads} KV heads do not split over TP {tp_size} (one must divide "
            "the other, as vLLM requires)")


def rank_heads(total_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads rank ``rank`` of a ``tp_size`` engine holds (global indices)."""
    check_split(total_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise TensorParallelError(f"rank {rank} outside TP {tp_size}")
    if tp_size <= total_heads:
        per = total_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp_size // total_heads)
    return range(head, head + 1)


def head_sources(total_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int,
                 *, replicated: bool = False) -> list[HeadSource]:
    """Where decode rank ``decode_rank`` gets each of its heads (see the module), in the order
    of its local heads. ``replicated``: every rank holds the same rows (an MLA latent of
    ``total_heads`` vectors): one prefill rank, spread over the decode ranks."""
    if replicated:
        q = decode_rank % prefill_tp
        return [HeadSource(q, total_heads, 0, total_heads, 0, total_heads)]
    check_split(total_heads, prefill_tp, "the prefill engine")
    check_split(total_heads, decode_tp, "the decode engine")
    want = rank_heads(total_heads, decode_tp, decode_rank)
    # a head replicated on several prefill ranks: start at a rank chosen by this decode rank, so
    # the decode ranks spread their READs over the replicas
    order = [(decode_rank + i) % prefill_tp for i in range(prefill_tp)]
    sources: list[HeadSource] = []
    covered: set[int] = set()
    for q in order:
        have = rank_heads(total_heads, prefill_tp, q)
        lo, hi = max(want.start, have.start), min(want.stop, have.stop)
        if lo >= hi or lo in covered:
            continue
        covered.update(range(lo, hi))
        sources.append(HeadSource(q, len(have), lo - have.start, hi - lo, lo - want.start,
                                  len(want)))
    if covered != set(want):  # the split rule above makes this unreachable; never a partial plan
        raise TensorParallelError(f"decode rank {decode_rank}: heads {sorted(set(want) - covered)} "
                                  "held by no prefill rank")
    return sorted(sources, key=lambda s: s.dst_start)


def model_kv_heads(geometry: KVGeometry, tp_size: int, total_kv_heads: int) -> tuple[int, ...]:
    """The model's KV heads per layer over all ranks, for the compatibility record: a K/V layer
    holds ``total_kv_heads`` (vLLM's ``get_total_num_kv_heads``) when this rank's share is what
    vLLM gives it (a drafter's layer too: vLLM shards an EAGLE drafter's heads as the target's),
    an MLA layer its latent vectors (the same on every rank); 0 where no other TP size can read
    the layer (a Mamba / linear-attention state, a share that does not match: a drafter of
    other heads)."""
    out = []
    for layer in geometry.layers:
        if layer.is_latent:
            out.append(layer.num_kv_heads)
        elif (layer.is_state or total_kv_heads < 1
              or layer.num_kv_heads != max(1, total_kv_heads // tp_size)):
            out.append(0)
        else:
            out.append(total_kv_heads)
    return tuple(out)


def tp_refusal(ours: CompatibilityRecord, theirs: CompatibilityRecord) -> str | None:
    """Why two engines of these records cannot exchange KV (None: they can). Equal TP sizes
    always can; other ones need every layer's model heads known on both sides, the same on
    every layer, split by both sizes as vLLM splits them (an MLA latent, the same rows on every
    rank, splits by any size)."""
    if ours.tp_size == theirs.tp_size:
        return None
    for record in (ours, theirs):
        heads = record.model_kv_heads
        if not heads:
            return "one side's turbowire predates TP-size mapping; start both at the same TP size"
        if len(heads) != len(record.kv_heads):  # a peer's record: never indexed past its end
            return (f"a record lists the model's heads of {len(heads)} layers and a rank's "
                    f"heads of {len(record.kv_heads)}")
        unread = [i for i, h in enumerate(heads) if h == 0]
        if any(record.kv_heads[i] == 0 for i in unread):  # a state layer holds no KV heads
            return ("this model's Mamba / linear-attention state moves per rank, which is "
                    "supported at equal TP sizes only")
        if unread:
            drafter = (" (a drafter's KV moves at other TP sizes only where its heads are the "
                       "target's and both sides' turbowire maps them: an older one does not)"
                       if record.num_draft_layers else "")
            return (f"a TP {record.tp_size} engine's layer {unread[0]} holds "
                    f"{record.kv_heads[unread[0]]} KV heads per rank, not vLLM's share of the "
                    f"model's heads (equal TP sizes only){drafter}")
        if len(set(heads)) != 1:
            return "this model's layers hold different KV head counts (equal TP sizes only)"
    if ours.rope_dim or theirs.rope_dim:  # an MLA latent: every rank holds all of it
        return None
    for record in (ours, theirs):
        heads, tp = record.model_kv_heads[0], record.tp_size
        try:
            check_split(heads, tp, f"a TP {tp} engine")
        except TensorParallelError as exc:
            return str(exc)
        share = max(1, heads // tp)
        if any(h != share for h in record.kv_heads):
            return (f"a TP {tp} engine of {heads} KV heads holds {share} per rank, a record "
                    f"says {record.kv_heads[0]}")
    return None


def peer_refusal(record: CompatibilityRecord, peer_tp: int) -> str | None:
    """``tp_refusal`` against a peer of the same model at TP size ``peer_tp`` (the decode
    scheduler knows only the prefill engine's TP size, from its params, before any handshake)."""
    from dataclasses import replace

    if peer_tp == record.tp_size:
        return None
    total = record.model_kv_heads[0] if record.model_kv_heads else 0
    share = record.kv_heads if record.rope_dim or total < 1 else tuple(
        max(1, total // peer_tp) for _ in record.kv_heads)
    return tp_refusal(record, replace(record, tp_size=peer_tp, kv_heads=share))


def load_plan(record: CompatibilityRecord, prefill_tp: int, decode_rank: int,
              *, replicated: bool) -> list[HeadSource]:
    """The sources of a load into decode rank ``decode_rank`` of the engine of ``record`` from
    a prefill engine of ``prefill_tp`` ranks (``tp_refusal`` said it can)."""
    if prefill_tp == record.tp_size:
        return [HeadSource.same_rank(decode_rank)]
    return head_sources(record.model_kv_heads[0], prefill_tp, record.tp_size, decode_rank,
                        replicated=replicated)


@dataclass(frozen=True)
class ChunkCut:
    """The part of a prefill rank's staged chunk a decode rank reads and where its heads go:
    the chunk is staged as ``groups`` chunks of ``sub_heads`` consecutive heads each, back to
    back and all of one size; this rank reads ``len(windows)`` of them from the ``first`` on,
    and keeps ``windows[i]`` of the i-th one read. ``groups == 1`` with one window: the whole
    chunk through a head window (a prefill engine that did not cut its chunks)."""

    groups: int
    sub_heads: int
    first: int
    windows: tuple[HeadWindow, ...]

    @property
    def parts(self) -> int:
        return len(self.windows)


def staged_head_groups(decode_tp: int, tp_size: int, rank_heads: int) -> int:
    """How many chunks of consecutive heads a prefill rank of ``rank_heads`` heads (of a TP
    ``tp_size`` engine) cuts each chunk into for decode engines of TP ``decode_tp``: one per
    decode rank that reads it (heads replicated past one head per rank: one per head)."""
    if decode_tp <= tp_size:
        return 1
    if decode_tp % tp_size:
        raise TensorParallelError(f"decode_tp_size {decode_tp} is not a multiple of this "
                                  f"engine's TP size {tp_size}")
    groups = min(decode_tp // tp_size, rank_heads)
    if rank_heads % groups:
        raise TensorParallelError(f"this engine's {rank_heads} KV heads per rank do not split "
                                  f"over decode_tp_size {decode_tp}")
    return groups


def chunk_cut(source: HeadSource, groups: int, local_heads: int) -> ChunkCut | None:
    """What decode rank reads of a chunk ``source`` names, its prefill rank having staged it in
    ``groups`` cut chunks (``local_heads``: this rank's heads, those of ``same_rank`` chunks).
    None: the whole chunk, in place."""
    src_heads = source.src_heads or local_heads
    if groups == 1 and source.whole:
        return None
    if groups < 1 or src_heads % groups:
        raise TensorParallelError(f"{src_heads} KV heads per chunk do not split into "
                                  f"{groups} staged groups")
    sub = src_heads // groups
    lo = source.src_start if source.src_heads else 0
    count = source.count if source.src_heads else local_heads
    dst = source.dst_start if source.src_heads else 0
    first, last = lo // sub, (lo + count - 1) // sub
    windows = []
    for part in range(first, last + 1):
        a, b = max(lo, part * sub), min(lo + count, (part + 1) * sub)
        windows.append(HeadWindow(sub, a - part * sub, b - a, dst + a - lo))
    return ChunkCut(groups, sub, first, tuple(windows))

