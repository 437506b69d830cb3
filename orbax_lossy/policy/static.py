"""``LeafPolicy``: static per-leaf codec choice from user rules and per-role defaults.

Rules are ``(selector, codec)`` pairs tried in order; a selector is either ``"role:<name>"``
or a regular expression searched in the leaf's path string (``params/Dense_0/kernel``). The
first match wins; otherwise ``defaults[role]`` applies. ``nonfloat`` and ``rng`` leaves are
always exact. On base saves a delta codec (``needs_reference``) is replaced by
``base_defaults[role]`` (:class:`~orbax_lossy.codecs.exact.Exact` for roles without one);
a direct codec is used as it is. Roles: :mod:`orbax_lossy.policy.roles`.

The defaults (``DEFAULT_ROLE_CODECS``, ``DEFAULT_BASE_CODECS``) compress the whole training
state; ``LeafPolicy.params_only()`` and ``LeafPolicy.lossless()`` are one argument away.
Measurements behind them: ``docs/whole_state.md``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from orbax_lossy.codecs.base import Codec
from orbax_lossy.codecs.cluster import Cluster
from orbax_lossy.codecs.exact import Exact
from orbax_lossy.codecs.lc import LC
from orbax_lossy.codecs.step import Step
from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.policy.base import EXACT_ROLES, ROLES, check_role
from orbax_lossy.policy.roles import path_roles
from orbax_lossy.treepaths import StoredPath, path_str

#: Codec of every role on delta saves (and on base saves, for direct codecs). Parameters:
#: uniform quantization of the delta with a step of 2.5x its RMS, entropy coded (``Step``:
#: 1.6-2.5x fewer bits than the former ``Cluster(3, mode="delta")`` at the same or smaller
#: damage to the resumed run; ``Step(3.0)`` moved the held-out CNN by +3.3%). First moments:
#: ``Step(4.0, mode="direct")`` (``Zero()`` is free but moved short runs by +7.1-7.8%).
#: Measurements: docs/whole_state.md.
DEFAULT_ROLE_CODECS: Mapping[str, Codec] = {
    "param": Step(rel=2.5),
    "first_moment": Step(rel=4.0, mode="direct"),
    "second_moment": LC(bits=2, domain="log"),
    "optimizer": Exact(),
    "state": Exact(),
    "nonfloat": Exact(),
    "rng": Exact(),
}

#: Codec of a role on base saves where its delta codec cannot be used (else Exact).
#: Parameters: k-means with 255 centroids (relative L2 error ~7e-3 on Gaussian weights); the
#: closed-loop deltas that follow code against the base's reconstruction, correcting its
#: error. Bases 2-2.5x smaller; run-average ratio 16.1 -> 24.9x (digits MLP), 13.2 -> 17.6x
#: (transformer), 12.4 -> 15.7x (held-out CNN) at the same per-delta ratio and the same final
#: loss after failure + restore (+0.59% vs +0.64%, -0.16% vs -0.16%, +0.61% vs +0.67%).
#: Second moments: clustered in log. Measurements: docs/whole_state.md.
DEFAULT_BASE_CODECS: Mapping[str, Codec] = {
    "param": Cluster(bits=8),
    "second_moment": Cluster(bits=4, domain="log"),
}

#: The previous defaults: float parameters LC(3), everything else exact.
PARAMS_ONLY_CODECS: Mapping[str, Codec] = {
    **{role: Exact() for role in ROLES},
    "param": LC(bits=3),
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

    rules: tuple[tuple[str, Codec], ...] = ()
    defaults: tuple[tuple[str, Codec], ...] = tuple(DEFAULT_ROLE_CODECS.items())
    base_defaults: tuple[tuple[str, Codec], ...] = tuple(DEFAULT_BASE_CODECS.items())

    def __post_init__(self) -> None:
        rules = tuple((_selector(selector), codec) for selector, codec in self.rules)
        for selector, codec in rules:
            if not hasattr(codec, "codec_id"):
                raise InvalidArgumentError(f"rule {selector!r}: {codec!r} is not a codec")
        defaults = tuple((check_role(role, "defaults"), codec) for role, codec in self.defaults)
        base = tuple((check_role(role, "base_defaults"), codec)
                     for role, codec in self.base_defaults)
        for role, codec in (*defaults, *base):
            if not hasattr(codec, "codec_id"):
                raise InvalidArgumentError(f"default of {role!r}: {codec!r} is not a codec")
        for role, codec in base:
            if codec.needs_reference:
                raise InvalidArgumentError(
                    f"base default of {role!r}: {codec!r} needs a reference (bases have none)")
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "defaults", defaults)
        object.__setattr__(self, "base_defaults", base)

    @classmethod
    def create(
        cls,
        rules: Sequence[tuple[str, Codec]] = (),
        defaults: Mapping[str, Codec] | None = None,
        base_defaults: Mapping[str, Codec] | None = None,
    ) -> LeafPolicy:
        """Rules tried in order, then ``DEFAULT_ROLE_CODECS`` updated with ``defaults``; on
        base saves ``DEFAULT_BASE_CODECS`` updated with ``base_defaults``."""
        merged = dict(DEFAULT_ROLE_CODECS)
        merged.update({check_role(r, "defaults"): c for r, c in (defaults or {}).items()})
        base = dict(DEFAULT_BASE_CODECS)
        base.update({check_role(r, "base_defaults"): c for r, c in (base_defaults or {}).items()})
        return cls(rules=tuple(rules), defaults=tuple(merged.items()),
                   base_defaults=tuple(base.items()))

    @classmethod
    def params_only(cls, rules: Sequence[tuple[str, Codec]] = ()) -> LeafPolicy:
        """Float parameters through ``LC(3)`` on deltas, everything else exact, bases included
        (the defaults before 0.2: optimizer moments cost as much as in plain Orbax)."""
        return cls(rules=tuple(rules), defaults=tuple(PARAMS_ONLY_CODECS.items()),
                   base_defaults=())

    @classmethod
    def lossless(cls) -> LeafPolicy:
        """Every leaf exact: delta chains and entropy coding only, no error anywhere."""
        return cls(defaults=tuple((role, Exact()) for role in ROLES), base_defaults=())

    def plan(self, paths: Sequence[StoredPath], values: Sequence[jax.Array],
             references: Sequence[jax.Array | None], is_base: bool,
             roles: Sequence[str] | None = None) -> list[Codec]:
        """:meth:`choose` for every leaf (:meth:`~orbax_lossy.policy.Policy.plan`); roles
        from ``roles`` or else from the paths (:func:`~orbax_lossy.policy.roles.path_roles`)."""
        if roles is None:
            roles = path_roles(paths, [value.dtype for value in values])
        return [
            self.choose(path, path_str(path), value.dtype, is_base, role)
            for path, value, role in zip(paths, values, roles, strict=True)
        ]

    def choose(self, path: StoredPath, path_string: str, dtype: np.dtype, is_base: bool,
               role: str | None = None) -> Codec:
        """The first matching rule's codec, else the role's default; Exact for ``nonfloat``
        and ``rng`` leaves; on a base save ``base_defaults[role]`` (or Exact) instead of a
        delta codec. ``role``: default from the path alone (no ``state`` role)."""
        if role is None:
            role = path_roles([path], [dtype])[0]
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
            codec = dict(self.defaults).get(role, Exact())
        if is_base and codec.needs_reference:
            return dict(self.base_defaults).get(role, Exact())
        return codec
