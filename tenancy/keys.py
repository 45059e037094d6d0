"""The API keys file (TOML): which keys belong to which tenant, and per-tenant settings.

Format::

    # One table per tenant; the table name is the tenant id
    # (1-64 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit).
    [tenants.alice]
    keys = ["sk-alice-1", "sk-alice-2"]   # required, non-empty; keys unique across the file
    ram_quota_bytes = 100_000_000         # optional integer >= 0
    ssd_quota_bytes = 2_000_000_000       # optional integer >= 0
    retention_seconds = 86400             # optional number > 0 (TTL in every tier)
    allow_http_images = false             # optional boolean, default false

    [tenants.ops]
    keys = ["sk-admin"]
    admin = true                          # optional boolean, default false

A key is any non-empty string without whitespace or control characters. Anything else (an
unknown field, a wrong type, an empty or duplicated key) is an error naming its location, e.g.
``tenants.bob.keys[0]``. Key values themselves are never echoed: they are secrets.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenancy.tenants import TenantId, TenantSettings, validate_tenant_id

_SETTINGS_FIELDS = ("ram_quota_bytes", "ssd_quota_bytes", "retention_seconds", "allow_http_images")
_TENANT_FIELDS = frozenset(("keys", "admin", *_SETTINGS_FIELDS))


class KeysFileError(ValueError):
    """The keys file cannot be read or does not follow the documented format."""


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """One tenant as declared in the keys file (before salts are derived)."""

    tenant_id: TenantId
    keys: tuple[str, ...]
    is_admin: bool
    settings: TenantSettings


def load_keys_file(path: Path) -> tuple[TenantEntry, ...]:
    """Read and validate a keys file.

    Args:
        path: TOML file in the format of this module's docstring.

    Returns:
        The tenants in file order.

    Raises:
        KeysFileError: Unreadable file, invalid TOML or any format violation.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise KeysFileError(f"cannot read keys file {path}: {e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KeysFileError(f"keys file {path} is not UTF-8: {e}") from e
    return parse_keys_toml(text, source=str(path))


def parse_keys_toml(text: str, *, source: str = "<keys>") -> tuple[TenantEntry, ...]:
    """Parse keys-file TOML text.

    Args:
        text: TOML document.
        source: Name used in error messages.

    Returns:
        The tenants in document order.

    Raises:
        KeysFileError: Invalid TOML or any format violation, naming the offending location.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise KeysFileError(f"{source}: invalid TOML: {e}") from e
    unknown = sorted(set(doc) - {"tenants"})
    if unknown:
        raise KeysFileError(f"{source}: unknown top-level field(s) {unknown}; expected [tenants.<id>]")
    tenants = doc.get("tenants")
    if tenants is not None and not isinstance(tenants, dict):
        raise KeysFileError(f"{source}: tenants must be a table, got {_type_name(tenants)}")
    if not tenants:
        raise KeysFileError(f"{source}: no tenants declared; add at least one [tenants.<id>] table")
    entries: list[TenantEntry] = []
    owner_of_key: dict[str, str] = {}
    for name, table in tenants.items():
        entry = _parse_tenant(source, name, table)
        for i, key in enumerate(entry.keys):
            previous = owner_of_key.get(key)
            if previous is not None:
                where = "the same tenant" if previous == name else f"tenant {previous!r}"
                raise KeysFileError(
                    f"{source}: tenants.{name}.keys[{i}] duplicates a key of {where}; "
                    "every key must map to exactly one tenant"
                )
            owner_of_key[key] = name
        entries.append(entry)
    return tuple(entries)


def _parse_tenant(source: str, name: str, table: Any) -> TenantEntry:
    where = f"{source}: tenants.{name}"
    try:
        tenant_id = validate_tenant_id(name)
    except ValueError as e:
        raise KeysFileError(f"{source}: {e}") from e
    if not isinstance(table, dict):
        raise KeysFileError(f"{where} must be a table, got {_type_name(table)}")
    unknown = sorted(set(table) - _TENANT_FIELDS)
    if unknown:
        raise KeysFileError(
            f"{where}: unknown field(s) {unknown}; allowed: {sorted(_TENANT_FIELDS)}"
        )
    keys = _parse_keys(where, table.get("keys"))
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise KeysFileError(f"{where}.admin must be a boolean, got {_type_name(admin)} {admin!r}")
    settings = _parse_settings(where, table)
    return TenantEntry(tenant_id=tenant_id, keys=keys, is_admin=admin, settings=settings)


def _parse_keys(where: str, value: Any) -> tuple[str, ...]:
    if value is None:
        raise KeysFileError(f"{where}.keys is missing; give a non-empty list of API keys")
    if not isinstance(value, list) or not value:
        raise KeysFileError(f"{where}.keys must be a non-empty list of strings, got {_type_name(value)}")
    keys: list[str] = []
    for i, key in enumerate(value):
        if not isinstance(key, str):
            raise KeysFileError(f"{where}.keys[{i}] must be a string, got {_type_name(key)}")
        if key == "":
            raise KeysFileError(f"{where}.keys[{i}] is empty")
        if any(c.isspace() or not c.isprintable() for c in key):
            raise KeysFileError(
                f"{where}.keys[{i}] contains whitespace or control characters "
                "(a Bearer token cannot carry them)"
            )
        keys.append(key)
    return tuple(keys)


def _parse_settings(where: str, table: Mapping[str, Any]) -> TenantSettings:
    values = {name: table[name] for name in _SETTINGS_FIELDS if name in table}
    for name in ("ram_quota_bytes", "ssd_quota_bytes"):
        if name in values and (isinstance(values[name], bool) or not isinstance(values[name], int)):
            raise KeysFileError(
                f"{where}.{name} must be an integer, got {_type_name(values[name])} {values[name]!r}"
            )
    retention = values.get("retention_seconds")
    if retention is not None and (isinstance(retention, bool) or not isinstance(retention, (int, float))):
        raise KeysFileError(
            f"{where}.retention_seconds must be a number, got {_type_name(retention)} {retention!r}"
        )
    allow = values.get("allow_http_images", False)
    if not isinstance(allow, bool):
        raise KeysFileError(
            f"{where}.allow_http_images must be a boolean, got {_type_name(allow)} {allow!r}"
        )
    try:
        return TenantSettings(**values)
    except ValueError as e:
        # Range errors (negative quota, non-positive retention) from TenantSettings.
        raise KeysFileError(f"{where}: {e}") from e


def _type_name(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)
