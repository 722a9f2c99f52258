"""Staging pool: all-or-nothing reservation, leases, heartbeats extending, expiry freeing."""

import threading

import pytest

from turbowire.connector.staging import StagingFullError, StagingPool


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reserve_lease_release_cycle():
    pool = StagingPool(num_slots=8, lease_seconds=10)
    assert pool.reserve("a", 3) == [0, 1, 2]
    assert pool.reserve("a", 2) == [3, 4]
    assert pool.reserve("b", 3) == [5, 6, 7]
    with pytest.raises(StagingFullError, match="need 1 slots, 0 free of 8"):
        pool.reserve("c", 1)
    lease = pool.lease("a", wire_bytes=123)
    assert lease.slots == [0, 1, 2, 3, 4]
    assert pool.snapshot().used_slots == 8 and pool.snapshot().leases == 1
    released, unknown, refused = pool.release(["a", "zzz"])
    assert released == ["a"] and unknown == ["zzz"] and refused == []
    assert pool.snapshot().used_slots == 3
    # freed slots are reused lowest-first
    assert pool.reserve("c", 2) == [0, 1]
    # a second release of the same lease is a no-op reported as unknown
    assert pool.release(["a"]) == ([], ["a"], [])


def test_all_or_nothing_and_drop():
    pool = StagingPool(num_slots=4, lease_seconds=10)
    pool.reserve("a", 3)
    with pytest.raises(StagingFullError):
        pool.reserve("b", 2)
    assert pool.snapshot().used_slots == 3  # nothing taken by the failed reservation
    assert pool.drop("a") == 3
    assert pool.snapshot().used_slots == 0


def test_heartbeat_extends_and_expiry_frees():
    clock = FakeClock()
    pool = StagingPool(num_slots=4, lease_seconds=10, clock=clock)
    pool.reserve("a", 2)
    pool.reserve("b", 2)
    pool.lease("a")
    pool.lease("b")
    clock.now += 8
    assert pool.heartbeat(["a", "x"]) == (["a"], ["x"], [])
    clock.now += 5  # b expired (13 s > 10 s), a extended to 118
    expired = pool.reap()
    assert [lease.request_id for lease in expired] == ["b"]
    assert pool.snapshot().used_slots == 2 and pool.has_lease("a")
    clock.now += 6
    assert [lease.request_id for lease in pool.reap()] == ["a"]
    assert pool.snapshot().used_slots == 0
    assert pool.release(["a"]) == ([], ["a"], [])


def test_concurrent_release_and_reserve_keep_slots_consistent():
    pool = StagingPool(num_slots=64, lease_seconds=60)
    errors: list[Exception] = []

    def worker(tag: str) -> None:
        try:
            for i in range(200):
                rid = f"{tag}-{i}"
                try:
                    pool.reserve(rid, 3)
                except StagingFullError:
                    continue
                pool.lease(rid)
                pool.release([rid])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(str(t),)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    snap = pool.snapshot()
    assert snap.used_slots == 0 and snap.leases == 0
    assert sorted(pool.reserve("final", 64)) == list(range(64))


def test_lease_with_two_consumers_frees_after_both_released():
    pool = StagingPool(num_slots=4, lease_seconds=10)
    pool.reserve("a", 2)
    pool.lease("a", consumers=2)
    assert pool.release(["a"], consumer=0) == (["a"], [], [])
    assert pool.snapshot().used_slots == 2  # rank 1 still reading
    pool.release(["a"], consumer=0)  # a repeated release by the same rank changes nothing
    assert pool.snapshot().used_slots == 2
    pool.release(["a"], consumer=1)
    assert pool.snapshot().used_slots == 0 and not pool.has_lease("a")


def test_byte_ranges_first_fit_merge_and_double_free():
    from turbowire.connector.staging import ByteRanges

    r = ByteRanges(1024)
    a = r.allocate(100)
    b = r.allocate(100)
    assert (a, b) == (0, 128)
    assert r.allocate(2000) is None
    r.free(a, 100)
    assert r.allocate(50) == 0  # reuses the hole
    r.free(0, 50)
    r.free(b, 100)
    assert r.free_bytes == 1024
    with pytest.raises(ValueError, match="double free"):
        r.free(0, 10)


# -- faults (issue 17) ---------------------------------------------------------------------------


def test_a_heartbeated_lease_does_not_strand_expired_ones_behind_it():
    """The oldest lease is kept alive by heartbeats for many lease periods; the leases created
    after it expire on time anyway (reap looks at every lease, not at a queue head), and their
    slots are reused while the heartbeated one still holds its own."""
    clock = FakeClock()
    pool = StagingPool(num_slots=12, lease_seconds=10, clock=clock)
    pool.reserve("kept", 2)
    pool.lease("kept")
    expiries: dict[str, float] = {}
    for i in range(12):  # a new 2-slot lease every 3 s for 36 s: 24 slots through a pool of 12
        rid = f"gone-{i}"
        try:
            pool.reserve(rid, 2)
        except StagingFullError:
            pytest.fail(f"{rid}: slots of expired leases were not given back ({pool.snapshot()})")
        pool.lease(rid)
        expiries[rid] = clock.now + 10
        for _ in range(3):
            clock.now += 1
            assert pool.heartbeat(["kept"]) == (["kept"], [], [])
            for lease in pool.reap():
                assert lease.request_id != "kept", "a heartbeated lease expired"
                assert expiries.pop(lease.request_id) <= clock.now
            late = [rid for rid, at in expiries.items() if at <= clock.now]
            assert not late, f"{late} outlived their lease behind the heartbeated one"
    assert pool.has_lease("kept") and pool.snapshot().leases == 1 + len(expiries)
    assert pool.snapshot().used_slots == 2 + 2 * len(expiries)


def test_a_heartbeat_never_shortens_a_lease_and_cannot_revive_a_reaped_one():
    clock = FakeClock()
    pool = StagingPool(num_slots=2, lease_seconds=10, clock=clock)
    pool.reserve("a", 1)
    lease = pool.lease("a")
    first = lease.expires_at
    clock.now -= 5  # a clock step backwards (or a stale caller): the expiry stays where it was
    pool.heartbeat(["a"])
    assert lease.expires_at == first
    clock.now += 5 + 10
    assert [x.request_id for x in pool.reap()] == ["a"]
    # the decode engine learns it is gone: unknown, not refused (it expired)
    assert pool.heartbeat(["a"], [lease.token]) == ([], ["a"], [])
    assert pool.heartbeat(["a"]) == ([], ["a"], [])
    assert pool.snapshot().used_slots == 0


def test_a_request_larger_than_the_whole_pool_falls_back_at_once():
    """No waiting for slots that can never be free: the reservation fails on an empty pool and
    takes nothing (the scheduler then falls back to recompute, reason staging_full)."""
    pool = StagingPool(num_slots=8, lease_seconds=10)
    with pytest.raises(StagingFullError, match="need 9 slots, 8 free of 8"):
        pool.reserve("huge", 9)
    snap = pool.snapshot()
    assert snap.used_slots == 0 and snap.reserved_requests == 0


# ---- lease capabilities (issue 17: forged kv_transfer_params released another request's lease)
def _leased(pool: StagingPool, rid: str, n: int = 2, consumers: int = 1):
    pool.reserve(rid, n)
    return pool.lease(rid, consumers=consumers)


def test_every_lease_gets_its_own_unguessable_token():
    pool = StagingPool(num_slots=8, lease_seconds=10)
    a, b = _leased(pool, "a"), _leased(pool, "b")
    assert len(a.token) == 32 and int(a.token, 16) >= 0
    assert a.token != b.token
    assert a.token not in repr(a)  # never in a log line


def test_release_and_heartbeat_without_the_token_touch_nothing():
    """The victim's lease survives a release (and a heartbeat) that names its request id with
    no token or a wrong one: the caller hears "unknown" and "refused" (every time: the decode
    engine reports it, not an expiry), the refusal is counted once."""
    clock = FakeClock()
    refused: list[tuple[list[str], list[str]]] = []
    pool = StagingPool(num_slots=8, lease_seconds=10, clock=clock,
                       on_refused=lambda missing, wrong: refused.append((missing, wrong)))
    victim = _leased(pool, "victim")
    wrong = "0" * 32 if victim.token != "0" * 32 else "1" * 32
    refusal = ([], ["victim"], ["victim"])
    assert pool.release(["victim"], 0, [""]) == refusal
    assert pool.release(["victim"], 0, [wrong]) == refusal
    assert pool.heartbeat(["victim"], [wrong]) == refusal
    assert pool.release(["victim"], 0, []) == refusal  # fewer tokens than ids
    assert pool.has_lease("victim") and pool.snapshot().used_slots == 2
    assert refused == [(["victim"], [])]  # the lease's first refusal only
    expires = pool._leases["victim"].expires_at
    clock.now += 5
    assert pool.heartbeat(["victim"], [wrong]) == refusal
    assert pool._leases["victim"].expires_at == expires  # not extended
    # the holder of the params still can
    assert pool.heartbeat(["victim"], [victim.token]) == (["victim"], [], [])
    assert pool.release(["victim"], 0, [victim.token]) == (["victim"], [], [])
    assert pool.snapshot().used_slots == 0
    # gone now: unknown to anyone, refused to no one (an expiry or a repeat, not a refusal)
    assert pool.heartbeat(["victim"], [wrong]) == ([], ["victim"], [])
    assert pool.release(["victim"], 0, [victim.token]) == ([], ["victim"], [])


def test_tokens_are_checked_per_id_and_per_rank():
    pool = StagingPool(num_slots=8, lease_seconds=10)
    a = _leased(pool, "a", consumers=2)
    b = _leased(pool, "b")
    done, unknown, refused = pool.release(["a", "b"], 0, [a.token, a.token])  # b: a's token
    assert done == ["a"] and unknown == ["b"] and refused == ["b"]
    assert pool.release(["a"], 1, ["f" * 32]) == ([], ["a"], ["a"])  # rank 1, wrong token: held
    assert pool.has_lease("a")
    assert pool.release(["a", "b"], 1, [a.token, b.token])[0] == ["a"]  # b: rank 1 not a reader
    assert not pool.has_lease("a") and pool.has_lease("b")


def test_the_side_channel_tells_a_refused_claim_from_an_expired_lease():
    """Client -> servicer -> pool, without a network: the token goes as an explicit field, and
    the reply lists a held lease named with a wrong (or no) token as ``refused`` (and, for older
    decode engines, ``unknown``), a lease that is gone only as ``unknown``."""
    from types import SimpleNamespace

    from turbowire.connector.sidechannel.client import SideChannelClient
    from turbowire.connector.sidechannel.server import SideChannelHandler

    pool = StagingPool(num_slots=8, lease_seconds=10)
    held, gone = _leased(pool, "held"), _leased(pool, "gone")
    servicer = SideChannelHandler(SimpleNamespace(leases=pool))
    sent: list[tuple[list[str], list[str]]] = []

    def call(method):
        def rpc(request, timeout, metadata):
            sent.append((list(request.request_ids), list(request.lease_tokens)))
            return method(request, SimpleNamespace(abort=lambda code, msg: pytest.fail(msg)))
        return rpc

    client = SideChannelClient("127.0.0.1", 1, None, timeout=1,
                               stub=SimpleNamespace(Heartbeat=call(servicer.Heartbeat),
                                                    ReleaseLease=call(servicer.ReleaseLease)))
    try:
        assert pool.release(["gone"]) == (["gone"], [], [])  # released: gone for good
        wrong = "f" * 32 if held.token != "f" * 32 else "e" * 32
        reply = client.heartbeat(["held", "gone"], "D", lease_tokens=[wrong, gone.token])
        assert sent[-1] == (["held", "gone"], [wrong, gone.token])  # explicit, in order
        assert list(reply.done) == [] and list(reply.unknown) == ["held", "gone"]
        assert list(reply.refused) == ["held"]
        reply = client.release(["held"], "D", 0, lease_tokens=[""])  # no token: refused too
        assert sent[-1] == (["held"], []) and list(reply.refused) == ["held"]
        reply = client.heartbeat(["held"], "D", lease_tokens=[held.token])
        assert list(reply.done) == ["held"] and not reply.unknown and not reply.refused
        assert client.release(["held"], "D", 0, lease_tokens=[held.token]).done == ["held"]
        with pytest.raises(ValueError, match="1 lease tokens for 2 request ids"):
            client.heartbeat(["a", "b"], "D", lease_tokens=["x"])
    finally:
        client.close()


# ---- issue 33: leases bound to their prompt (H3), claim deadline and age cap (M1), L3 --------
def test_a_claim_presenting_another_prompt_is_refused_and_extends_nothing():
    mismatched: list[list[str]] = []
    clock = FakeClock()
    pool = StagingPool(num_slots=8, lease_seconds=10, clock=clock,
                       on_mismatch=lambda ids: mismatched.append(ids))
    pool.reserve("p1", 2)
    lease = pool.lease("p1", prompt_digest="d" * 24, num_tokens=45)
    expires = lease.expires_at
    clock.now += 5
    for claim in [("e" * 24, 45), ("d" * 24, 44), ("e" * 24, 44)]:  # digest, count, both
        answer = pool.heartbeat(["p1"], [lease.token], [claim])
        assert answer == ([], ["p1"], []) and answer.mismatched == ["p1"]
    assert lease.expires_at == expires and not lease.claimed  # not extended
    assert mismatched == [["p1"]]  # counted once per lease
    # a wrong token is refused first (lease_refused), whatever the prompt
    answer = pool.heartbeat(["p1"], ["f" * 32], [("e" * 24, 45)])
    assert answer == ([], ["p1"], ["p1"]) and answer.mismatched == []
    # the holder with its own prompt claims it; an older decode engine (no digest) too
    answer = pool.heartbeat(["p1"], [lease.token], [("d" * 24, 45)])
    assert answer == (["p1"], [], []) and answer.mismatched == [] and lease.claimed
    assert pool.heartbeat(["p1"], [lease.token], [("", 0)]) == (["p1"], [], [])
    assert pool.heartbeat(["p1"], [lease.token]) == (["p1"], [], [])
    # a release needs no prompt: the holder of the token may always let its lease go
    assert pool.release(["p1"], 0, [lease.token]) == (["p1"], [], [])
    # a lease not bound to a prompt (no token ids on the prefill side) is not checked
    pool.reserve("p2", 1)
    free = pool.lease("p2")
    assert pool.heartbeat(["p2"], [free.token], [("e" * 24, 3)]) == (["p2"], [], [])


def test_an_unclaimed_lease_expires_after_the_claim_deadline():
    clock = FakeClock()
    pool = StagingPool(num_slots=8, lease_seconds=30, clock=clock, claim_seconds=5)
    pool.reserve("claimed", 2)
    claimed = pool.lease("claimed", prompt_digest="d" * 24, num_tokens=40)
    pool.reserve("never", 2)
    pool.lease("never")
    assert claimed.expires_at == clock.now + 5
    clock.now += 3
    assert pool.heartbeat(["claimed"], [claimed.token], [("d" * 24, 40)]) == (["claimed"], [], [])
    assert claimed.expires_at == clock.now + 30  # claimed: the full lease from now on
    clock.now += 2.5
    assert [lease.request_id for lease in pool.reap()] == ["never"]
    assert pool.has_lease("claimed") and pool.snapshot().used_slots == 2
    # a claim deadline longer than the lease is the lease
    pool2 = StagingPool(num_slots=2, lease_seconds=4, clock=clock, claim_seconds=10)
    pool2.reserve("x", 1)
    assert pool2.lease("x").expires_at == clock.now + 4


def test_heartbeats_extend_a_lease_only_up_to_its_age_cap():
    clock = FakeClock()
    pool = StagingPool(num_slots=4, lease_seconds=10, clock=clock, max_age_seconds=25)
    pool.reserve("a", 1)
    lease = pool.lease("a")
    created = clock.now
    for _ in range(10):  # a decode engine heartbeating a request queued for ever
        clock.now += 4
        assert pool.heartbeat(["a"], [lease.token]).done == ["a"]
        assert lease.expires_at <= created + 25
    assert lease.expires_at == created + 25
    clock.now = created + 25
    assert [x.request_id for x in pool.reap()] == ["a"]
    assert pool.snapshot().used_slots == 0
    # a cap below lease_seconds is lease_seconds
    pool2 = StagingPool(num_slots=2, lease_seconds=10, clock=clock, max_age_seconds=3)
    pool2.reserve("b", 1)
    b = pool2.lease("b")
    clock.now += 1
    pool2.heartbeat(["b"], [b.token])
    assert b.expires_at == b.created + 10


def test_one_request_cannot_take_more_than_its_share():
    from turbowire.connector.staging import StagingShareError

    pool = StagingPool(num_slots=10, lease_seconds=10, max_request_slots=4)
    assert pool.reserve("a", 3) == [0, 1, 2]
    with pytest.raises(StagingShareError, match="more than its share of 4 of 10") as info:
        pool.reserve("a", 2)  # 5 in all
    assert info.value.reason == "staging_share"
    assert isinstance(info.value, StagingFullError)  # the scheduler's fallback path
    assert pool.reserve("b", 4) == [3, 4, 5, 6]  # another request has its own share


def test_a_repeated_request_id_never_touches_the_live_lease():
    """L3: a request id that already holds a lease (a client repeating X-Request-Id with vLLM's
    id randomization off) is refused with its own error; the first request's lease is intact."""
    from turbowire.connector.staging import DuplicateLeaseError

    pool = StagingPool(num_slots=8, lease_seconds=10)
    pool.reserve("dup", 2)
    first = pool.lease("dup")
    with pytest.raises(DuplicateLeaseError, match="already holds a lease") as info:
        pool.reserve("dup", 1)
    assert info.value.reason == "internal" and isinstance(info.value, ValueError)
    with pytest.raises(DuplicateLeaseError):
        pool.lease("dup")
    assert pool._leases["dup"] is first and first.slots == [0, 1]
    assert pool.snapshot().used_slots == 2


def test_the_side_channel_answers_a_mismatched_claim_in_its_own_field():
    from types import SimpleNamespace

    from turbowire.connector.sidechannel.client import SideChannelClient
    from turbowire.connector.sidechannel.server import SideChannelHandler

    pool = StagingPool(num_slots=8, lease_seconds=10)
    pool.reserve("r", 1)
    lease = pool.lease("r", prompt_digest="d" * 24, num_tokens=9)
    servicer = SideChannelHandler(SimpleNamespace(leases=pool))
    aborted: list[str] = []

    class Ctx:
        def abort(self, code, msg):
            aborted.append(msg)
            raise RuntimeError(msg)

    client = SideChannelClient("127.0.0.1", 1, None, timeout=1, stub=SimpleNamespace(
        Heartbeat=lambda request, timeout, metadata: servicer.Heartbeat(request, Ctx())))
    try:
        reply = client.heartbeat(["r"], "D", lease_tokens=[lease.token], prompts=[("e" * 24, 9)])
        assert list(reply.prompt_mismatch) == ["r"] and list(reply.unknown) == ["r"]
        assert not reply.refused and not reply.done
        reply = client.heartbeat(["r"], "D", lease_tokens=[lease.token], prompts=[("d" * 24, 9)])
        assert list(reply.done) == ["r"] and not reply.prompt_mismatch
        with pytest.raises(ValueError, match="1 prompts for 2 request ids"):
            client.heartbeat(["r", "s"], "D", prompts=[("d", 1)])
        from turbowire.connector.sidechannel import sidechannel_pb2 as pb

        with pytest.raises(RuntimeError, match="prompt digests"):
            servicer.Heartbeat(pb.LeaseRequest(request_ids=["r"], prompt_digests=["a", "b"],
                                               prompt_tokens=[1, 2]), Ctx())
        with pytest.raises(RuntimeError, match="longer than 64"):
            servicer.Heartbeat(pb.LeaseRequest(request_ids=["r"], prompt_digests=["a" * 65],
                                               prompt_tokens=[1]), Ctx())
        with pytest.raises(RuntimeError, match="too many request ids"):
            servicer.Heartbeat(pb.LeaseRequest(request_ids=["r"] * 4097), Ctx())
    finally:
        client.close()
