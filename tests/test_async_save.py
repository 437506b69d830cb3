"""Async saves: ``mngr.save()`` returns once device work is dispatched and host copies are
secured, so the caller may donate or overwrite its arrays at once; bad arguments fail in
``LossySave(...)``, before the manager starts anything."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_lossy as ol
from orbax_lossy.treepaths import path_str


class GatedHandler(ol.LossyCheckpointHandler):
    """The real handler, whose background write waits until the test opens the gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.write_threads: list[str] = []

    def _write_files(self, *args, **kwargs):
        self.write_threads.append(threading.current_thread().name)
        assert self.gate.wait(60), "gate never opened"
        return super()._write_files(*args, **kwargs)


def params_at(t: int) -> dict:
    k = jax.random.split(jax.random.key(t), 2)
    return {
        "w": jnp.cos(jnp.arange(128 * 64, dtype=jnp.float32).reshape(128, 64) * 1e-3)
        + 0.01 * t * jax.random.normal(k[0], (128, 64)),
        "b": 0.1 * t * jnp.ones((64,), jnp.float32),
        "host": np.arange(10, dtype=np.float32) + t,
    }


#: The default deltas with exact parameter bases (the default's bases are lossy), so a base's
#: restore is compared bitwise with the arrays as they were when save() returned.
EXACT_BASES = ol.LeafPolicy.create(base_defaults={"param": ol.Exact()})

donate_all = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 + 7, p), donate_argnums=0)


@pytest.mark.parametrize("donated_step", [0, 1])  # a base save and a delta save
def test_donate_and_overwrite_right_after_save_returns(tmp_path, assert_bitwise, donated_step):
    handler = GatedHandler(EXACT_BASES, base_interval=5)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    expected = {}
    for step in range(donated_step + 1):
        params = params_at(step)
        old = jax.tree.map(np.array, params)
        if step == donated_step:
            mngr.wait_until_finished()  # save() would wait for the previous (gated) write
            handler.gate.clear()
        assert mngr.save(step, args=ol.LossySave(params))
        snap = {
            path_str(p): None if v is None else np.array(v)
            for p, v in zip(handler.reference.paths, handler.reference.values, strict=True)
        }
        expected[step] = (old, snap)
    # save() returned while the background write is still blocked: nothing committed yet.
    assert not handler.gate.is_set() and mngr.is_saving_in_progress()
    assert str(donated_step) not in os.listdir(tmp_path)

    device = {k: v for k, v in params.items() if k != "host"}
    new = donate_all(device)
    for name, v in device.items():
        # A leaf the save copied is donated: its buffer is gone. A ready CPU leaf the save
        # holds zero-copy (once the background donation probe has answered, which races with
        # this second save) cannot be donated: the runtime copies it, and it keeps its values.
        assert v.is_deleted() or np.array_equal(np.asarray(v), old[name]), name
    params["host"][:] = -1.0  # overwrite the host leaf in place
    assert not any(v.is_deleted() for v in handler.reference.values if v is not None)

    handler.gate.set()
    mngr.wait_until_finished()
    assert mngr.all_steps() == list(range(donated_step + 1))
    assert all(name != threading.main_thread().name for name in handler.write_threads)
    assert float(new["w"][0, 0]) == 7.0

    restored = ol.checkpoint_manager(tmp_path, max_to_keep=None).restore(donated_step)
    old, snap = expected[donated_step]
    assert_bitwise(restored["host"], old["host"], "host leaf keeps the old values")
    for name in ("w", "b"):
        assert_bitwise(restored[name], snap[name], name)
        np.testing.assert_allclose(np.asarray(restored[name]), old[name], atol=0.02)
    if donated_step == 0:  # a base with exact parameters is lossless
        assert_bitwise(restored["w"], old["w"], "base w")
    mngr.close()


def test_sync_mode_also_works(tmp_path, assert_bitwise):
    mngr = ol.checkpoint_manager(tmp_path, enable_async_checkpointing=False, max_to_keep=None,
                                 policy=EXACT_BASES)
    for step in range(3):
        p = params_at(step)
        mngr.save(step, args=ol.LossySave(p))
        assert str(step) in os.listdir(tmp_path)  # committed when save() returns
    assert_bitwise(ol.checkpoint_manager(tmp_path).restore(0)["w"], params_at(0)["w"], "base")


@pytest.mark.parametrize(
    "item, match",
    [
        (None, "needs an item"),
        ({}, "no leaves"),
        ({"a": jnp.ones(3), "s": "text"}, r"'s' has unsupported type str"),
        ({"o": np.array([object(), 1], dtype=object)}, "'o' is an object array"),
        ({"l": [jnp.ones(2), lambda x: x]}, "unsupported type function"),
    ],
)
def test_bad_trees_fail_in_lossy_save_before_the_manager_starts(tmp_path, item, match):
    mngr = ol.checkpoint_manager(tmp_path)
    with pytest.raises(ol.InvalidArgumentError, match=match):
        mngr.save(0, args=ol.LossySave(item))  # raised while building the args
    assert not mngr.is_saving_in_progress()
    assert os.listdir(tmp_path) == []
    mngr.save(0, args=ol.LossySave({"a": jnp.ones(3)}))  # the manager is still usable
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0]


def test_donated_array_is_rejected_up_front(tmp_path):
    x = {"w": jnp.ones((4, 4))}
    donate_all(x)
    with pytest.raises(ol.InvalidArgumentError, match="'w' is a deleted"):
        ol.LossySave(x)


def test_bad_handler_settings_are_rejected():
    with pytest.raises(ol.InvalidArgumentError):
        ol.LossyCheckpointHandler(base_interval=0)
    with pytest.raises(ol.InvalidArgumentError):
        ol.LossyCheckpointHandler(chunk_bytes=10)
    with pytest.raises(ol.InvalidArgumentError):
        ol.LeafPolicy.create(rules=[("role:nope", ol.LC())])


def test_typestr_and_registration():
    assert ol.LossyCheckpointHandler.typestr() == "orbax_lossy.LossyCheckpointHandler"
    assert isinstance(ol.LossyCheckpointHandler(), ocp.AsyncCheckpointHandler)
    default = ol.LossyCheckpointHandler()
    assert default.base_interval >= 1
    codecs = default.policy.plan([(("d", "w"),)], [jnp.ones(3)], [jnp.ones(3)], False)
    assert codecs == [ol.LeafPolicy().plan([(("d", "w"),)], [jnp.ones(3)], [jnp.ones(3)],
                                           False)[0]]
    assert codecs[0].lossy and codecs[0].needs_reference  # the default compresses params
    ol.LossyRestore()  # every restore field is optional


class RecordingHandler(ol.LossyCheckpointHandler):
    """The real handler, recording the thread each commit publishes on; ``fail_at``: the
    step whose commit raises while writing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commit_threads: list[threading.Thread] = []
        self.fail_at: int | None = None

    def _publish(self, *args, **kwargs):
        self.commit_threads.append(threading.current_thread())
        return super()._publish(*args, **kwargs)

    def _write_files(self, directory, process, header, jobs):
        if header.step == self.fail_at:
            raise OSError(f"disk full while writing step {header.step}")
        return super()._write_files(directory, process, header, jobs)


def test_commits_run_on_persistent_workers_and_failures_surface(tmp_path, assert_bitwise):
    """save() starts no thread per save: commits run on a pool whose threads outlive them
    (Thread.start blocked save() for 1-4 ms), after Orbax's directory signals, and a
    commit's exception still reaches wait_until_finished()."""
    handler = RecordingHandler(EXACT_BASES, base_interval=5)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    for step in range(3):
        assert mngr.save(step, args=ol.LossySave(params_at(step)))
        mngr.wait_until_finished()
    assert len(handler.commit_threads) == 3
    assert all(t.name.startswith("orbax_lossy_commit") for t in handler.commit_threads)
    assert all(t.is_alive() for t in handler.commit_threads)  # pooled, not one per save
    assert mngr.all_steps() == [0, 1, 2]
    restored = ol.checkpoint_manager(tmp_path, max_to_keep=None).restore(2)
    assert_bitwise(restored["host"], np.asarray(params_at(2)["host"]), "host leaf")

    handler.fail_at = 3
    mngr.save(3, args=ol.LossySave(params_at(3)))
    with pytest.raises(OSError, match="disk full while writing step 3"):
        mngr.wait_until_finished()
    assert 3 not in mngr.all_steps()
    handler.fail_at = None
    assert mngr.save(4, args=ol.LossySave(params_at(4)))  # the failed save left a base next
    mngr.wait_until_finished()
    assert 4 in mngr.all_steps()
    mngr.close()


def test_cpu_leaves_are_held_without_a_copy_and_donation_waits(tmp_path, monkeypatch,
                                                                 assert_bitwise):
    """On CPU, save() copies nothing: it holds numpy views of the caller's buffers (zero-copy
    arrays of the handler's own over them). Until the commit has dispatched its encode, a
    program that donates the caller's array writes its output elsewhere (jax 0.10 keeps the
    array alive, jax 0.12.1 marks it deleted), and the checkpoint holds the values of the save
    even if the caller deletes its array."""
    from orbax_lossy.engine import save as save_engine
    from orbax_lossy.engine import transfer

    deadline = time.monotonic() + 60
    transfer.donation_probe()  # the first call starts the probe in the background
    while not transfer._PROBE.done():
        assert time.monotonic() < deadline, "the donation probe did not finish in 60 s"
        time.sleep(0.01)
    assert transfer.donation_probe(), f"jax {jax.__version__}: the CPU hold is off, saves copy"
    w = jnp.arange(256 * 64, dtype=jnp.float32).reshape(256, 64) * 1.0
    v = jnp.full((64,), 3.0, jnp.float32)
    jax.block_until_ready((w, v))
    held = transfer.hold_on_host([w, v])
    assert all(isinstance(h, transfer.HostHold) for h in held)  # views; arrays in the commit
    built = transfer.materialize(held)
    assert built[0].unsafe_buffer_pointer() == w.unsafe_buffer_pointer()  # zero-copy
    assert built[0].sharding == w.sharding and built[1].shape == v.shape
    del built
    old = {"w": np.array(w), "v": np.array(v)}
    del held

    gate = threading.Event()
    dispatch = save_engine.dispatch_encode

    def gated_dispatch(request):
        assert gate.wait(60), "gate never opened"
        return dispatch(request)

    monkeypatch.setattr(save_engine, "dispatch_encode", gated_dispatch)
    mngr = ol.checkpoint_manager(tmp_path, handler=ol.LossyCheckpointHandler(EXACT_BASES),
                                 max_to_keep=None)
    assert mngr.save(0, args=ol.LossySave({"w": w, "v": v}))
    overwrite = jax.jit(lambda a: a * 0 + 7, donate_argnums=0)
    w_memory = w.unsafe_buffer_pointer()
    new_w = overwrite(w)
    assert float(new_w[0, 0]) == 7.0
    # The runtime does not reuse memory the handler holds: jax 0.10 refuses the donation (w
    # stays alive), jax 0.12.1 marks w deleted and writes the output elsewhere.
    assert new_w.unsafe_buffer_pointer() != w_memory
    if not w.is_deleted():
        assert_bitwise(w, old["w"], "w, not donated")
    v.delete()  # the caller drops its array outright: the held memory stays valid
    gate.set()
    mngr.wait_until_finished()
    restored = ol.checkpoint_manager(tmp_path, max_to_keep=None).restore(0)
    assert_bitwise(restored["w"], old["w"], "w holds the saved values")
    assert_bitwise(restored["v"], old["v"], "v holds the saved values")
    mngr.close()


def test_building_a_handler_leaves_jax_uninitialized():
    """Handlers are built before ``jax.distributed.initialize()`` in multi-host scripts:
    constructing one must not start JAX's backends (the CPU donation probe runs in the
    background at the first save instead). Orbax's own CheckpointManager does start them."""
    script = (
        "from jax._src import xla_bridge\n"
        "import orbax_lossy as ol\n"
        "handler = ol.LossyCheckpointHandler(ol.AdaptivePolicy(), base_interval=5)\n"
        "args = ol.LossySave({'w': [1.0, 2.0]})\n"
        "assert not xla_bridge.backends_are_initialized(), 'backends started'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_restored_state_can_be_donated_at_once(tmp_path, assert_bitwise):
    """A restore's reference (for the next delta) is the handler's own copy: a train step may
    donate the restored state at once (its buffers are given up, as after plain Orbax's
    restore), and the next delta is still coded against the restored values: its restore
    equals that of a run that never stopped."""
    device_params = [{k: v for k, v in params_at(t).items() if k != "host"} for t in range(3)]
    straight = ol.checkpoint_manager(tmp_path / "straight", max_to_keep=None)
    for t, p in enumerate(device_params):
        straight.save(t, args=ol.LossySave(p))
        straight.wait_until_finished()
    straight.close()

    first = ol.checkpoint_manager(tmp_path / "resumed", max_to_keep=None)
    for t, p in enumerate(device_params[:2]):
        first.save(t, args=ol.LossySave(p))
        first.wait_until_finished()
    first.close()
    resumed = ol.checkpoint_manager(tmp_path / "resumed", max_to_keep=None)
    restored = resumed.restore(1, args=ol.LossyRestore(device_params[1]))
    new = donate_all(restored)
    assert all(float(x.reshape(-1)[0]) == 7.0 for x in jax.tree.leaves(new))
    assert all(x.is_deleted() for x in jax.tree.leaves(restored))  # donated, not copied
    resumed.save(2, args=ol.LossySave(device_params[2]))
    resumed.wait_until_finished()
    resumed.close()

    again = ol.checkpoint_manager(tmp_path / "straight", max_to_keep=None).restore(2)
    after = ol.checkpoint_manager(tmp_path / "resumed", max_to_keep=None).restore(2)
    for name in again:
        assert_bitwise(after[name], np.asarray(again[name]), f"{name}: the delta after it")
