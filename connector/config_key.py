"""``ConfigKey``: what the key table declares of one ``kv_connector_extra_config`` key (its kind,
doc, default or how the default is derived) and how docs/configuration.md shows it. A module of
its own so every part of the table (``config_keys``, ``config_store``) builds its rows from it
without importing another part."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from turbowire.connector.config_kinds import ValueKind

__all__ = ["PRESET_LIST", "ConfigKey", "Derive"]


#: Stands for the codec's preset names in a key's doc (``ConfigKey.rendered_doc``).
PRESET_LIST = "{presets}"


Derive = Callable[[Mapping[str, Any], Mapping[str, str]], Any]


@dataclass(frozen=True)
class ConfigKey:
    """One ``kv_connector_extra_config`` key: everything the code and the docs say about it.

    ``derive`` computes the default from the other keys' values and the environment when the key
    is absent (``default_doc`` then says so in the docs); ``stored`` is False for keys that only
    steer the parsing and are not kept in ``TurboWireConfig``.
    """

    name: str
    kind: ValueKind
    doc: str
    default: Any = None
    factory: Callable[[], Any] | None = None
    default_doc: str = ""
    derive: Derive | None = None
    stored: bool = True

    def default_value(self) -> Any:
        """The default when nothing else decides it (a fresh object for mutable defaults)."""
        return self.factory() if self.factory is not None else self.default

    def rendered_doc(self) -> str:
        """The table's "meaning" cell: ``doc`` with the codec's preset names filled in (imported
        here only: the codec loads torch, the config must not)."""
        if PRESET_LIST not in self.doc:
            return self.doc
        from turbowire.codec.presets import list_presets

        return self.doc.replace(PRESET_LIST, ", ".join(f"`{p}`" for p in list_presets()))

    def default_cell(self) -> str:
        """The README default column."""
        return self.default_doc or f"`{self.kind.show(self.default_value())}`"
