from __future__ import annotations

import hashlib
import hmac

import pytest

from tenancy.tenants import (
    Tenant,
    TenantId,
    TenantSettings,
    make_tenant,
    tenant_namespace,
    tenant_salt,
    validate_tenant_id,
)

SECRET = bytes(range(32))


def test_salt_is_hmac_sha256_of_tenant_id() -> None:
    salt = tenant_salt(SECRET, TenantId("alice"))
    assert salt == hmac.new(SECRET, b"alice", hashlib.sha256).digest()
    assert len(salt) == 32


def test_salt_golden_value() -> None:
    # Pinned: changing the derivation orphans every cache on disk.
    alice = make_tenant(SECRET, "alice")
    assert alice.salt.hex() == "6eefad2bed97b6d93ee663d67a44b46016b3d79dcad54ada39b61a1d14874d1b"
    assert alice.namespace == "4ad84fc8b38aa13e"
    assert alice.namespace == hashlib.sha256(b"ns" + alice.salt).hexdigest()[:16]


def test_salts_differ_per_tenant_and_are_stable() -> None:
    a1 = make_tenant(SECRET, "alice")
    a2 = make_tenant(SECRET, "alice")
    b = make_tenant(SECRET, "bob")
    assert a1 == a2
    assert a1.salt != b.salt
    assert a1.namespace != b.namespace


def test_salt_depends_on_secret() -> None:
    assert make_tenant(SECRET, "alice").salt != make_tenant(b"\x01" * 32, "alice").salt


def test_namespace_is_short_hex_and_hides_the_id() -> None:
    tenant = make_tenant(SECRET, "alice")
    assert len(tenant.namespace) == 16
    int(tenant.namespace, 16)
    assert "alice" not in tenant.namespace
    assert tenant.namespace == tenant_namespace(tenant.salt)


def test_repr_does_not_show_salt() -> None:
    tenant = make_tenant(SECRET, "alice")
    assert tenant.salt.hex() not in repr(tenant)
    assert repr(tenant.salt) not in repr(tenant)


def test_defaults() -> None:
    tenant = make_tenant(SECRET, "alice")
    assert tenant.is_admin is False
    assert tenant.settings == TenantSettings(None, None, None, False)
    assert isinstance(tenant, Tenant)


@pytest.mark.parametrize("bad", ["", "has space", "-lead", "a" * 65, "x\x00y", "é"])
def test_invalid_tenant_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant id"):
        validate_tenant_id(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ram_quota_bytes": -1}, "ram_quota_bytes must be >= 0, got -1"),
        ({"ssd_quota_bytes": 1.5}, "ssd_quota_bytes must be an integer"),
        ({"ram_quota_bytes": True}, "ram_quota_bytes must be an integer"),
        ({"retention_seconds": 0}, "retention_seconds must be a finite number > 0, got 0"),
        ({"retention_seconds": float("inf")}, "finite"),
        ({"allow_http_images": 1}, "allow_http_images must be a boolean"),
    ],
)
def test_settings_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantSettings(**kwargs)
