"""Compatibility record: each differing field is named in the refusal."""

import dataclasses
import json

import pytest

from turbowire.connector.compat import CompatibilityRecord, IncompatiblePeerError
from turbowire.connector.geometry import KVGeometry, LayerSpec

GEO = KVGeometry(
    layers=tuple(LayerSpec(f"model.layers.{i}.self_attn.attn", 3, 64) for i in range(4)),
    block_size=32,
    dtype="bfloat16",
)
BASE = CompatibilityRecord.build(
    model="SmolLM2-135M-Instruct",
    geometry=GEO,
    preset="tq4",
    codec_format_version=1,
    tp_size=1,
    speculative_config=None,
    model_kv_heads=(3,) * 4,
)

CHANGES = {
    "model": "other-model",
    "num_layers": 5,
    "num_draft_layers": 1,
    "kv_heads": (3, 3, 3, 1),
    "head_dim": 128,
    "block_size": 64,
    "dtype": "float16",
    "preset": "raw",
    "format_version": 99,
    "codec_format_version": 2,
    "tp_size": 2,
    "speculative_config": '{"method": "eagle"}',
    "weights": "0123456789abcdef",  # other weights under the same served name
    "model_kv_heads": (3, 3, 3, 1),
    "rope_dim": 64,
}


def test_every_field_is_checked():
    names = {f.name for f in dataclasses.fields(CompatibilityRecord)}
    assert names == set(CHANGES)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_mismatch_names_field(field):
    other = dataclasses.replace(BASE, **{field: CHANGES[field]})
    err = BASE.mismatch(other, ("prefill engine", "decode engine"))
    assert isinstance(err, IncompatiblePeerError)
    assert err.field_name == field
    assert f"{field} differs" in str(err) and "prefill engine" in str(err)
    with pytest.raises(IncompatiblePeerError):
        BASE.check(other)


def test_equal_records_and_dict_roundtrip():
    assert BASE.mismatch(dataclasses.replace(BASE)) is None
    assert CompatibilityRecord.from_dict(BASE.to_dict()) == BASE


def _spec_record(**factors):
    return dataclasses.replace(BASE, speculative_config=json.dumps(factors, sort_keys=True))


@pytest.mark.parametrize(
    "key, theirs",
    [("method", "eagle3"), ("model", "/models/other-draft"), ("kv_cache_dtype", "fp8"),
     ("num_speculative_tokens", 3)],
)
def test_speculative_mismatch_names_the_setting(key, theirs):
    factors = {"method": "eagle", "model": "/models/draft", "kv_cache_dtype": "auto",
               "num_speculative_tokens": 0}
    ours, other = _spec_record(**factors), _spec_record(**{**factors, key: theirs})
    err = ours.mismatch(other, ("prefill engine", "decode engine"))
    assert isinstance(err, IncompatiblePeerError)
    assert err.field_name == f"speculative_config.{key}"
    assert f"speculative_config.{key} differs" in str(err)
    assert ours.mismatch(_spec_record(**factors)) is None


def test_speculative_on_one_side_only_says_which():
    err = _spec_record(method="eagle").mismatch(BASE, ("decode engine", "prefill engine"))
    assert err is not None and err.field_name == "speculative_config"
    assert "decode engine runs 'eagle'" in str(err) and "prefill engine has none" in str(err)


def test_a_drafter_on_one_side_is_named_before_its_layer_count():
    ours = dataclasses.replace(BASE, num_layers=5, num_draft_layers=1,
                               speculative_config=json.dumps({"method": "eagle"}))
    err = ours.mismatch(BASE)
    assert err is not None and err.field_name == "speculative_config"
