from __future__ import annotations

from pathlib import Path

import pytest

from tenancy.keys import KeysFileError, TenantEntry, load_keys_file, parse_keys_toml
from tenancy.tenants import TenantSettings

GOOD = """
[tenants.alice]
keys = ["sk-alice-1", "sk-alice-2"]
ram_quota_bytes = 100_000_000
ssd_quota_bytes = 2_000_000_000
retention_seconds = 86400
allow_http_images = true

[tenants.bob]
keys = ["sk-bob"]
retention_seconds = 0.5

[tenants.ops]
keys = ["sk-admin"]
admin = true
"""


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(GOOD)
    assert load_keys_file(path) == (
        TenantEntry(
            tenant_id="alice",
            keys=("sk-alice-1", "sk-alice-2"),
            is_admin=False,
            settings=TenantSettings(
                ram_quota_bytes=100_000_000,
                ssd_quota_bytes=2_000_000_000,
                retention_seconds=86400,
                allow_http_images=True,
            ),
        ),
        TenantEntry("bob", ("sk-bob",), False, TenantSettings(retention_seconds=0.5)),
        TenantEntry("ops", ("sk-admin",), True, TenantSettings()),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"no tenants declared"),
        ("[tenants]\n", r"no tenants declared"),
        ("tenants = 3\n", r"keys.toml: tenants must be a table, got integer"),
        ("[tenant.alice]\nkeys=['k']\n", r"unknown top-level field\(s\) \['tenant'\]"),
        ("[tenants.alice]\nkeys = ['k']\nram_quota = 5\n", r"tenants.alice: unknown field\(s\) \['ram_quota'\]"),
        ("[tenants.alice]\nadmin = true\n", r"tenants.alice.keys is missing"),
        ("[tenants.alice]\nkeys = []\n", r"tenants.alice.keys must be a non-empty list"),
        ("[tenants.alice]\nkeys = 'sk-1'\n", r"tenants.alice.keys must be a non-empty list of strings, got string"),
        ("[tenants.alice]\nkeys = ['ok', 7]\n", r"tenants.alice.keys\[1\] must be a string, got integer"),
        ("[tenants.alice]\nkeys = ['ok', '']\n", r"tenants.alice.keys\[1\] is empty"),
        ("[tenants.alice]\nkeys = ['has space']\n", r"tenants.alice.keys\[0\] contains whitespace"),
        ("[tenants.alice]\nkeys = ['k']\nadmin = 'yes'\n", r"tenants.alice.admin must be a boolean, got string 'yes'"),
        ("[tenants.alice]\nkeys = ['k']\nram_quota_bytes = '1GB'\n", r"tenants.alice.ram_quota_bytes must be an integer, got string '1GB'"),
        ("[tenants.alice]\nkeys = ['k']\nssd_quota_bytes = 1.5\n", r"tenants.alice.ssd_quota_bytes must be an integer, got float 1.5"),
        ("[tenants.alice]\nkeys = ['k']\nram_quota_bytes = true\n", r"tenants.alice.ram_quota_bytes must be an integer, got boolean True"),
        ("[tenants.alice]\nkeys = ['k']\nram_quota_bytes = -5\n", r"tenants.alice: ram_quota_bytes must be >= 0, got -5"),
        ("[tenants.alice]\nkeys = ['k']\nretention_seconds = 'a day'\n", r"tenants.alice.retention_seconds must be a number, got string"),
        ("[tenants.alice]\nkeys = ['k']\nretention_seconds = -1\n", r"tenants.alice: retention_seconds must be a finite number > 0, got -1"),
        ("[tenants.alice]\nkeys = ['k']\nallow_http_images = 1\n", r"tenants.alice.allow_http_images must be a boolean, got integer 1"),
        ("[tenants.alice]\nkeys = ['a']\n[tenants.bob]\nkeys = ['b', 'a']\n", r"tenants.bob.keys\[1\] duplicates a key of tenant 'alice'"),
        ("[tenants.alice]\nkeys = ['a', 'a']\n", r"tenants.alice.keys\[1\] duplicates a key of the same tenant"),
        ("[tenants.'bad id']\nkeys = ['a']\n", r"invalid tenant id 'bad id'"),
        ("[tenants]\nalice = 3\n", r"tenants.alice must be a table, got integer"),
        ("[tenants.alice\n", r"invalid TOML"),
    ],
)
def test_bad_files(text: str, message: str) -> None:
    with pytest.raises(KeysFileError, match=message):
        parse_keys_toml(text, source="keys.toml")


def test_errors_never_echo_key_values() -> None:
    with pytest.raises(KeysFileError) as info:
        parse_keys_toml("[tenants.a]\nkeys=['sk-secret-123']\n[tenants.b]\nkeys=['sk-secret-123']\n")
    assert "sk-secret-123" not in str(info.value)


def test_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[tenants.alice]\nkeys = []\n")
    with pytest.raises(KeysFileError, match=f"^{path}: tenants.alice.keys"):
        load_keys_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="cannot read keys file"):
        load_keys_file(tmp_path / "nope.toml")
