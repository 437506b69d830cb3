"""A small real training run (a Flax MLP on scikit-learn's digits) for demos, tests, benchmarks.

The digits images ship with scikit-learn, so nothing is downloaded. ``run`` is the project's
"main job": it trains the model, checkpoints it through :func:`orbax_lossy.checkpoint_manager`
and prints the bytes each checkpoint takes against the raw state and against plain Orbax.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state


def load_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): 8x8 digit images scaled to [0, 1], 80/20 split."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the demo needs scikit-learn: pip install 'orbax-lossy[dev]'") from e
    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


class MLP(nn.Module):
    """Two ReLU hidden layers of width ``hidden``, then 10 logits."""

    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """The 10 logits of every row of ``x`` (flattened 8x8 images)."""
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


def make_optimizer(name: str, learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """The optax optimizer ``name`` (``sgd`` with momentum, ``adam`` or ``adamw``)."""
    if name == "sgd":
        return optax.sgd(learning_rate * 30, momentum=0.9)
    if name == "adam":
        return optax.adam(learning_rate)
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=1e-4)
    raise ValueError(f"unknown optimizer {name!r}")


def create_state(
    optimizer: str = "adamw", hidden: int = 128, seed: int = 0
) -> train_state.TrainState:
    """A fresh ``TrainState`` of an :class:`MLP` with the optimizer ``optimizer``."""
    model = MLP(hidden)
    params = model.init(jax.random.key(seed), jnp.zeros((1, 64), jnp.float32))["params"]
    return train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=make_optimizer(optimizer)
    )


def loss_fn(params: Any, apply_fn: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of the model on ``(x, y)``."""
    logits = apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def train_step(state: train_state.TrainState, x: jax.Array, y: jax.Array):
    """One jitted gradient step on a batch: ``(new state, loss before the step)``."""
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, x, y)
    return state.apply_gradients(grads=grads), loss


def evaluate(state: train_state.TrainState, x: np.ndarray, y: np.ndarray) -> float:
    """The loss of ``state`` on ``(x, y)`` as a Python float."""
    return float(loss_fn(state.params, state.apply_fn, jnp.asarray(x), jnp.asarray(y)))


def batches(x: np.ndarray, y: np.ndarray, batch: int, seed: int) -> Iterator[tuple[Any, Any]]:
    """Endless deterministic minibatches (step k always gets the same batch for a seed)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch + 1, batch):
            idx = order[start : start + batch]
            yield jnp.asarray(x[idx]), jnp.asarray(y[idx])


def training_run(
    steps: int, optimizer: str = "adamw", hidden: int = 128, seed: int = 0, batch: int = 64
) -> Iterator[tuple[int, train_state.TrainState]]:
    """Yield ``(step, state)`` after every step of a deterministic training run."""
    x, y, _, _ = load_digits(seed)
    state = create_state(optimizer, hidden, seed)
    data = batches(x, y, batch, seed)
    for step in range(1, steps + 1):
        state, _ = train_step(state, *next(data))
        yield step, state


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def run(
    directory: str | None = None,
    steps: int = 300,
    every: int = 10,
    bits: int | None = None,
    base_interval: int = 10,
    optimizer: str = "adamw",
) -> dict[str, Any]:
    """Train on digits, checkpoint the whole TrainState with orbax-lossy and with plain Orbax
    side by side, print the bytes of every checkpoint and the loss after a lossy restore.

    The library's default policy is used unless ``bits`` is given (then float parameters go
    through ``LC(bits)``). Without ``directory`` the checkpoints live in a temporary folder
    that is removed at the end.
    """
    import orbax.checkpoint as ocp
    from rich.progress import Progress

    import orbax_lossy as ol

    owned = None if directory else tempfile.TemporaryDirectory(prefix="orbax_lossy_demo_")
    directory = directory or owned.name  # type: ignore[union-attr]
    lossy_dir, plain_dir = os.path.join(directory, "lossy"), os.path.join(directory, "plain")
    policy = None if bits is None else ol.LeafPolicy.create(defaults={"param": ol.LC(bits=bits)})
    lossy = ol.checkpoint_manager(lossy_dir, policy=policy, base_interval=base_interval,
                                  max_to_keep=None)
    plain = ocp.CheckpointManager(plain_dir)
    rows = []
    _, _, x_test, y_test = load_digits()
    last = None
    t0 = time.perf_counter()
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("training and checkpointing", total=steps)
            for step, state in training_run(steps, optimizer):
                progress.advance(task)
                if step % every:
                    continue
                lossy.save(step, args=ol.LossySave(state))
                plain.save(step, args=ocp.args.StandardSave(state))
                lossy.wait_until_finished()
                plain.wait_until_finished()
                manifest = ol.format.read_manifest(os.path.join(lossy_dir, str(step), "default"))
                rows.append((step, manifest.header.save_type,
                             _dir_bytes(os.path.join(lossy_dir, str(step))),
                             _dir_bytes(os.path.join(plain_dir, str(step)))))
                last = state
        if last is None:
            raise ValueError(f"no checkpoint to report: steps={steps} < every={every}")
        restored = lossy.restore(rows[-1][0], args=ol.LossyRestore(last))
    finally:
        lossy.close()
        plain.close()
    raw = sum(np.asarray(x).nbytes for x in jax.tree.leaves(last))
    codecs = "library defaults" if bits is None else f"params LC({bits})"
    print(f"digits MLP, {optimizer}, whole TrainState (params + optimizer state + step), "
          f"{codecs}, a base every {base_interval} saves; raw state {raw} bytes")
    print(f"{'step':>6} {'type':>6} {'lossy B':>10} {'orbax B':>10} {'smaller':>8}")
    for step, save_type, lossy_b, plain_b in rows:
        print(f"{step:>6} {save_type:>6} {lossy_b:>10} {plain_b:>10} {plain_b / lossy_b:>7.1f}x")
    total_lossy = sum(r[2] for r in rows)
    total_plain = sum(r[3] for r in rows)
    deltas = [r for r in rows if r[1] == "delta"]
    delta_ratio = sum(r[3] for r in deltas) / max(sum(r[2] for r in deltas), 1)
    exact_loss = evaluate(last, x_test, y_test)
    lossy_loss = evaluate(restored, x_test, y_test)
    print(f"average over the run (bases included): {total_plain / total_lossy:.1f}x smaller "
          "than plain Orbax")
    print(f"deltas alone: {delta_ratio:.1f}x smaller than plain Orbax")
    print(f"test loss: trained {exact_loss:.4f}, restored from the lossy checkpoint "
          f"{lossy_loss:.4f}")
    where = "removed" if owned else f"kept in {directory}"
    print(f"wall time {time.perf_counter() - t0:.1f} s; checkpoints {where}")
    if owned is not None:
        owned.cleanup()
    return {
        "rows": rows,
        "average_ratio": total_plain / total_lossy,
        "delta_ratio": delta_ratio,
        "exact_loss": exact_loss,
        "lossy_loss": lossy_loss,
    }
