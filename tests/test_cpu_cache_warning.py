"""The warning for multi-process CPU runs on jax >= 0.12.1 with the persistent compilation
cache on (two processes hang in programs loaded from it; docs/performance.md)."""

from __future__ import annotations

import warnings

import pytest

from orbax_lossy import handler


@pytest.mark.parametrize(("version", "platforms", "cache", "processes", "warns"), [
    ("0.12.1", {"cpu"}, "/tmp/cache", 2, True),
    ("0.13.0rc1", {"cpu"}, "/tmp/cache", 4, True),
    ("0.12.0.1", {"cpu"}, "/tmp/cache", 2, False),  # measured clean on 2026-12-04
    ("0.10.2", {"cpu"}, "/tmp/cache", 2, False),
    ("0.12.1", {"cpu"}, None, 2, False),
    ("0.12.1", {"cpu"}, "", 2, False),
    ("0.12.1", {"cpu"}, "/tmp/cache", 1, False),
    ("0.12.1", {"gpu"}, "/tmp/cache", 2, False),  # not measured there
])
def test_cpu_cache_hang_warning(version, platforms, cache, processes, warns):
    message = handler.cpu_cache_hang_warning(version, platforms, cache, processes)
    assert (message is not None) == warns
    if warns:
        assert version in message and cache in message and "cache off" in message


def test_the_warning_is_given_once_per_process(monkeypatch):
    monkeypatch.setattr(handler, "_WARNED", set())
    message = handler.cpu_cache_hang_warning("0.12.1", {"cpu"}, "/c", 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handler._warn_once(message)
        handler._warn_once(message)
        handler._warn_once(None)
    assert [str(w.message) for w in caught] == [message]
    assert caught[0].category is RuntimeWarning
