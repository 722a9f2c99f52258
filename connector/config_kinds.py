"""The value kinds of ``kv_connector_extra_config`` keys: how a value is parsed, bounded and
described in docs/configuration.md (``config_keys.CONFIG_KEYS`` gives each key its kind)."""

from __future__ import annotations

import abc
import ipaddress
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turbowire.errors import TurboWireError

__all__ = [
    "Choice", "ConnectorConfigError", "Fraction", "Int", "Names", "ParamsByName", "PeerList",
    "Seconds", "Size", "Text", "ValueKind", "format_size", "is_ip_address", "is_thread_cpus",
    "parse_size",
]



class ConnectorConfigError(TurboWireError, ValueError):
    """A ``kv_connector_extra_config`` value is missing or invalid."""


# -- sizes -----------------------------------------------------------------------------------------

_SIZE_UNITS: tuple[tuple[str, int], ...] = (
    ("gib", 1 << 30), ("gb", 10**9), ("g", 1 << 30),
    ("mib", 1 << 20), ("mb", 10**6), ("m", 1 << 20),
    ("kib", 1 << 10), ("kb", 10**3), ("k", 1 << 10),
    ("b", 1),
)


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as "256MiB", "1GiB", "64M" (bare K/M/G are binary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.isdigit():
            return int(text)
        for suffix, mult in _SIZE_UNITS:
            if text.endswith(suffix):
                try:
                    return int(float(text[: -len(suffix)]) * mult)
                except (ValueError, OverflowError):
                    break
    raise ConnectorConfigError(
        f"{key}={value!r} is not a byte count: use an integer (268435456) or a string "
        "with a unit ('256MiB', '1GiB')"
    )


def format_size(n: int) -> str:
    """The shortest exact binary-unit spelling of ``n`` ("256MiB"), as the docs show sizes."""
    for suffix, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


# -- value kinds: parse (JSON-ish extra config), check (a typed value), describe (README) ----------


class ValueKind(abc.ABC):
    """How one key's value is read, bounded and documented."""

    def parse(self, key: str, raw: Any) -> Any:
        """The typed value of ``raw`` as given in ``kv_connector_extra_config`` (checked)."""
        self.check(key, raw)
        return raw

    def check(self, key: str, value: Any) -> None:
        """Raise ``ConnectorConfigError`` naming ``key`` when ``value`` is out of bounds."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The docs table's "values" cell: the type and what is allowed."""

    def show(self, value: Any) -> str:
        """A value as the docs table's default column spells it (inside backticks)."""
        return json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)


@dataclass(frozen=True)
class Size(ValueKind):
    """A byte count, an int or a string with a unit."""

    minimum: int
    why: str = ""

    def parse(self, key: str, raw: Any) -> int:
        n = parse_size(key, raw)
        self.check(key, n)
        return n

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConnectorConfigError(
                f"{key} must be a byte count such as 268435456 or '256MiB' (got {value!r})"
            )
        if value < self.minimum:
            raise ConnectorConfigError(
                f"{key}={value} is too small: use at least {format_size(self.minimum)}{self.why}"
            )

    def describe(self) -> str:
        return f'bytes >= `{format_size(self.minimum)}`: integer or `"64MiB"`, `"1GiB"`'

    def show(self, value: Any) -> str:
        return format_size(value)


def _number(key: str, raw: Any, convert: Any, accepted: tuple[type, ...], what: str) -> Any:
    """``convert(raw)`` for a JSON number or a numeric string, else the config error."""
    if isinstance(raw, bool) or not isinstance(raw, accepted):
        raise ConnectorConfigError(f"{key} must be {what} (got {raw!r})")
    try:
        return convert(raw)
    except ValueError as exc:
        raise ConnectorConfigError(f"{key} must be {what} (got {raw!r})") from exc


@dataclass(frozen=True)
class Seconds(ValueKind):
    """A finite duration in seconds with a lower and an optional upper bound."""

    minimum: float
    maximum: float = math.inf

    def parse(self, key: str, raw: Any) -> float:
        number = _number(key, raw, float, (int, float, str), "a number of seconds")
        self.check(key, number)
        return number

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConnectorConfigError(f"{key} must be a number of seconds (got {value!r})")
        if not math.isfinite(value):
            raise ConnectorConfigError(
                f"{key}={value} is not a finite number of seconds: use {self.describe_range()}"
            )
        if value < self.minimum:
            raise ConnectorConfigError(f"{key}={value} is too small: use at least {self.minimum}")
        if value > self.maximum:
            raise ConnectorConfigError(
                f"{key}={value} is too large: use at most {self.maximum:g}"
            )

    def describe_range(self) -> str:
        """The allowed values in words (errors)."""
        if math.isfinite(self.maximum):
            return f"{self.minimum:g}..{self.maximum:g}"
        return f"at least {self.minimum:g}"

    def describe(self) -> str:
        if math.isfinite(self.maximum):
            return f"seconds `{self.minimum:g}`..`{self.maximum:g}`"
        return f"seconds >= `{self.minimum:g}`"

    def show(self, value: Any) -> str:
        return f"{value:g}"


@dataclass(frozen=True)
class Int(ValueKind):
    """An integer in ``minimum..maximum``; ``why`` explains the bounds in the error."""

    minimum: int
    maximum: int
    why: str = ""

    def parse(self, key: str, raw: Any) -> int:
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        number = _number(key, raw, int, (int, str), "an integer")
        self.check(key, number)
        return number

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConnectorConfigError(f"{key} must be an integer (got {value!r})")
        if not self.minimum <= value <= self.maximum:
            raise ConnectorConfigError(
                f"{key}={value} is out of range: use {self.minimum}..{self.maximum}{self.why}"
            )

    def describe(self) -> str:
        return f"integer `{self.minimum}`..`{self.maximum}`"


@dataclass(frozen=True)
class Text(ValueKind):
    """A string; each rule is (predicate, error template with ``{key}`` and ``{value}``)."""

    what: str
    rules: tuple[tuple[Callable[[str], bool], str], ...] = ()
    nullable: bool = False
    secret: bool = False

    def parse(self, key: str, raw: Any) -> str | None:
        if self.nullable and (raw is None or raw == ""):
            return None  # "" and null both mean "not set"
        self.check(key, raw)
        return raw

    def check(self, key: str, value: Any) -> None:
        if value is None and self.nullable:
            return
        shown = "a non-string value" if self.secret else repr(value)
        if not isinstance(value, str):
            raise ConnectorConfigError(f"{key} must be {self.what} (got {shown})")
        for ok, template in self.rules:
            if not ok(value):
                raise ConnectorConfigError(template.format(key=key, value=value))

    def describe(self) -> str:
        return self.what


@dataclass(frozen=True)
class Choice(ValueKind):
    """One of a few words, or null (then someone else's default applies)."""

    choices: tuple[str, ...]

    def check(self, key: str, value: Any) -> None:
        if value is not None and value not in self.choices:
            raise ConnectorConfigError(
                f"{key}={value!r} is unknown: use one of {list(self.choices)}"
            )

    def describe(self) -> str:
        return " or ".join(f"`{c}`" for c in self.choices)


@dataclass(frozen=True)
class Names(ValueKind):
    """A non-empty list of names; a comma-separated string is accepted (shell-friendly)."""

    example: str

    def parse(self, key: str, raw: Any) -> tuple[str, ...]:
        if isinstance(raw, str):
            raw = [name.strip() for name in raw.split(",") if name.strip()]
        if not isinstance(raw, (list, tuple)):
            raise ConnectorConfigError(
                f"{key} must be a non-empty list such as {self.example} (got {raw!r})"
            )
        names = tuple(raw)
        self.check(key, names)
        return names

    def check(self, key: str, value: Any) -> None:
        if (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not value
            or not all(isinstance(name, str) and name for name in value)
        ):
            raise ConnectorConfigError(
                f"{key} must be a non-empty list such as {self.example} (got {value!r})"
            )

    def describe(self) -> str:
        return 'list of names, or `"A,B"`'


@dataclass(frozen=True)
class ParamsByName(ValueKind):
    """A mapping name -> {string: string} (per-backend init parameters)."""

    example: str
    inner_example: str

    def parse(self, key: str, raw: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(raw, Mapping) or not all(isinstance(v, Mapping) for v in raw.values()):
            raise ConnectorConfigError(
                f"{key} must map a backend to its init params, e.g. {self.example} (got {raw!r})"
            )
        params = {name: dict(inner) for name, inner in raw.items()}
        self.check(key, params)
        return params

    def check(self, key: str, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise ConnectorConfigError(
                f"{key} must map a backend to its init params, e.g. {self.example}"
            )
        for name, inner in value.items():
            if not isinstance(inner, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in inner.items()
            ):
                raise ConnectorConfigError(
                    f"{key}[{name!r}] must map strings to strings, e.g. {self.inner_example}"
                )

    def describe(self) -> str:
        return "object: backend -> {string: string}"


@dataclass(frozen=True)
class Fraction(ValueKind):
    """A share in (0, 1]."""

    def parse(self, key: str, raw: Any) -> float:
        number = _number(key, raw, float, (int, float, str), "a fraction in (0, 1]")
        self.check(key, number)
        return number

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConnectorConfigError(f"{key} must be a fraction in (0, 1] (got {value!r})")
        if not 0 < value <= 1:
            raise ConnectorConfigError(f"{key}={value} is out of range: use a fraction in (0, 1]")

    def describe(self) -> str:
        return "a fraction in (0, `1`]"

    def show(self, value: Any) -> str:
        return f"{value:g}"


@dataclass(frozen=True)
class PeerList(ValueKind):
    """Prefill peers a decode engine may dial: CIDRs, IPs, host names, optional ports."""

    def parse(self, key: str, raw: Any) -> tuple[str, ...]:
        if isinstance(raw, str):
            raw = [entry.strip() for entry in raw.split(",") if entry.strip()]
        if not isinstance(raw, (list, tuple)):
            raise ConnectorConfigError(
                f"{key} must be a list such as [\"10.0.0.0/8\", \"prefill-0.svc:5700\"] "
                f"(got {raw!r})"
            )
        entries = tuple(raw)
        self.check(key, entries)
        return entries

    def check(self, key: str, value: Any) -> None:
        from turbowire.connector.peers import PeerAllowlist, PeerAllowlistError

        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConnectorConfigError(f"{key} must be a list of CIDRs, IPs or host names")
        try:
            PeerAllowlist.parse(list(value))
        except PeerAllowlistError as exc:
            raise ConnectorConfigError(f"{key}: {exc}") from exc

    def describe(self) -> str:
        return ('list of CIDRs, IPs or host names, each with an optional `:port`, or `"A,B"`; '
                "empty: any")


def is_thread_cpus(text: str) -> bool:
    from turbowire.connector.threads import AUTO, INHERIT, parse_cpu_list

    if text in (AUTO, INHERIT):
        return True
    try:
        return bool(parse_cpu_list(text))
    except ValueError:
        return False


def is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
