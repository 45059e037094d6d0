"""The retention sweeper of a live server: with a four-second retention and a short sweep
interval, a tenant's state leaves the disk on its own (no request needed), while the other
tenant's stays."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lifecycle.test_erasure_live import index_rows, namespace_of
from tests.server.conftest import LiveServer, make_config, running_server
from tests.server.helpers import image_message, png_data_url

KEYS_TOML = """
[tenants.brief]
keys = ["sk-brief"]
retention_seconds = 4

[tenants.steady]
keys = ["sk-steady"]
"""


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("sweeper")
    keys = root / "keys.toml"
    keys.write_text(KEYS_TOML)
    config = make_config(tiny_model_path, root / "state", keys_file=keys, ttl_sweep_interval_s=0.2)
    with running_server(config) as live:
        yield live


def test_the_sweeper_removes_expired_state_from_disk(server: LiveServer) -> None:
    messages = [image_message("What colour is this?", png_data_url((24, 24), (10, 90, 200)))]
    for key in ("sk-steady", "sk-brief"):  # brief last: its four seconds start now
        server.client(api_key=key).chat.completions.create(
            model=server.model, messages=messages, max_tokens=2, temperature=0)
    brief, steady = namespace_of(server, "brief"), namespace_of(server, "steady")
    # Features are written through by the background writer: wait for both rows to land
    # (well within brief's retention).
    deadline = time.monotonic() + 3.0
    while {ns for _, _, ns, _ in index_rows(server)} != {brief, steady}:
        assert time.monotonic() < deadline, index_rows(server)
        time.sleep(0.05)
    deadline = time.monotonic() + 15.0
    while brief in {ns for _, _, ns, _ in index_rows(server)}:
        assert time.monotonic() < deadline, "the sweeper did not remove the expired features"
        time.sleep(0.1)
    assert {ns for _, _, ns, _ in index_rows(server)} == {steady}
    assert not list((server.config.cache_dir / "vision").glob(f"*/{brief}/*/*/*"))
