"""The first restore of a new process: numba's kernels load in the background from the
handler's creation on (``entropy.warmup``), and the decode programs compile ahead on the
compile workers (``engine.precompile``), not one by one on the restoring thread."""

from __future__ import annotations

import json

import pytest

from orbax_lossy.entropy import warmup

_FIRST_RESTORE = r"""
import json, sys, threading
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)  # every program really compiles
import orbax_lossy as ol

compiled_on = []
def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        compiled_on.append(threading.current_thread().name)
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


def test_warmup_round_trips_every_stream_mode_once_per_process() -> None:
    done = warmup.start()
    assert done.result(timeout=300) is None
    assert warmup.start() is done  # once per process
    warmup.warm()  # the round trips are exact (it raises otherwise)


_OFF = r"""
import os, threading
os.environ["ORBAX_LOSSY_WARMUP"] = "0"
import orbax_lossy as ol
from orbax_lossy.entropy import warmup
ol.LossyCheckpointHandler()
assert warmup.start().done()
assert not any(t.name == "orbax_lossy_warmup" for t in threading.enumerate())
print("ok")
"""


def test_warmup_can_be_turned_off(run_cpu_script) -> None:
    assert run_cpu_script(["-c", _OFF]).strip().splitlines()[-1] == "ok"
