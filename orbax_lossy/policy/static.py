"""``LeafPolicy``: static per-leaf codec choice from user rules and per-role defaults.

Rules are ``(selector, codec)`` pairs tried in order; a selector is either ``"role:<name>"``
or a regular expression searched in the leaf's path string (``params/Dense_0/kernel``). The
first match wins; otherwise ``defaults[role]`` applies. ``nonfloat`` and ``rng`` leaves are
always exact, and delta codecs (``needs_reference``) fall back to
:class:`~orbax_lossy.codecs.exact.Exact` on base saves.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import ClassVar

import jax
import numpy as np

from orbax_lossy.codecs.base import Codec
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.policy.base import EXACT_ROLES, check_role, leaf_role
from orbax_lossy.treepaths import StoredPath, path_str

DEFAULT_ROLE_CODECS: Mapping[str, Codec] = {
    "param": LC(bits=3),
    "first_moment": Exact(),
    "second_moment": Exact(),
    "optimizer": Exact(),
    "nonfloat": Exact(),
    "rng": Exact(),
}


def _selector(selector: str) -> str:
    """Validate a rule selector; an old role name is rewritten to the new one."""
    if not isinstance(selector, str):
        raise InvalidArgumentError(f"rule selector must be a string, got {selector!r}")
    if selector.startswith("role:"):
        return "role:" + check_role(selector[5:], f"rule {selector!r}")
    try:
        re.compile(selector)
    except re.error as e:
        raise InvalidArgumentError(f"bad rule pattern {selector!r}: {e}") from e
    return selector


@dataclasses.dataclass(frozen=True)
class LeafPolicy:
    """Static per-leaf codec choice (see the module docstring)."""

    #: the same plan for the same tree on every save
    plan_varies: ClassVar[bool] = False

    rules: tuple[tuple[str, Codec], ...] = ()
    defaults: tuple[tuple[str, Codec], ...] = tuple(DEFAULT_ROLE_CODECS.items())

    def __post_init__(self) -> None:
        rules = tuple((_selector(selector), codec) for selector, codec in self.rules)
        for selector, codec in rules:
            if not hasattr(codec, "codec_id"):
                raise InvalidArgumentError(f"rule {selector!r}: {codec!r} is not a codec")
        defaults = tuple((check_role(role, "defaults"), codec) for role, codec in self.defaults)
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "defaults", defaults)

    @classmethod
    def create(
        cls,
        rules: Sequence[tuple[str, Codec]] = (),
        defaults: Mapping[str, Codec] | None = None,
    ) -> LeafPolicy:
        """Rules tried in order, then ``DEFAULT_ROLE_CODECS`` updated with ``defaults``."""
        merged = dict(DEFAULT_ROLE_CODECS)
        merged.update({check_role(r, "defaults"): c for r, c in (defaults or {}).items()})
        return cls(rules=tuple(rules), defaults=tuple(merged.items()))

    def plan(self, paths: Sequence[StoredPath], values: Sequence[jax.Array],
             references: Sequence[jax.Array | None], is_base: bool) -> list[Codec]:
        """:meth:`choose` for every leaf (:meth:`~orbax_lossy.policy.Policy.plan`)."""
        return [
            self.choose(path, path_str(path), value.dtype, is_base)
            for path, value in zip(paths, values, strict=True)
        ]

    def choose(self, path: StoredPath, path_string: str, dtype: np.dtype, is_base: bool) -> Codec:
        """The first matching rule's codec, else the role's default; Exact for ``nonfloat``
        and ``rng`` leaves, and instead of a delta codec on a base save."""
        role = leaf_role(path, dtype)
        if role in EXACT_ROLES:
            return Exact()
        codec: Codec | None = None
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
        if is_base and codec.needs_reference:
            return Exact()
        return codec
