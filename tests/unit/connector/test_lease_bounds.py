"""The lease's bounds live once (config.py): whatever lease a prefill engine may configure, every
decode engine accepts in the params it hands out (issue 34: 100000 was accepted by the config,
refused by every decode engine, recomputed and never released, so the prefill's staging filled).
"""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbowire.connector import params as params_module
from turbowire.connector.config import (
    CONFIG_KEYS_BY_NAME,
    DEFAULT_LEASE_SECONDS,
    MAX_LEASE_SECONDS,
    MIN_LEASE_SECONDS,
    ConnectorConfigError,
    TurboWireConfig,
)
from turbowire.connector.params import (
    RemotePrefill,
    new_lease_token,
    prefill_result,
    prompt_digest,
)


def _params_for(cfg: TurboWireConfig) -> dict:
    return prefill_result(
        engine_id="eng-p", request_id="req-1", host="127.0.0.1", port=5700, slots=[4, 5, 6],
        num_tokens=70, tp_size=1, preset="tq4", format_version=2,
        prompt_hash=prompt_digest(list(range(70)), 70), lease_seconds=cfg.lease_seconds,
        dense_bytes=1000, wire_bytes=250, lease_token=new_lease_token(),
    )


@pytest.mark.parametrize("lease", [100000, "100000", MAX_LEASE_SECONDS + 1, "inf", float("inf"),
                                   "-inf", "nan"])
def test_config_refuses_a_lease_no_decode_engine_accepts(lease):
    with pytest.raises(ConnectorConfigError, match="lease_seconds"):
        TurboWireConfig.from_extra_config({"lease_seconds": lease}, environ={})


def test_too_large_and_infinite_name_the_bound():
    with pytest.raises(ConnectorConfigError, match="too large: use at most 86400"):
        TurboWireConfig.from_extra_config({"lease_seconds": 100000}, environ={})
    with pytest.raises(ConnectorConfigError, match="not a finite number of seconds: use 1..86400"):
        TurboWireConfig.from_extra_config({"lease_seconds": "inf"}, environ={})
    with pytest.raises(ConnectorConfigError, match="lease_seconds"):
        TurboWireConfig(lease_seconds=math.inf)


def test_one_home_for_the_bounds():
    kind = CONFIG_KEYS_BY_NAME["lease_seconds"].kind
    assert (kind.minimum, kind.maximum) == (MIN_LEASE_SECONDS, MAX_LEASE_SECONDS)
    assert CONFIG_KEYS_BY_NAME["lease_seconds"].default == DEFAULT_LEASE_SECONDS
    assert params_module.MAX_LEASE_SECONDS is MAX_LEASE_SECONDS
    assert params_module.DEFAULT_LEASE_SECONDS is DEFAULT_LEASE_SECONDS


@pytest.mark.parametrize("lease", [MIN_LEASE_SECONDS, DEFAULT_LEASE_SECONDS, MAX_LEASE_SECONDS])
def test_the_bounds_themselves_round_trip(lease):
    cfg = TurboWireConfig.from_extra_config({"lease_seconds": lease}, environ={})
    assert RemotePrefill.parse(_params_for(cfg), block_size=32).lease_seconds == lease


@given(st.floats(min_value=MIN_LEASE_SECONDS, max_value=MAX_LEASE_SECONDS))
def test_any_lease_the_config_accepts_the_decode_side_accepts(lease):
    cfg = TurboWireConfig.from_extra_config({"lease_seconds": lease}, environ={})
    assert RemotePrefill.parse(_params_for(cfg), block_size=32).lease_seconds == lease
