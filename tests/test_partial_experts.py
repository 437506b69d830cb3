"""Issue 13: Partial Experts Checkpoint (PEC) on a small NNX MoE (8 experts, top-2, AdamW)."""

from __future__ import annotations

import os
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import orbax_lossy as ol
from orbax_lossy.experts import PartialExperts, partial_experts_report, selection, toy
from orbax_lossy.experts.rules import default_group, parse_rules, plan_layout
from orbax_lossy.policy.base import ROLES
from orbax_lossy.treepaths import flatten, path_str

RULES = [(r"moe/(w_in|b_in|w_out|b_out)$", 0)]
GROUPS = ("blocks/0/moe", "blocks/1/moe")
EXACT = ol.LeafPolicy.create(defaults={r: ol.Exact() for r in ROLES})


def manager(directory, pec, policy=None, **kw):
    kw.setdefault("max_to_keep", 50)
    kw.setdefault("base_interval", 50)
    return ol.checkpoint_manager(directory, partial_experts=pec, policy=policy, **kw)


def flat(tree) -> dict[str, np.ndarray]:
    paths, leaves, _ = flatten(tree)
    return {path_str(p).removesuffix("/value"): np.asarray(v) for p, v in
            zip(paths, leaves, strict=True)}


def is_expert(name: str) -> bool:
    return name.rsplit("/", 1)[-1] in ("w_in", "b_in", "w_out", "b_out") and "/moe/" in name


def group_of(name: str) -> str:
    return next(g for g in GROUPS if g + "/" in name)


@pytest.fixture(scope="module")
def data():
    return toy.CharData(toy.synthetic_text(4000), context=4)


def build(data, seed=0):
    return toy.build(data.vocab, d=8, h=8, context=4, seed=seed)


def train(directory, data, pec, *, saves=8, every=2, policy=EXACT, start=None, **kw):
    """Train, saving every ``every`` steps; returns saved states and routed tokens per step."""
    model, opt = start or build(data)
    mngr = manager(directory, pec, policy, **kw)
    states, tokens = {}, {}
    acc = np.zeros((2, 8), np.int64)
    for step in range(1, saves * every + 1):
        _, counts = toy.train_step(model, opt, *data.batch(step, 16))
        acc += np.asarray(counts)
        if step % every == 0:
            state = nnx.state((model, opt))
            tok = {g: acc[i].copy() for i, g in enumerate(GROUPS)}
            mngr.save(step, args=ol.LossySave(state, expert_tokens=tok))
            mngr.wait_until_finished()
            states[step], tokens[step] = flat(state), tok
            acc[:] = 0
    return mngr, states, tokens, (model, opt)


def restore(directory, data, step, pec=None, policy=EXACT):
    pec = pec or PartialExperts(k=2, rules=RULES)
    mngr = manager(directory, pec, policy)
    model, opt = build(data, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = mngr.restore(step, args=ol.LossyRestore(nnx.state((model, opt))))
    return mngr, pec, tree


# --------------------------------------------------------------------------- rules and selection


def test_default_groups_pair_params_and_moments():
    assert default_group("params/blocks/0/moe/w_in") == "blocks/0/moe"
    assert default_group("opt_state/1/0/mu/blocks/0/moe/w_in") == "blocks/0/moe"
    assert default_group("model/blocks/3/moe/w_out/value") == "blocks/3/moe"
    # an NNX (model, optimizer) tuple: the parameter path has a leading tuple index
    paths = [(("s", 0), ("d", "blocks"), ("d", 0), ("d", "moe"), ("d", "w_in")),
             (("s", 1), ("d", "opt_state"), ("s", 0), ("d", "mu"), ("d", "blocks"), ("d", 0),
              ("d", "moe"), ("d", "w_in"))]
    layout = plan_layout(paths, [(8, 2, 3)] * 2, parse_rules(RULES))
    assert list(layout.groups) == ["blocks/0/moe"]
    assert len(layout.groups["blocks/0/moe"].units) == 2
    # ... but a group that ends like another is not merged into it when the extra prefix is
    # another layer, not a container (`layers/1/moe` is its own MoE layer, not `moe`)
    paths = [(("d", "params"), ("d", "moe"), ("d", "w")),
             *[(("d", "params"), ("d", "layers"), ("s", i), ("d", "moe"), ("d", "w"))
               for i in (1, 0)]]
    layout = plan_layout(paths, [(8, 3)] * 3, parse_rules([(r"moe/w$", 0)]))
    assert sorted(layout.groups) == ["layers/0/moe", "layers/1/moe", "moe"]


def test_rule_errors_name_the_problem():
    with pytest.raises(ol.InvalidArgumentError, match="matches no leaf"):
        plan_layout([(("d", "w"),)], [(8, 2)], parse_rules([("nothing", 0)]))
    with pytest.raises(ol.InvalidArgumentError, match="blocks/0/moe.*experts"):
        plan_layout([(("d", "params"), ("d", "blocks"), ("d", 0), ("d", "moe"), ("d", "w_in")),
                     (("d", "params"), ("d", "blocks"), ("d", 0), ("d", "moe"), ("d", "b_in"))],
                    [(8, 2), (4, 2)], parse_rules(RULES))
    with pytest.raises(ol.InvalidArgumentError, match="out of range"):
        plan_layout([(("d", "moe"), ("d", "w_in"))], [(8,)], parse_rules([("w_in", 2)]))
    with pytest.raises(ol.InvalidArgumentError, match="capture group"):
        PartialExperts(k=1, rules=[("expert_", "path")])
    with pytest.raises(ol.InvalidArgumentError, match="k must be"):
        PartialExperts(k=0, rules=RULES)
    with pytest.raises(ol.InvalidArgumentError, match="expert_tokens"):
        ol.LossySave({"a": jnp.zeros(2)}, expert_tokens={"g": -np.ones(8)})


def test_sequential_round_robin_interleaved():
    n, k = 8, 2
    for position in range(4):
        seen = set()
        for cursor in range(n // k):
            seen.update(selection.sequential(n, k, cursor, position))
        assert seen == set(range(n))
    # consecutive layers hold different blocks of experts at the same save
    assert selection.sequential(8, 2, 0, 0) == [0, 1]
    assert selection.sequential(8, 2, 0, 1) == [2, 3]
    assert selection.sequential(8, 2, 1, 0) == [2, 3]
    assert selection.sequential(8, 3, 2, 0) == [0, 6, 7]
    # over 2 expert-parallel shards (experts 0-3, 4-7): K/2 of each shard, rotating per shard
    assert [selection.sequential(8, 2, c, 0, shards=2) for c in range(5)] == [
        [0, 4], [1, 5], [2, 6], [3, 7], [0, 4]]
    assert selection.sequential(8, 4, 0, 1, shards=2) == [2, 3, 6, 7]
    assert selection.sequential(8, 2, 0, 0, shards=4) == [0, 1]  # K < shards: unbalanced


@pytest.mark.parametrize("n,k,layers,shards", [(16, 2, 4, 8), (16, 1, 8, 8), (8, 2, 4, 8),
                                               (32, 4, 2, 8), (12, 2, 3, 6)])
def test_striped_rotation_balances_scanned_layers_over_more_shards_than_k(n, k, layers,
                                                                           shards):
    # K < P shards: no layer row is balanced, but L consecutive rows (a scanned leaf's layers,
    # or L MoE layers bundled) hold L*K/P slices of every shard (the flat cut's condition), and
    # each row still sees every expert in N/K saves
    assert selection.striped(n, k, shards)
    per = n // shards
    for cursor in range(2 * n // k):
        rows = [selection.sequential(n, k, cursor, p, stripes=shards) for p in range(layers)]
        owners = np.bincount([e // per for row in rows for e in row], minlength=shards)
        assert owners.tolist() == [layers * k // shards] * shards
        assert all(len(set(row)) == k for row in rows)
    for p in range(layers):
        seen = set()
        for cursor in range(n // k):
            seen.update(selection.sequential(n, k, cursor, p, stripes=shards))
        assert seen == set(range(n))
    # one expert per shard: the striped order is the plain one
    assert all(selection.sequential(8, 2, c, p, stripes=8) == selection.sequential(8, 2, c, p)
               for c in range(4) for p in range(4))
    assert not selection.striped(16, 8, 8) and not selection.striped(12, 2, 8)


def test_load_aware_balanced_over_more_shards_than_k():
    # 4 rows (MoE layers), K=2 of 8 experts over 8 shards (one expert each): every shard holds
    # exactly 4*2/8 = 1 slice; within that quota the experts with the most unsaved tokens win
    rng = np.random.default_rng(3)
    for _ in range(20):
        unsaved = rng.integers(0, 100, size=(4, 8))
        age = rng.integers(0, 5, size=(4, 8))
        held = selection.load_aware_balanced(8, 2, unsaved, age, None, 8)
        assert held is not None and all(len(set(h)) == 2 for h in held)
        assert sorted(e for h in held for e in h) == list(range(8))
    # the row/expert pair with the most tokens is always held
    unsaved = np.zeros((4, 8), np.int64)
    unsaved[2, 5] = 50
    held = selection.load_aware_balanced(8, 2, unsaved, np.zeros((4, 8)), None, 8)
    assert 5 in held[2]
    # staleness first: expert 7 of row 0 unsaved for 9 saves is held although it has no tokens
    age = np.zeros((4, 8), np.int64)
    age[0, 7] = 9
    held = selection.load_aware_balanced(8, 2, np.ones((4, 8)), age, 3, 8)
    assert 7 in held[0]
    # 16 experts over 8 shards (2 each), 2 rows x K=4 = 8 slices: one per shard
    held = selection.load_aware_balanced(16, 4, rng.integers(0, 9, (2, 16)),
                                         np.zeros((2, 16)), None, 8)
    assert np.bincount([e // 2 for h in held for e in h], minlength=8).tolist() == [1] * 8
    # quotas that cannot be met are refused (3 rows x K=2 over 8 shards)
    assert selection.load_aware_balanced(8, 2, np.ones((3, 8)), np.ones((3, 8)), None, 8) is None


def test_load_aware_top_k_ties_and_staleness():
    unsaved = [5, 9, 9, 1, 0, 0, 0, 7]
    age = [0, 1, 3, 0, 0, 0, 0, 0]
    assert selection.load_aware(8, 2, unsaved, age, None) == [1, 2]
    assert selection.load_aware(8, 3, unsaved, age, None) == [1, 2, 7]
    # expert 2 (age 3) and ties broken by age then id
    assert selection.load_aware(8, 1, [1, 1, 1, 1, 1, 1, 1, 1], [0, 2, 2, 0, 0, 0, 0, 0],
                                None) == [1]
    # staleness cap: expert 5 gets no tokens but must be saved after 4 saves
    stale = [0, 0, 0, 0, 0, 4, 0, 0]
    assert 5 in selection.load_aware(8, 2, unsaved, stale, 4)
    # over 2 expert-parallel shards: the top K/2 of each shard
    assert selection.load_aware(8, 2, unsaved, age, None, shards=2) == [2, 7]


# --------------------------------------------------------------------------- storage and restore


def test_restore_oracle_every_expert_from_its_newest_holder(tmp_path, data, assert_bitwise):
    pec = PartialExperts(k=2, rules=RULES)
    mngr, states, _, _ = train(tmp_path, data, pec, saves=7)
    mngr.close()
    steps = sorted(states)
    for s in (steps[0], steps[3], steps[-1]):
        rep = partial_experts_report(tmp_path / str(s) / "default")
        _, _, tree = restore(tmp_path, data, s)
        got = flat(tree)
        assert got.keys() == states[s].keys()
        for name, value in got.items():
            if not is_expert(name):
                assert_bitwise(value, states[s][name], name)
                continue
            holders = rep["expert_steps"][group_of(name)]
            for e, h in enumerate(holders):
                assert h <= s
                assert_bitwise(value[e], states[h][name][e], f"{name}[{e}] from step {h}")


def test_params_and_moments_of_an_expert_come_from_one_save(tmp_path, data):
    pec = PartialExperts(k=2, rules=RULES)
    mngr, states, _, _ = train(tmp_path, data, pec, saves=5)
    mngr.close()
    _, _, tree = restore(tmp_path, data, 10)
    got = flat(tree)
    rep = partial_experts_report(tmp_path / "10" / "default")
    for g, holders in rep["expert_steps"].items():
        names = [n for n in got if is_expert(n) and group_of(n) == g]
        assert {"mu", "nu"} <= {part for n in names for part in n.split("/")}
        for e, h in enumerate(holders):
            for n in names:  # weights, mu and nu all equal their values at the same step h
                np.testing.assert_array_equal(got[n][e], states[h][n][e], err_msg=f"{n}[{e}]")


def test_partial_save_stores_k_of_n_experts(tmp_path, data):
    pec = PartialExperts(k=2, rules=RULES)
    mngr, _, _, _ = train(tmp_path, data, pec, saves=2)
    mngr.close()
    first = ol.checkpoint_stats(tmp_path / "2" / "default")
    second = ol.checkpoint_stats(tmp_path / "4" / "default")
    w1 = {r["path"]: r for r in first}
    w2 = {r["path"]: r for r in second}
    name = next(n for n in w1 if n.endswith("0/blocks/0/moe/w_in/value") and "opt" not in n)
    assert w1[name]["shape"][0] == 8 and w2[name]["shape"][0] == 2  # held slot [K, ...]
    assert w2[name]["stored_bytes"] <= w1[name]["stored_bytes"] * 2 / 8 + 64
    rep = partial_experts_report(tmp_path / "4" / "default")
    assert rep["full"] is False and rep["k"] == 2
    assert all(len(h) == 2 for h in rep["held"].values())
    assert set(rep["depends_on"]) == {2}


def test_k_equal_n_costs_exactly_a_normal_save(tmp_path, data, assert_bitwise):
    model, opt = build(data)
    toy.train_step(model, opt, *data.batch(1, 16))
    state = nnx.state((model, opt))
    plain = ol.checkpoint_manager(tmp_path / "plain", policy=EXACT)
    pec = manager(tmp_path / "pec", PartialExperts(k=8, rules=RULES), EXACT)
    for mngr in (plain, pec):
        for step in (1, 2):  # step 2 repeats step 1: unchanged leaves are stored as `same`
            mngr.save(step, args=ol.LossySave(state))
            mngr.wait_until_finished()
    for step in (1, 2):
        a, b = ({r["path"].removesuffix("/value"): (r["codec"], r["stored_bytes"])
                 for r in ol.checkpoint_stats(tmp_path / run / str(step) / "default")}
                for run in ("plain", "pec"))
        assert a == b  # same leaves, codecs and bytes, no PEC record
    restored = flat(restore(tmp_path / "pec", data, 2, PartialExperts(k=8, rules=RULES))[2])
    for name, value in flat(state).items():
        assert_bitwise(restored[name], value, name)


def test_closed_loop_with_lossy_codecs(tmp_path, data, assert_bitwise):
    """LC deltas of held experts are against each expert's own reconstruction: a fresh
    restore of every step equals the saving side's per-expert mosaic (and reference) bit for
    bit, across engine bases and deltas."""
    pec = PartialExperts(k=2, rules=RULES)
    policy = ol.LeafPolicy.create(defaults={**{r: ol.Exact() for r in ROLES},
                                            "param": ol.Cluster(bits=3, mode="delta"),
                                            "first_moment": ol.LC(bits=4),
                                            "second_moment": ol.LC(bits=2, domain="log")})
    model, opt = build(data)
    mngr = manager(tmp_path, pec, policy, base_interval=5)
    handler = pec_handler(mngr)
    for step in range(1, 11):
        toy.train_step(model, opt, *data.batch(step, 16))
        state = nnx.state((model, opt))
        mngr.save(step, args=ol.LossySave(state))
        mngr.wait_until_finished()
        layout = pec.layout(state)
        paths, _, _ = flatten(state)
        mosaic = pec.mosaic()
        ref = {path_str(p).removesuffix("/value"): v
               for p, v in zip(handler.reference.paths, handler.reference.values, strict=True)}
        _, _, tree = restore(tmp_path, data, step, PartialExperts(k=2, rules=RULES), policy)
        got = flat(tree)
        for g in layout.groups.values():
            for u, unit in enumerate(g.units):
                name = path_str(paths[unit.leaf]).removesuffix("/value")
                assert_bitwise(got[name], mosaic[f"{g.name}#{u}"], f"step {step} {name}")
        for name, value in ref.items():
            if value is not None and name in got and not is_expert(name):
                assert_bitwise(got[name], value, f"step {step} {name}")
    stats = {r["path"]: r["codec"]["id"] for r in ol.checkpoint_stats(tmp_path / "3" / "default")}
    assert any(c == "lc" for p, c in stats.items() if "moe/w_in" in p)  # held slots: LC deltas


def pec_handler(mngr):
    for h in mngr._options.preservation_policy.handlers:  # noqa: SLF001
        if getattr(h, "partial_experts", None) is not None:
            return h
    raise AssertionError("no PEC handler")


# --------------------------------------------------------------------------- chains, retention


def test_retention_keeps_holders_and_missing_holder_is_named(tmp_path, data):
    pec = PartialExperts(k=2, rules=RULES)
    mngr, _, _, _ = train(tmp_path, data, pec, saves=6, max_to_keep=1)
    assert 12 in mngr.all_steps()
    rep = partial_experts_report(tmp_path / "12" / "default")
    holders = sorted({h for hs in rep["expert_steps"].values() for h in hs})
    assert set(holders) <= set(mngr.all_steps())  # every holder kept by the chain policy
    mngr.close()
    victim = min(h for h in holders if h != 12)
    shutil.rmtree(tmp_path / str(victim))
    with pytest.raises(ol.MissingStepError, match=rf"group 'blocks/\d/moe': expert \d+ .*step "
                                                  rf"{victim}") as e:
        restore(tmp_path, data, 12)
    assert e.value.step == victim


def test_restore_reads_back_only_to_the_oldest_holder(tmp_path, data):
    pec = PartialExperts(k=4, rules=RULES)  # every expert re-held within 2 saves
    mngr, _, _, _ = train(tmp_path, data, pec, saves=6)
    mngr.close()
    rep = partial_experts_report(tmp_path / "12" / "default")
    oldest = min(h for hs in rep["expert_steps"].values() for h in hs)
    assert oldest == 10
    for s in (2, 4, 6, 8):  # no payload before the oldest holder is read (exact storage)
        for f in (tmp_path / str(s) / "default").glob("data.p*.bin"):
            f.unlink()
    restore(tmp_path, data, 12, PartialExperts(k=4, rules=RULES))


def test_an_expert_from_an_old_step_reads_only_its_own_pieces(tmp_path, data):
    """Slot pieces are cut per expert: restoring step 8 reads, from the full save at step 2,
    only the pieces of the experts still restored from there (plus the step's PEC record)."""
    from orbax_lossy.experts.record import META_NAME, _find
    from orbax_lossy.format.manifest import read_manifest

    mngr, _, _, _ = train(tmp_path, data, PartialExperts(k=2, rules=RULES), saves=4)
    mngr.close()
    _, pec, _ = restore(tmp_path, data, 8)
    rep = pec.last_restore_report
    old = {g: [e for e, s in enumerate(rep["expert_steps"][g]) if s == 2] for g in GROUPS}
    assert old == {"blocks/0/moe": [6, 7], "blocks/1/moe": [0, 1]}
    manifest = read_manifest(tmp_path / "2" / "default")
    meta = partial_experts_report(tmp_path / "2" / "default")
    record = sum(p.length for p in _find(manifest, META_NAME).pieces)
    want, slot_total = 0, 0
    for leaf in manifest.leaves:
        name = leaf.name.removesuffix("/value")
        if not is_expert(name):
            continue
        assert all(p.box[0][1] - p.box[0][0] == 1 for p in leaf.pieces)  # one expert a piece
        slot_total += sum(p.length for p in leaf.pieces)
        rows = [meta["held"][group_of(name)].index(e) for e in old[group_of(name)]]
        want += sum(p.length for p in leaf.pieces if p.box[0][0] in rows)
    assert rep["expert_bytes_read"][2] == record + want
    assert 0.2 * slot_total < want < 0.3 * slot_total  # 2 of 8 experts


def test_rotation_continues_after_restart(tmp_path, data):
    pec = PartialExperts(k=2, rules=RULES, dynamic_k=False)
    mngr, _, _, start = train(tmp_path, data, pec, saves=3)
    mngr.close()
    before = partial_experts_report(tmp_path / "6" / "default")
    pec2 = PartialExperts(k=2, rules=RULES, dynamic_k=False)
    mngr2, _, tree = restore(tmp_path, data, 6, pec2)
    model, opt = build(data, seed=3)
    nnx.update((model, opt), tree)
    mngr2.save(8, args=ol.LossySave(nnx.state((model, opt))))
    mngr2.wait_until_finished()
    after = partial_experts_report(tmp_path / "8" / "default")
    assert after["cursor"] == before["cursor"] + 1 and not after["full"]
    expected = {g: selection.sequential(8, 2, before["cursor"], i) for i, g in enumerate(GROUPS)}
    assert after["held"] == expected


# --------------------------------------------------------------------------- PLT, Dynamic-K


def test_plt_accounting_matches_a_recount(tmp_path, data):
    pec = PartialExperts(k=2, rules=RULES, total_assignments=10_000)
    mngr, _, tokens, _ = train(tmp_path, data, pec, saves=6)
    mngr.close()
    steps = sorted(tokens)
    for s in steps:
        rep = partial_experts_report(tmp_path / str(s) / "default")
        for g in GROUPS:
            holders = rep["expert_steps"][g]
            lost = sum(int(tokens[t][g][e]) for e, h in enumerate(holders) for t in steps
                       if h < t <= s)
            assert rep["lost_tokens"][g] == lost, (s, g)
            assert rep["tokens_seen"][g] == sum(int(tokens[t][g].sum()) for t in steps if t <= s)
        expected = np.mean([rep["lost_tokens"][g] / 10_000 for g in GROUPS])
        assert rep["plt"] == pytest.approx(expected)
        assert rep["plt_denominator"] == "total_assignments"


def test_dynamic_k_doubles_after_a_lossy_restore_and_accumulates(tmp_path, data):
    pec = PartialExperts(k=1, rules=RULES)
    mngr, _, _, _ = train(tmp_path, data, pec, saves=4)
    mngr.close()
    rep = partial_experts_report(tmp_path / "8" / "default")
    assert rep["plt_denominator"] == "tokens_seen" and rep["plt"] > 0.0375
    assert rep["k_next"] == 2
    pec2 = PartialExperts(k=1, rules=RULES)
    mngr2, _, tree = restore(tmp_path, data, 8, pec2)
    assert pec2.last_restore_report["k_next"] == 2 and pec2.k_for() == 2
    model, opt = build(data, seed=3)
    nnx.update((model, opt), tree)
    mngr2.save(10, args=ol.LossySave(nnx.state((model, opt)), expert_tokens={
        g: np.ones(8, np.int64) for g in GROUPS}))
    mngr2.wait_until_finished()
    rep10 = partial_experts_report(tmp_path / "10" / "default")
    assert rep10["k"] == 2 and [8, 2] in rep10["k_history"]
    assert rep10["restores"][0]["step"] == 8
    # the lost tokens of the first restore stay in the cumulative PLT
    assert rep10["plt"] >= rep["plt"] * rep["tokens_seen"]["blocks/0/moe"] / (
        rep10["tokens_seen"]["blocks/0/moe"]) - 1e-9
    with pytest.raises(ol.InvalidArgumentError, match="unknown group"):
        pec_handler(mngr2).partial_experts.prepare_save(
            str(tmp_path / "12" / "default"),
            ol.LossySave(nnx.state((model, opt)), expert_tokens={"nope": np.ones(8)}))
    with pytest.raises(ol.InvalidArgumentError, match="blocks/0/moe.*shape"):
        pec_handler(mngr2).partial_experts.prepare_save(
            str(tmp_path / "12" / "default"),
            ol.LossySave(nnx.state((model, opt)), expert_tokens={"blocks/0/moe": np.ones(5)}))


def test_load_aware_needs_tokens_and_saves_the_busiest(tmp_path, data):
    pec = PartialExperts(k=2, rules=RULES, selection="load_aware", max_staleness=3)
    model, opt = build(data)
    state = nnx.state((model, opt))
    mngr = manager(tmp_path, pec, EXACT)
    with pytest.raises(ol.InvalidArgumentError, match="load_aware"):
        pec.prepare_save(str(tmp_path / "1" / "default"), ol.LossySave(state))
    tok = {g: np.arange(8, dtype=np.int64) for g in GROUPS}
    for step in (1, 2):
        mngr.save(step, args=ol.LossySave(state, expert_tokens=tok))
        mngr.wait_until_finished()
    assert partial_experts_report(tmp_path / "2" / "default")["held"] == {
        g: [6, 7] for g in GROUPS}
    os.environ.pop("UNUSED", None)
