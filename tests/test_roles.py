"""Leaf roles from the training framework (Flax NNX variable types, linen collections,
TrainState fields, Optax state types) and from names otherwise; non-parameter state exact."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from nnx_models import BNTrainState, Net, linen_bn_train_step
from nnx_models import nnx_setup as shared_nnx_setup

import orbax_lossy as ol
from orbax_lossy.policy import DEFAULT_BASE_CODECS, DEFAULT_ROLE_CODECS, leaf_roles, path_roles
from orbax_lossy.treepaths import flatten, path_str


def roles_by_path(tree, keep_none: bool = False) -> dict[str, str]:
    paths, _, _ = flatten(tree, keep_none=keep_none)
    roles = leaf_roles(tree, keep_none=keep_none)
    assert len(roles) == len(paths)
    return {path_str(p): r for p, r in zip(paths, roles, strict=True)}


def path_roles_by_path(tree) -> dict[str, str]:
    paths, leaves, _ = flatten(tree)
    dtypes = [np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype for x in leaves]
    return {path_str(p): r for p, r in zip(paths, path_roles(paths, dtypes), strict=True)}


#: codec id of the default policy's parameter codec on delta saves
PARAM_CODEC = DEFAULT_ROLE_CODECS["param"].codec_id
#: the default policy's parameter codec on base saves
BASE_PARAM_CODEC = DEFAULT_BASE_CODECS["param"].codec_id

# ----------------------------------------------------------------------------- linen


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(3)(nn.relu(x).reshape((x.shape[0], -1)))


class BNState(BNTrainState):
    ema_params: dict
    loss_scale: jax.Array


def linen_bn_state():
    model = CNN()
    variables = model.init(jax.random.key(0), jnp.ones((2, 6, 6, 1)))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    ts = BNState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                        batch_stats=variables["batch_stats"], ema_params=variables["params"],
                        loss_scale=jnp.float32(2.0**15))
    x = jax.random.normal(jax.random.key(1), (8, 6, 6, 1))
    y = jax.random.randint(jax.random.key(2), (8,), 0, 3)

    @jax.jit
    def step(ts):
        ts = linen_bn_train_step(ts, x, y)
        ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ts.ema_params, ts.params)
        return ts.replace(ema_params=ema, loss_scale=ts.loss_scale * 0.5)

    return ts, step


def test_linen_train_state_roles():
    ts, _ = linen_bn_state()
    roles = roles_by_path(ts)
    assert roles["step"] == "nonfloat"
    assert roles["params/Conv_0/kernel"] == "param"
    assert roles["params/BatchNorm_0/scale"] == "param"
    assert roles["batch_stats/BatchNorm_0/mean"] == "state"
    assert roles["batch_stats/BatchNorm_0/var"] == "state"
    assert roles["ema_params/Conv_0/kernel"] == "state"
    assert roles["loss_scale"] == "state"
    assert roles["opt_state/1/0/mu/Conv_0/kernel"] == "first_moment"
    assert roles["opt_state/1/0/nu/Dense_0/bias"] == "second_moment"
    assert roles["opt_state/1/0/count"] == "nonfloat"
    # the paths alone give the same roles for a linen TrainState
    assert path_roles_by_path(ts) == roles


def test_linen_variables_collections():
    variables = CNN().init(jax.random.key(0), jnp.ones((2, 6, 6, 1)))
    roles = roles_by_path(variables)
    assert {r for p, r in roles.items() if p.startswith("params/")} == {"param"}
    assert {r for p, r in roles.items() if p.startswith("batch_stats/")} == {"state"}


def test_optax_state_types_decide_outside_opt_state():
    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
    opt = optax.chain(optax.adam(1e-3), optax.ema(0.99)).init(params)
    sgd = optax.sgd(0.1, momentum=0.9).init(params)
    roles = roles_by_path({"p": params, "o": opt, "s": sgd})  # no conventional names
    assert roles["p/w"] == "param"
    assert roles["o/0/0/mu/w"] == "first_moment" and roles["o/0/0/nu/b"] == "second_moment"
    assert roles["o/1/ema/w"] == "optimizer"  # an EMA kept by the optimizer: exact
    assert roles["s/0/trace/w"] == "first_moment"


def test_plain_tree_keeps_float_leaves_params():
    tree = {"w": jnp.ones(3), "b": jnp.zeros(2), "n": jnp.int32(3), "k": jax.random.key(0),
            "opt_state": {"mu": jnp.ones(3)}, "none": None}
    roles = roles_by_path(tree)
    assert roles == {"b": "param", "k": "rng", "n": "nonfloat", "opt_state/mu": "first_moment",
                     "w": "param"}
    assert roles_by_path(tree, keep_none=True)["none"] == "nonfloat"
    assert path_roles_by_path(tree) == roles


def test_params_key_makes_other_float_leaves_state():
    params = {"w": jnp.ones(3)}
    tree = {"params": params, "opt_state": optax.adam(1e-3).init(params),
            "loss_scale": jnp.float32(1024.0), "ema": params, "metrics": {"loss": jnp.float32(1)}}
    roles = roles_by_path(tree)
    assert roles["params/w"] == "param"
    assert roles["loss_scale"] == roles["ema/w"] == roles["metrics/loss"] == "state"
    assert path_roles_by_path(tree) == roles


# ----------------------------------------------------------------------------- NNX


class CountingNet(Net):
    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.count = nnx.Variable(jnp.float32(0.0))  # a user variable: not a Param


def nnx_setup():
    return shared_nnx_setup(optax.adamw(1e-2), CountingNet)


@pytest.mark.parametrize("split", [False, True])
def test_nnx_roles(split):
    model, opt, _ = nnx_setup()
    state = nnx.split(model)[1] if split else nnx.state(model)
    roles = roles_by_path({"model": state, "opt": nnx.state(opt)})
    assert roles["model/l1/kernel/value"] == "param"
    assert roles["model/bn/scale/value"] == "param"
    assert roles["model/bn/mean/value"] == roles["model/bn/var/value"] == "state"
    assert roles["model/count/value"] == "state"
    assert roles["model/drop/rngs/key/value"] == "rng"
    assert roles["opt/opt_state/0/mu/l1/kernel/value"] == "first_moment"
    assert roles["opt/opt_state/0/nu/bn/scale/value"] == "second_moment"
    assert roles["opt/step/value"] == "nonfloat"


# ----------------------------------------------------------------------------- policies


def plan_by_path(policy, tree, is_base: bool, with_roles: bool = True) -> dict[str, str]:
    """The policy's codec id per float/int device leaf, given the typed roles."""
    paths, leaves, _ = flatten(tree)
    roles = leaf_roles(tree)
    keep = [i for i, x in enumerate(leaves)
            if not jax.dtypes.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key)]
    values = [jnp.asarray(leaves[i]) for i in keep]
    refs = [None if is_base else v for v in values]
    plan = policy.plan([paths[i] for i in keep], values, refs, is_base,
                       roles=[roles[i] for i in keep] if with_roles else None)
    return {path_str(paths[i]): c.codec_id for i, c in zip(keep, plan, strict=True)}


def test_default_policy_on_nnx_state_with_roles():
    model, opt, step = nnx_setup()
    step(model, opt)
    tree = {"model": nnx.state(model), "opt": nnx.state(opt)}
    delta = plan_by_path(ol.LeafPolicy(), tree, is_base=False)
    assert delta["model/l1/kernel/value"] == PARAM_CODEC
    assert delta["model/bn/mean/value"] == delta["model/bn/var/value"] == "exact"
    assert delta["model/count/value"] == "exact"
    assert delta["opt/opt_state/0/mu/l1/kernel/value"] != "exact"
    assert delta["opt/opt_state/0/nu/l1/kernel/value"] == "lc"
    base = plan_by_path(ol.LeafPolicy(), tree, is_base=True)
    assert BASE_PARAM_CODEC == "cluster" and DEFAULT_BASE_CODECS["param"] == ol.Cluster(8)
    assert base["model/l1/kernel/value"] == base["model/bn/scale/value"] == BASE_PARAM_CODEC
    assert base["model/bn/var/value"] == base["model/count/value"] == "exact"
    assert base["opt/opt_state/0/nu/l1/kernel/value"] == "cluster"
    # the adaptive policy gives `state` no budget: lossless (it prices leaf by leaf, so the
    # model's state alone decides this leaf's codec; pricing the optimizer's moments too
    # compiled ~35 s of statistics programs that this check does not look at)
    adaptive = plan_by_path(ol.AdaptivePolicy(), {"model": tree["model"]}, is_base=False)
    assert adaptive["model/bn/mean/value"] in ("exact", "bitmask")
    # without roles (paths only) an NNX tree has no framework marks: batch stats are params
    assert plan_by_path(ol.LeafPolicy(), tree, False, with_roles=False)[
        "model/bn/mean/value"] == PARAM_CODEC


def test_presets():
    ts, _ = linen_bn_state()
    lossless = plan_by_path(ol.LeafPolicy.lossless(), ts, is_base=False)
    assert set(lossless.values()) == {"exact"}
    params_only = plan_by_path(ol.LeafPolicy.params_only(), ts, is_base=False)
    assert {c for p, c in params_only.items() if p.startswith("params/")} == {"lc"}
    assert {c for p, c in params_only.items() if not p.startswith("params/")} == {"exact"}
    default = plan_by_path(ol.LeafPolicy(), ts, is_base=False)
    assert default["opt_state/1/0/nu/Conv_0/kernel"] == "lc"
    assert default["batch_stats/BatchNorm_0/var"] == "exact"
    # bases: lossless and params_only are all exact; the default codes params only
    for preset in (ol.LeafPolicy.lossless(), ol.LeafPolicy.params_only()):
        assert set(plan_by_path(preset, ts, is_base=True).values()) == {"exact"}
    base = plan_by_path(ol.LeafPolicy(), ts, is_base=True)
    assert {c for p, c in base.items() if p.startswith("params/")} == {BASE_PARAM_CODEC}
    assert {c for p, c in base.items()
            if p.startswith(("batch_stats/", "ema_params/", "loss_scale"))} == {"exact"}
    exact_bases = ol.LeafPolicy.create(base_defaults={"param": ol.Exact()})
    assert {c for p, c in plan_by_path(exact_bases, ts, is_base=True).items()
            if p.startswith("params/")} == {"exact"}
    with pytest.raises(ol.errors.InvalidArgumentError, match="needs a reference"):
        ol.LeafPolicy.create(base_defaults={"param": ol.LC(3)})


def test_linen_batchnorm_state_saved_with_defaults(tmp_path, assert_bitwise):
    """End to end with the default policy: batch stats, EMA and loss scale come back bitwise,
    params and moments lossy, and the restored state trains on."""
    ts, step = linen_bn_state()
    mngr = ol.checkpoint_manager(tmp_path, max_to_keep=None)
    saved = []
    for s in range(3):
        for _ in range(2):
            ts = step(ts)
        saved.append(ts)
        mngr.save(s, args=ol.LossySave(ts))
    mngr.wait_until_finished()
    restored = ol.checkpoint_manager(tmp_path).restore(2, args=ol.LossyRestore(ts))
    for name in ("batch_stats", "ema_params", "loss_scale", "step"):
        jax.tree.map(lambda a, b, n=name: assert_bitwise(a, b, n),
                     getattr(restored, name), getattr(saved[2], name))
    differs = jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), restored.params,
        saved[2].params))
    assert any(differs)
    assert int(step(restored).step) == int(saved[2].step) + 1
    # Step 0 is a base: parameters Cluster(8) (relative L2 error per leaf <= 2e-2; ~7e-3 on
    # Gaussian data), everything that is not a parameter or a moment exact. Step 1, the delta
    # after it, codes against the base's reconstruction: within the delta codec's bound.
    fresh = ol.checkpoint_manager(tmp_path)
    for s in (0, 1):
        got = fresh.restore(s, args=ol.LossyRestore(ts))
        for name in ("batch_stats", "ema_params", "loss_scale", "step"):
            jax.tree.map(lambda a, b, n=name: assert_bitwise(a, b, n),
                         getattr(got, name), getattr(saved[s], name))
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(saved[s].params),
                        strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if s == 0:
                assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
            np.testing.assert_allclose(a, b, atol=0.05)
    base_codecs = {r["path"]: r["codec"]["id"]
                   for r in ol.checkpoint_stats(tmp_path / "0" / "default")}
    assert {c for p, c in base_codecs.items() if p.startswith("params/")} == {BASE_PARAM_CODEC}
