"""Orbax's standard save/restore arguments, with Orbax's meaning, on the lossy handler."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax.training import orbax_utils

import orbax_lossy as ol

#: The default deltas with exact parameter bases (the default's bases are lossy): the tests
#: below compare a base's restore bitwise with what Orbax would restore.
EXACT_BASES = ol.LeafPolicy.create(base_defaults={"param": ol.Exact()})


def _state() -> dict:
    return {
        "params": {"w": jnp.linspace(-1.0, 1.0, 256, dtype=jnp.float32).reshape(16, 16)},
        "counts": np.arange(4, dtype=np.int64),
        "step": 7,
    }


@pytest.fixture
def saved(tmp_path):
    state = _state()
    with ol.checkpoint_manager(tmp_path / "ck") as mngr:
        mngr.save(0, args=ol.LossySave(state))
        mngr.wait_until_finished()
    return tmp_path / "ck", state


def test_flax_save_and_restore_args_from_target(saved, tmp_path) -> None:
    state = _state()
    save_args = orbax_utils.save_args_from_target(state)
    with ol.checkpoint_manager(tmp_path / "flax", policy=EXACT_BASES) as mngr:
        mngr.save(0, args=ol.LossySave(state, save_args=save_args))
        mngr.wait_until_finished()
        restore_args = orbax_utils.restore_args_from_target(state)
        out = mngr.restore(0, args=ol.LossyRestore(state, restore_args=restore_args))
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(state["params"]["w"]))
    assert isinstance(out["counts"], np.ndarray) and out["counts"].dtype == np.int64
    assert out["step"] == 7


def test_save_args_dtype_casts_like_orbax(tmp_path) -> None:
    state = _state()
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(), state)
    save_args["params"]["w"] = ocp.SaveArgs(dtype=jnp.bfloat16)
    with ol.checkpoint_manager(tmp_path, policy=EXACT_BASES) as mngr:
        mngr.save(0, args=ol.LossySave(state, save_args=save_args))
        mngr.wait_until_finished()
        out = mngr.restore(0)
    assert out["params"]["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]),
                                  np.asarray(state["params"]["w"].astype(jnp.bfloat16)))
    with pytest.raises(ol.InvalidArgumentError, match="chunk grid"):
        ol.LossySave(state, save_args={"params": {"w": ocp.SaveArgs(chunk_byte_size=1 << 20)}})
    with pytest.raises(ol.InvalidArgumentError, match="custom_metadata"):
        ol.LossySave(state, custom_metadata={"a": 1})


def test_partial_restore_and_placeholder(saved) -> None:
    root, state = saved
    with ol.checkpoint_manager(root) as mngr:
        subset = {"params": state["params"]}
        with pytest.raises(ol.InvalidArgumentError, match="partial_restore=True"):
            mngr.restore(0, args=ol.LossyRestore(subset))
        out = mngr.restore(0, args=ol.LossyRestore(subset, partial_restore=True))
        assert set(out) == {"params"}
        skipped = mngr.restore(0, args=ol.LossyRestore(
            {"params": state["params"], "counts": ocp.PLACEHOLDER, "step": ocp.PLACEHOLDER}))
        assert skipped["counts"] is ocp.PLACEHOLDER and skipped["step"] is ocp.PLACEHOLDER
        np.testing.assert_array_equal(np.asarray(skipped["params"]["w"]),
                                      np.asarray(out["params"]["w"]))


def test_unsupported_options_are_named(saved) -> None:
    with pytest.raises(ol.InvalidArgumentError, match="transforms"):
        ol.LossyRestore(transforms={})
    with pytest.raises(ol.InvalidArgumentError, match="support_layout"):
        ol.LossyRestore(support_layout=True)
    root, state = saved
    with ol.checkpoint_manager(root) as mngr:
        bad = {"params": {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32)},
               "counts": state["counts"], "step": 0}
        with pytest.raises(ol.InvalidArgumentError, match="neither pads nor truncates"):
            mngr.restore(0, args=ol.LossyRestore(bad, strict=False))


def test_numpy_leaves_stay_numpy_and_nothing_narrows(saved) -> None:
    root, state = saved
    with ol.checkpoint_manager(root) as mngr:
        plain = mngr.restore(0)
        assert isinstance(plain["counts"], np.ndarray) and plain["counts"].dtype == np.int64
        onto_numpy = mngr.restore(0, args=ol.LossyRestore(state))
        assert isinstance(onto_numpy["counts"], np.ndarray)
        if not jax.config.jax_enable_x64:
            target = dict(state, counts=jax.ShapeDtypeStruct((4,), np.int64))
            with pytest.raises(ol.InvalidArgumentError, match="narrow"):
                mngr.restore(0, args=ol.LossyRestore(target))


def test_item_metadata_is_orbax_tree_metadata(saved) -> None:
    root, _ = saved
    with ol.checkpoint_manager(root) as mngr:
        meta = mngr.item_metadata(0)
    assert isinstance(meta.tree, dict)
    w = meta["params"]["w"]
    assert isinstance(w, ocp.metadata.ArrayMetadata)
    assert w.shape == (16, 16) and w.dtype == jnp.float32 and w.sharding is not None
    assert isinstance(meta["step"], ocp.metadata.ScalarMetadata)
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta.tree)
    assert abstract["params"]["w"].shape == (16, 16)


def test_restore_without_target_uses_the_saved_sharding(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import orbax_lossy as ol
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
        sh = NamedSharding(mesh, P("data", "model"))
        w = jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), sh)
        exact_bases = ol.LeafPolicy.create(base_defaults={{"param": ol.Exact()}})
        with ol.checkpoint_manager({os.fspath(tmp_path)!r}, policy=exact_bases) as mngr:
            mngr.save(0, args=ol.LossySave({{"w": w}}))
            mngr.wait_until_finished()
            got = mngr.restore(0)["w"]
        assert got.sharding == sh, got.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_orbax_standard_args_on_the_lossy_manager_name_the_fix(tmp_path) -> None:
    with ol.checkpoint_manager(tmp_path) as mngr:
        with pytest.raises(ol.InvalidArgumentError, match=r"ol\.LossySave"):
            mngr.save(0, args=ocp.args.StandardSave(_state()))
        assert mngr.save(1, args=ol.LossySave(_state()))  # the manager is still usable
        mngr.wait_until_finished()
        with pytest.raises(ol.InvalidArgumentError, match=r"ol\.LossyRestore"):
            mngr.restore(1, args=ocp.args.StandardRestore(_state()))
        assert mngr.all_steps() == [1]


def test_restore_without_target_keeps_empty_nodes_like_orbax(tmp_path) -> None:
    import optax

    params = {"w": jnp.ones(3)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = {"params": params, "opt": tx.init(params), "e": {}, "l": []}
    with ocp.CheckpointManager(tmp_path / "plain") as plain:
        plain.save(0, args=ocp.args.StandardSave(state))
        plain.wait_until_finished()
        want = plain.restore(0)
    with ol.checkpoint_manager(tmp_path / "lossy") as mngr:
        mngr.save(0, args=ol.LossySave(state))
        mngr.wait_until_finished()
        got = mngr.restore(0)
        typed = mngr.restore(0, args=ol.LossyRestore(state))
    assert jax.tree.structure(got) == jax.tree.structure(want)  # EmptyState -> None, {} , []
    assert got["e"] == {} and got["l"] == [] and got["opt"][0] is None
    assert jax.tree.structure(typed) == jax.tree.structure(state)
