"""PEC with the expert axis sharded over an ``expert`` mesh axis (8 simulated CPU devices).

The device count must be set before jax is imported, so this file re-runs itself as a script
in a subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and the tests assert
on the JSON it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("pec_sharded")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    with open(out / "result.json") as f:
        return json.load(f)


def test_rules_proposed_from_the_expert_mesh_axis(result):
    assert sorted(result["rules"]) == [["^opt_state/mu/blocks/0/moe/b_in$", 0],
                                       ["^opt_state/mu/blocks/0/moe/w_in$", 0],
                                       ["^params/blocks/0/moe/b_in$", 0],
                                       ["^params/blocks/0/moe/w_in$", 0]]


def test_held_slot_is_cut_per_shard(result):
    # w_in [8, 16, 8] on P("expert", None, "data") over 2 expert shards: K=2 is one held
    # expert per shard, so the [2, 16, 8] slot keeps the leaf's sharding (expert axis too) and
    # is cut on each device from its own rows: no collective in the compiled programs.
    assert result["held_rows"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # steps 2..5
    assert result["slot_spec"] == ["expert", None, "data"]
    assert result["slot_shard_experts"] == [1] * 8
    assert result["take_collectives"] == [] and result["put_collectives"] == []
    assert result["mosaic_spec"] == ["expert", None, "data"]


def test_each_stored_piece_is_one_expert(result):
    # pieces are cut along the slot's expert axis: a restore reads one expert alone
    assert result["piece_rows"] and all(n == 1 for n in result["piece_rows"])


def test_fewer_held_experts_than_shards_fall_back_to_a_gather(result):
    # K=2 over 8 expert shards cannot be balanced: the slot's expert axis is replicated and
    # XLA moves the held rows (documented in docs/partial_experts.md)
    assert result["fallback_spec"] == [None, None, None]
    assert result["fallback_collectives"]


def test_fewer_held_experts_than_shards_with_scanned_layers_cut_flat(result):
    # w [8, 4, 6] (4 scanned layers) on P("expert") over 8 expert shards, K=2: no layer row can
    # be balanced, but the striped rotation spreads the 4 x 2 held slices one per shard, and
    # the flat [8, 6] slot is cut on each device from its own rows: no collective.
    flat = result["flat"]
    for held in flat["held_rows"]:  # steps 2..5: every shard's expert once per save
        assert sorted(e for row in held for e in row) == list(range(8))
    assert flat["slot_shape"] == [8, 6]
    assert flat["slot_spec"] == ["expert", None]
    assert flat["slot_shard_rows"] == [1] * 8
    assert flat["take_collectives"] == [] and flat["put_collectives"] == []
    assert flat["piece_rows"] and all(n == 1 for n in flat["piece_rows"])
    assert flat["rows_recorded"]
    assert flat["oracle"] == "ok" and flat["untargeted"] == "ok"
    assert flat["closed_loop"] == "ok"


def test_k_below_the_expert_shards_bundles_per_layer_leaves(result):
    # 4 MoE layers as separate leaves blocks/i/moe/w [8, 6] on P("expert") over 8 shards, K=2:
    # one layer's 2 held experts cannot be spread over 8 shards, but the 4 layers' 8 held
    # slices can: the same leaf of the 4 layers is stored as one flat bundle `params/*/w`
    # (and `opt_state/mu/*/w`), cut per shard without a collective
    b = result["bundle"]
    for held in b["held_rows"]:
        assert sorted(e for row in held for e in row) == list(range(8))
    assert b["stored"] == ["opt_state/mu/*/w", "params/*/w"]
    assert b["slot_shape"] == [8, 6] and b["piece_rows"] == [1] * 8
    assert b["take_collectives"] == [] and b["put_collectives"] == []
    assert b["oracle"] == "ok" and b["untargeted"] == "ok"
    assert b["closed_loop"] == "ok"


def test_load_aware_k_below_the_expert_shards_stays_bundled(result):
    # the same 4 per-layer leaves with selection="load_aware": the top experts by unsaved
    # tokens are chosen under a quota of one slice per shard, so the bundle still applies
    la = result["bundle_load_aware"]
    assert la["stored"] == ["opt_state/mu/*/w", "params/*/w"]
    for held in la["held_rows"]:
        assert sorted(e for row in held for e in row) == list(range(8))
    assert la["hot_held"]  # the expert with the most tokens was held
    assert la["oracle"] == "ok"


def test_restore_oracle_on_the_saving_sharding(result):
    assert result["oracle"] == "ok"


@pytest.mark.parametrize("target", ["same", "replicated", "single_device"])
def test_restore_onto_other_shardings(result, target):
    assert result["targets"][target] == "ok"


def test_closed_loop_with_lc_sharded(result):
    assert result["closed_loop"] == "ok"


def _main(out: str) -> None:
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import orbax_lossy as ol
    from orbax_lossy.experts import device_ops
    from orbax_lossy.experts.record import _find
    from orbax_lossy.format.manifest import read_manifest
    from orbax_lossy.policy.base import ROLES
    from orbax_lossy.treepaths import flatten, path_str

    warnings.simplefilter("ignore")
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("expert", "data"))
    specs = {"w_in": P("expert", None, "data"), "b_in": P("expert", None),
             "router": P(None, "data")}
    shapes = {"w_in": (8, 16, 8), "b_in": (8, 16), "router": (16, 8)}

    def make(step: int) -> dict:
        rng = np.random.default_rng(step)

        def part():
            return {"blocks": [{"moe": {
                k: jax.device_put(jnp.asarray(rng.normal(size=shapes[k]), jnp.float32),
                                  NamedSharding(mesh, specs[k]))
                for k in ("w_in", "b_in", "router")}}]}

        return {"params": part(), "opt_state": {"mu": part()}}

    def flat(tree):
        paths, leaves, _ = flatten(tree)
        return {path_str(p): np.asarray(v) for p, v in zip(paths, leaves, strict=True)}

    res: dict = {}
    state0 = make(0)
    res["rules"] = [list(r) for r in ol.rules_from_shardings(state0)]
    rules = [(r"moe/(w_in|b_in)$", 0)]
    collectives = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                   "reduce-scatter", "collective-broadcast")
    w0 = state0["params"]["blocks"][0]["moe"]["w_in"]
    held = np.array([[0, 4]])
    slot = device_ops.take(w0, held, 0, None)
    res["slot_spec"] = list(slot.sharding.spec) + [None] * (3 - len(slot.sharding.spec))
    res["slot_shard_experts"] = [s.data.shape[0] for s in slot.addressable_shards]
    res["take_collectives"] = [c for c in collectives
                               if c in device_ops.take_hlo(w0, held, 0, None)]
    res["put_collectives"] = [c for c in collectives
                              if c in device_ops.put_hlo(w0, slot, held, 0, None)]
    assert np.array_equal(np.asarray(slot), np.asarray(w0)[[0, 4]])
    mesh8 = Mesh(np.array(jax.devices()), ("expert",))
    w8 = jax.device_put(w0, NamedSharding(mesh8, P("expert")))
    fallback = device_ops.take(w8, np.array([[2, 3]]), 0, None)
    res["fallback_spec"] = list(fallback.sharding.spec) + [None] * (
        3 - len(fallback.sharding.spec))
    res["fallback_collectives"] = [c for c in collectives if c in device_ops.take_hlo(
        w8, np.array([[2, 3]]), 0, None)]
    assert np.array_equal(np.asarray(fallback), np.asarray(w0)[[2, 3]])
    exact = ol.LeafPolicy.create(defaults={r: ol.Exact() for r in ROLES})

    root = os.path.join(out, "exact")
    pec = ol.PartialExperts(k=2, rules=rules)
    mngr = ol.checkpoint_manager(root, partial_experts=pec, policy=exact, max_to_keep=2)
    states = {}
    for step in range(1, 6):
        st = make(step)
        mngr.save(step, args=ol.LossySave(st))
        mngr.wait_until_finished()
        states[step] = flat(st)
    res["held_rows"] = [ol.partial_experts_report(os.path.join(root, str(s), "default"))[
        "held"]["blocks/0/moe"] for s in (2, 3, 4, 5)]
    entry = _find(read_manifest(os.path.join(root, "3", "default")), "params/blocks/0/moe/w_in")
    res["piece_rows"] = [p.box[0][1] - p.box[0][0] for p in entry.pieces]
    mosaic = pec.mosaic()
    spec = next(v for v in mosaic.values() if v.ndim == 3).sharding.spec  # a w_in
    res["mosaic_spec"] = list(spec) + [None] * (3 - len(spec))
    mngr.close()
    rep = ol.partial_experts_report(os.path.join(root, "5", "default"))

    def check(tree) -> str:
        got = flat(tree)
        for name, value in got.items():
            if name.endswith(("w_in", "b_in")):
                for e, h in enumerate(rep["expert_steps"]["blocks/0/moe"]):
                    if not np.array_equal(value[e], states[h][name][e]):
                        return f"{name}[{e}] != step {h}"
            elif not np.array_equal(value, states[5][name]):
                return f"{name} != step 5"
        return "ok"

    def restore(target):
        m = ol.checkpoint_manager(root, partial_experts=ol.PartialExperts(k=2, rules=rules),
                                  policy=exact)
        return m.restore(5, args=ol.LossyRestore(target))

    same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state0)
    tree = restore(same)
    res["oracle"] = check(tree)
    ok_sharding = all(v.sharding == s.sharding for v, s in zip(
        jax.tree.leaves(tree), jax.tree.leaves(same), strict=True))
    res["targets"] = {"same": "ok" if ok_sharding and res["oracle"] == "ok" else "bad"}
    repl = NamedSharding(mesh, P())
    res["targets"]["replicated"] = check(restore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=repl), state0)))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    res["targets"]["single_device"] = check(restore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state0)))

    # closed loop with LC deltas on the held slots, sharded
    lc = ol.LeafPolicy.create(defaults={**{r: ol.Exact() for r in ROLES}, "param": ol.LC(bits=3),
                                        "first_moment": ol.LC(bits=3)})
    verdict = _closed_loop(os.path.join(out, "lc"), make, rules, lc, same, ("w_in", "b_in"))
    res["closed_loop"] = verdict
    res["flat"] = _flat_case(out, mesh8, exact, lc, collectives)
    res["bundle"] = _bundle_case(out, mesh8, exact, lc, collectives)
    res["bundle_load_aware"] = res["bundle"].pop("load_aware")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(res, f)


def _flatten_np(tree) -> dict:
    import numpy as np

    from orbax_lossy.treepaths import flatten, path_str

    paths, leaves, _ = flatten(tree)
    return {path_str(p): np.asarray(v) for p, v in zip(paths, leaves, strict=True)}


def _exact_and_closed_loop(out: str, label: str, make, rules, exact, lc,
                           expert_value) -> dict:
    """Five saves of ``make(step)`` with exact codecs, then a restore of step 5 checked against
    the saved states (every expert from its holder: ``expert_value(value, e, layer)`` cuts
    one expert slice of a leaf), targeted and untargeted; then five LC saves, each restored in
    a fresh manager and compared with the mosaic (the closed loop)."""
    import jax
    import numpy as np

    import orbax_lossy as ol

    res: dict = {}
    root = os.path.join(out, f"{label}_exact")
    mngr = ol.checkpoint_manager(root, partial_experts=ol.PartialExperts(k=2, rules=rules),
                                 policy=exact, max_to_keep=2)
    states = {}
    for step in range(1, 6):
        st = make(step)
        mngr.save(step, args=ol.LossySave(st))
        mngr.wait_until_finished()
        states[step] = _flatten_np(st)
    mngr.close()
    res["root"] = root
    res["reports"] = {s: ol.partial_experts_report(os.path.join(root, str(s), "default"))
                      for s in range(2, 6)}
    holders = res["reports"][5]["expert_steps"]

    def check(tree) -> str:
        got = _flatten_np(tree)
        if set(got) != set(states[5]):
            return f"leaves {sorted(set(got) ^ set(states[5]))}"
        for name, value in got.items():
            if not name.endswith("moe/w"):
                if not np.array_equal(value, states[5][name]):
                    return f"{name} != step 5"
                continue
            group = next(g for g in holders if f"/{g}/" in f"/{name}")
            per_layer = holders[group]
            per_layer = per_layer if isinstance(per_layer[0], list) else [per_layer]
            for lyr, row in enumerate(per_layer):
                for e, h in enumerate(row):
                    if not np.array_equal(expert_value(value, e, lyr),
                                          expert_value(states[h][name], e, lyr)):
                        return f"{name}[{e}, layer {lyr}] != step {h}"
        return "ok"

    same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        make(0))
    m = ol.checkpoint_manager(root, partial_experts=ol.PartialExperts(k=2, rules=rules),
                              policy=exact)
    res["oracle"] = check(m.restore(5, args=ol.LossyRestore(same)))
    res["untargeted"] = check(m.restore(5))
    m.close()

    res["closed_loop"] = _closed_loop(os.path.join(out, f"{label}_lc"), make, rules, lc, same,
                                      ("moe/w",))
    return res


def _closed_loop(root: str, make, rules, lc, target, suffixes) -> str:
    """Five saves with ``lc``, each restored in a fresh manager onto ``target``: every expert
    leaf of PEC's mosaic (what the next delta is coded against) must be one restored leaf
    ending in ``suffixes``, bit for bit."""
    import numpy as np

    import orbax_lossy as ol

    pec = ol.PartialExperts(k=2, rules=rules)
    mngr = ol.checkpoint_manager(root, partial_experts=pec, policy=lc, max_to_keep=2)
    verdict = "ok"
    for step in range(1, 6):
        mngr.save(step, args=ol.LossySave(make(step)))
        mngr.wait_until_finished()
        m = ol.checkpoint_manager(root, partial_experts=ol.PartialExperts(k=2, rules=rules),
                                  policy=lc)
        got = _flatten_np(m.restore(step, args=ol.LossyRestore(target)))
        for key, full in pec.mosaic().items():
            if not any(np.array_equal(np.asarray(full), got[n]) for n in got
                       if n.endswith(suffixes)):
                verdict = f"step {step}: mosaic {key} differs from the restore"
    mngr.close()
    return verdict


def _flat_case(out, mesh8, exact, lc, collectives) -> dict:
    """K=2 of 8 experts over 8 expert shards with 4 scanned layers (the flat cut)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from orbax_lossy.experts import device_ops
    from orbax_lossy.experts.record import _find
    from orbax_lossy.experts.restore import _Context
    from orbax_lossy.format.manifest import read_manifest

    res: dict = {}
    w_sh = NamedSharding(mesh8, P("expert", None, None))

    def make(step: int) -> dict:
        rng = np.random.default_rng(100 + step)

        def part():
            return {"moe": {
                "w": jax.device_put(jnp.asarray(rng.normal(size=(8, 4, 6)), jnp.float32), w_sh),
                "router": jax.device_put(jnp.asarray(rng.normal(size=(6, 8)), jnp.float32),
                                         NamedSharding(mesh8, P()))}}

        return {"params": part(), "opt_state": {"mu": part()}}

    w0 = make(0)["params"]["moe"]["w"]
    held = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    assert device_ops.local_plan(w0, held, 0, 1) is None
    cut = device_ops.flat_plan([w0], [held], 0, 1)
    slot = device_ops.take_flat([w0], cut)
    res["slot_spec"] = list(slot.sharding.spec) + [None] * (2 - len(slot.sharding.spec))
    res["slot_shard_rows"] = [s.data.shape[0] for s in slot.addressable_shards]
    res["take_collectives"] = [c for c in collectives
                               if c in device_ops.flat_hlo("take", [w0], cut)]
    res["put_collectives"] = [c for c in collectives
                              if c in device_ops.flat_hlo("put", [w0], cut, slot)]
    w0_np = np.asarray(w0)
    assert np.array_equal(np.asarray(slot), np.stack([w0_np[e, lyr] for _, lyr, e in cut.rows]))
    (back,) = device_ops.put_flat([jnp.zeros_like(w0)], slot, cut)
    expect = np.zeros_like(w0_np)
    expect[held.T, np.arange(4)[None, :]] = w0_np[held.T, np.arange(4)[None, :]]
    assert np.array_equal(np.asarray(back), expect) and back.sharding == w0.sharding

    runs = _exact_and_closed_loop(out, "flat", make, [(r"moe/w$", 0, 1)], exact, lc,
                                  lambda v, e, lyr: v[e, lyr])
    root, reports = runs.pop("root"), runs.pop("reports")
    res.update(runs)
    res["held_rows"] = [reports[s]["held"]["moe"] for s in range(2, 6)]
    entry = _find(read_manifest(os.path.join(root, "4", "default")), "params/moe/w")
    res["slot_shape"] = list(entry.shape)
    res["piece_rows"] = [p.box[0][1] - p.box[0][0] for p in entry.pieces]
    unit = _Context(os.path.join(root, "4", "default"), 1, [0]).meta(4)["groups"]["moe"][
        "units"][0]
    res["rows_recorded"] = (sorted((lyr, e) for lyr, e, _ in unit["rows"]) == sorted(
        (lyr, e) for lyr, row in enumerate(res["held_rows"][2]) for e in row)
        and sorted(r for _, _, r in unit["rows"]) == list(range(8))
        and unit["shape"] == [8, 4, 6])
    return res


def _bundle_case(out, mesh8, exact, lc, collectives) -> dict:
    """K=2 of 8 experts over 8 expert shards, 4 MoE layers as separate leaves (a bundle)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from orbax_lossy.experts import device_ops
    from orbax_lossy.experts.record import _find
    from orbax_lossy.format.manifest import read_manifest

    res: dict = {}
    w_sh = NamedSharding(mesh8, P("expert", None))

    def make(step: int) -> dict:
        rng = np.random.default_rng(200 + step)

        def part():
            return {"blocks": [{"moe": {"w": jax.device_put(
                jnp.asarray(rng.normal(size=(8, 6)), jnp.float32), w_sh)}} for _ in range(4)],
                "head": jax.device_put(jnp.asarray(rng.normal(size=(6,)), jnp.float32),
                                       NamedSharding(mesh8, P()))}

        return {"params": part(), "opt_state": {"mu": part()}}

    ws = [make(0)["params"]["blocks"][i]["moe"]["w"] for i in range(4)]
    helds = [np.array([[2 * i, 2 * i + 1]]) for i in range(4)]
    cut = device_ops.flat_plan(ws, helds, 0, None)
    slot = device_ops.take_flat(ws, cut)
    res["take_collectives"] = [c for c in collectives
                               if c in device_ops.flat_hlo("take", ws, cut)]
    res["put_collectives"] = [c for c in collectives
                              if c in device_ops.flat_hlo("put", ws, cut, slot)]
    assert [s.data.shape[0] for s in slot.addressable_shards] == [1] * 8
    runs = _exact_and_closed_loop(out, "bundle", make, [(r"moe/w$", 0)], exact, lc,
                                  lambda v, e, lyr: v[e])
    root, reports = runs.pop("root"), runs.pop("reports")
    res.update(runs)
    groups = [f"blocks/{i}/moe" for i in range(4)]
    res["held_rows"] = [[reports[s]["held"][g] for g in groups] for s in range(2, 6)]
    manifest = read_manifest(os.path.join(root, "4", "default"))
    res["stored"] = sorted(e.name for e in manifest.leaves if e.name.endswith("/w"))
    entry = _find(manifest, "params/*/w")
    res["slot_shape"] = list(entry.shape)
    res["piece_rows"] = [p.box[0][1] - p.box[0][0] for p in entry.pieces]
    res_la = _load_aware_bundle(out, make, groups, exact)
    return {**res, "load_aware": res_la}


def _load_aware_bundle(out: str, make, groups, exact) -> dict:
    """The bundle case under ``selection="load_aware"`` with per-layer token counts."""
    import jax
    import numpy as np

    import orbax_lossy as ol
    from orbax_lossy.format.manifest import read_manifest

    root = os.path.join(out, "bundle_load_aware")
    rules = [(r"moe/w$", 0)]

    def pec():
        return ol.PartialExperts(k=2, rules=rules, selection="load_aware")

    mngr = ol.checkpoint_manager(root, partial_experts=pec(), policy=exact, max_to_keep=2)
    rng = np.random.default_rng(7)
    states = {}
    for step in range(1, 5):
        tokens = {g: rng.integers(0, 10, 8) for g in groups}
        tokens[groups[1]][6] = 1000  # layer 1's expert 6 is the busiest
        st = make(step)
        mngr.save(step, args=ol.LossySave(st, expert_tokens=tokens))
        mngr.wait_until_finished()
        states[step] = _flatten_np(st)
    mngr.close()
    reports = {s: ol.partial_experts_report(os.path.join(root, str(s), "default"))
               for s in range(2, 5)}
    res: dict = {"held_rows": [[reports[s]["held"][g] for g in groups] for s in range(2, 5)]}
    res["hot_held"] = all(6 in reports[s]["held"][groups[1]] for s in range(2, 5))
    res["stored"] = sorted(e.name for e in read_manifest(os.path.join(root, "4", "default"))
                           .leaves if e.name.endswith("/w"))
    same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        make(0))
    got = _flatten_np(ol.checkpoint_manager(root, partial_experts=pec(), policy=exact).restore(
        4, args=ol.LossyRestore(same)))
    holders = reports[4]["expert_steps"]
    res["oracle"] = "ok"
    for name, value in got.items():
        g = next((g for g in groups if f"/{g}/" in f"/{name}"), None)
        for e in range(8) if g else ():
            if not np.array_equal(value[e], states[holders[g][e]][name][e]):
                res["oracle"] = f"{name}[{e}] != step {holders[g][e]}"
        if g is None and not np.array_equal(value, states[4][name]):
            res["oracle"] = f"{name} != step 4"
    return res


if __name__ == "__main__":
    _main(sys.argv[1])
