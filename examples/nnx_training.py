"""Flax NNX training loop with orbax-lossy checkpoints, a simulated crash and a resume.

Trains an NNX MLP with ``nnx.Optimizer(adamw)`` on scikit-learn's digits, saves the whole
state with the library's default policy (parameters and Adam moments lossy, step counter and
RNG exact; see docs/whole_state.md) every 10 steps, "crashes" at step 120, then a fresh
manager restores the latest checkpoint into a freshly built model and training continues.

    python examples/nnx_training.py [--dir /tmp/nnx_run] [--steps 200]
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import orbax_lossy as ol
from orbax_lossy.demo import batches, load_digits


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(64, 128, rngs=rngs)
        self.l2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.relu(self.l1(x)))


def build(seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(m: MLP) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--crash-at", type=int, default=120)
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="orbax_lossy_nnx_")
    x, y, x_test, y_test = load_digits()

    def manager():
        return ol.checkpoint_manager(directory, base_interval=10, max_to_keep=3)

    model, optimizer = build()
    mngr = manager()
    data = batches(x, y, 64, seed=0)
    for step in range(1, args.crash_at + 1):
        loss = train_step(model, optimizer, *next(data))
        if step % 10 == 0:
            mngr.save(step, args=ol.LossySave(nnx.state((model, optimizer))))
    mngr.close()
    print(f"crash after step {args.crash_at} (loss {float(loss):.4f}); "
          f"kept steps {manager().all_steps()}")

    # --- a new process: rebuild the model, restore the latest checkpoint into it
    model, optimizer = build(seed=1)  # different init: everything must come from the checkpoint
    mngr = manager()
    latest = mngr.latest_step()
    restored = mngr.restore(latest, args=ol.LossyRestore(nnx.state((model, optimizer))))
    nnx.update((model, optimizer), restored)
    print(f"restored step {latest}; optimizer step counter {int(optimizer.step[...])}")
    data = batches(x, y, 64, seed=0)
    for _ in range(latest):  # same data order as the uninterrupted run
        next(data)
    for step in range(latest + 1, args.steps + 1):
        loss = train_step(model, optimizer, *next(data))
        if step % 10 == 0:
            mngr.save(step, args=ol.LossySave(nnx.state((model, optimizer))))
    mngr.close()
    logits = model(jnp.asarray(x_test))
    accuracy = float((logits.argmax(-1) == jnp.asarray(y_test)).mean())
    print(f"finished {args.steps} steps: train loss {float(loss):.4f}, "
          f"test accuracy {accuracy:.3f}")
    item = f"{directory}/{manager().latest_step()}/default"
    for row in ol.checkpoint_stats(item)[:6]:
        print(f"  {row['path']:<40} {row['codec']['id']:<8} {row['ratio']:6.1f}x "
              f"err {row['rel_error']:.1e}")


if __name__ == "__main__":
    main()
