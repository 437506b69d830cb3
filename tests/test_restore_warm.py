"""The first restore of a new process: numba's kernels load in the background from the
handler's creation on (``entropy.warmup``), and the decode programs compile ahead on the
compile workers (``engine.precompile``), not one by one on the restoring thread."""

from __future__ import annotations

import json

import pytest

from orbax_lossy.entropy import warmup

_FIRST_RESTORE = r"""
import json, os, sys, threading
os.environ["ORBAX_LOSSY_WARMUP"] = "0"  # the restore's own compiling ahead, not the manager's
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)  # every program really compiles
import orbax_lossy as ol

compiled_on = []
def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        compiled_on.append(f"{threading.current_thread().name}: {kwargs.get('fun_name')}")
jax.monitoring.register_event_duration_secs_listener(listener)

root = sys.argv[1]
mngr = ol.checkpoint_manager(root, max_to_keep=None)
state = {"params": {"w": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "b": jnp.ones((32,))},
         "opt": {"mu": jnp.zeros((64, 32))}}
for step in range(6):
    state = jax.tree.map(lambda x: x * 1.01 + 0.001, state)
    mngr.save(step, args=ol.LossySave(state))
    mngr.wait_until_finished()
mngr.close()
compiled_on.clear()
fresh = ol.checkpoint_manager(root, max_to_keep=None)
restored = fresh.restore(5)
first = list(compiled_on)
compiled_on.clear()
again = fresh.restore(5)  # nothing left to compile
second = list(compiled_on)
same = all(bool(jnp.array_equal(a, b)) for a, b in
           zip(jax.tree.leaves(restored), jax.tree.leaves(again), strict=True))
print(json.dumps({"first": first, "again": second, "same": same}))
"""


@pytest.mark.slow
def test_first_restore_compiles_its_programs_on_the_compile_workers(tmp_path,
                                                                   run_cpu_script) -> None:
    out = json.loads(run_cpu_script(["-c", _FIRST_RESTORE, str(tmp_path)]).strip()
                     .splitlines()[-1])
    assert out["first"], out  # the restore compiled decode programs ...
    assert all(t.startswith("orbax_lossy_compile") for t in out["first"]), out  # ... ahead
    assert out["again"] == [] and out["same"], out


def test_warmup_round_trips_every_stream_mode_once_per_process(monkeypatch) -> None:
    monkeypatch.setenv(warmup.ENV, "1")  # the test session turns it off
    monkeypatch.setattr(warmup, "_DONE", None)  # as in a new process
    done = warmup.start()
    assert done.result(timeout=300) is None
    assert warmup.start() is done  # once per process
    warmup.warm()  # the round trips are exact (it raises otherwise)


_OFF = r"""
import os, sys, threading
os.environ["ORBAX_LOSSY_WARMUP"] = "0"
import jax.numpy as jnp
import orbax_lossy as ol
from orbax_lossy.entropy import warmup
mngr = ol.checkpoint_manager(sys.argv[1])
mngr.save(0, args=ol.LossySave({"w": jnp.ones((8, 8))}))
mngr.wait_until_finished()
ol.checkpoint_manager(sys.argv[1])  # a directory with a checkpoint: nothing compiles ahead
assert warmup.start().done()
names = {t.name for t in threading.enumerate()}
assert "orbax_lossy_warmup" not in names and "orbax_lossy_compile_ahead" not in names, names
print("ok")
"""


def test_warmup_can_be_turned_off(tmp_path, run_cpu_script) -> None:
    assert run_cpu_script(["-c", _OFF, str(tmp_path)]).strip().splitlines()[-1] == "ok"


_SAVE = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import orbax_lossy as ol
from orbax_lossy.treepaths import path_str
root = sys.argv[1]
handler = ol.LossyCheckpointHandler()
mngr = ol.checkpoint_manager(root, handler=handler, max_to_keep=None)
state = {"params": {"w": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "b": jnp.ones((32,))},
         "opt_state": {"mu": {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}}}
for step in range(7):
    state = jax.tree.map(lambda x, s=step: x * 1.01 + 0.001 * (s + 1), state)
    mngr.save(step, args=ol.LossySave(state))
    mngr.wait_until_finished()
ref = handler.reference_for("default")
np.savez(sys.argv[2], **{path_str(p): np.asarray(v) for p, v in zip(ref.paths, ref.values)})
mngr.close()
"""

_RESTART = r"""
import json, os, sys, threading
os.environ["ORBAX_LOSSY_WARMUP"] = "1"  # the test session turns it off
import jax, numpy as np
jax.config.update("jax_enable_compilation_cache", False)
import orbax_lossy as ol
from orbax_lossy.engine import precompile
from orbax_lossy.treepaths import flatten, path_str
compiled_on = []
def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        compiled_on.append(f"{threading.current_thread().name}: {kwargs.get('fun_name')}")
jax.monitoring.register_event_duration_secs_listener(listener)
mngr = ol.checkpoint_manager(sys.argv[1], max_to_keep=None)
for t in threading.enumerate():  # the job would build its state meanwhile
    if t.name == "orbax_lossy_compile_ahead":
        t.join()
ahead = len(precompile._SUBMITTED)
for future in list(precompile._SUBMITTED.values()):
    future.result()
before = len(compiled_on)
restored = mngr.restore(mngr.latest_step())
during = compiled_on[before:]
held = np.load(sys.argv[2])
paths, leaves, _ = flatten(restored)
same = all(np.asarray(v).tobytes() == held[path_str(p)].tobytes()
           for p, v in zip(paths, leaves) if path_str(p) in held.files)
ol.checkpoint_manager(sys.argv[1], max_to_keep=None)  # after a restore: nothing ahead
again = any(t.name == "orbax_lossy_compile_ahead" for t in threading.enumerate())
print(json.dumps({"ahead": ahead, "during": during, "same": same, "again": again}))
"""


@pytest.mark.slow
def test_a_new_manager_compiles_the_newest_steps_programs_before_the_restore(
        tmp_path, run_cpu_script) -> None:
    """Creating the manager of a directory with checkpoints compiles, in the background, the
    decode programs of its newest step; the restore then compiles nothing and returns the
    saver's reconstruction bit for bit. A manager created after a restore does not."""
    held = str(tmp_path / "held.npz")
    run_cpu_script(["-c", _SAVE, str(tmp_path / "ckpt"), held])
    out = json.loads(run_cpu_script(["-c", _RESTART, str(tmp_path / "ckpt"), held])
                     .strip().splitlines()[-1])
    assert out["ahead"] >= 2 and out["during"] == [] and out["same"], out
    assert not out["again"], out  # once per process, before its first restore


def test_a_restore_cancels_speculative_programs_it_does_not_need(monkeypatch) -> None:
    """Programs compiled ahead for the saved shardings never queue in front of a restore onto
    other shardings: the restore cancels the ones that have not started."""
    import collections
    import concurrent.futures
    import threading

    from orbax_lossy.engine import precompile

    pool = concurrent.futures.ThreadPoolExecutor(2)
    monkeypatch.setattr(precompile, "_POOL", pool)
    monkeypatch.setattr(precompile, "_SUBMITTED", collections.OrderedDict())
    monkeypatch.setattr(precompile, "_SPECULATIVE", set())
    release = threading.Event()
    ran: list[str] = []
    for name in ("busy-0", "busy-1"):  # both workers held
        precompile.submit(name, lambda n=name: (release.wait(30), ran.append(n)))
    for name in ("saved-a", "saved-b"):
        precompile.submit(name, lambda n=name: ran.append(n), speculative=True)
    precompile.keep_only({"saved-a", "other"})  # the restore needs saved-a, not saved-b
    precompile.submit("other", lambda: ran.append("other"))
    release.set()
    for key in ("busy-0", "busy-1", "saved-a", "saved-b", "other"):
        precompile.wait(key)
    pool.shutdown(wait=True)
    assert sorted(ran) == ["busy-0", "busy-1", "other", "saved-a"], ran
    assert "saved-b" not in precompile._SUBMITTED and not precompile._SPECULATIVE


def test_a_restore_calls_the_programs_it_compiled_ahead(tmp_path, monkeypatch) -> None:
    """The decode programs compiled ahead are the ones a restore runs: it calls them, not
    the jitted function (which found them only through JAX's caches and, on a loaded
    machine, now and then compiled one again on the restoring thread)."""
    import collections

    import jax
    import jax.numpy as jnp
    import numpy as np

    import orbax_lossy as ol
    from orbax_lossy.engine import device, precompile

    monkeypatch.setattr(precompile, "_SUBMITTED", collections.OrderedDict())
    monkeypatch.setattr(precompile, "_SPECULATIVE", set())
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    state = {"w": jnp.linspace(-1, 1, 96 * 40).reshape(96, 40), "mu": jnp.zeros((96, 40))}
    for step in range(4):
        state = jax.tree.map(lambda x: x * 1.01 + 0.001, state)
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
    expected = mngr.restore(3)  # compiles its programs ahead and runs them
    assert precompile._SUBMITTED, "nothing was compiled ahead"

    jitted_calls = []
    program = device.decode_links_program

    class Counting:
        def __init__(self, jitted):
            self.jitted = jitted

        def lower(self, *args, **kwargs):
            return self.jitted.lower(*args, **kwargs)

        def __call__(self, *args, **kwargs):
            jitted_calls.append(kwargs.get("plans"))
            return self.jitted(*args, **kwargs)

    monkeypatch.setattr(device, "decode_links_program", lambda s: Counting(program(s)))
    again = mngr.restore(3)
    assert jitted_calls == [], jitted_calls
    for name in ("w", "mu"):
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(expected[name]))
    mngr.close()


def test_decode_links_falls_back_where_the_compiled_program_does_not_fit() -> None:
    """A program compiled for other shapes is not run: the jitted function decodes."""
    import jax
    import numpy as np

    import orbax_lossy as ol
    from orbax_lossy.engine import device

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    codec = ol.Exact()
    spec = jax.ShapeDtypeStruct
    fields_of = {name: dtype for name, dtype in codec.field_dtypes(np.float32).items()}
    other = device.decode_links_program(sharding).lower(
        ({name: spec((3,), dtype) for name, dtype in fields_of.items()},), ({},), None,
        plans=(codec,), dtype=np.float32).compile()
    x = np.arange(8, dtype=np.float32)
    fields = ({name: x.view(dtype) for name, dtype in fields_of.items()},)
    out = device.decode_links(fields, ({},), None, plans=(codec,), dtype=np.float32,
                              sharding=sharding, compiled=other)
    np.testing.assert_array_equal(np.asarray(out), x)
