"""Exact leaves that did not change since the reference are stored as ``same`` (a zero run)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.format.manifest import read_manifest


def stored(root, step: int) -> dict[str, tuple[str, int]]:
    """Per leaf of a step: (codec id, bytes of its pieces)."""
    manifest = read_manifest(os.path.join(root, str(step), "default"))
    return {e.name: (e.codec.codec_id, sum(p.length for p in e.pieces))
            for e in manifest.leaves}


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint8) if a.dtype != np.bool_ else a


@pytest.fixture
def frozen() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 96)).astype(np.float32)
    w[3, :4] = [np.nan, -0.0, np.inf, -np.inf]  # special bits must survive too
    return {"w": w, "table": np.arange(4096, dtype=np.int32),
            "mask": rng.random(300) < 0.5}


def test_lossless_policy_stores_unchanged_leaves_once(tmp_path, frozen):
    root = str(tmp_path)
    mngr = ol.checkpoint_manager(root, policy=ol.LeafPolicy.lossless(), max_to_keep=1)
    states = {}
    for step in range(1, 5):
        moving = np.full((32, 32), step, np.float32)
        # a leaf that changes by one ulp in one element, and one whose zero changes sign
        ulp = frozen["w"].copy()
        ulp[0, 0] = np.nextafter(ulp[0, 0], np.float32(np.inf)) if step % 2 else ulp[0, 0]
        signed = np.zeros(8, np.float32) * (-1.0 if step % 2 else 1.0)
        states[step] = {**frozen, "moving": moving, "ulp": ulp, "signed": signed}
        mngr.save(step, args=ol.LossySave({k: jnp.asarray(v) for k, v in
                                           states[step].items()}))
        mngr.wait_until_finished()
    first, later = stored(root, 1), stored(root, 4)
    for name in ("w", "table", "mask"):
        assert first[name][0] == "exact"
        assert later[name][0] == "same" and later[name][1] < 16, later[name]
    assert first["w"][1] > 30_000
    for name in ("moving", "ulp", "signed"):  # changed bits: stored again, exactly
        assert later[name][0] == "exact", (name, later[name])
    mngr.close()
    # max_to_keep=1 kept step 1, which the unchanged leaves of step 4 come from
    assert os.path.isdir(os.path.join(root, "1"))
    restored = ol.checkpoint_manager(root).restore(4)
    for name, value in states[4].items():
        np.testing.assert_array_equal(bits(restored[name]), bits(value), err_msg=name)


def test_default_policy_stores_unchanged_state_as_same(tmp_path):
    # `params` marks the parameters, so `frozen_stats` is state: exact by default, and
    # `same` while it does not move; the parameters keep their lossy delta codecs
    rng = np.random.default_rng(1)
    params = rng.standard_normal((64, 64)).astype(np.float32)
    stats = rng.standard_normal(512).astype(np.float32)
    root = str(tmp_path)
    mngr = ol.checkpoint_manager(root)
    for step in range(1, 4):
        params = params + 1e-3 * rng.standard_normal(params.shape).astype(np.float32)
        mngr.save(step, args=ol.LossySave({"params": {"w": jnp.asarray(params)},
                                           "frozen_stats": jnp.asarray(stats)}))
        mngr.wait_until_finished()
    mngr.close()
    assert stored(root, 1)["frozen_stats"][0] == "exact"
    assert stored(root, 3)["frozen_stats"][0] == "same"
    assert stored(root, 3)["params/w"][0] not in ("exact", "same")
    restored = ol.checkpoint_manager(root).restore(3)
    np.testing.assert_array_equal(bits(restored["frozen_stats"]), bits(stats))


def test_same_without_its_earlier_link_names_the_missing_step(tmp_path, frozen):
    root = str(tmp_path)
    mngr = ol.checkpoint_manager(root, policy=ol.LeafPolicy.lossless())
    for step in (1, 2):
        mngr.save(step, args=ol.LossySave({k: jnp.asarray(v) for k, v in frozen.items()}))
        mngr.wait_until_finished()
    mngr.close()
    assert stored(root, 2)["w"][0] == "same"
    os.remove(os.path.join(root, "1", "default", "manifest.msgpack"))
    with pytest.raises(ol.LossyError, match="1"):
        ol.checkpoint_manager(root).restore(2)
