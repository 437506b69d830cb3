"""Retention with ``ChainPreservationPolicy``: whatever the inner Orbax policy deletes, every
step the manager lists stays restorable (bit for bit), across restarts."""

from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orbax_lossy as ol
from orbax_lossy.format.manifest import read_manifest_body as read_manifest
from orbax_lossy.treepaths import flatten, path_str

P = ocp.checkpoint_managers

POLICIES = {
    "latest1": lambda: P.LatestN(1),
    "latest2": lambda: P.LatestN(2),
    "every3": lambda: P.EveryNSteps(3),
    "every4_or_latest1": lambda: P.AnyPreservationPolicy([P.EveryNSteps(4), P.LatestN(1)]),
    "best1": lambda: P.BestN(
        get_metric_fn=lambda m: m["loss"], n=1, keep_checkpoints_without_metrics=False
    ),
    "custom": lambda: P.CustomSteps([1, 5]),
}


def state_at(t: int) -> dict:
    k = jax.random.key(t)
    return {
        "w": jnp.sin(jnp.arange(96, dtype=jnp.float32) * 0.1 + 0.05 * t)
        + 0.01 * jax.random.normal(k, (96,)),
        "n": jnp.int32(t),
    }


def snapshot(handler):
    return {
        path_str(p): np.array(v)
        for p, v in zip(handler.reference.paths, handler.reference.values, strict=True)
    }


def bits(x):
    a = np.asarray(x)
    return a.view(np.uint32) if a.dtype == np.float32 else a


class Session:
    """One 'process': a handler and a manager on the shared directory."""

    def __init__(self, root: str, policy: str, base_interval: int):
        self.handler = ol.LossyCheckpointHandler(base_interval=base_interval)
        self.mngr = ol.checkpoint_manager(
            root, handler=self.handler, preservation_policy=POLICIES[policy]()
        )


def assert_all_listed_restorable(root: str, listed: list[int], recon: dict) -> None:
    on_disk = sorted(int(n) for n in os.listdir(root) if n.isdigit())
    assert on_disk == listed
    reader = ocp.CheckpointManager(root)  # a plain manager in a "fresh process"
    for step in listed:
        restored = reader.restore(step)
        paths, leaves, _ = flatten(restored)
        for p, v in zip(paths, leaves, strict=True):
            np.testing.assert_array_equal(
                bits(v), bits(recon[step][path_str(p)]), err_msg=f"step {step} {path_str(p)}"
            )
    reader.close()


def closure_holds(root: str, listed: list[int]) -> None:
    for step in listed:
        ref = read_manifest(os.path.join(root, str(step), "default"))["reference"]
        assert ref is None or ref["step"] in listed, f"step {step} needs deleted {ref['step']}"


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(1, 3), st.booleans(), st.floats(0, 1)),
        st.tuples(st.just("restart"), st.sampled_from(sorted(POLICIES)), st.booleans()),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first_policy=st.sampled_from(sorted(POLICIES)),
    base_interval=st.integers(1, 4),
    ops=OPS,
)
def test_listed_steps_are_always_restorable(first_policy, base_interval, ops):
    with tempfile.TemporaryDirectory() as root:
        session = Session(root, first_policy, base_interval)
        recon: dict[int, dict] = {}
        step = 0
        for op in ops:
            if op[0] == "save":
                _, gap, force_base, loss = op
                session.mngr.save(
                    step,
                    args=ol.LossySave(state_at(step), force_base=force_base),
                    metrics={"loss": loss},
                )
                recon[step] = snapshot(session.handler)
                step += gap
            else:
                _, policy, restore_latest = op
                session.mngr.wait_until_finished()
                session.mngr.close()
                session = Session(root, policy, base_interval)
                latest = session.mngr.latest_step()
                if restore_latest and latest is not None:
                    session.mngr.restore(latest)  # the next save is a delta on it
            session.mngr.wait_until_finished()
            listed = session.mngr.all_steps()
            closure_holds(root, listed)
        assert_all_listed_restorable(root, session.mngr.all_steps(), recon)
        session.mngr.close()


def test_latest_n_keeps_the_chain_of_the_latest_step(tmp_path):
    mngr = ol.checkpoint_manager(tmp_path, base_interval=4, max_to_keep=1)
    seen = []
    for step in range(6):
        mngr.save(step, args=ol.LossySave(state_at(step)))
        mngr.wait_until_finished()
        seen.append(mngr.all_steps())
    # bases at 0 and 4; LatestN(1) alone would keep only the newest step
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [4], [4, 5]]


def test_policy_rebuilds_dependencies_from_disk_after_restart(tmp_path):
    with ol.checkpoint_manager(tmp_path, base_interval=10, max_to_keep=None) as m1:
        for step in range(4):
            m1.save(step, args=ol.LossySave(state_at(step)))
    h = ol.LossyCheckpointHandler(base_interval=10)
    m2 = ol.checkpoint_manager(tmp_path, handler=h, preservation_policy=P.LatestN(1))
    m2.restore(3)
    m2.save(4, args=ol.LossySave(state_at(4)))  # delta on 3, whose chain is on disk only
    m2.wait_until_finished()
    assert m2.all_steps() == [0, 1, 2, 3, 4]
    assert read_manifest(tmp_path / "4" / "default")["reference"]["step"] == 3


def test_without_the_chain_policy_saves_are_self_contained_and_warn(tmp_path):
    """A plain manager with Orbax's own retention: no step may become unrestorable."""
    handler = ol.LossyCheckpointHandler(base_interval=10)
    registry = ocp.handlers.create_default_handler_registry(default=handler)
    options = ocp.CheckpointManagerOptions(preservation_policy=P.LatestN(1))
    with ocp.CheckpointManager(tmp_path, options=options, handler_registry=registry) as mngr:
        with pytest.warns(UserWarning, match="ChainPreservationPolicy"):
            for step in range(3):
                mngr.save(step, args=ol.LossySave(state_at(step)))
            mngr.wait_until_finished()
        assert mngr.all_steps() == [2]
        assert read_manifest(tmp_path / "2" / "default")["kind"] == "base"
        held = snapshot(handler)
        restored = mngr.restore(2)
        # the handler's reconstruction of step 2 bit for bit (a self-contained base; the
        # default's bases code float parameters with Cluster(8))
        np.testing.assert_array_equal(np.asarray(restored["w"]).view(np.uint32),
                                      held["w"].view(np.uint32))
        np.testing.assert_allclose(np.asarray(restored["w"]), np.asarray(state_at(2)["w"]),
                                   atol=2e-2)


def test_unmanaged_deltas_opt_in_breaks_the_chain(tmp_path):
    """Control: with deltas forced on, LatestN alone deletes what step 2 needs."""
    handler = ol.LossyCheckpointHandler(base_interval=10, unmanaged_deltas=True)
    registry = ocp.handlers.create_default_handler_registry(default=handler)
    options = ocp.CheckpointManagerOptions(preservation_policy=P.LatestN(1))
    with ocp.CheckpointManager(tmp_path, options=options, handler_registry=registry) as mngr:
        for step in range(3):
            mngr.save(step, args=ol.LossySave(state_at(step)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2]
        with pytest.raises(ol.MissingStepError) as e:
            mngr.restore(2)
        assert e.value.step == 1


@pytest.mark.parametrize(
    "options",
    [
        ocp.CheckpointManagerOptions(max_to_keep=2),
        ocp.CheckpointManagerOptions(max_to_keep=1, keep_period=3),
        ocp.CheckpointManagerOptions(
            max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min",
            keep_checkpoints_without_metrics=False,
        ),
        ocp.CheckpointManagerOptions(keep_time_interval=datetime.timedelta(seconds=30)),
    ],
)
def test_legacy_options_become_the_policy_orbax_builds(options):
    from orbax.checkpoint import checkpoint_manager as cm

    from orbax_lossy.retention import legacy_preservation_policy

    @dataclasses.dataclass
    class Info:
        step: int
        time: datetime.datetime
        metrics: dict | None

    t0 = datetime.datetime(2024, 1, 1)
    infos = [
        Info(
            step=s, time=t0 + datetime.timedelta(seconds=20 * s),
            metrics=None if s == 4 else {"loss": (s * 7) % 5},
        )
        for s in range(8)
    ]
    ctx = P.PreservationContext()
    ours = legacy_preservation_policy(options).should_preserve(infos, context=ctx)
    orbax = cm._get_default_preservation_policy(options).should_preserve(infos, context=ctx)
    assert list(ours) == list(orbax)
