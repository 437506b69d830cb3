"""The Orbax guides' manager patterns with the lossy handler swapped in.

Each run saves ~10 steps of a small training state (float params, an int counter) beside a
JSON item, then checks: every listed step restores and matches what was saved (ints exactly,
which pins the step; float params within 10% of the leaf's largest magnitude: these states
change by up to 7% of it per save, and the default parameter codec, ``Step(2.5)``, errs by up
to half a step, at most half the largest change of the coded delta); the listed steps are
what plain Orbax lists for the same options plus the steps that ``ol.kept_for_chains``
reports; the caller's options object is unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import warnings

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_lossy as ol

P = ocp.checkpoint_managers
Opts = ocp.CheckpointManagerOptions
LOSSES = [4.0, 2.5, 0.5, 3.0, 2.0, 5.0, 1.5, 2.2, 3.3, 0.9]  # best (min) at step 2
N_STEPS = len(LOSSES)


def state_at(t: int) -> dict:
    grid = np.linspace(-1.0, 1.0, 192, dtype=np.float32)
    return {
        "params": {
            "kernel": jnp.asarray((np.sin(3 * grid + 0.07 * t)).reshape(12, 16)),
            "bias": jnp.asarray(0.1 * np.cos(grid[:16] - 0.05 * t)),
        },
        "count": jnp.int32(7 * t + 1),
    }


def config_at(t: int) -> dict:
    return {"lr": 0.01, "epoch": t // 4, "tag": f"run-{t}"}


def assert_matches(restored: dict, saved: dict, where: str) -> None:
    for name in ("kernel", "bias"):
        got = np.asarray(restored["params"][name])
        exp = np.asarray(saved["params"][name])
        bound = 0.1 * float(np.max(np.abs(exp)))
        assert got.shape == exp.shape, where
        assert float(np.max(np.abs(got - exp))) <= bound, f"{where}: {name}"
    assert int(restored["count"]) == int(saved["count"]), f"{where}: count"


def plain_orbax_steps(root: os.PathLike, options: Opts, steps: list[int]) -> list[int]:
    """What plain Orbax lists after the same saves (a JSON item stands in for the state)."""
    with ocp.CheckpointManager(root, options=copy.copy(options)) as mngr:
        for t in steps:
            mngr.save(t, args=ocp.args.JsonSave(config_at(t)), metrics={"loss": LOSSES[t]})
        mngr.wait_until_finished()
        return mngr.all_steps()


def run(mngr: ocp.CheckpointManager, multi: bool) -> list[int]:
    saved = []
    for t in range(N_STEPS):
        if multi:
            args = ocp.args.Composite(
                state=ol.LossySave(state_at(t)), extra=ocp.args.JsonSave(config_at(t))
            )
        else:
            args = ol.LossySave(state_at(t))
        if mngr.save(t, args=args, metrics={"loss": LOSSES[t]}):
            saved.append(t)
    mngr.wait_until_finished()
    return saved


def check_every_listed_step(mngr: ocp.CheckpointManager, multi: bool) -> None:
    for t in mngr.all_steps():
        out = mngr.restore(t)
        if multi:
            assert out.extra == config_at(t)
            out = out.state
        assert_matches(out, state_at(t), f"step {t}")


def check_listing(mngr, root, options: Opts, saved: list[int]) -> dict[int, list[int]]:
    """Listed = what plain Orbax keeps + steps reported as kept only for chains."""
    extra = ol.kept_for_chains(mngr)
    plain = plain_orbax_steps(root.parent / f"{root.name}-plain", options, saved)
    assert set(mngr.all_steps()) == set(plain) | set(extra)
    assert not set(extra) & set(plain)
    deps = ol.chain_dependencies(mngr)
    for step, needers in extra.items():
        assert needers and all(step in deps[n] for n in needers)
    for step in mngr.all_steps():
        assert set(deps[step]) <= set(mngr.all_steps()), f"step {step} lost a dependency"
    return extra


def fingerprint(options: Opts) -> dict:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


OPTIONS = {
    "max_to_keep": lambda: Opts(max_to_keep=2),
    "latest_n": lambda: Opts(preservation_policy=P.LatestN(2)),
    "keep_period": lambda: Opts(max_to_keep=1, keep_period=4),
    "best_min": lambda: Opts(max_to_keep=1, best_fn=lambda m: m["loss"], best_mode="min"),
    "best_no_metrics": lambda: Opts(
        max_to_keep=2, best_fn=lambda m: m["loss"], keep_checkpoints_without_metrics=False
    ),
    "every_n_steps": lambda: Opts(preservation_policy=P.EveryNSteps(4)),
    "any_policy": lambda: Opts(
        preservation_policy=P.AnyPreservationPolicy([P.CustomSteps([1]), P.LatestN(1)])
    ),
    "save_interval": lambda: Opts(max_to_keep=2, save_interval_steps=2),
    "keep_time": lambda: Opts(max_to_keep=1, keep_time_interval=datetime.timedelta(hours=1)),
}


@pytest.mark.parametrize(
    ("name", "multi", "use_async"),
    [
        ("max_to_keep", False, True),
        ("max_to_keep", True, False),
        ("latest_n", True, True),
        ("keep_period", True, True),
        ("best_min", False, False),
        ("best_min", True, True),
        ("best_no_metrics", True, False),
        ("every_n_steps", False, True),
        ("any_policy", True, False),
        ("save_interval", True, True),
        ("keep_time", False, False),
    ],
)
def test_lossy_manager_with_orbax_options(tmp_path, name, multi, use_async):
    options = dataclasses.replace(OPTIONS[name](), enable_async_checkpointing=use_async)
    before = fingerprint(options)
    root = tmp_path / "ckpt"
    items = {"extra": ocp.handlers.JsonCheckpointHandler()} if multi else None
    handler = ol.LossyCheckpointHandler(base_interval=3)
    with ol.checkpoint_manager(root, handler=handler, items=items, options=options) as mngr:
        saved = run(mngr, multi)
        extra = check_listing(mngr, root, options, saved)
        check_every_listed_step(mngr, multi)
        if options.best_fn is not None:
            pick = min if options.best_mode == "min" else max
            best = pick(saved, key=lambda t: LOSSES[t])
            assert mngr.best_step() == best and best in mngr.all_steps()
        if name == "max_to_keep":
            # bases every 3 saves: 0, 3, 6, 9; the last two steps 8, 9: 8 needs 6 and 7
            assert mngr.all_steps() == [6, 7, 8, 9] and extra == {6: [8], 7: [8]}
    assert fingerprint(options) == before  # the caller's object is untouched


@pytest.mark.parametrize("use_async", [False, True])
def test_hand_built_manager_with_composite(tmp_path, use_async):
    """Orbax's guide pattern: a registry, Composite(state=..., extra=JsonSave), a policy."""
    handler = ol.LossyCheckpointHandler(base_interval=4)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(None, ol.LossySave, handler)  # any item name receiving Lossy args
    registry.add(None, ol.LossyRestore, handler)
    registry.add("extra", ocp.args.JsonSave, ocp.handlers.JsonCheckpointHandler())
    registry.add("extra", ocp.args.JsonRestore, ocp.handlers.JsonCheckpointHandler())
    policy = ol.ChainPreservationPolicy(P.LatestN(1), handler, tmp_path)  # no item name
    options = Opts(preservation_policy=policy, enable_async_checkpointing=use_async)
    with ocp.CheckpointManager(tmp_path, options=options, handler_registry=registry) as mngr:
        run(mngr, multi=True)
        # bases at 0, 4, 8: the newest step 9 needs 8
        assert mngr.all_steps() == [8, 9]
        assert ol.kept_for_chains(mngr) == {8: [9]}
        check_every_listed_step(mngr, multi=True)


def test_plain_orbax_retention_writes_restorable_bases(tmp_path):
    """The guide as written (max_to_keep, no chain policy): self-contained steps + a warning."""
    handler = ol.LossyCheckpointHandler(base_interval=3)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ol.LossySave, handler)
    registry.add("state", ol.LossyRestore, handler)
    options = Opts(max_to_keep=2, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path, options=options, handler_registry=registry) as mngr:
        with pytest.warns(UserWarning, match="ChainPreservationPolicy"):
            run(mngr, multi=True)
        assert mngr.all_steps() == [8, 9]
        assert ol.chain_dependencies(mngr) == {8: [], 9: []}
        check_every_listed_step(mngr, multi=True)


def test_two_lossy_items_with_their_own_handlers(tmp_path):
    ema = ol.LossyCheckpointHandler(base_interval=2)
    items = {"ema": ema, "extra": ocp.handlers.JsonCheckpointHandler}
    with ol.checkpoint_manager(tmp_path, base_interval=3, items=items, max_to_keep=1) as mngr:
        for t in range(N_STEPS):
            mngr.save(
                t,
                args=ocp.args.Composite(
                    params=ol.LossySave(state_at(t)),
                    ema=ol.LossySave(state_at(t + 1)),
                    extra=ocp.args.JsonSave(config_at(t)),
                ),
            )
        mngr.wait_until_finished()
        # ema: bases at 0, 2, 4, 6, 8, so step 9 needs step 8, which must restore whole:
        # its params are a delta on 7 -> 6 (params bases at 0, 3, 6, 9)
        assert mngr.all_steps() == [6, 7, 8, 9]
        assert ol.kept_for_chains(mngr) == {6: [9], 7: [9], 8: [9]}
        for t in mngr.all_steps():
            out = mngr.restore(t)
            assert_matches(out.params, state_at(t), f"params@{t}")
            assert_matches(out.ema, state_at(t + 1), f"ema@{t}")


@pytest.mark.parametrize("use_async", [False, True])
def test_two_lossy_items_sharing_one_handler_stay_restorable(tmp_path, use_async):
    options = Opts(max_to_keep=1, enable_async_checkpointing=use_async)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ol.checkpoint_manager(tmp_path, base_interval=3, options=options) as mngr:
            for t in range(6):
                mngr.save(
                    t,
                    args=ocp.args.Composite(
                        a=ol.LossySave(state_at(t)), b=ol.LossySave(state_at(t + 1))
                    ),
                )
            mngr.wait_until_finished()
            for t in mngr.all_steps():
                out = mngr.restore(t)
                assert_matches(out.a, state_at(t), f"a@{t}")
                assert_matches(out.b, state_at(t + 1), f"b@{t}")
            # One reference per item: both chains have bases at 0 and 3, so old steps go.
            assert mngr.all_steps() == [3, 4, 5]
    assert not [w for w in caught if "orbax_lossy" in str(w.message)]


def test_restart_reads_dependencies_from_disk(tmp_path):
    opts = Opts(max_to_keep=2, enable_async_checkpointing=False)
    items = {"extra": ocp.handlers.JsonCheckpointHandler()}
    with ol.checkpoint_manager(tmp_path, base_interval=4, items=items, options=opts) as first:
        for t in range(6):
            first.save(t, args=ocp.args.Composite(
                state=ol.LossySave(state_at(t)), extra=ocp.args.JsonSave(config_at(t))))
        assert first.all_steps() == [4, 5]
    # A new "process": new handler and manager on the same directory.
    second = ol.checkpoint_manager(tmp_path, base_interval=4, items=items, options=opts)
    assert ol.chain_dependencies(second) == {4: [], 5: [4]}
    second.restore(5)  # the next save is a delta on 5, whose chain is known only on disk
    for t in range(6, N_STEPS):
        second.save(t, args=ocp.args.Composite(
            state=ol.LossySave(state_at(t)), extra=ocp.args.JsonSave(config_at(t))))
    second.wait_until_finished()
    # 6, 7 are deltas on 5 -> 4; step 8 is a new base (chain of 4 links), 9 a delta on it
    assert second.all_steps() == [8, 9]
    assert ol.chain_dependencies(second) == {8: [], 9: [8]}
    check_every_listed_step(second, multi=True)
    second.close()


def test_policy_and_delete_options_together_name_the_fix(tmp_path):
    with pytest.raises(ol.InvalidArgumentError, match="mutually exclusive.*LatestN"):
        ol.checkpoint_manager(
            tmp_path, options=Opts(max_to_keep=2), preservation_policy=P.LatestN(1)
        )
    # A manager built by hand gets Orbax's own error; our helper accepts the policy alone.
    handler = ol.LossyCheckpointHandler()
    policy = ol.ChainPreservationPolicy(P.LatestN(1), handler, tmp_path)
    with pytest.raises(ValueError, match="mutually exclusive"):
        ocp.CheckpointManager(tmp_path, options=Opts(max_to_keep=2, preservation_policy=policy))
    options = Opts(preservation_policy=policy)
    before = fingerprint(options)
    ol.checkpoint_manager(tmp_path, handler=handler, options=options).close()
    assert fingerprint(options) == before
