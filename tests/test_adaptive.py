"""AdaptivePolicy and optimizer moments: LC on Adam deltas, the choice rule, end to end."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import orbax_lossy as ol
from orbax_lossy.codecs.base import codec_from_config
from orbax_lossy.codecs.bitmask import Bitmask
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC, table_estimate
from orbax_lossy.engine import device as program
from orbax_lossy.format.manifest import read_manifest_body as read_manifest
from orbax_lossy.policy import AdaptivePolicy
from orbax_lossy.policy.adaptive import leaf_statistics
from orbax_lossy.treepaths import flatten, path_str

#: width of every layer: both kernels are (WIDTH, WIDTH) and both biases (WIDTH,), like the
#: frozen bf16 table, so a save compiles its per-leaf statistics and codec programs for two
#: shapes per dtype and role, not four (AdaptivePolicy compiles one per distinct leaf shape)
WIDTH = 64


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(WIDTH)(x))
        return nn.Dense(WIDTH)(x)


def trainer(lr: float = 1e-4):
    model, tx = MLP(), optax.adamw(lr)
    xs = jax.random.normal(jax.random.key(1), (64, WIDTH))
    ys = jax.random.normal(jax.random.key(2), (64, WIDTH))

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, xs) - ys) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = model.init(jax.random.key(0), xs)
    return params, tx.init(params), step


def train(params, opt_state, step, n: int):
    for _ in range(n):
        params, opt_state = step(params, opt_state)
    return params, opt_state


def make_state(params, opt_state, t: int) -> dict:
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    frozen = jax.random.normal(jax.random.key(7), (WIDTH, WIDTH), jnp.bfloat16)  # frozen table
    return {"params": params, "bf16": bf16, "frozen": frozen, "opt_state": opt_state,
            "step": jnp.int32(t)}


# --------------------------------------------------------------------------- moments via LC


def test_lc_on_adam_moment_deltas_is_bounded_and_nu_stays_finite():
    params, opt_state, step = trainer(1e-3)
    params, opt_state = train(params, opt_state, step, 5)
    ref = opt_state[0]
    _, opt_state = train(params, opt_state, step, 3)
    new = opt_state[0]
    names = ["mu"] * len(jax.tree.leaves(ref.mu)) + ["nu"] * len(jax.tree.leaves(ref.nu))
    refs = jax.tree.leaves(ref.mu) + jax.tree.leaves(ref.nu)
    vals = jax.tree.leaves(new.mu) + jax.tree.leaves(new.nu)
    plan = (LC(bits=4),) * len(vals)
    none = (None,) * len(vals)
    out = program.encode_tree(vals, refs, plan=plan, shardings=none)
    dec = program.decode_tree([o["fields"] for o in out], [o["side"] for o in out], refs,
                              plan=plan, dtypes=tuple(v.dtype for v in vals), shardings=none)
    for name, r, v, o, got in zip(names, refs, vals, out, dec, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(o["recon"]))
        d, got = np.asarray(v) - np.asarray(r), np.asarray(got)
        assert np.all(np.isfinite(got))
        # each kept element within 50% of its delta, dropped ones smaller than kept buckets
        assert np.linalg.norm(got - np.asarray(v)) <= 0.5 * np.linalg.norm(d) + 1e-12
        if name == "nu":
            assert np.all(got >= 0)

# --------------------------------------------------------------------------- the rule


def synthetic_leaves():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 128)).astype(np.float32) * 0.05
    bf_ref = jnp.asarray(w, jnp.bfloat16)
    flip = rng.random(w.shape) < 0.01
    bf_new = jnp.where(flip, (bf_ref.astype(jnp.float32) * 1.02).astype(jnp.bfloat16), bf_ref)
    f_ref = jnp.asarray(w)
    f_new = f_ref + jnp.asarray(rng.standard_normal(w.shape) * 1e-5, jnp.float32)
    nu_ref = jnp.asarray(np.exp(rng.normal(-12, 1, w.shape)), jnp.float32)
    nu_new = nu_ref * 0.999 + 1e-3 * jnp.asarray(np.exp(rng.normal(-12, 1, w.shape)), jnp.float32)
    paths = [
        (("key", "params"), ("key", "bf")),
        (("key", "params"), ("key", "w")),
        (("key", "opt_state"), ("key", "nu"), ("key", "w")),
        (("key", "params"), ("key", "tiny")),
        (("key", "step"),),
    ]
    values = [bf_new, f_new, nu_new, f_new[0, :8], jnp.int32(3)]
    refs = [bf_ref, f_ref, nu_ref, f_ref[0, :8], jnp.int32(2)]
    return paths, values, refs


def test_rule_picks_bitmask_lc_and_exact_where_expected():
    paths, values, refs = synthetic_leaves()
    policy = AdaptivePolicy()
    plan = policy.plan(paths, values, refs, is_base=False)
    assert plan[0] == Bitmask()  # 1% of bf16 elements changed
    assert isinstance(plan[1], LC)  # tiny float32 delta: LC within the 1e-3 budget
    assert isinstance(plan[2], (LC, Cluster))
    assert plan[3] == Exact() or plan[3] == Bitmask()  # below min_size: lossless
    assert plan[4] == Exact()
    assert policy.plan(paths, values, refs, is_base=False) == plan  # deterministic
    # base save: parameters and counters lossless, the second moment may take a direct codec
    base = policy.plan(paths, values, [None] * 5, is_base=True)
    assert base[0] == base[1] == base[3] == base[4] == Exact()
    assert not base[2].needs_reference
    assert base[2] == Exact() or base[2].domain == "log"
    strict_base = AdaptivePolicy.create({"second_moment": 0.0})
    assert all(c == Exact() for c in strict_base.plan(paths, values, [None] * 5, is_base=True))
    lossless = AdaptivePolicy.create({"param": 0.0, "second_moment": 0.0})
    assert all(isinstance(c, (Exact, Bitmask))
               for c in lossless.plan(paths, values, refs, is_base=False))
    bad = list(values)
    bad[1] = bad[1].at[0, 0].set(jnp.nan)
    assert policy.plan(paths, bad, refs, is_base=False)[1] == Exact()


def test_lc_error_estimate_matches_the_real_encoding():
    rng = np.random.default_rng(5)
    ref = jnp.asarray(rng.standard_normal(5000), jnp.float32)
    value = ref + jnp.asarray(rng.standard_normal(5000) * 1e-3, jnp.float32)
    stats = jax.device_get(leaf_statistics(value, ref))
    for bits in (1, 2, 3, 5, 8):
        _, estimate_sq = table_estimate(stats["delta_table"], 5000, bits)
        err = np.linalg.norm(np.asarray(LC(bits=bits).device_encode(value, ref).recon - value))
        # the estimate is the computed error plus a 2% margin: above it, and close to it
        assert err <= np.sqrt(estimate_sq) + 1e-12, bits
        assert np.sqrt(estimate_sq) <= 1.05 * err + 1e-9, bits


def test_bad_policy_parameters():
    with pytest.raises(ol.InvalidArgumentError):
        AdaptivePolicy.create({"weights": 0.1})
    with pytest.raises(ol.InvalidArgumentError):
        AdaptivePolicy(lc_bits=(0,))
    with pytest.raises(ol.InvalidArgumentError):
        AdaptivePolicy(lossless_slack=0.5)
    assert hash(AdaptivePolicy()) == hash(AdaptivePolicy())


# --------------------------------------------------------------------------- end to end


def test_adamw_flax_state_through_the_manager(tmp_path, assert_bitwise):
    policy = AdaptivePolicy.create({"first_moment": 0.05, "second_moment": 0.05},
                                   cluster_bits=(4,), lc_bits=(2, 4))
    handler = ol.LossyCheckpointHandler(policy, base_interval=10)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    params, opt_state, step = trainer()
    held, states = {}, {}
    for t in range(3):
        params, opt_state = train(params, opt_state, step, 2)
        states[t] = make_state(params, opt_state, t)
        assert mngr.save(t, args=ol.LossySave(states[t]))
        held[t] = [None if v is None else np.array(v) for v in handler.reference.values]
    mngr.wait_until_finished()

    budgets = dict(policy.budgets)
    seen = set()
    for t in range(3):
        manifest = read_manifest(os.path.join(tmp_path, str(t), "default"))
        codecs = {path_str(tuple(map(tuple, leaf["path"]))): leaf["codec"]["id"]
                  for leaf in manifest["leaves"]}
        seen |= set(codecs.values())
        if t == 0:  # base: parameters exact; optimizer moments exact or a direct codec
            for leaf in manifest["leaves"]:
                codec = codec_from_config(leaf["codec"])
                assert not codec.needs_reference
                if leaf["role"] not in ("first_moment", "second_moment"):
                    assert leaf["codec"]["id"] == "exact"
                else:
                    assert leaf["rel_error"] <= budgets[leaf["role"]] * 1.5
        assert codecs["step"] == "exact"
        if t > 0:
            assert codecs["frozen"] == "bitmask"
        for leaf in manifest["leaves"]:
            if leaf["codec"]["id"] == "lc":
                assert leaf["rel_error"] <= budgets[leaf["role"]] * (1 + 1e-5)
        restored = mngr.restore(t, args=ol.LossyRestore(states[t]))
        _, leaves, _ = flatten(restored)
        for i, (got, exp) in enumerate(zip(leaves, held[t], strict=True)):
            if exp is not None:
                assert_bitwise(got, exp, f"step {t} leaf {i}")
    assert "bitmask" in seen and "lc" in seen
    mngr.close()


def test_adaptive_saves_compile_per_leaf_shape_and_codec_not_per_plan(tmp_path,
                                                                      monkeypatch) -> None:
    """Changing plans reuse cached per-leaf programs; the manifest says how to decode. (With
    the CPU kernels off: on CPU, float32 LC/Step leaves compile no XLA program at all.)"""
    from orbax_lossy.engine import cpu_encode
    from orbax_lossy.engine import device as program

    monkeypatch.setenv(cpu_encode.ENV, "0")
    from orbax_lossy.format.manifest import read_manifest_body as read_manifest

    rng = np.random.default_rng(0)
    w = {f"w{i}": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for i in range(4)}
    handler = ol.LossyCheckpointHandler(ol.AdaptivePolicy.create(budgets={"param": 0.3}))
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=None)
    program.encode_tree.clear_cache()
    combos = set()
    for step in range(6):
        # leaves change at different rates, so plans differ from save to save
        w = {k: v + (1e-3 * (i + 1) * step % 3) * jnp.asarray(rng.standard_normal(v.shape),
                                                               jnp.float32)
             for i, (k, v) in enumerate(w.items())}
        mngr.save(step, args=ol.LossySave(w))
        mngr.wait_until_finished()
        manifest = read_manifest(tmp_path / str(step) / "default")
        assert manifest["programs"] == "per_leaf"
        combos |= {repr(sorted(leaf["codec"].items())) for leaf in manifest["leaves"]}
    assert len(combos) >= 2  # the plan really changed
    assert program.encode_tree._cache_size() == len(combos)
    restored = ol.checkpoint_manager(tmp_path).restore(5)
    for k in w:
        np.testing.assert_array_equal(np.asarray(restored[k]),
                                      np.asarray(handler.reference.values[sorted(w).index(k)]))


def test_first_moment_gets_pruned_direct_lc_and_newborn_second_moments_stay_positive():
    rng = np.random.default_rng(4)
    mu_ref = jnp.asarray(rng.standard_normal((256, 64)) * 1e-3, jnp.float32)
    mu = jnp.asarray(rng.standard_normal((256, 64)) * 1e-3, jnp.float32)  # a fresh EMA
    nu_ref = jnp.asarray(np.exp(rng.normal(-12, 1, (256, 64))), jnp.float32).at[:4].set(0.0)
    nu = nu_ref * 0.99 + 1e-7  # the zero rows become positive ("born")
    paths = [(("key", "opt_state"), ("key", "mu"), ("key", "w")),
             (("key", "opt_state"), ("key", "nu"), ("key", "w"))]
    loose = AdaptivePolicy.create({"first_moment": 1.0}, cluster_bits=(4,))
    plan = loose.plan(paths, [mu, nu], [mu_ref, nu_ref], is_base=False)
    assert plan[0] == LC(1, mode="direct") or plan[0] == LC(2, mode="direct")
    # newborn second-moment elements (zero reference, positive now) never decode to 0
    # (they take the smallest kept positive bucket's symbol)
    for codec in (LC(3), LC(4)):
        out = program.encode_tree([nu], [nu_ref], plan=(codec,), shardings=(nu.sharding,))[0]
        assert bool(out["safe"]), codec
        recon = np.asarray(out["recon"])
        assert recon.min() > 0
    # LC(2) keeps only negative buckets here (the largest deltas are decays): nothing to lift
    # into, so the guard refuses it and the handler would store the leaf exactly
    out = program.encode_tree([nu], [nu_ref], plan=(LC(2),), shardings=(nu.sharding,))[0]
    assert not bool(out["safe"])
    # with a tighter first-moment budget the choice must meet it (LC errors are computed)
    tight = AdaptivePolicy.create({"first_moment": 0.3}, cluster_bits=())
    (codec,) = tight.plan(paths[:1], [mu], [mu_ref], is_base=False)
    out = program.encode_tree([mu], [mu_ref], plan=(codec,), shardings=(mu.sharding,))[0]
    assert float(out["rel_error"]) <= 0.3 * 1.02


# --------------------------------------------------------------------------- sampled statistics


def test_sample_positions_are_global_coprime_and_cover_every_column():
    import math

    from orbax_lossy.policy.adaptive.statistics import sample_size, sample_stride

    assert sample_stride(5000, 1 << 16) == 1 and sample_stride(1 << 20, 0) == 1
    for shape in [(1365, 1024), (4096, 512), (3, 1 << 20), (7, 12, 4096), (257, 1000)]:
        n = math.prod(shape)
        stride = sample_stride(n, 1 << 16)
        assert math.gcd(stride, n) == 1 and stride >= -(-n // (1 << 16))
        assert sample_size(n, 1 << 16) == len(range(0, n, stride)) <= 1 << 16
        # every column (and every position of the last two axes) is sampled alike
        pos = np.arange(0, n, stride)
        cols = np.bincount(pos % shape[-1], minlength=shape[-1])
        per_column = len(pos) / shape[-1]
        assert cols.min() >= math.floor(per_column) - 1 and cols.max() <= math.ceil(per_column) + 1


def test_sampled_lc_estimate_sees_the_largest_elements_outside_the_sample():
    """A few deltas far above the sample's largest shift the buckets LC keeps: the sampled
    estimate (with the leaf's largest elements merged in) must not be optimistic."""
    from orbax_lossy.policy.adaptive.statistics import (
        completed,
        sample_size,
        sample_stride,
    )

    rng = np.random.default_rng(3)
    n, sample = 1 << 18, 1 << 12
    ref = rng.standard_normal(n).astype(np.float32)
    delta = rng.standard_normal(n).astype(np.float32) * 1e-3
    stride = sample_stride(n, sample)
    delta[np.arange(1, n, stride)[:6]] *= 300  # never sampled: positions 1 mod stride
    value, reference = jnp.asarray(ref + delta), jnp.asarray(ref)
    raw = jax.device_get(leaf_statistics(value, reference, sample=sample))
    stats, priced_n = completed(raw, value.dtype, n, sample)
    assert priced_n == stride * sample_size(n, sample)
    moved = np.linalg.norm(np.asarray(value) - ref)
    optimistic = 0
    for bits in (2, 3, 4, 6):
        recon = np.asarray(LC(bits).device_encode(value, reference).recon)
        real = np.linalg.norm(recon - np.asarray(value)) / moved
        est = LC(bits).estimate(stats, priced_n, np.dtype(np.float32))
        assert est.progress_error >= 0.97 * real, (bits, est, real)
        bare = LC(bits).estimate(raw, sample_size(n, sample), np.dtype(np.float32))
        optimistic += bare.progress_error < 0.5 * real
    assert optimistic  # without the leaf's largest elements the sample misleads


def test_sampled_plan_matches_the_whole_leaf_plan_and_is_deterministic():
    paths, values, refs = synthetic_leaves()  # 128 x 128 leaves: sampled at 2**12
    whole = AdaptivePolicy(stats_sample=0, trial_sample=0)
    sampled = AdaptivePolicy(stats_sample=1 << 12, trial_sample=1 << 11)
    for is_base, rs in ((False, refs), (True, [None] * len(refs))):
        plan = sampled.plan(paths, values, rs, is_base=is_base)
        assert plan == whole.plan(paths, values, rs, is_base=is_base)
        assert plan == sampled.plan(paths, values, rs, is_base=is_base)


def test_sampled_second_moment_trial_sees_elements_far_below_their_reference():
    """The elementwise RMS of a delta codec on a second moment is dominated by a few elements
    far below their reference; here none is in the trial sample. The sampled trial's estimate
    must not be optimistic, and the codec the policy picks must meet the budget."""
    from orbax_lossy.policy.adaptive.statistics import elementwise_rel_rms, sample_stride

    rng = np.random.default_rng(5)
    n, trial = 1 << 18, 1 << 11
    ref = np.exp(rng.normal(-12, 1.5, n)).astype(np.float32)
    value = ref * np.exp(rng.normal(0, 0.05, n)).astype(np.float32)
    stride = sample_stride(n, trial)
    far = np.arange(1, n, stride)[:12]  # positions 1 mod stride: never in the trial sample
    value[far] = ref[far] * 1e-4
    v, r = jnp.asarray(value), jnp.asarray(ref)
    codecs = tuple(c for b in (2, 3, 4) for c in (LC(b), LC(b, domain="log")))
    stats = jax.device_get(leaf_statistics(v, r, measured=codecs, measure="elementwise",
                                           sample=1 << 12, trial_sample=trial))
    for codec, t in zip(codecs, stats["trials"], strict=True):
        recon = codec.device_encode(v, r).recon
        real = float(elementwise_rel_rms(v, recon, r != 0))
        assert float(t["elem_rel"]) >= 0.97 * real, (codec, float(t["elem_rel"]), real)
    policy = AdaptivePolicy.create(stats_sample=1 << 12, trial_sample=trial)
    (codec,) = policy.plan([("nu", "w")], [v], [r], is_base=False, roles=["second_moment"])
    recon = codec.device_encode(v, r).recon if codec.needs_reference else v
    assert float(elementwise_rel_rms(v, recon, r != 0)) <= 0.2, codec


SHARDED_STATS = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.codecs.lc import LC
from orbax_lossy.policy.adaptive import leaf_statistics
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
rng = np.random.default_rng(0)
ref = jnp.asarray(np.exp(rng.normal(-12, 1, (256, 96))), jnp.float32)
val = ref * 0.99 + jnp.asarray(np.exp(rng.normal(-14, 1, (256, 96))), jnp.float32)
kw = dict(measured=(Cluster(4, domain="log"), LC(3)), measure="elementwise", sample=4096,
          trial_sample=1024)
one = jax.device_get(leaf_statistics(val, ref, **kw))
for spec in (P("a", "b"), P(None, "b"), P("b", None)):
    sh = NamedSharding(mesh, spec)
    got = jax.device_get(leaf_statistics(jax.device_put(val, sh), jax.device_put(ref, sh), **kw))
    for path, a in jax.tree_util.tree_leaves_with_path(one):
        b = dict(jax.tree_util.tree_leaves_with_path(got))[path]
        if np.issubdtype(np.asarray(a).dtype, np.floating):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=0, err_msg=str((spec, path)))
        else:
            np.testing.assert_array_equal(b, a, err_msg=str((spec, path)))
print("OK")
"""


def test_sampled_statistics_of_a_sharded_leaf_are_those_of_the_global_array(tmp_path):
    """The sample is taken at global positions: sharding the leaf changes nothing."""
    import subprocess
    import sys

    script = tmp_path / "sharded_stats.py"
    script.write_text(SHARDED_STATS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_whole_leaf_trials_on_the_cpu_kernels_match_the_xla_trials(monkeypatch):
    """Second moments' delta candidates are measured on the whole leaf; on one CPU device
    the encode kernels run those trials (host_trials.py). Same statistics as the XLA trials,
    and the same plan."""
    from orbax_lossy.engine import cpu_encode
    from orbax_lossy.policy.adaptive import host_trials

    rng = np.random.default_rng(8)
    n = 1 << 17
    ref = np.exp(rng.normal(-12, 1.5, n)).astype(np.float32)
    value = ref * np.exp(rng.normal(0, 0.05, n)).astype(np.float32)
    value[::9973] = ref[::9973] * 1e-4  # a few far below their reference
    ref[5] = 0.0  # one newborn element (left out of the elementwise error)
    v, r = jnp.asarray(value), jnp.asarray(ref)
    codecs = tuple(c for b in (2, 3, 4) for c in (LC(b), LC(b, domain="log")))
    assert all(host_trials.eligible(c, v, r) for c in codecs)
    kw = dict(measured=(Cluster(4, domain="log"), *codecs), measure="elementwise",
              sample=1 << 12, trial_sample=1 << 11)
    host = jax.device_get(leaf_statistics(v, r, **kw))
    monkeypatch.setenv(cpu_encode.ENV, "0")
    assert not host_trials.eligible(codecs[0], v, r)
    xla = jax.device_get(leaf_statistics(v, r, **kw))
    assert len(host["trials"]) == len(xla["trials"]) == len(kw["measured"])
    for codec, a, b in zip(kw["measured"], host["trials"], xla["trials"], strict=True):
        assert bool(a["safe"]) == bool(b["safe"]), codec
        assert set(a) == set(b), codec
        for key in sorted(set(b) - {"safe", "hist"}):  # the norms and the errors
            np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=1e-4,
                                       err_msg=f"{codec} {key}")
        for name, hist in b["hist"].items():
            if isinstance(codec, LC) and codec.domain == "log":  # ratios from another log
                assert np.abs(a["hist"][name] - hist).sum() <= n // 1000, codec
            else:
                np.testing.assert_array_equal(a["hist"][name], hist, err_msg=str(codec))
    policy = AdaptivePolicy.create(stats_sample=1 << 12, trial_sample=1 << 11)
    on_xla = policy.plan([("nu", "w")], [v], [r], is_base=False, roles=["second_moment"])
    monkeypatch.delenv(cpu_encode.ENV)
    assert policy.plan([("nu", "w")], [v], [r], is_base=False, roles=["second_moment"]) == on_xla
