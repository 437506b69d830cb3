"""Device programs: one per class of leaves for saves; old whole-tree checkpoints decode in
the groups of leaves they were written with (``leaf_groups``)."""

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


def _pairs(n: int, rng: np.random.Generator) -> dict:
    """``n`` matrices and ``n`` weakly typed vectors (``jnp.full`` of a Python float)."""
    return {"params": {**{f"w{i}": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
                          for i in range(n)},
                       **{f"b{i}": jnp.full((8,), 0.5) for i in range(n)}}}


def test_saves_compile_one_program_per_class_of_leaves(tmp_path) -> None:
    """The encode programs are cached per class of leaves (shape, dtype, sharding, codec), so
    a tree with 3x the leaves of the same classes compiles nothing new, and weakly typed
    leaves (copied at a first save, held without a copy later, restored strong) do not
    compile their programs again either."""
    rng = np.random.default_rng(1)
    device.encode_tree.clear_cache()
    counts = []
    for n in (4, 12):
        state = _pairs(n, rng)
        assert all(x.weak_type for k, x in state["params"].items() if k.startswith("b"))
        mngr = ol.checkpoint_manager(tmp_path / str(n), max_to_keep=None)
        for step in range(4):
            state = jax.tree.map(lambda x, d=1e-3 * (step + 1): x + d, state)
            mngr.save(step, args=ol.LossySave(state))
            mngr.wait_until_finished()
            counts.append(device.encode_tree._cache_size())
        restored = mngr.restore(3)
        mngr.save(4, args=ol.LossySave(jax.tree.map(lambda x: x + 1e-3, restored)))
        mngr.wait_until_finished()
        counts.append(device.encode_tree._cache_size())
        mngr.close()
    # base: Cluster(8) on both shapes; deltas: Cluster(3, delta) on both shapes
    assert counts == [2] + [4] * 9, counts
