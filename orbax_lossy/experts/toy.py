"""A small NNX Mixture-of-Experts character LM (tests, example and benchmark of PEC).

Stacked experts in the MaxText layout: per MoE layer ``w_in [E, d, h]``, ``b_in [E, h]``,
``w_out [E, h, d]``, ``b_out [E, d]`` and a router ``Linear(d, E)``; top-k routing (dense
compute, it is tiny). ``__call__`` returns the logits and the tokens routed to each expert,
``[layers, E]``: the ``expert_tokens`` PEC's accounting needs.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class MoE(nnx.Module):
    """Top-k routed experts with stacked weights (expert axis 0)."""

    def __init__(self, d: int, h: int, experts: int, top_k: int, rngs: nnx.Rngs) -> None:
        self.top_k = top_k
        self.router = nnx.Linear(d, experts, rngs=rngs)
        key = rngs.params()
        k1, k2 = jax.random.split(key)
        self.w_in = nnx.Param(jax.random.normal(k1, (experts, d, h)) / np.sqrt(d))
        self.b_in = nnx.Param(jnp.zeros((experts, h)))
        self.w_out = nnx.Param(jax.random.normal(k2, (experts, h, d)) / np.sqrt(h))
        self.b_out = nnx.Param(jnp.zeros((experts, d)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Output ``[T, d]`` and tokens routed per expert ``[E]``."""
        experts = self.w_in.shape[0]
        probs = jax.nn.softmax(self.router(x), axis=-1)
        top_p, top_i = jax.lax.top_k(probs, self.top_k)
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        onehot = jax.nn.one_hot(top_i, experts, dtype=x.dtype)  # [T, k, E]
        gates = jnp.einsum("tk,tke->te", top_p, onehot)
        hidden = jax.nn.gelu(jnp.einsum("td,edh->teh", x, self.w_in[...]) + self.b_in[...])
        y = jnp.einsum("teh,ehd->ted", hidden, self.w_out[...]) + self.b_out[...]
        counts = jnp.sum(onehot, axis=(0, 1)).astype(jnp.int32)
        return jnp.einsum("te,ted->td", gates, y), counts


class Block(nnx.Module):
    """Pre-norm residual MoE block."""

    def __init__(self, d: int, h: int, experts: int, top_k: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.moe = MoE(d, h, experts, top_k, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Residual output and tokens routed per expert."""
        y, counts = self.moe(self.norm(x))
        return x + y, counts


class CharMoE(nnx.Module):
    """Predict the next character from the previous ``context`` characters."""

    def __init__(self, vocab: int, *, context: int = 8, d: int = 32, h: int = 64,
                 experts: int = 8, top_k: int = 2, layers: int = 2, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.mix = nnx.Linear(context * d, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, h, experts, top_k, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Logits ``[B, vocab]`` and tokens routed per expert ``[layers, E]``."""
        x = self.embed(tokens).reshape(tokens.shape[0], -1)
        x = self.mix(x)
        counts = []
        for block in self.blocks:
            x, c = block(x)
            counts.append(c)
        return self.head(x), jnp.stack(counts)


def build(vocab: int, *, lr: float = 3e-3, seed: int = 0, **kw) -> tuple[CharMoE, nnx.Optimizer]:
    """The model and an AdamW optimizer over its parameters."""
    model = CharMoE(vocab, seed=seed, **kw)
    return model, nnx.Optimizer(model, optax.adamw(lr, weight_decay=1e-4), wrt=nnx.Param)


@nnx.jit
def train_step(model: CharMoE, optimizer: nnx.Optimizer, x: jax.Array,
               y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One AdamW step; returns the loss and the tokens routed per expert ``[layers, E]``."""

    def loss_fn(m: CharMoE):
        logits, counts = m(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), counts

    (loss, counts), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, counts


@nnx.jit
def eval_loss(model: CharMoE, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy on a batch."""
    logits, _ = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def stdlib_text(max_chars: int = 400_000, files: int = 12) -> str:
    """Text of a few Python standard library modules (sorted, deterministic)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    chosen = [n for n in names if os.path.basename(n) in (
        "textwrap.py", "shlex.py", "string.py", "fnmatch.py", "heapq.py", "bisect.py",
        "colorsys.py", "keyword.py", "queue.py", "sched.py", "calendar.py", "difflib.py")]
    text = ""
    for n in (chosen or names)[:files]:
        with open(n, encoding="utf-8", errors="replace") as f:
            text += f.read()
        if len(text) >= max_chars:
            break
    return text[:max_chars]


class CharData:
    """Deterministic batches of (context, next char) windows over a text."""

    def __init__(self, text: str, context: int = 8) -> None:
        chars = sorted(set(text))
        self.vocab = len(chars)
        self.ids = np.asarray([chars.index(c) for c in text], np.int32) if len(text) < 2000 \
            else np.searchsorted(np.asarray(chars), np.asarray(list(text))).astype(np.int32)
        self.context = context
        split = int(len(self.ids) * 0.9)
        self.train, self.valid = self.ids[:split], self.ids[split:]

    def batch(self, step: int, size: int = 64, valid: bool = False) -> tuple[jax.Array, jax.Array]:
        """Batch ``step`` (the same batch for the same step, in every run)."""
        data = self.valid if valid else self.train
        rng = np.random.default_rng(step + (1 << 20 if valid else 0))
        starts = rng.integers(0, len(data) - self.context - 1, size)
        idx = starts[:, None] + np.arange(self.context + 1)[None, :]
        w = data[idx]
        return jnp.asarray(w[:, :-1]), jnp.asarray(w[:, -1])


def synthetic_text(n: int = 20_000, seed: int = 0) -> str:
    """A small deterministic text for fast tests."""
    rng = np.random.default_rng(seed)
    words = ["def ", "return ", "self", "(x)", ": ", "\n    ", "import ", "for i in ", "if "]
    return "".join(words[i] for i in rng.integers(0, len(words), n // 5))[:n]
