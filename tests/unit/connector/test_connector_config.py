"""Extra-config validation: every bad value stops the engine with a message naming the key."""

import pytest

from turbowire.connector.config import ConnectorConfigError, TurboWireConfig


def test_defaults_are_valid():
    cfg = TurboWireConfig.from_extra_config({}, environ={})
    assert cfg.preset == "tq4"
    assert cfg.nixl_backends == ("UCX",)
    assert cfg.auth_token is None
    assert cfg.load_failure_policy is None


def test_sizes_accept_units_and_recv_follows_staging():
    cfg = TurboWireConfig.from_extra_config({"staging_bytes": "8MiB"}, environ={})
    assert cfg.staging_bytes == 8 << 20
    assert cfg.recv_bytes == 8 << 20
    cfg = TurboWireConfig.from_extra_config(
        {"staging_bytes": 1 << 20, "recv_bytes": "2MiB"}, environ={}
    )
    assert (cfg.staging_bytes, cfg.recv_bytes) == (1 << 20, 2 << 20)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"presett": "tq4"}, "unknown kv_connector_extra_config key"),
        ({"preset": "tq9"}, "preset='tq9' is unknown"),
        ({"staging_bytes": "lots"}, "staging_bytes='lots' is not a byte count"),
        ({"staging_bytes": 1024}, "staging_bytes=1024 is too small"),
        ({"lease_seconds": 0.1}, "lease_seconds=0.1 is too small"),
        ({"lease_seconds": "soon"}, "lease_seconds must be a number"),
        ({"side_channel_port": 70000}, "side_channel_port=70000 is out of range"),
        ({"side_channel_host": ""}, "side_channel_host must be the address"),
        ({"side_channel_bind": "my-host"}, "side_channel_bind='my-host' must be an IP"),
        ({"nixl_backends": []}, "nixl_backends must be a non-empty list"),
        ({"decode_pipeline_groups": 0}, "decode_pipeline_groups=0 is out of range"),
        ({"decode_pipeline_groups": "many"}, "decode_pipeline_groups must be an integer"),
        ({"nixl_progress_delay_us": -1}, "nixl_progress_delay_us=-1 is out of range"),
        ({"nixl_backend_params": {"GDS": {}}}, "names backend 'GDS' that is not in"),
        ({"nixl_backend_params": {"UCX": {"ucx_devices": 3}}}, "must map strings to strings"),
        ({"load_failure_policy": "retry"}, "load_failure_policy='retry' is unknown"),
        ({"auth_token": "short"}, "auth_token is too short"),
    ],
)
def test_bad_values_name_the_key(extra, needle):
    with pytest.raises(ConnectorConfigError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        TurboWireConfig.from_extra_config(extra, environ={}, known_presets=["raw", "tq4"])


def test_auth_token_from_env_and_custom_env_name():
    cfg = TurboWireConfig.from_extra_config({}, environ={"TURBOWIRE_AUTH_TOKEN": "s3cret-token"})
    assert cfg.auth_token == "s3cret-token"
    cfg = TurboWireConfig.from_extra_config(
        {"auth_token_env": "MY_TOKEN"}, environ={"MY_TOKEN": "another-token"}
    )
    assert cfg.auth_token == "another-token"
    # explicit key wins over the environment
    cfg = TurboWireConfig.from_extra_config(
        {"auth_token": "explicit-token"}, environ={"TURBOWIRE_AUTH_TOKEN": "s3cret-token"}
    )
    assert cfg.auth_token == "explicit-token"


def test_backend_params_and_comma_list():
    cfg = TurboWireConfig.from_extra_config(
        {"nixl_backends": "UCX", "nixl_backend_params": {"UCX": {"ucx_devices": "veth0"}}},
        environ={},
    )
    assert cfg.nixl_backends == ("UCX",)
    assert cfg.nixl_backend_params["UCX"]["ucx_devices"] == "veth0"


def test_unresolvable_host_is_reported():
    cfg = TurboWireConfig.from_extra_config(
        {"side_channel_host": "no-such-host.invalid"}, environ={}
    )
    with pytest.raises(ConnectorConfigError, match="does not resolve"):
        cfg.check_resolvable()


def test_pipeline_and_progress_defaults_and_overrides():
    cfg = TurboWireConfig.from_extra_config({}, environ={})
    assert (cfg.decode_pipeline_groups, cfg.nixl_progress_delay_us) == (8, 100)
    cfg = TurboWireConfig.from_extra_config(
        {"decode_pipeline_groups": "1", "nixl_progress_delay_us": 0}, environ={}
    )
    assert (cfg.decode_pipeline_groups, cfg.nixl_progress_delay_us) == (1, 0)


@pytest.mark.parametrize("layers,groups", [(1, 8), (8, 8), (30, 8), (32, 3), (5, 1)])
def test_layer_groups_cover_every_layer_once_in_order(layers, groups):
    from turbowire.connector.loader import layer_groups

    split = layer_groups(layers, groups)
    assert len(split) == min(layers, groups)
    assert [layer for g in split for layer in g] == list(range(layers))
    sizes = [len(g) for g in split]
    assert max(sizes) - min(sizes) <= 1
