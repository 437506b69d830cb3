"""numba's on-disk cache for kernels compiled per set of constants (a closure per set).

numba keys a cached closure by the pickle of its cells. The CPU encode kernels
(:mod:`orbax_lossy.engine.cpu_encode`) close over their constants *and* over an inlined
per-element ``@njit`` function, and a numba dispatcher pickles with a random ``uuid4``: the
key was new in every process, so every process compiled each kernel again (about 2 s for
LC's statistics pass on the benchmark machine, on the commit path of the first save that
used it) and appended one more entry to the cache files. :func:`stable_cache` keys a kernel
by its bytecode and a description of its cells that is the same in every process: a
dispatcher cell by its function's name, bytecode and own cells, any other cell by its pickle.
numba still drops a cache entry when the kernel's source file changes.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher


def describe(func: Any) -> bytes:
    """The bytecode and closure of a Python function as bytes that depend only on them:
    dispatcher cells described the same way, recursively (not by their pickle)."""
    parts = [func.__qualname__.encode(), func.__code__.co_code]
    for cell in func.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, Dispatcher):
            parts.append(b"dispatcher:" + describe(value.py_func))
        else:
            parts.append(pickle.dumps(value, protocol=4))
    return b"\0".join(hashlib.sha256(p).digest() for p in parts)


class StableFunctionCache(FunctionCache):
    """A numba :class:`FunctionCache` whose index key holds :func:`describe` of the kernel
    instead of the pickle of its cells; numba 0.60-0.68 define the key in ``_index_key``."""

    def _index_key(self, sig: Any, codegen: Any) -> tuple:
        return (sig, codegen.magic_tuple(), hashlib.sha256(describe(self._py_func)).hexdigest())


def stable_cache(kernel: Any) -> Any:
    """Turn on ``kernel``'s on-disk cache (a numba dispatcher made without ``cache=True``)
    under a key that is the same in every process. Returns ``kernel``."""
    kernel._cache = StableFunctionCache(kernel.py_func)
    return kernel
