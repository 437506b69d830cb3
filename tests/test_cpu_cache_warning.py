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
    monkeypatch.setattr(handler, "cpu_cache_hang_warning", lambda *args: "the message")
    handler._warn_cache_hang.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handler._warn_cache_hang()
            handler._warn_cache_hang()
    finally:
        handler._warn_cache_hang.cache_clear()
    assert [str(w.message) for w in caught] == ["the message"]
    assert caught[0].category is RuntimeWarning


def test_jax_versions_whose_cache_hangs_multiprocess():
    assert handler.jax_cache_hangs_multiprocess("0.12.1")
    assert handler.jax_cache_hangs_multiprocess("0.13.0.dev20270101")
    assert not handler.jax_cache_hangs_multiprocess("0.12.0.1")
    assert not handler.jax_cache_hangs_multiprocess("0.10.2")
