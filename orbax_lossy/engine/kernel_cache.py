"""numba's on-disk cache for kernels compiled per set of constants (a closure per set).

numba keys a cached closure by the pickle of its cells. The CPU encode kernels
(:mod:`orbax_lossy.engine.cpu_encode`) close over their constants *and* over an inlined
per-element ``@njit`` function, and a numba dispatcher pickles with a random ``uuid4``: the
key was new in every process, so every process compiled each kernel again (about 2 s for
LC's statistics pass on the benchmark machine, on the commit path of the first save that
used it) and appended one more entry to the cache files. :func:`stable_cache` keys a kernel
by its bytecode, constants, and a description of its cells and of the module globals it
reads that is the same in every process: a dispatcher by its function's description, any
other value by its pickle. numba still drops a cache entry when the kernel's source file
changes; the globals cover constants imported from other modules, whose change it does not
see.
"""

from __future__ import annotations

import hashlib
import pickle
import types
from typing import Any

from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher
from numba.core.extending import _Intrinsic


def _describe_code(code: types.CodeType) -> list[bytes]:
    """A code object's bytecode and constants, nested code objects (inner functions) by the
    same description instead of their pickle (which holds file names and line numbers)."""
    parts = [code.co_code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            parts.extend(_describe_code(const))
        else:
            parts.append(b"const:" + repr(const).encode())
    return parts


def _describe_value(value: Any, seen: set[int]) -> bytes:
    if isinstance(value, Dispatcher):
        return b"dispatcher:" + describe(value.py_func, seen)
    if isinstance(value, _Intrinsic):  # its pickle holds a random uuid; its code generator
        return b"intrinsic:" + describe(value._defn, seen)
    if isinstance(value, types.FunctionType):
        return b"function:" + describe(value, seen)
    return pickle.dumps(value, protocol=4)


def describe(func: Any, seen: set[int] | None = None) -> bytes:
    """The bytecode, constants, closure and module globals of a Python function as bytes
    that depend only on them: dispatcher and function values described the same way,
    recursively (not by their pickle). numba freezes the globals a kernel reads (a constant
    imported from another module) into its machine code, so their values are part of the
    key; modules and values that cannot be pickled (classes, numba's intrinsics) are keyed
    by their names only, as numba's source-file stamp already covers this file's code."""
    seen = set() if seen is None else seen
    if id(func) in seen:  # a recursive kernel
        return func.__qualname__.encode()
    seen.add(id(func))
    parts = [func.__qualname__.encode(), *_describe_code(func.__code__)]
    for cell in func.__closure__ or ():
        parts.append(_describe_value(cell.cell_contents, seen))
    scope = func.__globals__
    for name in sorted(_global_names(func.__code__)):
        if name not in scope:
            continue  # a builtin, or an attribute name
        value = scope[name]
        if isinstance(value, types.ModuleType | type):
            parts.append(b"name:" + name.encode())
            continue
        try:
            parts.append(name.encode() + b"=" + _describe_value(value, seen))
        except Exception:  # an intrinsic or another object pickle cannot hold
            parts.append(b"name:" + name.encode())
    return b"\0".join(hashlib.sha256(p).digest() for p in parts)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


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
