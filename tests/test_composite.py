"""A hand-built ``ocp.CheckpointManager`` (``handler_registry=``) where the lossy item sits in
an ``ocp.args.Composite`` beside ``JsonSave`` metadata and a ``StandardSave`` item."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import orbax_lossy as ol
from orbax_lossy.format.manifest import read_manifest_body as read_manifest
from orbax_lossy.treepaths import path_str

P = ocp.checkpoint_managers


def make_manager(root, handler, inner):
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ol.LossySave, handler)
    registry.add("state", ol.LossyRestore, handler)
    registry.add("meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
    registry.add("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
    registry.add("exact", ocp.args.StandardSave, ocp.StandardCheckpointHandler())
    registry.add("exact", ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ol.ChainPreservationPolicy(inner, handler, root, "state")
    )
    return ocp.CheckpointManager(root, options=options, handler_registry=registry)


def params_at(t):
    k = jax.random.split(jax.random.key(t), 2)
    return {
        "w": jnp.linspace(-1, 1, 300, dtype=jnp.float32).reshape(20, 15)
        + 0.02 * t * jax.random.normal(k[0], (20, 15)),
        "rng": k[1],
        "n": jnp.int32(t),
    }


def test_composite_items_chain_retention_and_restore(tmp_path, assert_bitwise):
    handler = ol.LossyCheckpointHandler(base_interval=3)
    mngr = make_manager(tmp_path, handler, P.LatestN(1))
    recon, kept = {}, []
    for step in range(5):
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=ol.LossySave(params_at(step)),
                meta=ocp.args.JsonSave({"step": step, "note": "hi"}),
                exact=ocp.args.StandardSave({"m": jnp.full((4,), step, jnp.float32)}),
            ),
        )
        recon[step] = {
            path_str(p): np.array(v)
            for p, v in zip(handler.reference.paths, handler.reference.values, strict=True)
        }
        mngr.wait_until_finished()
        kept.append(mngr.all_steps())
    # bases at 0 and 3; LatestN(1) alone would keep only the newest step
    assert kept == [[0], [0, 1], [0, 1, 2], [3], [3, 4]]
    m4 = read_manifest(tmp_path / "4" / "state")
    assert m4["kind"] == "delta" and m4["reference"]["step"] == 3
    mngr.close()

    # A fresh hand-built manager: restore everything with no args.
    fresh = make_manager(tmp_path, ol.LossyCheckpointHandler(base_interval=3), P.LatestN(1))
    out = fresh.restore(4)
    assert out.meta == {"step": 4, "note": "hi"}
    np.testing.assert_array_equal(np.asarray(out.exact["m"]), np.full((4,), 4, np.float32))
    for name, exp in recon[4].items():
        assert_bitwise(out.state[name], exp, name)
    assert jax.dtypes.issubdtype(out.state["rng"].dtype, jax.dtypes.prng_key)

    # Partial, typed restore of the lossy item only.
    target = {"w": jax.ShapeDtypeStruct((20, 15), jnp.float32)}
    part = fresh.restore(
        3, args=ocp.args.Composite(state=ol.LossyRestore(target, partial_restore=True)))
    assert set(part.keys()) == {"state"} and set(part.state) == {"w"}
    assert_bitwise(part.state["w"], recon[3]["w"], "w@3")

    # Shapes and dtypes without reading payloads.
    meta = fresh.item_metadata(4)
    assert (meta.state["w"].shape, meta.state["w"].dtype) == ((20, 15), jnp.float32)
    assert (meta.state["n"].shape, meta.state["n"].dtype) == ((), jnp.int32)
    assert jax.dtypes.issubdtype(meta.state["rng"].dtype, jax.dtypes.prng_key)

    # Continue: the restored full item became the reference, so step 5 is a delta on 4.
    fresh.restore(4, args=ocp.args.Composite(state=ol.LossyRestore()))
    fresh.save(
        5,
        args=ocp.args.Composite(
            state=ol.LossySave(params_at(5)),
            meta=ocp.args.JsonSave({"step": 5}),
            exact=ocp.args.StandardSave({"m": jnp.zeros((4,), jnp.float32)}),
        ),
    )
    fresh.wait_until_finished()
    assert read_manifest(tmp_path / "5" / "state")["reference"]["step"] == 4
    assert fresh.all_steps() == [3, 4, 5]
    fresh.close()


def test_plain_manager_in_a_new_session_restores_by_typestr(tmp_path, assert_bitwise):
    handler = ol.LossyCheckpointHandler(base_interval=4)
    mngr = make_manager(tmp_path, handler, P.LatestN(None))
    for step in range(2):
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=ol.LossySave(params_at(step)), meta=ocp.args.JsonSave({"step": step})
            ),
        )
    mngr.wait_until_finished()
    w1 = np.array(handler.reference.values[2])  # leaves sorted: n, rng, w
    mngr.close()
    plain = ocp.CheckpointManager(tmp_path)  # no registry: handlers found by typestr
    out = plain.restore(1)
    assert out.meta == {"step": 1}
    assert_bitwise(out.state["w"], w1, "w@1")
