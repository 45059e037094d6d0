from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from tenancy.secret import SECRET_BYTES, SecretFileError, load_or_create_secret


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secret_created_0600_and_reused(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    first = load_or_create_secret(cache_dir)
    path = cache_dir / "server_secret"
    assert len(first) == SECRET_BYTES == 32
    assert _mode(path) == 0o600
    assert path.read_bytes() == first
    assert load_or_create_secret(cache_dir) == first
    # No temporary files are left behind.
    assert sorted(p.name for p in cache_dir.iterdir()) == ["server_secret"]


def test_secret_created_0600_despite_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        load_or_create_secret(tmp_path)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "server_secret") == 0o600


def test_two_cache_dirs_get_different_secrets(tmp_path: Path) -> None:
    assert load_or_create_secret(tmp_path / "a") != load_or_create_secret(tmp_path / "b")


def test_racing_creators_agree(tmp_path: Path) -> None:
    results: list[bytes] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        results.append(load_or_create_secret(tmp_path))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    assert len(set(results)) == 1
    assert results[0] == (tmp_path / "server_secret").read_bytes()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_refuses_group_or_other_permissions(tmp_path: Path, mode: int) -> None:
    load_or_create_secret(tmp_path)
    path = tmp_path / "server_secret"
    path.chmod(mode)
    with pytest.raises(SecretFileError, match=f"permissions 0{mode:o}.*chmod 600"):
        load_or_create_secret(tmp_path)


@pytest.mark.parametrize("length", [0, 16, 33])
def test_refuses_wrong_length(tmp_path: Path, length: int) -> None:
    path = tmp_path / "server_secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"x" * length)
    os.close(fd)
    with pytest.raises(SecretFileError, match=f"holds {length} bytes, expected exactly 32"):
        load_or_create_secret(tmp_path)
    # Never overwritten: the operator decides.
    assert path.read_bytes() == b"x" * length


def test_refuses_symlink(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    fd = os.open(real, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"s" * 32)
    os.close(fd)
    (tmp_path / "server_secret").symlink_to(real)
    with pytest.raises(SecretFileError, match="symbolic link"):
        load_or_create_secret(tmp_path)
