"""PEC in two JAX processes (``jax.distributed``, 4 fake CPU devices each, the expert axis split
over the two processes): both processes hold the same experts (the primary's selection), each
writes only the held experts it owns (one of K=2), and each restores every expert from its
holder.

The test launches this file twice as a script (ranks 0 and 1); every subprocess has a hard
timeout and is killed on the way out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses: deselect with -m 'not slow'

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pec_mp")
    port = str(_free_port())
    from subprocess_env import cpu_env  # not at import: this file also runs as a worker

    env = cpu_env(processes=2)
    procs = []
    for rank in range(2):
        log = open(out / f"log.p{rank}.txt", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, __file__, str(rank), port, str(out)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for p, _ in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
    logs = "\n".join((out / f"log.p{r}.txt").read_text()[-3000:] for r in range(2))
    assert all(p.returncode == 0 for p, _ in procs), logs
    return [json.loads((out / f"result.p{r}.json").read_text()) for r in range(2)]


def test_both_processes_hold_the_same_experts(results):
    assert results[0]["held"] == results[1]["held"]
    assert results[0]["depends_on"] == results[1]["depends_on"]


def test_each_process_writes_its_own_data_file(results):
    assert results[0]["data_files"] == ["data.p0.bin", "data.p1.bin"]
    assert results[0]["data_bytes"][0] > 0 and results[0]["data_bytes"][1] > 0


def test_each_process_writes_only_the_held_experts_it_owns(results):
    # experts 0-3 live on process 0, 4-7 on process 1; K=2 holds one expert per process
    held = results[0]["held"]["moe"]
    assert [e // 4 for e in held] == [0, 1]
    full, part = results[0]["expert_bytes"]["1"], results[0]["expert_bytes"]["4"]
    assert set(full) == set(part) == {"data.p0.bin", "data.p1.bin"}
    for f in full:  # each process: 1 of its 4 experts, so about a quarter of its full save
        assert 0.2 < part[f] / full[f] < 0.3, (f, part[f], full[f])


def test_k_below_the_expert_shards_cuts_flat_per_process(results):
    # scan/w [8, 4 layers, 6] over 8 expert shards (4 per process), K=2: the striped rotation
    # holds 8 (layer, expert) slices per save, one per shard, so each process writes 4 of its
    # 16 full-save slices, cut locally (no gather onto one process)
    rows = results[0]["scan_rows"]
    assert sorted(e for _, e in rows) == list(range(8))
    full, part = results[0]["expert_bytes"]["scan1"], results[0]["expert_bytes"]["scan4"]
    assert set(full) == set(part) == {"data.p0.bin", "data.p1.bin"}
    for f in full:
        assert 0.2 < part[f] / full[f] < 0.3, (f, part[f], full[f])


def test_k_below_the_expert_shards_bundles_layers_per_process(results):
    # layers/i/moe/w [8, 6], 4 MoE layers as separate leaves over 8 expert shards, K=2: one
    # bundle `params/*/w` of the 4 layers' 8 held slices, one per shard, so each
    # process writes its own 4 rows (a quarter of its 16 full-save expert rows)
    assert results[0]["bundle_stored"] == ["params/*/w"]
    full, part = results[0]["bundle_bytes"]["1"], results[0]["bundle_bytes"]["4"]
    assert set(full) == set(part) == {"data.p0.bin", "data.p1.bin"}
    for f in full:
        assert 0.2 < part[f] / full[f] < 0.3, (f, part[f], full[f])


def test_every_process_restores_the_oracle(results):
    assert results[0]["oracle"] == "ok" and results[1]["oracle"] == "ok"


def _worker(rank: int, port: str, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=rank, initialization_timeout=30)
    import warnings

    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import orbax_lossy as ol
    from orbax_lossy.policy.base import ROLES

    warnings.simplefilter("ignore")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("expert", "data"))
    mesh8 = Mesh(np.array(jax.devices()), ("ep",))
    shard = {"w": NamedSharding(mesh, P("expert", None, None)),
             "dense": NamedSharding(mesh, P()),
             "scan": NamedSharding(mesh8, P("ep", None, None))}
    shapes = {"w": (8, 6, 4), "dense": (6, 6), "scan": (8, 4, 6),
              **{f"layer{i}": (8, 6) for i in range(4)}}
    shard.update({f"layer{i}": NamedSharding(mesh8, P("ep", None)) for i in range(4)})

    def values(step: int) -> dict[str, np.ndarray]:
        return {k: np.random.default_rng(10 * step + i).standard_normal(s).astype(np.float32)
                for i, (k, s) in enumerate(sorted(shapes.items()))}

    def state(step: int) -> dict:
        v = values(step)
        arrays = {k: jax.make_array_from_callback(v[k].shape, shard[k],
                                                  lambda idx, a=v[k]: a[idx]) for k in v}
        return {"params": {"moe": {"w": arrays["w"]}, "dense": arrays["dense"],
                           "scan": {"w": arrays["scan"]},
                           "layers": [{"moe": {"w": arrays[f"layer{i}"]}} for i in range(4)]}}

    exact = ol.LeafPolicy.create(defaults={r: ol.Exact() for r in ROLES})
    root = os.path.join(out, "ckpt")
    rules = [(r"moe/w$", 0), (r"scan/w$", 0, 1)]
    mngr = ol.checkpoint_manager(root, partial_experts=ol.PartialExperts(k=2, rules=rules),
                                 policy=exact, max_to_keep=2)
    for step in range(1, 5):
        mngr.save(step, args=ol.LossySave(state(step), expert_tokens={
            "moe": np.full(8, 3, np.int64), "scan": np.full((4, 8), 3, np.int64)}))
        mngr.wait_until_finished()
    mngr.close()
    item = os.path.join(root, "4", "default")
    rep = ol.partial_experts_report(item)
    target = {"params": {"moe": {"w": jax.ShapeDtypeStruct((8, 6, 4), np.float32,
                                                           sharding=shard["w"])},
                         "dense": jax.ShapeDtypeStruct((6, 6), np.float32,
                                                       sharding=shard["dense"]),
                         "scan": {"w": jax.ShapeDtypeStruct((8, 4, 6), np.float32,
                                                            sharding=shard["scan"])},
                         "layers": [{"moe": {"w": jax.ShapeDtypeStruct(
                             (8, 6), np.float32, sharding=shard[f"layer{i}"])}}
                             for i in range(4)]}}
    mngr = ol.checkpoint_manager(root, partial_experts=ol.PartialExperts(k=2, rules=rules),
                                 policy=exact)
    tree = mngr.restore(4, args=ol.LossyRestore(target))
    verdict = "ok"
    w = tree["params"]["moe"]["w"]
    for s in w.addressable_shards:
        e0 = s.index[0].start or 0
        for j in range(s.data.shape[0]):
            e = e0 + j
            want = values(rep["expert_steps"]["moe"][e])["w"][e]
            if not np.array_equal(np.asarray(s.data[j]), want):
                verdict = f"expert {e} differs from step {rep['expert_steps']['moe'][e]}"
    scan = tree["params"]["scan"]["w"]
    for s in scan.addressable_shards:
        e = s.index[0].start or 0
        for layer in range(4):
            h = rep["expert_steps"]["scan"][layer][e]
            if not np.array_equal(np.asarray(s.data[0, layer]), values(h)["scan"][e, layer]):
                verdict = f"scan expert {e} layer {layer} differs from step {h}"
    for i in range(4):
        for s in tree["params"]["layers"][i]["moe"]["w"].addressable_shards:
            e = s.index[0].start or 0
            h = rep["expert_steps"][f"layers/{i}/moe"][e]
            if not np.array_equal(np.asarray(s.data[0]), values(h)[f"layer{i}"][e]):
                verdict = f"layer {i} expert {e} differs from step {h}"
    d = tree["params"]["dense"]
    if not np.array_equal(np.asarray(d.addressable_shards[0].data), values(4)["dense"]):
        verdict = "dense differs"
    mngr.close()
    files = sorted(f for f in os.listdir(item) if f.startswith("data."))
    from orbax_lossy.experts.record import _find
    from orbax_lossy.format.manifest import read_manifest

    expert_bytes: dict = {}
    for s in (1, 4):
        for label, name in (("", "params/moe/w"), ("scan", "params/scan/w")):
            entry = _find(read_manifest(os.path.join(root, str(s), "default")), name)
            per: dict = {}
            for p in entry.pieces:
                per[p.file] = per.get(p.file, 0) + p.length
            expert_bytes[f"{label}{s}"] = per
    bundle_bytes: dict = {}
    for s, name in ((1, None), (4, "params/*/w")):
        man = read_manifest(os.path.join(root, str(s), "default"))
        per = {}
        for entry in man.leaves:
            if (entry.name == name if name else "layers/" in entry.name):
                for p in entry.pieces:
                    per[p.file] = per.get(p.file, 0) + p.length
        bundle_bytes[str(s)] = per
    result = {"held": rep["held"], "bundle_bytes": bundle_bytes,
              "bundle_stored": sorted(e.name for e in read_manifest(item).leaves
                                      if "*" in e.name),
              "scan_rows": [[lyr, e] for lyr, row in enumerate(rep["held"]["scan"])
                            for e in row], "depends_on": rep["depends_on"], "oracle": verdict,
              "expert_bytes": expert_bytes,
              "data_files": files,
              "data_bytes": [os.path.getsize(os.path.join(item, f)) for f in files]}
    with open(os.path.join(out, f"result.p{rank}.json"), "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
