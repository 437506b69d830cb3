"""Single-process sharding checks with 8 fake CPU devices (run as a subprocess).

Usage: python sharded_single.py OUT_DIR

Saves a delta chain of a state sharded over a 4x2 mesh through ``orbax_lossy`` and restores
every step onto several shardings; writes ``OUT_DIR/result.json`` with the measurements. Any
failed check raises (non-zero exit code), so the parent test sees it.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_lossy  # noqa: E402
from orbax_lossy import format as fmt  # noqa: E402
from orbax_lossy.engine import device as program  # noqa: E402
from orbax_lossy.format.manifest import read_manifest_body as read_manifest  # noqa: E402

CHUNK_BYTES = 4096


def make_state(shardings, step):
    rng = np.random.default_rng(step)
    base = np.random.default_rng(0)
    w = base.standard_normal((256, 128)).astype(np.float32) + 1e-2 * step * rng.standard_normal(
        (256, 128)
    ).astype(np.float32)
    v = base.standard_normal((128,)).astype(np.float32) + 1e-2 * step * rng.standard_normal(
        (128,)
    ).astype(np.float32)
    b = base.standard_normal((64, 64)).astype(np.float32) + 1e-2 * step * rng.standard_normal(
        (64, 64)
    ).astype(np.float32)
    return {
        "params": {
            "w": jax.device_put(w, shardings["w"]),
            "v": jax.device_put(v, shardings["v"]),
            "b": jax.device_put(b, shardings["b"]),  # fully replicated
        },
        "count": jax.device_put(np.int32(step), shardings["count"]),
        "step": step,
    }


def check_bitexact(restored, expected, where):
    for key in ("w", "v", "b"):
        got = np.asarray(jax.device_get(restored["params"][key]))
        want = np.asarray(jax.device_get(expected[key]))
        if (
            got.dtype != want.dtype
            or got.shape != want.shape
            or not np.array_equal(got.view(np.uint32), want.view(np.uint32))
        ):
            raise AssertionError(f"{where}: leaf {key} differs from the save-time reconstruction")


def main(out_dir: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    devices = np.array(jax.devices())
    mesh42 = Mesh(devices.reshape(4, 2), ("data", "model"))
    mesh24 = Mesh(devices.reshape(2, 4), ("x", "y"))
    save_sh = {
        "w": NamedSharding(mesh42, P("data", "model")),
        "v": NamedSharding(mesh42, P("data")),
        "b": NamedSharding(mesh42, P()),
        "count": NamedSharding(mesh42, P()),
    }
    result: dict = {}

    # 1. encode_tree keeps the input shardings (no gather).
    from orbax_lossy.codecs.lc import LC

    x = make_state(save_sh, 1)["params"]
    refs = make_state(save_sh, 0)["params"]
    vals = [x["w"], x["v"], x["b"]]
    enc = program.encode_tree(
        vals,
        [refs["w"], refs["v"], refs["b"]],
        plan=(LC(bits=3),) * 3,
        shardings=tuple(v.sharding for v in vals),
    )
    shard_ok = []
    for v, e in zip(vals, enc, strict=True):
        for name, f in list(e["fields"].items()) + [("recon", e["recon"])]:
            same = f.sharding.is_equivalent_to(v.sharding, v.ndim)
            shard_ok.append(bool(same))
            if not same:
                raise AssertionError(f"encode output {name} sharding {f.sharding} != {v.sharding}")
            per_dev = {s.device: s.data.shape for s in f.addressable_shards}
            want = {s.device: s.data.shape for s in v.addressable_shards}
            if per_dev != want:
                raise AssertionError(f"encode output {name} shard shapes {per_dev} != {want}")
    result["encode_shardings_preserved"] = all(shard_ok)

    # 2. Save a chain: base + deltas (base_interval 3 => steps 0 base, 1,2 deltas, 3 base, 4).
    root = os.path.join(out_dir, "ckpt")
    handler = orbax_lossy.LossyCheckpointHandler(base_interval=3, chunk_bytes=CHUNK_BYTES)
    mngr = orbax_lossy.checkpoint_manager(root, handler=handler, max_to_keep=10)
    expected = {}
    kinds = {}
    for step in range(5):
        state = make_state(save_sh, step)
        mngr.save(step, args=orbax_lossy.LossySave(state))
        kinds[step] = handler.last_save_stats["kind"]
        # Reconstruction held at save time (copy to host before the next save replaces it).
        vals = handler.reference.values
        paths = handler.reference.paths
        exp = {}
        for p, v in zip(paths, vals, strict=True):
            if p[0][1] == "params":
                exp[p[1][1]] = np.asarray(jax.device_get(v))
        expected[step] = exp
    mngr.wait_until_finished()
    result["kinds"] = kinds
    result["all_steps"] = list(mngr.all_steps())

    # 3. Manifest: one replica per shard; the replicated leaf's pieces cover it exactly once.
    manifest = read_manifest(os.path.join(root, "4", "default"))
    coverage = {}
    for leaf in manifest["leaves"]:
        name = "/".join(str(k) for _, k in leaf["path"])
        total = math.prod(leaf["shape"]) if leaf["shape"] else 1
        count = np.zeros(leaf["shape"], np.int32)
        for p in leaf["pieces"]:
            count[tuple(slice(a, b) for a, b in p["box"])] += 1
        coverage[name] = {
            "elements": total,
            "covered_once": bool(np.all(count == 1)),
            "pieces": len(leaf["pieces"]),
            "stored_bytes": leaf["stored_bytes"],
        }
        if not np.all(count == 1):
            raise AssertionError(f"{name}: pieces cover the array {np.unique(count)} times")
    result["coverage"] = coverage
    # The default policy's bases: params Cluster(8), restored bitwise above like any link.
    base_manifest = read_manifest(os.path.join(root, "0", "default"))
    result["base_codecs"] = {"/".join(str(k) for _, k in leaf["path"]): leaf["codec"]["id"]
                             for leaf in base_manifest["leaves"]}
    data_files = sorted(n for n in os.listdir(os.path.join(root, "4", "default")))
    result["files_step4"] = data_files

    # 4. Restore every step onto several target shardings; bit-exact vs the save-time recon.
    targets = {
        "same_mesh": save_sh,
        "mesh_2x4": {
            "w": NamedSharding(mesh24, P("y", "x")),
            "v": NamedSharding(mesh24, P(("x", "y"))),
            "b": NamedSharding(mesh24, P(None, "y")),
            "count": NamedSharding(mesh24, P()),
        },
        "single_device": {k: SingleDeviceSharding(jax.devices()[3]) for k in save_sh},
        "replicated": {k: NamedSharding(mesh24, P()) for k in save_sh},
    }
    shapes = {"w": (256, 128), "v": (128,), "b": (64, 64)}
    restores = {}
    for tname, sh in targets.items():
        abstract = {
            "params": {
                k: jax.ShapeDtypeStruct(shapes[k], jnp.float32, sharding=sh[k]) for k in shapes
            },
            "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=sh["count"]),
            "step": 0,
        }
        for step in range(5):
            fresh = orbax_lossy.LossyCheckpointHandler(chunk_bytes=CHUNK_BYTES)
            restored = fresh.restore(
                os.path.join(root, str(step), "default"), orbax_lossy.LossyRestore(abstract)
            )
            check_bitexact(restored, expected[step], f"{tname} step {step}")
            for k in shapes:
                arr = restored["params"][k]
                if not arr.sharding.is_equivalent_to(sh[k], arr.ndim):
                    raise AssertionError(f"{tname}: {k} restored with sharding {arr.sharding}")
                if not arr.committed:  # as Orbax restores: placed, not free to move
                    raise AssertionError(f"{tname}: {k} restored uncommitted")
            if int(restored["count"]) != step or restored["step"] != step:
                raise AssertionError(f"{tname} step {step}: count/step mismatch")
        restores[tname] = "ok"
        # Through the manager too (last step, chain of deltas).
    restored = mngr.restore(
        4,
        args=orbax_lossy.LossyRestore(
            {
                "params": {
                    k: jax.ShapeDtypeStruct(shapes[k], jnp.float32, sharding=targets["mesh_2x4"][k])
                    for k in shapes
                },
                "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=targets["mesh_2x4"]["count"]),
                "step": 0,
            }
        ),
    )
    check_bitexact(restored, expected[4], "manager restore step 4")
    restores["manager"] = "ok"
    result["restores"] = restores
    mngr.close()

    # 5. Partial reads: restoring one quarter of `w` reads about a quarter of its payload.
    # A lossless base (exact raw payload, many chunks; the default's bases code params with
    # Cluster(8)).
    exact_root = os.path.join(out_dir, "exact")
    exact = orbax_lossy.LossyCheckpointHandler(
        orbax_lossy.LeafPolicy.lossless(), chunk_bytes=CHUNK_BYTES)
    with orbax_lossy.checkpoint_manager(exact_root, handler=exact) as emngr:
        emngr.save(0, args=orbax_lossy.LossySave(make_state(save_sh, 0)))
        emngr.wait_until_finished()
    step_dir = os.path.join(exact_root, "0", "default")
    man = read_manifest(step_dir)
    wleaf = next(lf for lf in man["leaves"] if [k for _, k in lf["path"]] == ["params", "w"])
    w_payload = wleaf["stored_bytes"]
    quarter_mesh = Mesh(devices[:4], ("q",))
    partial = {}
    for label, spec, frac in (
        ("rows_quarter", P("q", None), 0.25),
        ("cols_quarter", P(None, "q"), 0.25),
    ):
        sh = NamedSharding(quarter_mesh, spec)
        # One device's shard is one quarter: build the target on that one device only.
        shard_index = sh.addressable_devices_indices_map((256, 128))[devices[0]]
        box = fmt.box_from_index(shard_index, (256, 128))
        from orbax_lossy.engine.reading import read_region as _read_region

        codec = orbax_lossy.Exact()
        pieces = [fmt.PieceRef.from_msgpack(p, "w") for p in wleaf["pieces"]]
        reader = fmt.PayloadReader(step_dir)
        needed = [p for p in pieces if fmt.intersect(p.box, box) is not None]
        _read_region(reader, needed, codec, "raw", np.float32, box, "w")
        partial[label] = {"bytes_read": reader.bytes_read, "payload": w_payload, "frac": frac}
        if reader.bytes_read > 1.1 * frac * w_payload + 64:
            raise AssertionError(f"{label}: read {reader.bytes_read} of {w_payload}")
    # The full restore of w (all 8 devices are addressable here) reads its whole payload.
    fresh = orbax_lossy.LossyCheckpointHandler(chunk_bytes=CHUNK_BYTES)
    fresh.restore(
        step_dir,
        orbax_lossy.LossyRestore(
            {"params": {"w": jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=save_sh["w"])}},
            partial_restore=True,
        ),
    )
    partial["full_restore_w"] = {"bytes_read": fresh.last_restore_bytes_read, "payload": w_payload}
    result["partial"] = partial
    result["w_pieces"] = len(wleaf["pieces"])

    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
