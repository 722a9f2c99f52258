"""kv_transfer_params: NixlConnector field names, strict validation of what comes back."""

import pytest

from turbowire.connector.geometry import (
    KVGeometry,
    LayerSpec,
    StagingLayout,
    block_tag,
    blocks_for_tokens,
    tokens_in_block,
)
from turbowire.connector.params import (
    RemotePrefill,
    TransferParamsError,
    prefill_result,
    prompt_digest,
)


def _params(**over):
    p = prefill_result(
        engine_id="eng-p",
        request_id="req-1",
        host="127.0.0.1",
        port=5700,
        slots=[4, 5, 6],
        num_tokens=70,
        tp_size=1,
        preset="tq4",
        format_version=1,
        prompt_hash=prompt_digest(list(range(70)), 70),
        lease_seconds=30.0,
        dense_bytes=1000,
        wire_bytes=250,
    )
    p.update(over)
    return p


def test_nixl_field_names_present():
    p = _params()
    for key in (
        "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
        "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens", "tp_size",
    ):
        assert key in p
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False


def test_parse_roundtrip_and_hma_nesting():
    r = RemotePrefill.parse(_params(), block_size=32)
    assert r.slots == (4, 5, 6) and r.num_tokens == 70 and r.port == 5700
    assert r.lease_seconds == _params()["turbowire_lease_seconds"]
    assert RemotePrefill.parse(_params(turbowire_lease_seconds=None), 32).lease_seconds == 30.0
    r2 = RemotePrefill.parse(_params(remote_block_ids=[[4, 5, 6]]), block_size=32)
    assert r2.slots == (4, 5, 6)


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"remote_engine_id": None}, "remote_engine_id is missing"),
        ({"remote_port": "5700"}, "remote_port must be int"),
        ({"remote_port": 0}, "not a TCP port"),
        ({"remote_num_tokens": -1}, "out of range"),
        ({"remote_num_tokens": True}, "got a bool"),
        ({"remote_block_ids": [4, 5]}, "has 2 slots but remote_num_tokens=70 needs 3"),
        ({"remote_block_ids": [4, -5, 6]}, "non-negative integers"),
        ({"remote_block_ids": "4,5,6"}, "must be a list"),
        ({"turbowire_preset": None}, "turbowire_preset is missing"),
        ({"tp_size": 0}, "tp_size must be an integer in 1..1024"),
        ({"tp_size": 1 << 30}, "tp_size must be an integer in 1..1024"),  # plans a load per rank
        ({"remote_block_ids": [4, 5, 4]}, "duplicate slots"),
        ({"remote_request_id": "r" * 10_000}, "10000 characters long"),
        ({"turbowire_fallback": "x" * 600}, "600 characters long"),
        ({"turbowire_prompt_hash": 7}, "turbowire_prompt_hash must be a string"),
        ({"turbowire_lease_seconds": "30"}, "turbowire_lease_seconds must be a number"),
        ({"turbowire_lease_seconds": True}, "must be a number, got bool"),
        ({"turbowire_lease_seconds": -1}, "not in"),
        ({"turbowire_lease_seconds": 0}, "not in"),
        ({"turbowire_lease_seconds": float("nan")}, "not in"),
        ({"turbowire_lease_seconds": float("inf")}, "not in"),
        ({"turbowire_lease_seconds": 1e12}, "not in"),
        ({"turbowire_prompt_hash": None}, "turbowire_prompt_hash is missing"),
    ],
)
def test_malformed_params_name_the_field(over, needle):
    with pytest.raises(TransferParamsError, match=needle):
        RemotePrefill.parse(_params(**over), block_size=32)


def test_prompt_digest_depends_on_prefix_only():
    a = prompt_digest([1, 2, 3, 4], 3)
    assert a == prompt_digest([1, 2, 3, 9], 3)
    assert a != prompt_digest([1, 2, 4, 4], 3)


def test_geometry_layout_and_bounds():
    geo = KVGeometry(
        layers=(
            LayerSpec("model.layers.10.self_attn.attn", 2, 64),
            LayerSpec("model.layers.2.self_attn.attn", 2, 64),
        ),
        block_size=32,
        dtype="bfloat16",
    )
    layout = StagingLayout.build(geo, lambda layer, tokens, heads: 1000 + layer, 10_000)
    assert layout.layer_offsets == (0, 1024)
    assert layout.slot_bytes == 1024 + 1024
    assert layout.num_slots == 4
    assert layout.chunk_offset(3, 1) == 3 * 2048 + 1024
    with pytest.raises(IndexError, match="staging slot 4 out of range"):
        layout.chunk_offset(4, 0)
    assert blocks_for_tokens(70, 32) == 3 and tokens_in_block(2, 70, 32) == 6
    assert block_tag("r", 1) != block_tag("r", 2) and 0 <= block_tag("r", 1) < 2**31


# ---- turbowire_lease_token: the lease's capability (transfer format 2)
TOKEN = "0123456789abcdef" * 2


def test_lease_token_is_parsed_and_kept_out_of_the_repr():
    r = RemotePrefill.parse(_params(turbowire_format_version=2, turbowire_lease_token=TOKEN), 32)
    assert r.lease_token == TOKEN and r.request_id == "req-1"
    assert TOKEN not in repr(r) and TOKEN not in f"{r}" and TOKEN not in "%s" % (r,)
    assert not hasattr(r, "lease")  # the id is a plain str: no token smuggled inside it


def test_the_token_travels_to_the_workers_in_its_own_field_not_in_the_id():
    """The load request carries the token next to the plain id; vLLM pickles the connector
    metadata from the scheduler to the workers (its own processes, not the network), and the
    token must survive that trip, but never show in a repr (log lines, tracebacks)."""
    import pickle

    from turbowire.connector.metadata import (
        LoadBlock,
        LoadRequest,
        PeerAddress,
        TurboWireConnectorMetadata,
    )

    load = LoadRequest("d-1", "req-1", PeerAddress("p", "h", 1, 1), [LoadBlock(0, 3, 5, 7, 9)],
                       "tq4", [3], lease_token=TOKEN)
    assert type(load.remote_request_id) is str
    meta = TurboWireConnectorMetadata(loads=[load])
    assert TOKEN not in repr(load) and TOKEN not in repr(meta) and TOKEN not in f"{meta}"
    (again,) = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)).loads
    assert again == load and again.lease_token == TOKEN
    assert type(again.remote_request_id) is str and again.remote_request_id == "req-1"
    # positional construction (bench/, older callers) cannot put a block list into the token
    with pytest.raises(TypeError):
        LoadRequest("d-1", "req-1", PeerAddress("p", "h", 1, 1), [], "tq4", [], TOKEN)
    assert LoadRequest("d", "r", PeerAddress("p", "h", 1, 1), [], "tq4").lease_token == ""


def test_prefill_result_carries_the_token():
    p = prefill_result(
        engine_id="e", request_id="r", host="h", port=1, slots=[0], num_tokens=1, tp_size=1,
        preset="tq4", format_version=2, prompt_hash="h", lease_seconds=30.0, dense_bytes=1,
        wire_bytes=1, lease_token=TOKEN,
    )
    assert p["turbowire_lease_token"] == TOKEN
    assert RemotePrefill.parse(p, 32).lease_token == TOKEN


@pytest.mark.parametrize("token", [
    "", "0" * 31, "0" * 129, "0123456789ABCDEF" * 2, "g" * 32, " " + "0" * 32, 12345, ["0" * 32],
    "0" * 100_000,
])
def test_malformed_lease_token_is_refused(token):
    with pytest.raises(TransferParamsError, match="turbowire_lease_token"):
        RemotePrefill.parse(_params(turbowire_format_version=2, turbowire_lease_token=token), 32)


def test_format_2_params_with_slots_need_the_token():
    with pytest.raises(TransferParamsError, match="turbowire_lease_token is missing"):
        RemotePrefill.parse(_params(turbowire_format_version=2), 32)
    # nothing staged (a fallback): no lease, no token needed
    empty = _params(turbowire_format_version=2, remote_block_ids=[], remote_num_tokens=0,
                    turbowire_fallback="staging_full")
    assert RemotePrefill.parse(empty, 32).lease_token is None
    # an older prefill engine (format 1) sends none: parsed, then declined as incompatible
    assert RemotePrefill.parse(_params(), 32).lease_token is None
