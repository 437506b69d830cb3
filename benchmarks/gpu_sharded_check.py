"""Sharded save/restore: plain Orbax (StandardCheckpointHandler) vs orbax_lossy, side by side.

Runs on whatever devices exist (GPU, TPU or CPU). A state of float32 parameters (~1 GiB by
default) is sharded over all devices along its first axis (plus a small replicated leaf), then
a few training-like steps are saved through

* ``ocp.CheckpointManager`` with ``ocp.args.StandardSave`` (plain Orbax), and
* ``orbax_lossy.checkpoint_manager`` with ``LossySave`` (step 0 is the lossless base, later
  steps are LC deltas against the previous reconstruction).

For every save it prints the time ``save()`` blocks the caller, the time until the step is
committed (``wait_until_finished``) and the bytes on disk; then the time to restore the last
step onto the same sharding (for orbax_lossy this decodes the chain: base + deltas).

    python benchmarks/gpu_sharded_check.py                 # ~1 GiB, all devices
    python benchmarks/gpu_sharded_check.py --small         # 8 MiB; runs in seconds on CPU
    python benchmarks/gpu_sharded_check.py --small --cpu-devices 8   # 8 fake CPU devices

``--cpu-devices`` only affects the CPU backend and must be given before jax starts (the
script sets ``XLA_FLAGS`` itself). Results also go to ``--json`` if given.
"""

from __future__ import annotations

import argparse
import os
import sys

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--small", action="store_true", help="8 MiB of params instead of ~1 GiB")
parser.add_argument("--gib", type=float, default=1.0, help="GiB of float32 params (not --small)")
parser.add_argument("--steps", type=int, default=4, help="saves per manager (1 base + deltas)")
parser.add_argument("--leaves", type=int, default=8, help="number of parameter matrices")
parser.add_argument("--cpu-devices", type=int, default=0, help="fake CPU devices (CPU only)")
parser.add_argument("--dir", default=None, help="checkpoint root (default: a temp dir)")
parser.add_argument("--json", default=None, help="also write the results to this file")
ARGS = parser.parse_args()
if ARGS.cpu_devices:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}"
    ).strip()
# Run from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_lossy  # noqa: E402


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def make_shapes(total_bytes: int, leaves: int, n_dev: int) -> list[tuple[int, int]]:
    per_leaf = total_bytes // leaves // 4  # float32 elements per leaf
    cols = 4096 if per_leaf >= 4096 * 64 * n_dev else 256
    rows = max(per_leaf // cols // n_dev, 1) * n_dev  # divisible by the device count
    return [(rows, cols)] * leaves


def build_state(shapes, sharding, rep_sharding):
    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(shapes))
        params = {
            f"layer{i}": jax.lax.with_sharding_constraint(
                0.02 * jax.random.normal(k, s, jnp.float32), sharding
            )
            for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
        }
        params["bias"] = jax.lax.with_sharding_constraint(
            jnp.zeros((1024,), jnp.float32), rep_sharding
        )
        return params

    return {"params": init(jax.random.key(0)), "step": 0}


@jax.jit
def train_step(params, key):
    """A fake optimizer step: small dense update (what a delta codec sees after one step)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    new = [
        p - 1e-4 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, new)


def run(name, make_manager, save_args, restore_args, state0, root):
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    mngr = make_manager(path)
    state = state0
    rows = []
    for step in range(ARGS.steps):
        if step:
            params = train_step(state["params"], jax.random.key(step))
            state = {"params": params, "step": step}
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        mngr.save(step, args=save_args(state))
        t_block = time.perf_counter() - t0
        mngr.wait_until_finished()
        t_commit = time.perf_counter() - t0
        rows.append(
            {
                "step": step,
                "blocked_s": t_block,
                "committed_s": t_commit,
                "bytes": dir_bytes(os.path.join(path, str(step))),
            }
        )
    last = ARGS.steps - 1
    mngr.close()
    # Restore with a fresh manager (no cached reference), onto the saving sharding.
    mngr = make_manager(path)
    t0 = time.perf_counter()
    restored = mngr.restore(last, args=restore_args(state))
    jax.block_until_ready(restored)
    t_restore = time.perf_counter() - t0
    err = max(
        float(jnp.max(jnp.abs(restored["params"][k] - state["params"][k]))) for k in state["params"]
    )
    mngr.close()
    return {"saves": rows, "restore_s": t_restore, "restore_max_abs_err": err}


def main() -> None:
    devices = np.array(jax.devices())
    n_dev = len(devices)
    total = (8 << 20) if ARGS.small else int(ARGS.gib * (1 << 30))
    shapes = make_shapes(total, ARGS.leaves, n_dev)
    mesh = Mesh(devices, ("x",))
    sharding = NamedSharding(mesh, P("x", None))
    rep = NamedSharding(mesh, P())
    state0 = build_state(shapes, sharding, rep)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state0["params"]))
    print(
        f"devices: {n_dev} x {devices[0].platform} ({devices[0].device_kind}); "
        f"params: {len(shapes)} x {shapes[0]} f32 + bias = {n_bytes / 2**20:.1f} MiB, "
        f"sharded P('x', None) over {n_dev} devices"
    )
    root = ARGS.dir or tempfile.mkdtemp(prefix="gpu_sharded_check_")

    def abstract(state):
        return jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array)
                else x
            ),
            state,
        )

    results = {
        "orbax": run(
            "orbax",
            lambda p: ocp.CheckpointManager(
                p, options=ocp.CheckpointManagerOptions(max_to_keep=ARGS.steps)
            ),
            lambda s: ocp.args.StandardSave(s),
            lambda s: ocp.args.StandardRestore(abstract(s)),
            state0,
            root,
        ),
        "orbax_lossy": run(
            "orbax_lossy",
            lambda p: orbax_lossy.checkpoint_manager(
                p, base_interval=ARGS.steps + 1, max_to_keep=ARGS.steps
            ),
            lambda s: orbax_lossy.LossySave(s),
            lambda s: orbax_lossy.LossyRestore(abstract(s)),
            state0,
            root,
        ),
    }

    print(
        f"\n{'step':>4} | {'orbax block':>11} {'commit':>8} {'MiB':>8} | "
        f"{'lossy block':>11} {'commit':>8} {'MiB':>8}"
    )
    for a, b in zip(results["orbax"]["saves"], results["orbax_lossy"]["saves"], strict=True):
        print(
            f"{a['step']:>4} | {a['blocked_s']:>10.3f}s {a['committed_s']:>7.3f}s "
            f"{a['bytes'] / 2**20:>8.2f} | {b['blocked_s']:>10.3f}s {b['committed_s']:>7.3f}s "
            f"{b['bytes'] / 2**20:>8.2f}"
        )
    print("(step 0 and, for orbax_lossy, step 1 - the first delta - include jit compilation)")
    for name in ("orbax", "orbax_lossy"):
        r = results[name]
        print(
            f"restore step {ARGS.steps - 1} ({name}): {r['restore_s']:.3f}s, "
            f"max |restored - saved| = {r['restore_max_abs_err']:.3g}"
        )
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(
                {
                    "devices": n_dev,
                    "platform": devices[0].platform,
                    "param_bytes": n_bytes,
                    "shapes": shapes,
                    **results,
                },
                f,
                indent=1,
            )
    if not ARGS.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
