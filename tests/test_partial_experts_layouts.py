"""PEC layouts besides stacked NNX experts: one subtree per expert (linen-style params dict),
scanned layers ``[E, L, ...]``, a tuple root, and the rule proposals."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_lossy as ol
from orbax_lossy.policy.base import ROLES
from orbax_lossy.treepaths import flatten, path_str

EXACT = ol.LeafPolicy.create(defaults={r: ol.Exact() for r in ROLES})


def flat(tree) -> dict[str, np.ndarray]:
    paths, leaves, _ = flatten(tree)
    return {path_str(p): np.asarray(v) for p, v in zip(paths, leaves, strict=True)}


def run(tmp_path, pec, make, steps=6):
    mngr = ol.checkpoint_manager(tmp_path, partial_experts=pec, policy=EXACT, max_to_keep=2,
                                 base_interval=50)
    states = {}
    for step in range(1, steps + 1):
        state = make(step)
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
        states[step] = flat(state)
    mngr.close()
    return states


def restore(tmp_path, pec, target, step):
    mngr = ol.checkpoint_manager(tmp_path, partial_experts=pec, policy=EXACT, max_to_keep=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flat(mngr.restore(step, args=ol.LossyRestore(target)))


def subtree_state(step: int, experts: int = 4) -> dict:
    rng = np.random.default_rng(step)

    def moe():
        return {f"expert_{e}": {"Dense_0": {"kernel": jnp.asarray(rng.normal(size=(3, 5)),
                                                                  jnp.float32),
                                            "bias": jnp.asarray(rng.normal(size=5),
                                                                jnp.float32)}}
                for e in range(experts)}

    params = {"MoELayer_0": moe(), "head": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32)}
    mu = {"MoELayer_0": moe(), "head": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32)}
    return {"params": params, "opt_state": {"mu": mu}, "step": step}


def test_one_subtree_per_expert(tmp_path):
    pec = ol.PartialExperts(k=1, rules=[(r"MoELayer_0/expert_(\d+)/", "path")])
    states = run(tmp_path, pec, subtree_state)
    stats = {r["path"] for r in ol.checkpoint_stats(tmp_path / "4" / "default")}
    assert sum("expert_" in p for p in stats) == 4  # 1 expert x (kernel, bias) x (param, mu)
    rep = ol.partial_experts_report(tmp_path / "6" / "default")
    assert list(rep["expert_steps"]) == ["MoELayer_0"]
    holders = rep["expert_steps"]["MoELayer_0"]
    assert holders == [2, 6, 3, 4] or sorted(holders)[-1] == 6
    got = restore(tmp_path, ol.PartialExperts(k=1, rules=[(r"MoELayer_0/expert_(\d+)/",
                                                            "path")]), subtree_state(0), 6)
    for name, value in got.items():
        if "expert_" in name:
            e = int(name.split("expert_")[1].split("/")[0])
            np.testing.assert_array_equal(value, states[holders[e]][name], err_msg=name)
        else:
            np.testing.assert_array_equal(value, states[6][name], err_msg=name)


def scanned_state(step: int) -> dict:
    rng = np.random.default_rng(100 + step)
    w = jnp.asarray(rng.normal(size=(4, 3, 2, 5)), jnp.float32)  # [E, L, d, h]
    return {"params": {"layers": {"moe": {"wi": w, "gate": jnp.asarray(rng.normal(size=(3, 2, 4)),
                                                                        jnp.float32)}}},
            "opt_state": {"mu": {"layers": {"moe": {"wi": w * 0.5}}}}}


def test_scanned_layers_expert_axis_and_layer_axis(tmp_path):
    rules = [(r"moe/wi$", 0, 1)]
    states = run(tmp_path, ol.PartialExperts(k=2, rules=rules), scanned_state)
    rep = ol.partial_experts_report(tmp_path / "5" / "default")
    holders = np.asarray(rep["expert_steps"]["layers/moe"])  # [L, E]
    assert holders.shape == (3, 4)
    held = np.asarray(rep["held"]["layers/moe"])
    assert held.shape == (3, 2) and len({tuple(r) for r in held}) > 1  # layers interleaved
    got = restore(tmp_path, ol.PartialExperts(k=2, rules=rules), scanned_state(0), 5)
    for name in ("params/layers/moe/wi", "opt_state/mu/layers/moe/wi"):
        for layer in range(3):
            for e in range(4):
                np.testing.assert_array_equal(got[name][e, layer],
                                              states[int(holders[layer, e])][name][e, layer])
    np.testing.assert_array_equal(got["params/layers/moe/gate"],
                                  states[5]["params/layers/moe/gate"])


def test_tuple_root_and_restore_without_target(tmp_path):
    def make(step):
        rng = np.random.default_rng(step)
        return (jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
                {"moe": {"w": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)}})

    states = run(tmp_path, ol.PartialExperts(k=2, rules=[(r"moe/w$", 0)]), make, steps=3)
    mngr = ol.checkpoint_manager(tmp_path, partial_experts=ol.PartialExperts(
        k=2, rules=[(r"moe/w$", 0)]), policy=EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = mngr.restore(3)
    got = flat(tree)
    np.testing.assert_array_equal(got["0"], states[3]["0"])
    assert got["1/moe/w"].shape == (8, 3)


def test_rules_from_shardings_and_nnx():
    from flax import nnx

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", None))
    tree = {"moe": {"w": jax.device_put(jnp.zeros((8, 3)), s)}, "dense": jnp.zeros((3, 3))}
    assert ol.rules_from_shardings(tree) == [(r"^moe/w$", 0)]

    class M(nnx.Module):
        def __init__(self):
            self.wi = nnx.Param(jnp.zeros((4, 2, 3)), out_sharding=("exp", None, "mlp"),
                                eager_sharding=False)
            self.dense = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    rules = ol.rules_from_nnx(M())
    assert len(rules) == 1 and rules[0][1] == 0
    layout = ol.PartialExperts(k=1, rules=rules).layout(nnx.state(M()))
    assert [g.n for g in layout.groups.values()] == [4]


def test_missing_expert_subtree_is_named():
    state = subtree_state(1)
    del state["params"]["MoELayer_0"]["expert_2"]
    with pytest.raises(ol.InvalidArgumentError, match="expert_2"):
        ol.PartialExperts(k=1, rules=[(r"MoELayer_0/expert_(\d+)/", "path")]).layout(state)
