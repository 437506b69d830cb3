"""Models and train steps shared by tests: a small NNX model with BatchNorm, Dropout and
AdamW-style training, and the linen BatchNorm train step (``TrainState`` + ``batch_stats``)."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from flax.training import train_state


class Net(nnx.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def nnx_setup(tx, net=Net):
    """(model, optimizer, jitted train step returning the loss) on fixed random data."""
    model = net(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(2), (32, 8))
    y = jax.random.randint(jax.random.key(3), (32,), 0, 4)

    @nnx.jit
    def step(model, opt):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    return model, opt, step


class BNTrainState(train_state.TrainState):
    """A linen ``TrainState`` with BatchNorm statistics."""

    batch_stats: dict


def linen_bn_train_step(ts, x, y):
    """One step of a linen ``BNTrainState`` (BatchNorm in training mode, softmax cross-entropy
    on ``(x, y)``): gradients applied, the updated batch statistics kept. Trace it in a jit."""

    def loss_fn(p):
        logits, upd = ts.apply_fn({"params": p, "batch_stats": ts.batch_stats}, x,
                                  mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

    grads, upd = jax.grad(loss_fn, has_aux=True)(ts.params)
    return ts.apply_gradients(grads=grads, batch_stats=upd["batch_stats"])
