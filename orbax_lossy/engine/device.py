"""The device halves of all codecs, as jitted programs over a list of leaves.

``encode_tree`` runs the ``device_encode`` of the leaves it is given in one compiled XLA
program; saves give it one leaf at a time (``save.dispatch_encode``, on :func:`leaf_pool` in a
single process), so a program is compiled once per class of leaves (shape, dtype, sharding,
codec) and reused by every leaf of that class and every later save. The codec plan and the
input shardings are static arguments.
Elementwise outputs (codec fields and the reconstruction) are constrained to the input's
sharding, so a sharded leaf is never gathered onto one device; per-leaf statistics reduce
globally, which makes the codec choices identical on every process.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from orbax_lossy.codecs.base import Codec, sign_safe
from orbax_lossy.codecs.same import bits_equal
from orbax_lossy.threads import core_pool


def _constrain(x: jax.Array, sharding: jax.sharding.Sharding | None) -> jax.Array:
    if sharding is None or len(sharding.device_set) <= 1:
        return x
    return jax.lax.with_sharding_constraint(x, sharding)


def _relative_error(value: jax.Array, recon: jax.Array) -> jax.Array:
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return jnp.zeros((), jnp.float32)
    v = value.astype(jnp.float32)
    err = jnp.sqrt(jnp.sum(jnp.square(recon.astype(jnp.float32) - v)))
    norm = jnp.sqrt(jnp.sum(jnp.square(v)))
    return jnp.where(norm > 0, err / jnp.maximum(norm, 1e-30), err)


def _finite(value: jax.Array, reference: jax.Array | None) -> jax.Array:
    if not jnp.issubdtype(value.dtype, jnp.inexact):
        return jnp.ones((), jnp.bool_)
    ok = jnp.all(jnp.isfinite(value))
    if reference is not None:
        ok &= jnp.all(jnp.isfinite(reference))
    return ok


def _guard(value: jax.Array, ref: jax.Array | None, recon: jax.Array, lossy: bool) -> jax.Array:
    """Whether a lossy or delta encoding may be stored (see :func:`encode_tree`).

    The same predicate as ``_finite(value, ref) & _finite(recon) & isfinite(value - ref) &
    sign_safe(value, recon)``, with the finiteness tests fused into one reduction (one pass
    over the leaf on XLA:CPU, instead of four) and the sign tests as float minima and maxima
    (see :func:`~orbax_lossy.codecs.base.all_nonnegative`).
    """
    ok = jnp.isfinite(recon) if jnp.issubdtype(recon.dtype, jnp.inexact) else None
    if jnp.issubdtype(value.dtype, jnp.inexact):
        ok = jnp.isfinite(value) if ok is None else ok & jnp.isfinite(value)
        if ref is not None:
            wide = jnp.promote_types(value.dtype, jnp.float32)
            ok &= jnp.isfinite(ref) & jnp.isfinite(value.astype(wide) - ref.astype(wide))
    safe = jnp.ones((), jnp.bool_) if ok is None else jnp.all(ok)
    if lossy:  # a non-negative value must decode non-negative, positive where positive
        safe &= sign_safe(value, recon)
    return safe


def _encode_tree(
    values: Sequence[jax.Array],
    references: Sequence[jax.Array | None],
    *,
    plan: tuple[Codec, ...],
    shardings: tuple[jax.sharding.Sharding | None, ...],
) -> list[dict[str, Any]]:
    """Encode every leaf; returns per leaf ``{fields, side, recon, safe, rel_error, same}``
    (``same``: an ``exact`` leaf is bit-identical to its reference).

    A lossy or delta codec's output is *guarded*: when the value, the reference, the delta
    between them or the reconstruction is not finite, or the reconstruction breaks the sign
    of a non-negative leaf (see :func:`sign_safe`), ``safe`` is False, the reconstruction is
    the value itself, and the handler stores the leaf exactly for this save (never garbage,
    never a wrong sign).
    """
    out = []
    for value, given, codec, sharding in zip(values, references, plan, shardings, strict=True):
        ref = given if codec.needs_reference else None
        enc = codec.device_encode(value, ref)
        # An exact leaf reconstructs to its value: the handler owns `value` (a copy made in
        # async_save), so no second copy is needed (XLA drops the codec's unused copy).
        recon = value if codec.codec_id == "exact" else enc.recon
        safe = jnp.ones((), jnp.bool_)
        if codec.lossy or codec.needs_reference:
            safe = _guard(value, ref, recon, codec.lossy)
            recon = jnp.where(safe, recon, value)
        out.append(
            {
                "fields": {k: _constrain(v, sharding) for k, v in enc.fields.items()},
                "side": enc.side,
                "recon": _constrain(recon, sharding),
                "safe": safe,
                "rel_error": _relative_error(value, recon),
                "same": _unchanged(value, given, codec),
            }
        )
    return out


def _unchanged(value: jax.Array, reference: jax.Array | None, codec: Codec) -> jax.Array:
    """Whether an ``exact`` leaf holds the same bits as its reference (then the save stores
    it as ``same``: :mod:`orbax_lossy.codecs.same`)."""
    if (codec.codec_id != "exact" or reference is None or reference.shape != value.shape
            or reference.dtype != value.dtype):
        return jnp.zeros((), jnp.bool_)
    return bits_equal(value, reference)


encode_tree = jax.jit(_encode_tree, static_argnames=("plan", "shardings"))
# Inputs are not donated: the guard and the error need the value after the reconstruction
# exists, so XLA copies a donated input and the program's peak memory grows (measured with
# ``compiled.memory_analysis()``: temp 9.0 -> 12.3 leaf sizes for the default policy).


def _decode_tree(
    fields: Sequence[dict[str, jax.Array]],
    sides: Sequence[dict[str, jax.Array]],
    references: Sequence[jax.Array | None],
    *,
    plan: tuple[Codec, ...],
    dtypes: tuple[Any, ...],
    shardings: tuple[jax.sharding.Sharding | None, ...],
) -> list[jax.Array]:
    """Inverse of :func:`encode_tree` for the leaves of one checkpoint."""
    out = []
    for f, side, ref, codec, dtype, sharding in zip(
        fields, sides, references, plan, dtypes, shardings, strict=True
    ):
        out.append(_constrain(codec.device_decode(f, side, ref, jnp.dtype(dtype)), sharding))
    return out


decode_tree = jax.jit(_decode_tree, static_argnames=("plan", "dtypes", "shardings"))
def _decode_links(
    fields: Sequence[dict[str, jax.Array]],
    sides: Sequence[dict[str, jax.Array]],
    reference: jax.Array | None,
    *,
    plans: tuple[Codec, ...],
    dtype: Any,
    sharding: jax.sharding.Sharding | None,
) -> jax.Array:
    """One leaf decoded through consecutive links of its chain: ``x = reference``, then per
    link ``x = decode(fields, side, x)`` (a link whose codec needs no reference starts
    afresh). XLA fuses the links into one pass over the leaf; every intermediate value is
    rounded to ``dtype`` as a link-by-link decode rounds it, so the result is bit-identical."""
    x = reference
    for f, side, codec in zip(fields, sides, plans, strict=True):
        ref = x if codec.needs_reference else None
        x = _constrain(codec.device_decode(f, side, ref, jnp.dtype(dtype)), sharding)
    assert x is not None
    return x


@functools.lru_cache(maxsize=256)
def decode_links_program(sharding: jax.sharding.Sharding) -> Any:
    """:func:`_decode_links` on ``sharding``, jitted: it donates the reference (a restore's own
    intermediate value) and puts its result on ``sharding`` (committed there even when every
    argument is a host array, see ``transfer.passes_as_host``)."""
    return jax.jit(functools.partial(_decode_links, sharding=sharding),
                   static_argnames=("plans", "dtype"), donate_argnums=(2,),
                   out_shardings=sharding)


def decode_links(
    fields: Sequence[dict[str, Any]],
    sides: Sequence[dict[str, Any]],
    reference: jax.Array | None,
    *,
    plans: tuple[Codec, ...],
    dtype: Any,
    sharding: jax.sharding.Sharding,
    compiled: Any = None,
) -> jax.Array:
    """Run :func:`decode_links_program` of ``sharding`` (see :func:`_decode_links`), or
    ``compiled``, that program compiled ahead for these arguments' shapes and dtypes
    (``engine.precompile``), where it accepts them."""
    if compiled is not None:
        try:
            return compiled(fields, sides, reference)
        except TypeError:  # arguments unlike the compiled ones: rejected before running
            if reference is not None and reference.is_deleted():
                raise
    return decode_links_program(sharding)(fields, sides, reference, plans=plans, dtype=dtype)


def leaf_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide workers that run the per-leaf encode programs of single-process saves
    (one per core). XLA:CPU runs a small program inside the call that dispatches
    it, so a loop of per-leaf calls on one thread would run them one after another on one
    core (and a commit's entropy coding would start only after the last); on these workers
    the programs use every core, and a save codes each leaf as soon as its program is done.
    Only for programs on one device each (no collectives)."""
    return core_pool("encode")


class Pending(Sequence):
    """Per leaf, a result computed on :func:`leaf_pool`, waited for when it is read (an
    exception of the leaf's program is raised there)."""

    def __init__(self, futures: Sequence[concurrent.futures.Future],
                 part: Callable[[Any], Any]) -> None:
        self._futures, self._part = list(futures), part

    def __len__(self) -> int:
        return len(self._futures)

    def __getitem__(self, j: Any) -> Any:  # an int: the results are read one by one
        return self._part(self._futures[j].result())


def strong(x: Any) -> Any:
    """``x`` without a weak type: a zero-copy alias of a weakly typed ``jax.Array`` (as
    ``jnp.full(shape, 1.0)`` makes), anything else unchanged.

    Compiled programs are cached by their inputs' types, weak or not, and the handler's own
    arrays are weak or strong depending on how they were made (a device copy keeps the
    caller's weak type, a zero-copy hold or a restore does not): without this, the same
    tree compiled its programs again at its second save.
    """
    if not isinstance(x, jax.Array) or not x.weak_type:
        return x
    return jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [s.data for s in x.addressable_shards])


def copy_tree(values: list[Any]) -> list[Any]:
    """Device copies of a list of arrays (the restored values become the next reference).

    ``jax.device_put(..., may_alias=False)``: an asynchronous copy per shard that compiles
    nothing (a jitted copy would compile once per restored tree), for all of them in one
    batched call (360 leaves of 46 k float32 elements: 18-24 ms one by one, 11-12 ms
    batched).
    """
    present = [v for v in values if v is not None]
    if not present:
        return list(values)
    copies = iter(jax.device_put(present, [v.sharding for v in present], may_alias=False,
                                 donate=False))
    return [None if v is None else next(copies) for v in values]
