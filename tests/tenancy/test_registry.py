from __future__ import annotations

from pathlib import Path

import pytest

from tenancy.errors import AdminRequired, AuthError, InvalidCredentials, MissingCredentials, UnknownTenant
from tenancy.keys import KeysFileError, parse_keys_toml
from tenancy.registry import TenantRegistry, require_admin
from tenancy.tenants import make_tenant

SECRET = bytes(range(32))

KEYS = """
[tenants.alice]
keys = ["sk-alice-1", "sk-alice-2"]
ram_quota_bytes = 1000

[tenants.bob]
keys = ["sk-bob"]

[tenants.ops]
keys = ["sk-admin"]
admin = true
"""


def _registry() -> TenantRegistry:
    return TenantRegistry.from_entries(parse_keys_toml(KEYS), SECRET)


def test_from_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    registry = TenantRegistry.from_keys_file(path, SECRET)
    assert registry.requires_auth is True
    assert [t.tenant_id for t in registry.all()] == ["alice", "bob", "ops"]
    assert registry.get("alice") == make_tenant(SECRET, "alice", settings=registry.get("alice").settings)
    assert registry.get("alice").settings.ram_quota_bytes == 1000
    assert registry.get("ops").is_admin is True
    assert registry.get("bob").is_admin is False


def test_bad_keys_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[tenants.alice]\nkeys = ['']\n")
    with pytest.raises(KeysFileError, match=r"tenants.alice.keys\[0\] is empty"):
        TenantRegistry.from_keys_file(path, SECRET)


@pytest.mark.parametrize(
    ("header", "tenant"),
    [
        ("Bearer sk-alice-1", "alice"),
        ("Bearer sk-alice-2", "alice"),
        ("bearer sk-bob", "bob"),
        ("BEARER   sk-admin  ", "ops"),
        ("  Bearer sk-bob", "bob"),
    ],
)
def test_authenticate_valid(header: str, tenant: str) -> None:
    assert _registry().authenticate(header).tenant_id == tenant


@pytest.mark.parametrize("header", [None, "", "   "])
def test_missing_credentials(header: str | None) -> None:
    with pytest.raises(MissingCredentials) as info:
        _registry().authenticate(header)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"


@pytest.mark.parametrize(
    "header",
    [
        "Bearer sk-alice-3",
        "Bearer sk-alice-",
        "Bearer sk-alice-1x",
        "Bearer SK-ALICE-1",
        "Basic sk-alice-1",
        "sk-alice-1",
        "Bearer",
        "Bearer ",
        "Token sk-bob",
    ],
)
def test_invalid_credentials(header: str) -> None:
    with pytest.raises(InvalidCredentials) as info:
        _registry().authenticate(header)
    assert info.value.status_code == 401
    assert isinstance(info.value, AuthError)
    assert "sk-alice" not in str(info.value)


def test_keys_stored_only_as_digests() -> None:
    registry = _registry()
    state = repr([getattr(registry, name) for name in TenantRegistry.__slots__])
    assert "sk-alice-1" not in state and "sk-admin" not in state


def test_single_default() -> None:
    registry = TenantRegistry.single_default(SECRET)
    assert registry.requires_auth is False
    default = make_tenant(SECRET, "default", is_admin=True)
    assert registry.all() == (default,)
    assert registry.authenticate(None) == default
    assert registry.authenticate("Bearer anything") == default
    assert registry.get("default") == default


def test_get_unknown() -> None:
    with pytest.raises(UnknownTenant, match="unknown tenant 'carol'"):
        _registry().get("carol")


def test_by_namespace() -> None:
    registry = _registry()
    bob = registry.get("bob")
    assert registry.by_namespace(bob.namespace) == bob
    with pytest.raises(UnknownTenant, match="no tenant has namespace '0000'"):
        registry.by_namespace("0000")


def test_require_admin() -> None:
    registry = _registry()
    require_admin(registry.get("ops"))
    with pytest.raises(AdminRequired, match="tenant 'bob' is not an admin") as info:
        require_admin(registry.get("bob"))
    assert info.value.status_code == 403


def test_same_tenant_salt_across_registries() -> None:
    # Restart with the same secret: same salts, so disk caches stay reachable.
    assert _registry().get("alice").salt == _registry().get("alice").salt
    other = TenantRegistry.from_entries(parse_keys_toml(KEYS), b"\x07" * 32)
    assert other.get("alice").salt != _registry().get("alice").salt
