"""Large trees are encoded and decoded in groups of leaves (bounded device temporaries)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import orbax_lossy as ol
from orbax_lossy.engine import device


def test_leaf_groups_are_consecutive_and_bounded() -> None:
    assert device.leaf_groups([10, 10, 100, 5, 5, 5], 20) == [range(0, 2), range(2, 3),
                                                                range(3, 6)]
    assert device.leaf_groups([], 20) == []
    assert device.leaf_groups([50], 20) == [range(0, 1)]
    sizes = list(np.random.default_rng(0).integers(1, 100, 200))
    groups = device.leaf_groups(sizes, 150)
    assert [j for g in groups for j in g] == list(range(200))
    assert all(sum(sizes[j] for j in g) <= 150 or len(g) == 1 for g in groups)


def test_grouped_programs_round_trip_like_one_program(tmp_path, monkeypatch,
                                                      assert_bitwise) -> None:
    """With a tiny group budget every leaf runs in its own program; saves and restores of a
    base and deltas give the same bits as with one program for the whole tree."""
    rng = np.random.default_rng(1)
    state = {"params": {f"w{i}": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
                        for i in range(3)},
             "opt_state": {"mu": {f"w{i}": jnp.asarray(1e-3 * rng.standard_normal((32, 16)),
                                                       jnp.float32) for i in range(3)}},
             "step": jnp.int32(0)}
    results = {}
    for budget in (1 << 40, 1):
        monkeypatch.setattr(device, "GROUP_BYTES", budget)
        handler = ol.LossyCheckpointHandler()
        mngr = ol.checkpoint_manager(tmp_path / str(budget), handler=handler, max_to_keep=None)
        s = state
        for step in range(3):
            s = jax.tree.map(lambda x: x * 1.01 + 1e-3 if x.dtype == jnp.float32 else x + 1, s)
            mngr.save(step, args=ol.LossySave(s))
        mngr.wait_until_finished()
        results[budget] = [np.asarray(x) for x in jax.tree.leaves(mngr.restore(2))]
        mngr.close()
    for a, b in zip(results[1 << 40], results[1], strict=True):
        assert_bitwise(b, a)
