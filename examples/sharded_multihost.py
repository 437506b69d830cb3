"""Sharded, multi-process lossy checkpoints with orbax_lossy.

By default this runs in one process with 8 fake CPU devices: a state sharded over a 4x2 mesh
is saved as a delta chain (base + deltas), then restored onto a different mesh.

    python examples/sharded_multihost.py

Two processes on one machine (4 fake CPU devices each), exactly as on a real multi-host job
(on GPU/TPU hosts drop --cpu-devices; every process runs the same script):

    python examples/sharded_multihost.py --num-processes 2 --process-id 0 \\
        --coordinator 127.0.0.1:12355 --cpu-devices 4 --dir /tmp/lossy_mh &
    python examples/sharded_multihost.py --num-processes 2 --process-id 1 \\
        --coordinator 127.0.0.1:12355 --cpu-devices 4 --dir /tmp/lossy_mh

The checkpoint directory must be shared by all processes. Each process writes only the
replica-0 shards it owns (``data.p<K>.bin``); process 0 merges the per-process indexes into
``manifest.msgpack`` when Orbax finalizes the step.
"""

from __future__ import annotations

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--dir", default="/tmp/orbax_lossy_sharded_example")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--cpu-devices", type=int, default=8, help="fake CPU devices per process")
parser.add_argument("--num-processes", type=int, default=1)
parser.add_argument("--process-id", type=int, default=0)
parser.add_argument("--coordinator", default="127.0.0.1:12355")
args = parser.parse_args()

# Must happen before jax is imported.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.cpu_devices}")

import jax  # noqa: E402

if args.num_processes > 1:
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_lossy  # noqa: E402


def log(*a):
    if jax.process_index() == 0:
        print(*a, flush=True)


n = jax.device_count()
devices = (
    np.array(jax.devices()).reshape(n // 2, 2)
    if n % 2 == 0
    else np.array(jax.devices()).reshape(n, 1)
)
mesh = Mesh(devices, ("data", "model"))
shardings = {
    "kernel": NamedSharding(mesh, P("data", "model")),  # sharded over both mesh axes
    "embed": NamedSharding(mesh, P("data", None)),  # sharded rows, replicated over "model"
    "bias": NamedSharding(mesh, P()),  # fully replicated: written once, by replica 0
}


@jax.jit
def init(key):
    k1, k2 = jax.random.split(key)
    params = {
        "kernel": 0.02 * jax.random.normal(k1, (1024, 512)),
        "embed": 0.02 * jax.random.normal(k2, (2048, 256)),
        "bias": jnp.zeros((512,)),
    }
    return {k: jax.lax.with_sharding_constraint(v, shardings[k]) for k, v in params.items()}


@jax.jit
def train_step(params, key):
    keys = jax.random.split(key, len(params))
    return {
        k: v - 1e-3 * jax.random.normal(kk, v.shape)
        for (k, v), kk in zip(params.items(), keys, strict=True)
    }


# base_interval=3: steps 0 and 3 are bases (parameters k-means coded with 255 centroids by the
# default policy), the others deltas.
handler = orbax_lossy.LossyCheckpointHandler(base_interval=3)
mngr = orbax_lossy.checkpoint_manager(args.dir, handler=handler, max_to_keep=2)
params = init(jax.random.key(0))
for step in range(args.steps):
    if step:
        params = train_step(params, jax.random.key(step))
    mngr.save(step, args=orbax_lossy.LossySave({"params": params, "step": step}))
    log(f"step {step}: {handler.last_save_stats['kind']}")
mngr.wait_until_finished()
log("kept steps (chains kept whole):", mngr.all_steps())

# Restore onto a different mesh and partitioning: each process reads only the chunks that
# overlap the shards its devices hold.
mesh2 = Mesh(np.array(jax.devices()).reshape(devices.shape[::-1]), ("a", "b"))
target = {
    "params": {
        "kernel": jax.ShapeDtypeStruct(
            (1024, 512), jnp.float32, sharding=NamedSharding(mesh2, P("b", "a"))
        ),
        "embed": jax.ShapeDtypeStruct(
            (2048, 256), jnp.float32, sharding=NamedSharding(mesh2, P(None, "a"))
        ),
        "bias": jax.ShapeDtypeStruct((512,), jnp.float32, sharding=NamedSharding(mesh2, P())),
    },
    "step": 0,
}
step = mngr.latest_step()
restored = mngr.restore(step, args=orbax_lossy.LossyRestore(target))
err = max(
    # Bring the restored leaf back to the training sharding before comparing.
    float(jnp.max(jnp.abs(jax.device_put(restored["params"][k], params[k].sharding) - params[k])))
    for k in params
)
log(f"restored step {restored['step']} onto mesh {dict(mesh2.shape)}: max |error| = {err:.2e}")
log(f"kernel sharding: {restored['params']['kernel'].sharding.spec}")
log(f"this process read {handler.last_restore_bytes_read} payload bytes")
mngr.close()
