"""Whole training state (params + AdamW moments + counters) through orbax-lossy vs plain Orbax.

Issue #5's measurement. Two AdamW training runs:

* the digits MLP of :mod:`orbax_lossy.demo` (scikit-learn's digits, nothing downloaded);
* a small character-level transformer language model (Flax linen, pre-LN, causal) trained on
  the source text of a fixed list of Python standard-library modules (``inspect.getsource``;
  deterministic for a given Python version), 90/10 train/eval split.

Each run is trained once, uninterrupted, keeping the ``TrainState`` every ``--every`` steps.
The same sequence of states is then saved through plain Orbax (``ocp.CheckpointManager`` +
``ocp.args.StandardSave``, default settings) and through orbax-lossy with each policy and each
``--base-interval``, every configuration in a fresh directory:

* ``default``: ``LeafPolicy()`` (``Step(2.5)`` parameter deltas, ``Step(4.0, mode="direct")``
  first moments, ``LC(2, domain="log")`` second moments, lossy bases; docs/whole_state.md);
* ``former default``: the same with ``Cluster(3, mode="delta")`` parameter deltas and
  ``LC(3, mode="direct")`` first moments;
* ``params only``: ``LeafPolicy.params_only()`` (float params ``LC(3)``, the rest exact);
* every other label changes one codec of the default (``p Step3``, ``mu zero``,
  ``mu LC2 direct``, ``nu LC3 log``, ...) or is an older whole-state policy (``whole LC3``,
  ``LC3+LC2mom``) or ``AdaptivePolicy()`` (``adaptive``, ``adaptive loose``);
  ``candidate_policies()`` lists them all.

Issue 14's levers (``--policies``): ``joint mu <alpha>`` / ``joint excp <alpha>`` (ExCP's joint
weight-momentum pruning, :class:`JointPrune`), ``base p Cl8`` / ``base p Cl6`` (lossy parameter
bases), ``p Bitmask`` / ``p Bitmask3`` with ``--only digits-bf16`` (bf16 parameters and moments).

Bytes are bytes on disk of each checkpoint directory. ``delta x`` is the plain Orbax average
over the mean lossy delta; ``run x`` the plain average over the lossy average over the whole run
with its bases; ``steady x`` the same for an endless run at that base interval,
``(base + (B - 1) * delta) / B`` from the measured mean base and delta.

Simulated failure: at ~60% of training the latest lossy checkpoint (a delta for the shown
intervals) is restored with ``LossyRestore(fresh_train_state)`` in a fresh manager (a new
process would do the same), and training continues to the end with the same data order (batches
are a function of the step number). ``resumed`` is the final eval loss of that run and
``diff %`` its relative difference from the uninterrupted run's final eval loss.

    python benchmarks/whole_state.py [--quick] [--base-interval 20,50] [--every 10]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state

import orbax_lossy as ol
from orbax_lossy import demo

# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """A deterministic training run: ``step_fn(state, step)`` consumes the batch of ``step``."""

    name: str
    init: Callable[[], train_state.TrainState]
    step_fn: Callable[[train_state.TrainState, int], train_state.TrainState]
    eval_loss: Callable[[train_state.TrainState], float]


def digits_workload(hidden: int, steps: int, batch: int = 64, seed: int = 0,
                    param_dtype: Any = jnp.float32) -> Workload:
    """The demo's digits MLP with AdamW and a warmup-cosine schedule (1e-3 peak, 1e-5 end).

    Batch ``k`` is a fixed function of ``k``. The schedule matters for the resume comparison:
    at a constant learning rate the final eval loss of this small, overfitting model is chaotic
    (Gaussian parameter noise of 3e-2 at the failure point moved it by 2.3%); with the decay it
    moves by less than 1% under the same noise (the benchmark prints these noise-floor rows).

    ``param_dtype=jnp.bfloat16``: the mixed-precision variant (``--only digits-bf16``): the
    parameters, and therefore Adam's moments (optax keeps them in the parameters' dtype), are
    bfloat16; the forward pass computes in float32 inputs promoted by Flax.
    """
    x, y, x_test, y_test = demo.load_digits(seed)
    # materialize the order once so that a resumed run can start at any step with the same data
    per_epoch = len(x) // batch
    rng = np.random.default_rng(seed)
    orders: list[np.ndarray] = []

    def batch_of(step: int) -> tuple[jax.Array, jax.Array]:
        i = step - 1  # steps are 1-based, like demo.training_run
        while len(orders) <= i // per_epoch:
            orders.append(rng.permutation(len(x)))
        idx = orders[i // per_epoch][(i % per_epoch) * batch : (i % per_epoch + 1) * batch]
        return jnp.asarray(x[idx]), jnp.asarray(y[idx])

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, max(steps // 20, 1), steps, 1e-5)
    tx = optax.adamw(schedule, weight_decay=1e-4)
    model = demo.MLP(hidden)

    def init() -> train_state.TrainState:
        params = model.init(jax.random.key(seed), jnp.zeros((1, 64), jnp.float32))["params"]
        params = jax.tree.map(lambda p: p.astype(param_dtype), params)
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    bf16 = np.dtype(param_dtype) == np.dtype(jnp.bfloat16)
    return Workload(
        name=f"digits MLP hidden={hidden}{' bf16 params+moments' if bf16 else ''}, "
             "warmup-cosine lr",
        init=init,
        step_fn=lambda s, k: demo.train_step(s, *batch_of(k))[0],
        eval_loss=lambda s: demo.evaluate(s, x_test, y_test),
    )


class BNState(train_state.TrainState):
    """A linen TrainState with BatchNorm statistics (roles: ``batch_stats`` is exact state)."""

    batch_stats: Any = None


class DigitsCNN(nn.Module):
    """Two 3x3 conv + BatchNorm + ReLU blocks on 8x8 digits, average pool, 10 logits."""

    width: int = 32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = x.reshape((x.shape[0], 8, 8, 1))
        for w in (self.width, 2 * self.width):
            x = nn.Conv(w, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), (2, 2)).reshape((x.shape[0], -1))
        return nn.Dense(10)(x)


def cnn_workload(width: int, steps: int, batch: int = 64, seed: int = 1) -> Workload:
    """Held out from tuning the defaults: a linen CNN with BatchNorm on digits, AdamW."""
    x, y, x_test, y_test = demo.load_digits(seed)
    rng = np.random.default_rng(seed)
    per_epoch = len(x) // batch
    orders: list[np.ndarray] = []

    def batch_of(step: int) -> tuple[jax.Array, jax.Array]:
        i = step - 1
        while len(orders) <= i // per_epoch:
            orders.append(rng.permutation(len(x)))
        idx = orders[i // per_epoch][(i % per_epoch) * batch : (i % per_epoch + 1) * batch]
        return jnp.asarray(x[idx]), jnp.asarray(y[idx])

    schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, max(steps // 20, 1), steps, 2e-5)
    tx = optax.adamw(schedule, weight_decay=1e-4)
    model = DigitsCNN(width)

    def init() -> BNState:
        v = model.init(jax.random.key(seed), jnp.zeros((1, 64), jnp.float32))
        return BNState.create(apply_fn=model.apply, params=v["params"], tx=tx,
                              batch_stats=v["batch_stats"])

    @jax.jit
    def train_step(state: BNState, xb: jax.Array, yb: jax.Array) -> BNState:
        def loss(p):
            logits, upd = state.apply_fn({"params": p, "batch_stats": state.batch_stats}, xb,
                                         mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), upd

        grads, upd = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"])

    @jax.jit
    def eval_step(state: BNState) -> jax.Array:
        logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                                jnp.asarray(x_test), train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                               jnp.asarray(y_test)).mean()

    return Workload(
        name=f"digits CNN+BatchNorm width={width} (held out), warmup-cosine lr",
        init=init,
        step_fn=lambda s, k: train_step(s, *batch_of(k)),
        eval_loss=lambda s: float(eval_step(s)),
    )


STDLIB_MODULES = (
    "argparse", "dataclasses", "functools", "enum", "collections", "json.encoder",
    "json.decoder", "heapq", "random", "statistics", "fractions", "textwrap", "string",
    "shutil", "difflib",
)


def stdlib_text(max_chars: int) -> str:
    """Source text of a fixed list of standard-library modules, concatenated, truncated."""
    parts = [inspect.getsource(importlib.import_module(m)) for m in STDLIB_MODULES]
    return "\n".join(parts)[:max_chars]


class Block(nn.Module):
    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.d_model)(nn.gelu(nn.Dense(4 * self.d_model)(h)))
        return x + h


class CharLM(nn.Module):
    vocab: int
    d_model: int = 96
    layers: int = 2
    heads: int = 4
    context: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model)(tokens)
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.context, self.d_model))
        x = x + pos[: tokens.shape[-1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.d_model, self.heads)(x, mask)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def charlm_workload(
    steps: int, d_model: int, layers: int, context: int = 64, batch: int = 32,
    max_chars: int = 320_000, seed: int = 0,
) -> Workload:
    text = stdlib_text(max_chars)
    chars = sorted(set(text))
    table = {c: i for i, c in enumerate(chars)}
    data = np.fromiter((table[c] for c in text), np.int32, len(text))
    split = int(0.9 * len(data))
    train, held = data[:split], data[split:]
    starts = np.linspace(0, len(held) - context - 2, 128).astype(np.int64)
    eval_x = jnp.asarray(np.stack([held[s : s + context] for s in starts]))
    eval_y = jnp.asarray(np.stack([held[s + 1 : s + context + 1] for s in starts]))
    model = CharLM(len(chars), d_model, layers, 4, context)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(steps // 20, 1), steps, 3e-4)
    tx = optax.adamw(schedule, weight_decay=0.01)

    def init() -> train_state.TrainState:
        params = model.init(jax.random.key(seed), jnp.zeros((1, context), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss(params, apply_fn, x, y):
        logits = apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(state, x, y):
        grads = jax.grad(loss)(state.params, state.apply_fn, x, y)
        return state.apply_gradients(grads=grads)

    @jax.jit
    def eval_step(state):
        return loss(state.params, state.apply_fn, eval_x, eval_y)

    def step_fn(state: train_state.TrainState, step: int) -> train_state.TrainState:
        offs = np.random.default_rng([seed, step]).integers(0, len(train) - context - 1, batch)
        x = np.stack([train[o : o + context] for o in offs])
        y = np.stack([train[o + 1 : o + context + 1] for o in offs])
        return train_step(state, jnp.asarray(x), jnp.asarray(y))

    return Workload(
        name=f"char transformer {layers}x{d_model} ctx {context} (vocab {len(chars)}, "
             f"{len(text) // 1000} KB stdlib text)",
        init=init,
        step_fn=step_fn,
        eval_loss=lambda s: float(eval_step(s)),
    )


# --------------------------------------------------------------------------- joint pruning


@dataclass(frozen=True)
class JointPrune:
    """Prototype of ExCP's joint weight-momentum pruning (arXiv 2406.11257), benchmark only.

    Before each delta save the saved *copy* of the state (training is untouched) is masked
    per parameter leaf: ``keep = |mu| > alpha * mean(|mu|)`` (``rule="mu"``: drop the
    weight-delta elements whose momentum is small) or ``keep = |delta| * rsqrt(nu + 1e-16)
    > alpha * mean(...)`` (``rule="excp"``: ExCP's weight criterion, the delta in units of
    Adam's step size); dropped parameter elements are set to the handler's reference (their
    delta is then exactly 0, symbol 0 of ``Cluster``/``LC``; closed loop: the dropped change
    is carried into the next delta), and the first moment is zeroed where the weight delta was
    dropped. ``policy`` codes the masked state. Bases are saved unmasked. The per-leaf codec
    contract cannot express this (one codec sees one leaf), so the prototype works on the
    state before ``save``, reading ``LossyCheckpointHandler.reference``.
    """

    policy: Any
    alpha: float
    rule: str = "mu"

    def apply(self, state: Any, handler: ol.LossyCheckpointHandler,
              base_interval: int) -> tuple[Any, float]:
        """The masked copy of ``state`` and the fraction of parameter elements kept."""
        ref = handler.reference
        if ref is None or ref.chain_length + 1 >= base_interval:
            return state, 1.0  # this save is a base
        paths, leaves, treedef = ol.treepaths.flatten(state)
        if ref.paths != tuple(paths):
            return state, 1.0
        roles = ol.policy.leaf_roles(state)

        def tail(path: Any, key: str) -> Any:
            names = [k for _, k in path]
            return tuple(path[names.index(key) + 1:]) if key in names else None

        moment = {role: {tail(p, k): i for i, (p, r) in enumerate(zip(paths, roles, strict=True))
                         for k in ("mu", "nu") if r == role and tail(p, k) is not None}
                  for role in ("first_moment", "second_moment")}
        new = list(leaves)
        kept = total = 0
        for i, (path, role) in enumerate(zip(paths, roles, strict=True)):
            if role != "param" or ref.values[i] is None:
                continue
            key = tail(path, "params")
            j = moment["first_moment"].get(key)
            k = moment["second_moment"].get(key)
            if j is None or k is None:
                continue
            p, r, mu, nu = leaves[i], jnp.asarray(ref.values[i]), leaves[j], leaves[k]
            if self.rule == "mu":
                score = jnp.abs(mu.astype(jnp.float32))
            else:
                score = jnp.abs((p - r).astype(jnp.float32)) * jax.lax.rsqrt(
                    nu.astype(jnp.float32) + 1e-16)
            keep = score > self.alpha * jnp.mean(score)
            new[i] = jnp.where(keep, p, r.astype(p.dtype))
            new[j] = jnp.where(keep, mu, jnp.zeros_like(mu))
            kept += int(jnp.sum(keep))
            total += keep.size
        return jax.tree_util.tree_unflatten(treedef, new), kept / max(total, 1)


# --------------------------------------------------------------------------- measurement


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def state_tree(state: train_state.TrainState) -> dict[str, Any]:
    """The TrainState's pytree fields as a dict (what plain Orbax saves)."""
    return flax.serialization.to_state_dict(state)


def train(work: Workload, steps: int, every: int, state=None, start: int = 0):
    """Run steps ``start+1 .. steps``; return (final state, {step: state at checkpoints})."""
    state = work.init() if state is None else state
    kept = {}
    for k in range(start + 1, steps + 1):
        state = work.step_fn(state, k)
        if k % every == 0:
            kept[k] = jax.tree.map(jnp.copy, state)
    return jax.block_until_ready(state), kept


def rel_l2(a: Any, b: Any) -> float:
    num = sum(float(jnp.sum(jnp.square(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                                   jax.tree.leaves(b),
                                                                   strict=True))
    den = sum(float(jnp.sum(jnp.square(y))) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5 if den else 0.0


def codec_counts(directory: str, steps: list[int]) -> collections.Counter:
    """Codec ids of the float moment/param leaves over all delta saves (from the manifests)."""
    counts: collections.Counter = collections.Counter()
    for s in steps:
        man = ol.format.manifest.read_manifest_body(os.path.join(directory, str(s), "default"))
        if man["kind"] != "delta":
            continue
        for leaf in man["leaves"]:
            if leaf.get("role") in ("param", "first_moment", "second_moment"):
                cfg = leaf["codec"]
                cid = cfg.get("id", cfg.get("codec_id", "?")) if isinstance(cfg, dict) else cfg
                counts[f"{leaf['role']}:{cid}"] += 1
    return counts


def measure(work: Workload, args: argparse.Namespace, root: str, every: int,
            wanted: list[str]) -> None:
    t0 = time.perf_counter()
    final, kept = train(work, args.steps, every)
    t_train = time.perf_counter() - t0
    ref_loss = work.eval_loss(final)
    steps = sorted(kept)
    fail_step = max(s for s in steps if s <= int(args.fail_at * args.steps))
    n_params = sum(x.size for x in jax.tree.leaves(final.params))
    raw = sum(x.nbytes for x in jax.tree.leaves(state_tree(final)))
    print(f"\n== {work.name}: {n_params} params, {raw} B raw TrainState, AdamW, {args.steps} "
          f"steps, {len(steps)} checkpoints every {every} steps (train {t_train:.0f} s)")
    print(f"   uninterrupted final eval loss {ref_loss:.4f}; failure after step "
          f"{int(args.fail_at * args.steps)} -> resume from checkpoint {fail_step}", flush=True)

    plain_dir = os.path.join(root, "plain")
    plain = ocp.CheckpointManager(plain_dir)
    for s in steps:
        plain.save(s, args=ocp.args.StandardSave(state_tree(kept[s])))
        plain.wait_until_finished()
    plain.close()
    plain_avg = statistics.mean(dir_bytes(os.path.join(plain_dir, str(s))) for s in steps)

    # noise floor of the resume comparison: resume from the *exact* checkpoint with Gaussian
    # noise of relative size eps added to every parameter leaf (moments exact). eps = 1e-3 is
    # far below LC(3)'s error; eps = 3e-2 matches the error budget of AdaptivePolicy(). If the
    # final loss moves as much under this noise as under a codec, the comparison measures the
    # sensitivity of the training run, not the codec.
    base_state = kept[fail_step]
    noise_losses = {}
    for eps in (1e-3, 3e-2):
        keys = iter(jax.random.split(jax.random.key(1),
                                     len(jax.tree.leaves(base_state.params))))
        noisy = base_state.replace(params=jax.tree.map(
            lambda x, eps=eps, keys=keys: x + eps * jnp.linalg.norm(x) / max(x.size, 1) ** 0.5
            * jax.random.normal(next(keys), x.shape, x.dtype), base_state.params))
        noise_losses[eps] = work.eval_loss(
            train(work, args.steps, every, noisy, start=fail_step)[0]
        )

    policies = candidate_policies()
    policies = {k: v for k, v in policies.items() if k in wanted}
    rows, notes = [], []
    for label, policy in policies.items():
        for interval in args.intervals:
            policy = policies[label]
            t1 = time.perf_counter()
            d = os.path.join(root, f"{label.replace(' ', '_')}_{interval}")
            joint = policy if isinstance(policy, JointPrune) else None
            policy = joint.policy if joint else policy
            handler = ol.LossyCheckpointHandler(policy, base_interval=interval)
            mngr = ol.checkpoint_manager(d, handler=handler, max_to_keep=None)
            sizes, kept_frac = [], []
            for s in steps:
                to_save = kept[s]
                if joint is not None:
                    to_save, frac = joint.apply(to_save, handler, interval)
                    kept_frac.append(frac)
                mngr.save(s, args=ol.LossySave(to_save))
                mngr.wait_until_finished()
                kind = ol.format.read_manifest(os.path.join(d, str(s), "default")).header.save_type
                sizes.append((kind, dir_bytes(os.path.join(d, str(s)))))
            mngr.close()
            # simulated failure: a fresh manager restores into a freshly built TrainState
            fresh = ol.checkpoint_manager(d, policy=policy, base_interval=interval,
                                          max_to_keep=None)
            restored = fresh.restore(fail_step, args=ol.LossyRestore(work.init()))
            fresh.close()
            fail_kind = ol.format.read_manifest(
                os.path.join(d, str(fail_step), "default")).header.save_type
            assert int(restored.step) == fail_step, (int(restored.step), fail_step)
            err = {k: rel_l2(getattr_path(restored, k), getattr_path(kept[fail_step], k))
                   for k in ("params", "mu", "nu")}
            resumed, _ = train(work, args.steps, every, restored, start=fail_step)
            loss = work.eval_loss(resumed)
            bases = [b for k, b in sizes if k == "base"]
            deltas = [b for k, b in sizes if k == "delta"]
            base_b = statistics.mean(bases)
            delta_b = statistics.mean(deltas) if deltas else float("nan")
            rows.append({
                "label": label, "interval": interval, "base": base_b, "delta": delta_b,
                "avg": statistics.mean(b for _, b in sizes),
                "steady": (base_b + (interval - 1) * delta_b) / interval,
                "loss": loss, "fail_kind": fail_kind, "err": err,
                "secs": time.perf_counter() - t1,
            })
            if label in ("adaptive", "default") and interval == args.intervals[0]:
                c = codec_counts(d, steps)
                notes.append(f"{label} codec choices over all delta saves (leaf count): "
                             + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
            if joint is not None:
                fracs = [f for f in kept_frac if f < 1.0] or [1.0]
                notes.append(f"{label} base/{interval}: joint pruning kept "
                             f"{100 * statistics.mean(fracs):.1f}% of the parameter-delta "
                             "elements per delta save")
            shutil.rmtree(d, ignore_errors=True)
            # Free the compiled programs of this configuration: on CPU every XLA executable
            # holds memory maps, and the adaptive policy compiles one small program per leaf
            # shape and codec; ten configurations in one process reach Linux's 65530-map limit.
            jax.clear_caches()
            r = rows[-1]
            print(f"   .. {label} base/{interval}: delta {plain_avg / r['delta']:.1f}x, run "
                  f"{plain_avg / r['avg']:.1f}x, final loss {r['loss']:.4f} "
                  f"({100 * (r['loss'] - ref_loss) / ref_loss:+.2f}%), {r['secs']:.0f} s",
                  flush=True)

    print(f"{'policy':<16} {'base/':>5} {'base B':>9} {'delta B':>8} {'run avg B':>9} "
          f"{'delta x':>8} {'run x':>6} {'steady x':>8} {'resumed':>8} {'diff %':>7} "
          f"{'err p/mu/nu at resume':>22} {'s':>4}")
    print(f"{'plain orbax':<16} {'-':>5} {plain_avg:>9.0f} {'-':>8} {plain_avg:>9.0f} "
          f"{'1.0x':>8} {'1.0x':>6} {'1.0x':>8} {ref_loss:>8.4f} {'-':>7}")
    for eps, noise_loss in noise_losses.items():
        print(f"{f'exact+{eps:.0e} noise':<16} {'-':>5} {'-':>9} {'-':>8} {'-':>9} {'-':>8} "
              f"{'-':>6} {'-':>8} {noise_loss:>8.4f} "
              f"{100 * (noise_loss - ref_loss) / ref_loss:>+7.2f}  "
              f"(noise floor: params perturbed {eps:.0e})")
    for r in rows:
        e = r["err"]
        print(f"{r['label']:<16} {r['interval']:>5} {r['base']:>9.0f} {r['delta']:>8.0f} "
              f"{r['avg']:>9.0f} {plain_avg / r['delta']:>7.1f}x {plain_avg / r['avg']:>5.1f}x "
              f"{plain_avg / r['steady']:>7.1f}x {r['loss']:>8.4f} "
              f"{100 * (r['loss'] - ref_loss) / ref_loss:>+7.2f}"
              f"{'*' if r['fail_kind'] == 'base' else ' '}"
              f"{e['params']:.0e}/{e['mu']:.0e}/{e['nu']:.0e}".replace("e-0", "e-")
              + f" {r['secs']:>4.0f}")
    if any(r["fail_kind"] == "base" for r in rows):
        print("  * the resume checkpoint is a lossless base for this interval")
    for n in notes:
        print("  " + n)
    target = [r for r in rows if plain_avg / r["delta"] >= 50 and plain_avg / r["avg"] >= 20
              and abs(r["loss"] - ref_loss) / ref_loss <= 0.01]
    print("  meets the target (deltas >= 50x, run >= 20x, final eval loss within 1%): "
          + (", ".join(sorted({r["label"] for r in target})) or "none"))


def candidate_policies() -> dict[str, Any]:
    """Every policy the benchmark knows, by label (``--policies``)."""
    exact_bases = {"second_moment": ol.Exact()}
    return {
        "default": ol.LeafPolicy(),
        "former default": ol.LeafPolicy.create(defaults={
            "param": ol.Cluster(3, mode="delta"), "first_moment": ol.LC(3, mode="direct")}),
        "p Step2": ol.LeafPolicy.create(defaults={"param": ol.Step(2.0)}),
        "p Step3": ol.LeafPolicy.create(defaults={"param": ol.Step(3.0)}),
        "mu Step3 direct": ol.LeafPolicy.create(
            defaults={"first_moment": ol.Step(3.0, mode="direct")}),
        "mu Step6 direct": ol.LeafPolicy.create(
            defaults={"first_moment": ol.Step(6.0, mode="direct")}),
        "mu zero": ol.LeafPolicy.create(defaults={"first_moment": ol.Zero()}),
        "p Step3 mu zero": ol.LeafPolicy.create(
            defaults={"param": ol.Step(3.0), "first_moment": ol.Zero()}),
        "params only": ol.LeafPolicy.params_only(),
        "lossless": ol.LeafPolicy.lossless(),
        "default nu exact-bases": ol.LeafPolicy.create(base_defaults=exact_bases),
        "p exact bases": ol.LeafPolicy.create(base_defaults={"param": ol.Exact()}),
        "mu LC1 direct": ol.LeafPolicy.create(defaults={"first_moment": ol.LC(1, mode="direct")}),
        "mu LC2 direct": ol.LeafPolicy.create(defaults={"first_moment": ol.LC(2, mode="direct")}),
        "mu LC3 direct": ol.LeafPolicy.create(defaults={"first_moment": ol.LC(3, mode="direct")}),
        "mu LC2 delta": ol.LeafPolicy.create(defaults={"first_moment": ol.LC(2)}),
        "nu LC3 log": ol.LeafPolicy.create(defaults={"second_moment": ol.LC(3, domain="log")}),
        "nu Cl4 log direct": ol.LeafPolicy.create(
            defaults={"second_moment": ol.Cluster(4, domain="log")}),
        "nu LC2 lin": ol.LeafPolicy.create(defaults={"second_moment": ol.LC(2)}),
        "p LC2": ol.LeafPolicy.create(defaults={"param": ol.LC(2)}),
        "p LC3": ol.LeafPolicy.create(defaults={"param": ol.LC(3)}),
        "p LC4": ol.LeafPolicy.create(defaults={"param": ol.LC(4)}),
        "p Cl2 delta": ol.LeafPolicy.create(defaults={"param": ol.Cluster(2, mode="delta")}),
        "p Cl3 delta": ol.LeafPolicy.create(defaults={"param": ol.Cluster(3, mode="delta")}),
        "p Cl4 delta": ol.LeafPolicy.create(defaults={"param": ol.Cluster(4, mode="delta")}),
        "p Bitmask": ol.LeafPolicy.create(defaults={"param": ol.Bitmask()}),
        "p Bitmask3": ol.LeafPolicy.create(defaults={"param": ol.Bitmask(3)}),
        "base p Cl8": ol.LeafPolicy.create(base_defaults={"param": ol.Cluster(8)}),
        "base p Cl6": ol.LeafPolicy.create(base_defaults={"param": ol.Cluster(6)}),
        "joint mu 0.5": JointPrune(ol.LeafPolicy(), 0.5),
        "joint mu 1": JointPrune(ol.LeafPolicy(), 1.0),
        "joint excp 0.5": JointPrune(ol.LeafPolicy(), 0.5, rule="excp"),
        "joint excp 1": JointPrune(ol.LeafPolicy(), 1.0, rule="excp"),
        "whole LC3": ol.LeafPolicy.create(
            defaults={"first_moment": ol.LC(3), "second_moment": ol.LC(3)},
            base_defaults=exact_bases),
        "LC3+LC2mom": ol.LeafPolicy.create(
            defaults={"first_moment": ol.LC(2), "second_moment": ol.LC(2)},
            base_defaults=exact_bases),
        "mu zero only": ol.LeafPolicy.create(
            defaults={"param": ol.Exact(), "second_moment": ol.Exact()},
            base_defaults=exact_bases),
        "adaptive": ol.AdaptivePolicy(),
        "adaptive loose": ol.AdaptivePolicy.create(
            budgets={"second_moment": 0.5}, progress_budgets={"param": 0.7}
        ),
    }


POLICY_NAMES = tuple(candidate_policies())

#: the default invocation: the library's defaults, plus the previous default for comparison
DEFAULT_POLICIES = ("default", "former default", "params only")

#: ``--levers``: the levers measured for docs/whole_state.md
LEVER_POLICIES = (
    "default", "default nu exact-bases", "mu LC1 direct", "mu LC2 direct", "mu LC3 direct",
    "nu LC3 log", "nu LC2 lin", "p LC2", "p LC3", "p LC4", "p Cl2 delta", "LC3+LC2mom", "adaptive",
)


def _entropy_bits(counts: np.ndarray) -> float:
    """Bits to code a histogram's symbols at its own order-0 entropy."""
    c = counts[counts > 0].astype(np.float64)
    return float(np.sum(c * np.log2(c.sum() / c))) if c.size else 0.0


def _conditional_bits(symbols: np.ndarray, context: np.ndarray) -> float:
    """Bits to code ``symbols`` with one order-0 model per context value (empirical
    conditional entropy; the models' own cost is not counted)."""
    joint = np.bincount(context.astype(np.int64) * 256 + symbols)
    return _entropy_bits(joint) - _entropy_bits(np.bincount(context.astype(np.int64)))


def _sign_class(symbols: np.ndarray) -> np.ndarray:
    """Five classes of a ``Step`` symbol: its multiple clamped to -2..2, plus 2."""
    return np.clip(symbols.astype(np.int64) - 128, -2, 2) + 2


def context_entropy(work: Workload, steps: int, every: int, interval: int) -> None:
    """Prototype (not in the format): what context modelling would save on the default
    codecs' symbols, closed loop like a save (parameter deltas ``Step(2.5)`` against the
    previous reconstruction, first moments ``Step(4.0, mode="direct")``). Per element, the
    order-0 entropy each leaf's stream is coded at today, against the entropy conditioned on
    (a) the previous save's symbol at the same position (256 contexts, or its multiple clamped
    to -2..2: 5 contexts), (b) the previous element of the same save (5 contexts), (c) for
    parameters, the same save's first-moment symbol. A base every ``interval`` saves has no
    previous symbols (its next delta is counted at order 0); the reference after a base is
    the exact value."""
    from orbax_lossy.codecs.step import levels, quantize, step_size

    _, kept = train(work, steps, every)
    states = [kept[k] for k in sorted(kept)]
    totals: dict[str, collections.Counter] = {"params": collections.Counter(),
                                              "mu": collections.Counter()}
    refs = [jnp.asarray(x) for x in jax.tree.leaves(states[0].params)]
    prev: dict[str, list[np.ndarray | None]] = {"params": [None] * len(refs),
                                                "mu": [None] * len(refs)}
    for i_save, st in enumerate(states[1:], start=1):
        is_base = i_save % interval == 0
        mus = getattr_path(st, "mu")
        for i, (v, m) in enumerate(zip(jax.tree.leaves(st.params), mus, strict=True)):
            if is_base:
                refs[i] = jnp.asarray(v)
                prev["params"][i] = prev["mu"][i] = None
                continue
            delta = v - refs[i]
            step = step_size(delta, 2.5)
            sym = quantize(delta, step)
            refs[i] = refs[i] + levels(step)[sym.astype(jnp.int32)]
            m_step = step_size(m, 4.0)
            coded = {"params": np.asarray(sym).reshape(-1),
                     "mu": np.asarray(quantize(m, m_step)).reshape(-1)}
            for what, cur in coded.items():
                t = totals[what]
                t["n"] += cur.size
                t["order-0"] += _entropy_bits(np.bincount(cur))
                before = prev[what][i]
                left = _sign_class(np.concatenate(([128], cur[:-1])).astype(np.uint8))
                t["previous element (5)"] += _conditional_bits(cur, left)
                if before is None:
                    t["previous save (256)"] += _entropy_bits(np.bincount(cur))
                    t["previous save (5)"] += _entropy_bits(np.bincount(cur))
                else:
                    t["previous save (256)"] += _conditional_bits(cur, before)
                    t["previous save (5)"] += _conditional_bits(cur, _sign_class(before))
                if what == "params":
                    t["same save's mu (256)"] += _conditional_bits(cur, coded["mu"])
                prev[what][i] = cur
    print(f"\ncontext modelling prototype, {work.name}: {len(states) - 1} saves every {every} "
          f"steps, a base every {interval}; bits per element (what a context-modelling "
          "entropy coder could reach; order-0 is what the streams are coded at today):")
    for what, t in totals.items():
        n = t.pop("n")
        h0 = t["order-0"]
        print(f"  {what:<7}" + "; ".join(f"{k} {b / n:.3f} ({h0 / max(b, 1e-9):.2f}x)"
                                       for k, b in t.items()), flush=True)


def getattr_path(state: train_state.TrainState, what: str) -> Any:
    """params, or the Adam mu / nu subtrees of a TrainState's optimizer state."""
    if what == "params":
        return state.params
    found = []
    jax.tree_util.tree_map_with_path(
        lambda p, x: found.append(x) if any(getattr(k, "name", None) == what for k in p)
        else None, state.opt_state)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run for a smoke check")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 600)")
    parser.add_argument("--every", type=int, default=20,
                        help="checkpoint every K steps (digits MLP and CNN)")
    parser.add_argument("--every-lm", type=int, default=20,
                        help="checkpoint every K steps (char transformer)")
    parser.add_argument("--base-interval", default=None,
                        help="comma-separated base intervals (default 10, the library's)")
    parser.add_argument("--fail-at", type=float, default=0.6, help="failure at this fraction")
    parser.add_argument("--hidden", type=int, default=512, help="digits MLP width")
    parser.add_argument("--d-model", type=int, default=96)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cnn-width", type=int, default=32)
    parser.add_argument("--only", default=None,
                        help="comma-separated workloads among digits,charlm,cnn,digits-bf16 "
                             "(default: digits,charlm,cnn)")
    parser.add_argument("--policies", default=None,
                        help="comma-separated policies for both runs (default: "
                             + ", ".join(DEFAULT_POLICIES) + ")")
    parser.add_argument("--levers", action="store_true",
                        help="the levers of docs/whole_state.md: " + ", ".join(LEVER_POLICIES))
    parser.add_argument("--full", action="store_true", help="every known policy")
    parser.add_argument("--context-entropy", action="store_true",
                        help="only the context-modelling prototype (on the --only workloads)")
    args = parser.parse_args()
    if args.quick:
        args.steps = args.steps or 60
        args.every = args.every_lm = 5
        args.base_interval = args.base_interval or "5"
        args.hidden, args.d_model, args.cnn_width = 64, 32, 8
    args.steps = args.steps or 600
    everything = list(POLICY_NAMES)
    if args.policies:
        pol_digits = pol_lm = args.policies.split(",")
        unknown = set(pol_digits) - set(candidate_policies())
        if unknown:
            parser.error(f"unknown policies {sorted(unknown)}; known: {list(candidate_policies())}")
    elif args.full:
        pol_digits = pol_lm = everything
    elif args.levers:
        pol_digits = pol_lm = list(LEVER_POLICIES)
    else:
        pol_digits = pol_lm = list(DEFAULT_POLICIES)
    args.intervals = [int(i) for i in (args.base_interval or "10").split(",")]
    only = set((args.only or "digits,charlm,cnn").split(","))
    t0 = time.perf_counter()
    if args.context_entropy:
        if "digits" in only:
            context_entropy(digits_workload(args.hidden, args.steps), args.steps, args.every,
                            args.intervals[0])
        if "charlm" in only:
            work = charlm_workload(args.steps, args.d_model, args.layers,
                                   max_chars=40_000 if args.quick else 320_000)
            context_entropy(work, args.steps, args.every_lm, args.intervals[0])
        if "cnn" in only:
            context_entropy(cnn_workload(args.cnn_width, args.steps), args.steps, args.every,
                            args.intervals[0])
        return
    root = tempfile.mkdtemp(prefix="orbax_lossy_whole_")
    try:
        if "digits" in only:
            measure(digits_workload(args.hidden, args.steps), args, os.path.join(root, "digits"),
                    args.every, pol_digits)
        if "charlm" in only:
            work = charlm_workload(args.steps, args.d_model, args.layers,
                                   max_chars=40_000 if args.quick else 320_000)
            measure(work, args, os.path.join(root, "charlm"), args.every_lm, pol_lm)
        if "digits-bf16" in only:
            measure(digits_workload(args.hidden, args.steps, param_dtype=jnp.bfloat16), args,
                    os.path.join(root, "digits-bf16"), args.every, pol_digits)
        if "cnn" in only:
            measure(cnn_workload(args.cnn_width, args.steps), args, os.path.join(root, "cnn"),
                    args.every, pol_digits)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
