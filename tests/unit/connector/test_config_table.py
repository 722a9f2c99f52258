"""The declarative key table: docs/configuration.md in sync, defaults valid, every bound
refused by key name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from turbowire.connector.config import (
    CONFIG_KEYS,
    CONFIG_KEYS_BY_NAME,
    KNOWN_KEYS,
    ConfigKey,
    ConnectorConfigError,
    Int,
    Seconds,
    Size,
    TurboWireConfig,
    format_size,
    main,
    parse_size,
    readme_table,
    render_markdown_table,
    update_readme,
)

CONFIG_PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def build(extra: dict[str, Any], environ: dict[str, str] | None = None) -> TurboWireConfig:
    return TurboWireConfig.from_extra_config(extra, environ=environ or {})


def test_readme_table_is_generated_from_the_key_table() -> None:
    readme = CONFIG_PAGE.read_text(encoding="utf-8")
    table = readme_table(readme)
    assert table is not None, "docs/configuration.md lacks the <!-- config-table --> markers"
    assert table == render_markdown_table(), (
        "docs/configuration.md table is stale: regenerate it with "
        "python -m turbowire.connector.config --write docs/configuration.md"
    )
    assert update_readme(readme) == readme


def test_cli_prints_and_writes_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out == render_markdown_table() + "\n"
    page = tmp_path / "README.md"
    page.write_text("intro\n<!-- config-table -->\nold\n<!-- /config-table -->\nrest\n")
    assert main(["--write", str(page)]) == 0
    marked = f"<!-- config-table -->\n{render_markdown_table()}\n<!-- /config-table -->"
    assert page.read_text() == f"intro\n{marked}\nrest\n"
    with pytest.raises(ValueError, match="markers"):
        update_readme("no table here")


def test_every_key_is_documented_and_the_dataclass_matches_the_table() -> None:
    stored = [k.name for k in CONFIG_KEYS if k.stored]
    assert [f.name for f in dataclasses.fields(TurboWireConfig)] == stored
    assert KNOWN_KEYS == set(CONFIG_KEYS_BY_NAME)
    table = render_markdown_table()
    for key in CONFIG_KEYS:
        assert key.doc.strip() and key.kind.describe()
        assert re.search(rf"^\| `{key.name}` \| ", table, re.MULTILINE)
        assert "|" not in key.doc  # would break the markdown row


@pytest.mark.parametrize("key", CONFIG_KEYS, ids=lambda k: k.name)
def test_every_default_validates(key: ConfigKey) -> None:
    value = key.default_value()
    if key.stored:
        key.kind.check(key.name, value)
        assert getattr(TurboWireConfig(), key.name) == value
    if value is not None:  # giving the default explicitly yields the same config
        assert build({key.name: value}) == build({})


def test_defaults_and_derived_defaults() -> None:
    cfg = build({})
    assert cfg == TurboWireConfig()
    assert (cfg.staging_bytes, cfg.recv_bytes) == (256 << 20, 256 << 20)
    assert (cfg.lease_seconds, cfg.side_channel_host, cfg.side_channel_port) == (
        30.0, "127.0.0.1", 5700,
    )
    assert build({"staging_bytes": "1MiB"}).recv_bytes == 1 << 20
    assert build({}, {"TURBOWIRE_AUTH_TOKEN": "env-token-1"}).auth_token == "env-token-1"
    assert build({}, {"TURBOWIRE_AUTH_TOKEN": ""}).auth_token is None
    assert build({"auth_token": ""}, {"TURBOWIRE_AUTH_TOKEN": "env-token-1"}).auth_token is None
    other_env = build({"auth_token_env": "X"}, {"TURBOWIRE_AUTH_TOKEN": "env-token-1"})
    assert other_env.auth_token is None
    with pytest.raises(ConnectorConfigError, match="auth_token is too short"):
        build({}, {"TURBOWIRE_AUTH_TOKEN": "short"})


def test_unknown_key_is_named_with_a_suggestion_and_the_known_keys() -> None:
    with pytest.raises(ConnectorConfigError) as info:
        build({"stagin_bytes": "1MiB", "zzz": 1})
    message = str(info.value)
    assert "'stagin_bytes'" in message and "'zzz'" in message
    assert "did you mean 'stagin_bytes' -> 'staging_bytes'" in message
    assert all(name in message for name in KNOWN_KEYS)
    with pytest.raises(ConnectorConfigError, match="JSON object"):
        TurboWireConfig.from_extra_config(["preset"], environ={})  # type: ignore[arg-type]


def _bound_cases() -> list[tuple[str, Any]]:
    """Just outside every numeric bound of the table, read off the table itself."""
    cases: list[tuple[str, Any]] = []
    for key in CONFIG_KEYS:
        kind = key.kind
        if isinstance(kind, Size):
            cases.append((key.name, kind.minimum - 1))
        elif isinstance(kind, Seconds):
            cases.append((key.name, kind.minimum / 2))
        elif isinstance(kind, Int):
            cases += [(key.name, kind.minimum - 1), (key.name, kind.maximum + 1)]
    return cases


@pytest.mark.parametrize(("name", "value"), _bound_cases())
def test_each_bound_is_refused_naming_the_key_and_the_value(name: str, value: Any) -> None:
    with pytest.raises(ConnectorConfigError, match=rf"^{name}={value} is (too small|out of range)"):
        build({name: value})
    with pytest.raises(ConnectorConfigError, match=rf"^{name}="):  # direct construction too
        TurboWireConfig(**{name: value})


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"preset": ""}, "preset must be a non-empty preset name"),
        ({"preset": 4}, "preset must be a preset name"),
        ({"side_channel_host": "a b"}, "side_channel_host must be the address"),
        ({"side_channel_host": 7}, "side_channel_host must be a host name"),
        ({"side_channel_bind": 0}, "side_channel_bind must be an IP address"),
        ({"nixl_backends": ["UCX", ""]}, "nixl_backends must be a non-empty list"),
        ({"nixl_backends": 3}, "nixl_backends must be a non-empty list"),
        ({"nixl_backend_params": ["UCX"]}, "nixl_backend_params must map a backend"),
        ({"auth_token": 12345678}, "auth_token must be a string"),
        ({"auth_token_env": ""}, "auth_token_env must name an environment variable"),
        ({"load_failure_policy": "retry"}, r"use one of \['fail', 'recompute'\]"),
        ({"lease_seconds": True}, "lease_seconds must be a number of seconds"),
        ({"lease_seconds": "nan"}, "lease_seconds must be a number of seconds"),
        ({"min_transfer_tokens": 1.5}, "min_transfer_tokens must be an integer"),
        ({"side_channel_port": True}, "side_channel_port must be an integer"),
        ({"recv_bytes": "1024"}, "recv_bytes=1024 is too small: use at least 64KiB"),
        ({"staging_bytes": True}, "staging_bytes=True is not a byte count"),
    ],
)
def test_bad_values_say_what_to_put_there(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConnectorConfigError, match=needle):
        build(extra)


def test_auth_token_is_not_echoed_in_errors() -> None:
    with pytest.raises(ConnectorConfigError) as info:
        build({"auth_token": "seven77"})
    assert "seven77" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("64MiB", 64 << 20), ("1GiB", 1 << 30), ("64KiB", 64 << 10), ("64M", 64 << 20),
        ("1.5GiB", 3 << 29), ("2 MiB", 2 << 20), ("10MB", 10**7), ("4096", 4096),
        ("512b", 512), (268435456, 268435456), (0, 0),
    ],
)
def test_sizes_parse(text: Any, n: int) -> None:
    assert parse_size("staging_bytes", text) == n


@pytest.mark.parametrize("bad", ["lots", "", "MiB", "infMiB", "nanGiB", "-", 1.5, None, True])
def test_bad_sizes_are_refused_naming_the_key(bad: Any) -> None:
    with pytest.raises(ConnectorConfigError, match="^staging_bytes=.* is not a byte count"):
        parse_size("staging_bytes", bad)


@pytest.mark.parametrize("n", [1, 1000, 64 << 10, 256 << 20, 3 << 29, 1 << 30])
def test_format_size_round_trips(n: int) -> None:
    assert parse_size("k", format_size(n)) == n


def test_parsed_values_are_typed() -> None:
    cfg = build(
        {
            "lease_seconds": "45", "side_channel_port": "5800", "decode_pipeline_groups": 4.0,
            "nixl_backends": "UCX, GDS", "nixl_backend_params": {"GDS": {"a": "b"}},
            "load_failure_policy": "recompute",
        }
    )
    assert cfg.lease_seconds == 45.0 and isinstance(cfg.lease_seconds, float)
    assert (cfg.side_channel_port, cfg.decode_pipeline_groups) == (5800, 4)
    assert cfg.nixl_backends == ("UCX", "GDS")
    assert cfg.load_failure_policy == "recompute"
