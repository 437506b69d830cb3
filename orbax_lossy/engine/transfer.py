"""Copies of coded fields between the device and the host (a save's results, a restore's
decoded symbols).

On the CPU backend a field's buffer already lives in host memory: ``copy_to_host_async`` and
``np.asarray`` hand it over. On an accelerator two things make the copy faster (measured on
one H200 with ``benchmarks/gpu_speed.sh``: unpinned ``np.asarray`` moves float32 at about 2
GB/s but uint8 at about 1.1 GB/s; a put to ``pinned_host`` memory moves about 3 GB/s):

* uint8 symbol fields whose last axis is a multiple of 4 cross as uint32 words (a bitcast on
  the device, undone by a free ``view`` on the host), so no byte-sized transfer path is used;
* the copy goes to pinned host memory (``memory_kind="pinned_host"``, as Orbax's own
  device-to-host path does) where the device has it, else through ``copy_to_host_async``.

A restore uploads decoded uint8 symbol fields the same way, as uint32 words bitcast back on
the device (:func:`upload`), when every shard's slice of the last axis is whole words.

``ORBAX_LOSSY_TRANSFER=plain`` turns both off (to compare, or if a backend misbehaves).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.shardings import is_single_device

#: environment variable: ``plain`` for ``copy_to_host_async`` + ``np.asarray`` everywhere
TRANSFER_ENV = "ORBAX_LOSSY_TRANSFER"
#: fields smaller than this are copied plainly (a dispatch costs more than it saves)
MIN_PACKED_BYTES = 1 << 20


def _accelerated(device: jax.Device) -> bool:
    mode = os.environ.get(TRANSFER_ENV, "auto")
    if mode == "plain":
        return False
    return mode == "force" or device.platform != "cpu"


@functools.lru_cache(maxsize=64)
def _pinned_memory(device: jax.Device) -> bool:
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # a backend without memory kinds
        return False


@jax.jit
def _pack_words(x: jax.Array) -> jax.Array:
    """uint8 ``[..., 4n]`` as uint32 ``[..., n]`` (the same bytes, little-endian words)."""
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4),
                                        jnp.uint32)


def _packable(data: jax.Array) -> bool:
    return (data.dtype == jnp.uint8 and data.ndim >= 1 and data.shape[-1] % 4 == 0
            and data.size > 0 and data.size >= MIN_PACKED_BYTES)


class HostCopy:
    """One device shard on its way to host memory; :meth:`result` is its numpy value."""

    def __init__(self, data: jax.Array) -> None:
        self.shape = tuple(data.shape)
        self.dtype = np.dtype(data.dtype)
        device = next(iter(data.devices()))
        if not _accelerated(device):
            data.copy_to_host_async()
            self._value: Any = data
            return
        if _packable(data):
            data = _pack_words(data)
        if _pinned_memory(device):
            data = jax.device_put(
                data, jax.sharding.make_single_device_sharding(device, memory_kind="pinned_host"))
        else:
            data.copy_to_host_async()
        self._value = data

    def result(self) -> np.ndarray:
        """The shard's values on the host (waits for the copy)."""
        host = np.asarray(self._value)
        if host.dtype != self.dtype:  # packed words: the same bytes, viewed back
            host = np.ascontiguousarray(host).view(self.dtype).reshape(self.shape)
        return host


def _packed_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A shard's index into the words array, as an index into the byte array."""
    *lead, last = index
    start, stop, _ = last.indices(shape[-1] // 4)
    return (*lead, slice(4 * start, 4 * stop))


def _uploads_words(shape: tuple[int, ...], dtype: np.dtype,
                   sharding: jax.sharding.Sharding) -> bool:
    if (np.dtype(dtype) != np.uint8 or not shape or shape[-1] % 4 or not math.prod(shape)
            or math.prod(shape) < MIN_PACKED_BYTES):
        return False
    if not _accelerated(next(iter(sharding.device_set))):
        return False
    words = (*shape[:-1], shape[-1] // 4)
    try:  # every shard of the words array must be exactly a shard of the bytes
        by_bytes = sharding.addressable_devices_indices_map(shape)
        by_words = sharding.addressable_devices_indices_map(words)
    except Exception:
        return False
    def bounds(index: tuple[slice, ...] | None, dims: tuple[int, ...]) -> tuple:
        index = index or tuple(slice(None) for _ in dims)
        return tuple(s.indices(n)[:2] for s, n in zip(index, dims, strict=True))

    for device, index in by_words.items():
        if device not in by_bytes:
            return False
        *lead, (start, stop) = bounds(index, words)
        if (*lead, (4 * start, 4 * stop)) != bounds(by_bytes[device], shape):
            return False
    return True


@functools.lru_cache(maxsize=256)
def _unpack_words(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> Any:
    def unpack(words: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)

    return jax.jit(unpack, out_shardings=sharding)


def passes_as_host(sharding: jax.sharding.Sharding) -> bool:
    """Whether a decode program takes a restored field on ``sharding`` as its host numpy array
    (no :func:`upload`): one CPU device in its default memory, where JAX's call aliases an
    aligned array. A restore of 360 leaves through 10 links made 3,600 upload calls, 41 us
    each among the decoding threads (340 ms of a 1.5 s restore); the program's own argument
    handling takes a numpy array for a few microseconds."""
    return _passes_as_host(sharding, os.environ.get(TRANSFER_ENV, "auto"))


@functools.lru_cache(maxsize=256)
def _passes_as_host(sharding: jax.sharding.Sharding, mode: str) -> bool:
    """:func:`passes_as_host` under transfer ``mode`` (cached: asked per leaf and link)."""
    if not is_single_device(sharding):
        return False
    device: jax.Device = next(iter(sharding.device_set))
    if device.platform != "cpu" or _accelerated(device):
        return False
    try:
        return sharding.memory_kind in (None, device.default_memory().kind)
    except Exception:  # a runtime without memory kinds: its one memory
        return sharding.memory_kind is None


def upload(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding,
           callback: Callable[[tuple[slice, ...] | None], np.ndarray]) -> jax.Array:
    """``jax.make_array_from_callback(shape, sharding, callback)``, for uint8 fields on an
    accelerator through uint32 words (the same bytes, unpacked on the device)."""
    if not _uploads_words(tuple(shape), np.dtype(dtype), sharding):
        return jax.make_array_from_callback(shape, sharding, callback)
    shape = tuple(shape)
    words_shape = (*shape[:-1], shape[-1] // 4)

    def words(index: tuple[slice, ...] | None) -> np.ndarray:
        full = index or tuple(slice(None) for _ in words_shape)
        host = np.ascontiguousarray(callback(_packed_index(full, shape)))
        return host.view(np.uint32)

    return _unpack_words(shape, sharding)(
        jax.make_array_from_callback(words_shape, sharding, words))


# ---------------------------------------------------------------------------- CPU holds


def _views_survive_donation() -> bool:
    """Whether a CPU buffer that a numpy view references keeps its memory and values when a
    program donates the array (the runtime then writes the output elsewhere), probed once per
    process on a tiny array (one small compilation; see :func:`donation_probe`). jax 0.10
    refuses such a donation (the array stays alive); jax 0.12.1 marks the donated array
    deleted, and the viewed memory stays intact and unused by the output. Both are safe."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
        x = jax.device_put(np.arange(64, dtype=np.float32), cpu) + 0
        view = np.asarray(x)
        viewed = view.__array_interface__["data"][0]
        y = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
        jax.block_until_ready(y)
        return (y.unsafe_buffer_pointer() != viewed
                and bool(np.array_equal(view, np.arange(64)))
                and bool(np.asarray(y)[3] == 6))
    except Exception:  # no CPU backend, or donation errors out: copy instead
        return False


_PROBE: concurrent.futures.Future | None = None
_PROBE_LOCK = threading.Lock()


def donation_probe() -> bool:
    """``_views_survive_donation`` without waiting for it: the first call starts the probe
    on a background thread and answers False (that save copies), later calls answer once it
    is done. Neither handler construction (which may precede ``jax.distributed.initialize``)
    nor ``save()`` compiles it."""
    global _PROBE
    with _PROBE_LOCK:
        if _PROBE is None:
            probe: concurrent.futures.Future = concurrent.futures.Future()
            _PROBE = probe

            def run() -> None:
                probe.set_result(_views_survive_donation())  # catches every exception itself

            # not a daemon: interpreter exit waits for it (milliseconds) instead of killing it
            # inside XLA, which aborts the process
            threading.Thread(target=run, name="orbax_lossy_donation_probe").start()
            return False
    return _PROBE.done() and bool(_PROBE.result())


@dataclasses.dataclass(frozen=True)
class HostHold:
    """A single-shard CPU array held by a numpy view of its buffer (the external reference
    that keeps the runtime from reusing the memory), not yet rebuilt into an array of the
    handler's own: :func:`materialize` does that, off the blocking path. ``shape``,
    ``dtype`` and ``sharding`` are the array's (what a save records before the encode)."""

    view: np.ndarray
    device: jax.Device
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding


def hold_on_host(arrays: list[Any]) -> list[jax.Array | HostHold | None]:
    """Per array, a zero-copy hold of its buffers, or None where that is not safe (then the
    caller copies it): a :class:`HostHold` for a single-shard array (a numpy view only; the
    array over it is built by :func:`materialize`, in the commit), else an array of the
    handler's own built over views of every shard.

    On CPU devices an array's buffers are host memory. A numpy view of every shard is an
    external reference: while it lives the runtime will not reuse the buffer (a program the
    caller runs with ``donate_argnums`` writes its output elsewhere, as it must while plain
    Orbax holds its own views; jax 0.10 keeps the donated array alive, jax 0.12.1 marks it
    deleted) and deleting the array leaves the memory alive. Arrays are built from those
    views without a copy (one batched ``device_put`` of aligned numpy arrays on CPU aliases
    them) and keep them alive until the handler drops them. That ``device_put`` is most of
    the cost of a hold (0.86 of 1.03 ms for 12 leaves), so single-shard arrays, the usual
    CPU case, leave it to :func:`materialize`. Needs a ready array (a view of a pending one
    would wait for it) and a finished :func:`donation_probe` that found the viewed memory
    survives a donation.
    """
    out: list[jax.Array | HostHold | None] = [None] * len(arrays)
    held = [j for j, x in enumerate(arrays)
            if all(getattr(d, "platform", None) == "cpu" for d in x.sharding.device_set)
            and x.is_ready()]
    if not held or not donation_probe():
        return out
    try:
        shards = {j: arrays[j].addressable_shards for j in held}
        views = {j: [np.asarray(s.data) for s in shards[j]] for j in held}
    except Exception:  # a dtype or layout numpy cannot view: copy every leaf as before
        return out
    several = [j for j in held if len(views[j]) != 1]
    for j in held:
        if len(views[j]) == 1:
            x = arrays[j]
            out[j] = HostHold(views[j][0], shards[j][0].device, tuple(x.shape),
                              np.dtype(x.dtype), x.sharding)
    if not several:
        return out
    try:
        built = jax.device_put([v for j in several for v in views[j]],
                               [s.device for j in several for s in shards[j]])
    except Exception:  # a layout the runtime cannot alias: copy those leaves
        return out
    position = 0
    for j in several:
        parts = built[position:position + len(views[j])]
        position += len(views[j])
        x = arrays[j]
        try:
            out[j] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, parts)
        except Exception:  # a sharding that cannot be rebuilt from its shards: copy it
            out[j] = None
    return out


def materialize(values: list[Any]) -> list[Any]:
    """``values`` with every :class:`HostHold` replaced by a zero-copy array over its view
    (one batched ``device_put``), on the hold's sharding; other values unchanged."""
    holds = [j for j, v in enumerate(values) if isinstance(v, HostHold)]
    if not holds:
        return list(values)
    out = list(values)
    built = jax.device_put([values[j].view for j in holds], [values[j].device for j in holds])
    for j, array in zip(holds, built, strict=True):
        hold = values[j]
        out[j] = (array if array.sharding == hold.sharding else
                  jax.make_array_from_single_device_arrays(hold.shape, hold.sharding, [array]))
    return out
