"""Train a small Flax model on real data (sklearn digits), checkpoint lossily every few steps,
simulate a failure, resume from the lossy checkpoint in a fresh manager and finish.

Documented tolerance: the resumed run's final training loss is within ``LOSS_TOL`` (absolute)
of the uninterrupted run's and its test accuracy within ``ACC_TOL``. Parameters come back
with LC 3-bit delta error; Adam moments, step counter and data order come back exactly.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import orbax_lossy as ol
from orbax_lossy.format.manifest import read_manifest_body as read_manifest

TOTAL_STEPS = 300
SAVE_EVERY = 5
FAIL_AT = 173  # the last checkpoint before the failure is step 170
BATCH = 128
LOSS_TOL = 0.02
ACC_TOL = 0.03


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def data():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm].astype(np.int32)
    return (jnp.asarray(x[:1500]), jnp.asarray(y[:1500])), (
        jnp.asarray(x[1500:]),
        jnp.asarray(y[1500:]),
    )


(X, Y), (XT, YT) = data()


def batch(step: int):
    """Deterministic batches from the step number: resuming replays the same data."""
    idx = np.random.default_rng(step).choice(len(X), BATCH, replace=False)
    return X[idx], Y[idx]


def loss_fn(params, apply_fn, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, x), y).mean()


@jax.jit
def train_step(ts, x, y):
    grads = jax.grad(loss_fn)(ts.params, ts.apply_fn, x, y)
    return ts.apply_gradients(grads=grads)


@jax.jit
def evaluate(ts):
    train_loss = loss_fn(ts.params, ts.apply_fn, X, Y)
    acc = jnp.mean(jnp.argmax(ts.apply_fn(ts.params, XT), -1) == YT)
    return train_loss, acc


def init_state():
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 64)))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))


def run(ts, start, stop, mngr=None):
    for step in range(start, stop):
        ts = train_step(ts, *batch(step))
        if mngr is not None and (step + 1) % SAVE_EVERY == 0:
            mngr.save(step + 1, args=ol.LossySave(ts))
    return ts


def test_resume_from_lossy_checkpoint_matches_uninterrupted_run(tmp_path):
    reference = run(init_state(), 0, TOTAL_STEPS)
    ref_loss, ref_acc = (float(v) for v in evaluate(reference))
    assert ref_loss < 0.2 and ref_acc > 0.9  # the model actually learns

    # Interrupted run: checkpoints every SAVE_EVERY steps, then the process "dies".
    handler = ol.LossyCheckpointHandler(base_interval=10)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=2)
    ts = init_state()
    mngr.save(0, args=ol.LossySave(ts))
    run(ts, 0, FAIL_AT, mngr)
    mngr.wait_until_finished()
    mngr.close()
    del mngr, handler, ts

    # Fresh manager, restore the latest lossy checkpoint, continue to the end.
    handler = ol.LossyCheckpointHandler(base_interval=10)
    mngr = ol.checkpoint_manager(tmp_path, handler=handler, max_to_keep=2)
    latest = mngr.latest_step()
    assert latest == 170
    ts = mngr.restore(latest, args=ol.LossyRestore(init_state()))
    assert int(ts.step) == latest
    ts = run(ts, latest, latest + SAVE_EVERY, mngr)
    # The first save after the restart continues the chain: a delta on restored step 170.
    assert handler.last_save_stats["kind"] == "delta"
    assert handler.dependencies_of(str(tmp_path), latest + SAVE_EVERY) == {"default": {latest}}
    ts = run(ts, latest + SAVE_EVERY, TOTAL_STEPS, mngr)
    mngr.wait_until_finished()
    loss, acc = (float(v) for v in evaluate(ts))
    print(
        f"uninterrupted loss {ref_loss:.4f} acc {ref_acc:.4f}; resumed loss {loss:.4f} "
        f"acc {acc:.4f}; |dloss| {abs(loss - ref_loss):.4f}"
    )
    assert int(ts.step) == TOTAL_STEPS
    assert abs(loss - ref_loss) < LOSS_TOL
    assert abs(acc - ref_acc) <= ACC_TOL

    # Every kept step restores, and the kept chain reaches back to a base.
    kinds = [read_manifest(tmp_path / str(s) / "default")["kind"] for s in mngr.all_steps()]
    assert kinds[0] == "base"
    fresh = ol.checkpoint_manager(tmp_path, max_to_keep=2)
    for step in fresh.all_steps():
        restored = fresh.restore(step, args=ol.LossyRestore(init_state()))
        assert int(restored.step) == step
    final = fresh.restore(TOTAL_STEPS, args=ol.LossyRestore(init_state()))
    f_loss, _ = (float(v) for v in evaluate(final))
    assert abs(f_loss - loss) < LOSS_TOL
