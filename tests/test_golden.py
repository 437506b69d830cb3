"""Golden fixtures: checkpoints written by every past format version restore bit for bit.

Each ``tests/fixtures/v<N>/`` holds a base + two deltas written by the real library at
format version N, and the values that version restored right after saving (see
``tests/fixtures/make_golden.py``, which also explains how to add the next version). Only the
public API is used here, so these tests hold across internal refactors.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_lossy as ol

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
VERSIONS = sorted(p.name for p in FIXTURES.glob("v*") if (p / "expected.json").is_file())


def _bits(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.array(x, copy=True)
    return a if a.dtype.kind in "biu" else a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _kind(x) -> str:
    if isinstance(x, jax.Array):
        return "prng_key" if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else "jax"
    return "numpy" if isinstance(x, np.ndarray) else type(x).__name__


def _check(restored, fixture: pathlib.Path, step: int) -> None:
    meta = json.loads((fixture / "expected.json").read_text())
    with np.load(fixture / "expected.npz") as npz:
        expected = {k: npz[k] for k in npz.files}
    flat, _ = jax.tree_util.tree_flatten_with_path(restored)
    got = {jax.tree_util.keystr(p): v for p, v in flat}
    assert set(got) == set(meta["leaves"]), f"{fixture.name} step {step}: leaf paths differ"
    for name, value in got.items():
        info = meta["leaves"][name]
        where = f"{fixture.name} step {step} {name}"
        assert _kind(value) == info["kind"], where
        if info["kind"] == "prng_key":
            assert str(value.dtype) == info["dtype"], where
        else:
            assert str(np.asarray(value).dtype) == info["dtype"], where
        bits, want = _bits(value), expected[f"{step}|{name}"]
        assert bits.shape == want.shape and bits.dtype == want.dtype, where
        np.testing.assert_array_equal(bits, want, err_msg=where)


@pytest.fixture(params=VERSIONS)
def fixture_copy(request, tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """(fixture directory, a writable copy of its checkpoint directory)."""
    src = FIXTURES / request.param
    dst = tmp_path / request.param
    shutil.copytree(src / "ckpt", dst)
    return src, dst


def test_fixtures_exist_for_every_format_version() -> None:
    versions = [json.loads((FIXTURES / v / "expected.json").read_text()) for v in VERSIONS]
    assert sorted(m["format_version"] for m in versions)[:2] == [1, 2]
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 200_000, f"fixtures grew to {total} bytes; keep them small"


def test_manager_restores_every_step_bitwise(fixture_copy) -> None:
    fixture, ckpt = fixture_copy
    steps = json.loads((fixture / "expected.json").read_text())["steps"]
    mngr = ol.checkpoint_manager(ckpt, max_to_keep=None, enable_async_checkpointing=False)
    try:
        assert sorted(mngr.all_steps()) == steps
        for step in steps:
            _check(mngr.restore(step), fixture, step)
    finally:
        mngr.close()


def test_checkpointer_restores_newest_delta_bitwise(fixture_copy) -> None:
    fixture, ckpt = fixture_copy
    step = max(json.loads((fixture / "expected.json").read_text())["steps"])
    with ocp.Checkpointer(ol.LossyCheckpointHandler()) as ckptr:
        restored = ckptr.restore(ckpt / str(step) / "default", args=ol.LossyRestore())
    _check(restored, fixture, step)
