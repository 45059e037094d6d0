"""Fixtures of the SSD tier tests: the cache family parameter of the engine tests."""

from __future__ import annotations

from tests.engine.conftest import family  # noqa: F401  (a pytest fixture, used by name)
