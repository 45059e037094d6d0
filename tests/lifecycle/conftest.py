"""Fixtures of the tenancy-lifecycle tests: the live-server factories of the server tests."""

from __future__ import annotations

from tests.server.conftest import tiny_model_path  # noqa: F401  (a fixture, used by name)
