"""Per-leaf codec choice: leaf roles, user rules and defaults.

Every leaf gets a *role* from its key path and dtype:

* ``rng`` - a typed PRNG key array; ``integer`` - integer, bool and complex leaves (step
  counters, token counts); these are always stored exactly;
* ``second_moment`` - Adam/AdamW ``nu`` (or ``v`` under an optimizer state);
  ``first_moment`` - Adam ``mu``, SGD momentum ``trace`` (or ``m`` under an optimizer
  state); ``optimizer`` - any other float leaf under an optimizer state;
* ``param`` - every other floating-point leaf.

Rules are ``(selector, codec)`` pairs tried in order; a selector is either ``"role:<name>"``
or a regular expression searched in the leaf's path string (``params/Dense_0/kernel``). The
first match wins; otherwise ``defaults[role]`` applies. Delta codecs (``needs_reference``)
fall back to :class:`~orbax_lossy.codecs.exact.Exact` on base saves.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.codecs.base import Codec
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.treepaths import StoredPath, path_str

ROLES = ("param", "first_moment", "second_moment", "optimizer", "integer", "rng")
_OPTIMIZER_KEYS = {"opt_state", "optimizer", "opt"}
_FIRST_MOMENT_KEYS = {"mu", "trace", "momentum", "m"}
_SECOND_MOMENT_KEYS = {"nu", "v"}


def leaf_role(path: StoredPath, dtype: np.dtype | jnp.dtype) -> str:
    """Role of a leaf from its key path and dtype (see module docstring)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "rng"
    if not jnp.issubdtype(dtype, jnp.floating):  # integers, bool, complex: stored exactly
        return "integer"
    keys = [str(k) for _, k in path]
    in_optimizer = any(k in _OPTIMIZER_KEYS for k in keys)
    if "nu" in keys or (in_optimizer and any(k in _SECOND_MOMENT_KEYS for k in keys)):
        return "second_moment"
    if any(k in ("mu", "trace", "momentum") for k in keys) or (
        in_optimizer and any(k in _FIRST_MOMENT_KEYS for k in keys)
    ):
        return "first_moment"
    if in_optimizer:
        return "optimizer"
    return "param"


class Policy(Protocol):
    """What the handler needs from a policy: one codec per device leaf, per save."""

    def plan(
        self,
        paths: Sequence[StoredPath],
        values: Sequence[jax.Array],
        references: Sequence[jax.Array | None],
        is_base: bool,
    ) -> list[Codec]: ...


DEFAULT_ROLE_CODECS: Mapping[str, Codec] = {
    "param": LC(bits=3),
    "first_moment": Exact(),
    "second_moment": Exact(),
    "optimizer": Exact(),
    "integer": Exact(),
    "rng": Exact(),
}


@dataclasses.dataclass(frozen=True)
class LeafPolicy:
    """Static per-leaf codec choice."""

    rules: tuple[tuple[str, Codec], ...] = ()
    defaults: tuple[tuple[str, Codec], ...] = tuple(DEFAULT_ROLE_CODECS.items())

    def __post_init__(self) -> None:
        for selector, codec in self.rules:
            if not isinstance(selector, str):
                raise InvalidArgumentError(f"rule selector must be a string, got {selector!r}")
            if selector.startswith("role:") and selector[5:] not in ROLES:
                raise InvalidArgumentError(f"unknown role in rule {selector!r}; roles: {ROLES}")
            if not selector.startswith("role:"):
                try:
                    re.compile(selector)
                except re.error as e:
                    raise InvalidArgumentError(f"bad rule pattern {selector!r}: {e}") from e
            if not hasattr(codec, "codec_id"):
                raise InvalidArgumentError(f"rule {selector!r}: {codec!r} is not a codec")

    @classmethod
    def create(
        cls,
        rules: Sequence[tuple[str, Codec]] = (),
        defaults: Mapping[str, Codec] | None = None,
    ) -> LeafPolicy:
        merged = dict(DEFAULT_ROLE_CODECS)
        merged.update(defaults or {})
        return cls(rules=tuple(rules), defaults=tuple(merged.items()))

    def plan(
        self,
        paths: Sequence[StoredPath],
        values: Sequence[jax.Array],
        references: Sequence[jax.Array | None],
        is_base: bool,
    ) -> list[Codec]:
        """Codec of every device leaf for one save (the interface the handler calls).

        ``references`` holds the previous reconstruction of each leaf (None on base saves).
        A policy must return the same plan on every process for the same inputs.
        """
        return [
            self.choose(path, path_str(path), value.dtype, is_base)
            for path, value in zip(paths, values, strict=True)
        ]

    def choose(self, path: StoredPath, path_string: str, dtype: np.dtype, is_base: bool) -> Codec:
        role = leaf_role(path, dtype)
        codec: Codec | None = None
        if role not in ("rng", "integer"):
            for selector, candidate in self.rules:
                if selector.startswith("role:"):
                    if selector[5:] == role:
                        codec = candidate
                        break
                elif re.search(selector, path_string):
                    codec = candidate
                    break
        if codec is None:
            codec = dict(self.defaults)[role]
        if role in ("rng", "integer") or (is_base and codec.needs_reference):
            return Exact()
        return codec
