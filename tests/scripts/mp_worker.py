"""One process of a 2-process ``jax.distributed`` run on CPU (4 fake devices each).

Usage: python mp_worker.py MODE RANK NUM_PROCS PORT OUT_DIR

MODE ``chain``: save a chain of sharded checkpoints with ``orbax_lossy.checkpoint_manager``,
restore every kept step onto another sharding, and write ``OUT_DIR/summary.p<RANK>.json``.
MODE ``crash``: commit steps 0..2, start step 3 and then die (rank 1 ``os._exit`` while the
save is in flight; rank 0 blocks until the parent kills it). Expected values of the committed
steps go to ``OUT_DIR/expected.npz`` (rank 0).
"""

from __future__ import annotations

import os
import sys

MODE, RANK, NPROCS, PORT, OUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{PORT}",
    num_processes=NPROCS,
    process_id=RANK,
    initialization_timeout=30,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_lossy  # noqa: E402
from orbax_lossy.format.manifest import read_manifest_body as read_manifest  # noqa: E402

SHAPES = {"w": (512, 256), "u": (256, 128), "b": (64,)}
CHUNK_BYTES = 16 << 10


def global_values(step: int) -> dict[str, np.ndarray]:
    out = {}
    for i, (name, shape) in enumerate(sorted(SHAPES.items())):
        base = np.random.default_rng(100 + i).standard_normal(shape).astype(np.float32)
        drift = np.random.default_rng(1000 * step + i).standard_normal(shape).astype(np.float32)
        out[name] = base + 1e-2 * step * drift
    return out


def make_state(step: int, shardings) -> dict:
    vals = global_values(step)
    params = {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
        for k, v in vals.items()
    }
    count = jax.make_array_from_callback((), shardings["count"], lambda idx: np.int32(step))
    return {"params": params, "count": count, "step": step}


def gather(x) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def reference_params(handler) -> dict[str, np.ndarray]:
    ref = handler.reference
    out = {}
    for path, value in zip(ref.paths, ref.values, strict=True):
        keys = [k for _, k in path]
        if keys[0] == "params":
            out[keys[1]] = gather(value)
    return out


def abstract(shardings) -> dict:
    return {
        "params": {
            k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=shardings[k])
            for k, s in SHAPES.items()
        },
        "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings["count"]),
        "step": 0,
    }


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


def hide_manifests_from_this_process():
    """Simulate a shared filesystem without cross-host read-after-write consistency: this
    process never sees ``manifest.msgpack`` files written by the primary."""
    import orbax_lossy.engine.reference as handler_module

    real_os = handler_module.os

    class _Path:
        def __getattr__(self, name):
            return getattr(real_os.path, name)

        @staticmethod
        def exists(path):
            if os.fspath(path).endswith("manifest.msgpack"):
                return False
            return real_os.path.exists(path)

    class _Os:
        path = _Path()

        def __getattr__(self, name):
            return getattr(real_os, name)

    handler_module.os = _Os()
    return lambda: setattr(handler_module, "os", real_os)


def dependency_of(handler, root, step):
    """The step the item of ``step`` depends on (None for a base)."""
    deps = handler.dependencies_of(os.path.normpath(root), step).get("default", set())
    return max(deps) if deps else None


def main() -> None:
    assert jax.process_count() == NPROCS and jax.local_device_count() == 4
    unhide = None
    if RANK == 1 and os.environ.get("MP_WORKER_HIDE_MANIFESTS") == "1":
        unhide = hide_manifests_from_this_process()  # during saves only
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
    save_sh = {
        "w": NamedSharding(mesh, P("data", "model")),
        "u": NamedSharding(mesh, P("data", None)),
        "b": NamedSharding(mesh, P()),  # replicated
        "count": NamedSharding(mesh, P()),
    }
    mesh2 = Mesh(devices.reshape(2, 4), ("x", "y"))
    restore_sh = {
        "w": NamedSharding(mesh2, P("y", "x")),
        "u": NamedSharding(mesh2, P(None, ("x", "y"))),
        "b": NamedSharding(mesh2, P("y")),
        "count": NamedSharding(mesh2, P()),
    }
    root = os.path.join(OUT, "ckpt")
    handler = orbax_lossy.LossyCheckpointHandler(base_interval=3, chunk_bytes=CHUNK_BYTES)
    mngr = orbax_lossy.checkpoint_manager(root, handler=handler, max_to_keep=2)
    summary: dict = {"rank": RANK, "process_count": jax.process_count(), "saves": []}
    expected: dict[int, dict[str, np.ndarray]] = {}
    n_steps = 7 if MODE == "chain" else 3

    for step in range(n_steps):
        t0 = time.perf_counter()
        mngr.save(step, args=orbax_lossy.LossySave(make_state(step, save_sh)))
        blocked = time.perf_counter() - t0
        ref = handler.reference
        summary["saves"].append(
            {
                "step": step,
                "kind": handler.last_save_stats["kind"],
                "reference_step": ref.step,
                "chain_length": ref.chain_length,
                "depends_on": dependency_of(handler, root, step),
                "all_steps_after_save": list(mngr.all_steps()),
                "blocked_s": blocked,
            }
        )
        expected[step] = reference_params(handler)
    mngr.wait_until_finished()
    if unhide is not None:
        unhide()

    if MODE == "crash":
        if RANK == 0:
            np.savez(
                os.path.join(OUT, "expected.npz"),
                **{f"{s}/{k}": v for s, d in expected.items() for k, v in d.items()},
            )
        multihost_utils.sync_global_devices("expected_written")
        # Step 3 is in flight when rank 1 dies: it dies inside its background write, before
        # its payload and index exist, so the step can never be committed (dying right after
        # save() returns would race with a fast background write).
        if RANK == 1:
            handler._write_files = lambda *args, **kwargs: os._exit(17)
        mngr.save(3, args=orbax_lossy.LossySave(make_state(3, save_sh)))
        if RANK == 1:
            print("rank 1 dying with save 3 in flight", flush=True)
            os._exit(17)
        print("rank 0 waiting for save 3 (peer is dead)", flush=True)
        mngr.wait_until_finished()  # blocks on the commit barrier; the parent kills us
        time.sleep(600)
        return

    summary["all_steps"] = list(mngr.all_steps())
    summary["dependencies"] = {
        str(s): dependency_of(handler, root, s) for s in range(n_steps)
    }
    # Bytes written per process, for every kept step.
    sizes = {}
    for s in summary["all_steps"]:
        item = os.path.join(root, str(s), "default")
        sizes[str(s)] = {
            n: os.path.getsize(os.path.join(item, n))
            for n in sorted(os.listdir(item))
            if n.startswith("data.p")
        }
    summary["data_file_sizes"] = sizes

    # Restore every kept step with another sharding, on both processes, with a fresh handler.
    restores = {}
    for s in summary["all_steps"]:
        fresh = orbax_lossy.LossyCheckpointHandler()
        out = fresh.restore(
            os.path.join(root, str(s), "default"), orbax_lossy.LossyRestore(abstract(restore_sh))
        )
        ok = True
        for k in SHAPES:
            arr = out["params"][k]
            ok &= arr.sharding.is_equivalent_to(restore_sh[k], arr.ndim)
            ok &= same_bits(gather(arr), expected[s][k])
        ok &= int(gather(out["count"])) == s and out["step"] == s
        restores[str(s)] = {"bitexact": bool(ok), "bytes_read": fresh.last_restore_bytes_read}
    # Through the manager as well (latest step).
    latest = mngr.latest_step()
    out = mngr.restore(latest, args=orbax_lossy.LossyRestore(abstract(restore_sh)))
    restores["manager"] = {
        "bitexact": all(same_bits(gather(out["params"][k]), expected[latest][k]) for k in SHAPES)
    }
    summary["restores"] = restores

    # Partial read: a target sharding over devices [p0:d0, p1:d0, p1:d1, p1:d2] splits w into
    # row quarters; process 0 owns one quarter, process 1 three quarters.
    base_step = next(s for s in summary["all_steps"] if summary["dependencies"][str(s)] is None)
    item = os.path.join(root, str(base_step), "default")
    wleaf = next(
        lf for lf in read_manifest(item)["leaves"] if [k for _, k in lf["path"]] == ["params", "w"]
    )
    qdev = np.array([devices[0], devices[4], devices[5], devices[6]])
    qsh = NamedSharding(Mesh(qdev, ("q",)), P("q", None))
    fresh = orbax_lossy.LossyCheckpointHandler()
    target = {"params": {"w": jax.ShapeDtypeStruct(SHAPES["w"], jnp.float32, sharding=qsh)}}
    out = fresh.restore(item, orbax_lossy.LossyRestore(target, partial_restore=True))
    local_rows = sum(s.data.shape[0] for s in out["params"]["w"].addressable_shards)
    summary["partial"] = {
        "step": base_step,
        "w_payload": wleaf["stored_bytes"],
        "w_pieces": len(wleaf["pieces"]),
        "local_fraction": local_rows / SHAPES["w"][0],
        "bytes_read": fresh.last_restore_bytes_read,
    }
    mngr.close()
    with open(os.path.join(OUT, f"summary.p{RANK}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main()
