"""numba's on-disk cache for kernels compiled per set of constants (a closure per set).

numba keys a cached closure by the pickle of its cells. The CPU encode kernels
(:mod:`orbax_lossy.engine.cpu_encode`) close over their constants *and* over an inlined
per-element ``@njit`` function, and a numba dispatcher pickles with a random ``uuid4``: the
key was new in every process, so every process compiled each kernel again (about 2 s for
LC's statistics pass on the benchmark machine, on the commit path of the first save that
used it) and appended one more entry to the cache files. :func:`cache_by_key` keys a
kernel's cache by its code and a string of its constants instead, the same in every process.
numba still drops a cache entry when the kernel's source file changes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from numba.core.caching import FunctionCache


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class KeyedFunctionCache(FunctionCache):
    """A numba :class:`FunctionCache` whose index key is the kernel's bytecode and ``key``
    (not the pickle of its closure cells); numba 0.60-0.68 define the key in ``_index_key``."""

    def __init__(self, py_func: Any, key: str) -> None:
        super().__init__(py_func)
        self._constants_key = key

    def _index_key(self, sig: Any, codegen: Any) -> tuple:
        code = self._py_func.__code__.co_code
        return (sig, codegen.magic_tuple(), (_digest(code), _digest(self._constants_key.encode())))


def cache_by_key(kernel: Any, *constants: Any) -> Any:
    """Turn on ``kernel``'s on-disk cache (a numba dispatcher made without ``cache=True``),
    keyed by ``constants``: every value its closure reads that changes what it compiles to
    (``repr`` of each: bools, ints, strings). Returns ``kernel``."""
    key = f"{kernel.py_func.__qualname__}{constants!r}"
    kernel._cache = KeyedFunctionCache(kernel.py_func, key)
    return kernel
