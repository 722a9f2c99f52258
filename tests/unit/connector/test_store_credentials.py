"""The store's Redis credentials (issue 33, M6): where the password comes from, and that no log
line or error shows it.

- ``TURBOWIRE_STORE_PASSWORD_FILE`` wins over ``TURBOWIRE_STORE_PASSWORD``; neither: None;
- a URL with its own password wins (nothing is added to it);
- an unreadable, empty or oversized file is an error naming the variable and the path, never a
  silent fallback to no password;
- ``redact_url`` hides a password in the userinfo and in a ``password=`` query parameter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.exceptions import AuthenticationError

from turbowire.errors import TurboWireError
from turbowire.store.directory import (
    STORE_PASSWORD_ENV,
    STORE_PASSWORD_FILE_ENV,
    STORE_USERNAME_ENV,
    Directory,
    StoreCredentialsError,
    auth_failure_message,
    is_auth_error,
    redact_url,
    store_credentials,
    store_password,
)

URL = "redis://redis.example:6379/0"


def test_no_password_set_gives_none() -> None:
    assert store_password({}) is None
    assert store_credentials(URL, {}) == {}
    assert store_password({STORE_PASSWORD_ENV: ""}) is None
    assert store_password({STORE_PASSWORD_ENV: " \n"}) is None
    assert store_password({STORE_PASSWORD_ENV: "pw\n"}) == "pw"  # a Secret's trailing newline


def test_the_variable_gives_the_password_and_the_user() -> None:
    env = {STORE_PASSWORD_ENV: "pw-from-env", STORE_USERNAME_ENV: "turbowire"}
    assert store_credentials(URL, env) == {"password": "pw-from-env", "username": "turbowire"}
    assert store_credentials(URL, {STORE_PASSWORD_ENV: "pw"}) == {"password": "pw"}
    # a user without a password means nothing to AUTH: nothing is passed
    assert store_credentials(URL, {STORE_USERNAME_ENV: "turbowire"}) == {}


def test_the_file_wins_and_is_stripped(tmp_path: Path) -> None:
    path = tmp_path / "password"
    path.write_text("  pw-from-file\n")
    env = {STORE_PASSWORD_FILE_ENV: str(path), STORE_PASSWORD_ENV: "pw-from-env"}
    assert store_password(env) == "pw-from-file"
    assert store_credentials(URL, env) == {"password": "pw-from-file"}


@pytest.mark.parametrize("url", [
    "redis://:own-pw@redis.example:6379/0",
    "redis://user:own-pw@redis.example:6379",
    "rediss://redis.example:6380/1?password=own-pw",
])
def test_a_url_with_its_own_password_wins(url: str, tmp_path: Path) -> None:
    env = {STORE_PASSWORD_ENV: "pw-from-env", STORE_USERNAME_ENV: "u",
           STORE_PASSWORD_FILE_ENV: str(tmp_path / "missing")}
    assert store_credentials(url, env) == {}


def test_a_url_user_is_kept() -> None:
    env = {STORE_PASSWORD_ENV: "pw", STORE_USERNAME_ENV: "other"}
    assert store_credentials("redis://acl-user@redis.example:6379", env) == {"password": "pw"}


def _file_error(env: dict[str, str]) -> str:
    with pytest.raises(StoreCredentialsError) as info:
        store_password(env)
    assert isinstance(info.value, TurboWireError) and info.value.reason == "bad_params"
    return str(info.value)


def test_an_unreadable_file_names_the_variable_and_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-file"
    message = _file_error({STORE_PASSWORD_FILE_ENV: str(missing),
                           STORE_PASSWORD_ENV: "fallback-pw"})
    assert STORE_PASSWORD_FILE_ENV in message and str(missing) in message
    message = _file_error({STORE_PASSWORD_FILE_ENV: str(tmp_path)})  # a directory
    assert str(tmp_path) in message


def test_an_empty_or_oversized_file_is_refused_without_its_content(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    assert "empty" in _file_error({STORE_PASSWORD_FILE_ENV: str(empty)})
    big = tmp_path / "big"
    big.write_text("secret-content" * 1000)
    message = _file_error({STORE_PASSWORD_FILE_ENV: str(big)})
    assert str(big) in message and "secret-content" not in message


def test_the_directory_reads_the_file_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad file stops the engine (or the proxy) at start, not at the first lookup."""
    monkeypatch.setenv(STORE_PASSWORD_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(StoreCredentialsError, match=STORE_PASSWORD_FILE_ENV):
        Directory(URL, ttl_seconds=5)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw123@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:pw123@h:6379", "redis://user:***@h:6379"),
    ("rediss://h:6380/1?password=pw123&ssl_cert_reqs=none",
     "rediss://h:6380/1?password=***&ssl_cert_reqs=none"),
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_redact_url_hides_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "pw123" not in redact_url(url)


def test_the_auth_message_says_what_to_set_and_hides_the_url_password() -> None:
    exc = AuthenticationError("WRONGPASS invalid username-password pair")
    assert is_auth_error(exc) and not is_auth_error(ConnectionError("refused"))
    message = auth_failure_message("redis://:pw123@h:6379", exc)
    assert STORE_PASSWORD_ENV in message and STORE_PASSWORD_FILE_ENV in message
    assert "WRONGPASS" in message and "pw123" not in message
