"""Which leaves hold experts, along which axis, and which MoE layer (group) they belong to.

A rule is ``(path regex, expert axis)``, ``(path regex, expert axis, layer axis)`` for scanned
layers stored as one ``[E, L, ...]`` leaf, or ``(path regex, "path")`` for models with one
subtree per expert, where the regex's first capture group is the expert id
(``r"moe/expert_(\\d+)/"``). Regexes are searched in the leaf's path string, with and without
a trailing NNX ``/value``; the first matching rule wins.

Every expert leaf belongs to a *group* (one MoE layer): by default its path with the leading
state/optimizer containers and its own name removed, so ``params/blocks/0/moe/w_in`` and
``opt_state/1/0/mu/blocks/0/moe/w_in`` are both in ``blocks/0/moe``. All leaves of a group
hold the same experts in every save, so an expert's weights and its optimizer moments always
come from the same step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.treepaths import StoredPath, path_str

_NNX_TAILS = ("value", "raw_value")
_STATE_KEYS = {"params", "param", "model", "state", "variables", "target", "models"}
_OPTIMIZER_KEYS = {"opt_state", "optimizer", "opt", "opt_states"}
_MOMENT_KEYS = {"mu", "nu", "trace", "momentum", "m", "v", "ema", "acc"}
META_KEY = "__pec__"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One parsed rule (see the module docstring)."""

    pattern: str
    expert_axis: int | None  # None: one subtree per expert (``"path"``)
    layer_axis: int | None = None

    @property
    def by_path(self) -> bool:
        """The expert id is in the path (one subtree per expert)."""
        return self.expert_axis is None


def parse_rules(rules: Sequence[Any]) -> tuple[Rule, ...]:
    """Validate user rules; raises :class:`InvalidArgumentError` naming the bad rule."""
    out = []
    for rule in rules:
        if isinstance(rule, Rule):
            out.append(rule)
            continue
        if not isinstance(rule, (tuple, list)) or len(rule) not in (2, 3):
            raise InvalidArgumentError(
                f"expert rule {rule!r} must be (regex, axis), (regex, axis, layer_axis) or "
                "(regex, 'path')")
        pattern, axis = rule[0], rule[1]
        layer = rule[2] if len(rule) == 3 else None
        try:
            compiled = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise InvalidArgumentError(f"expert rule {rule!r}: bad regex: {e}") from e
        if axis == "path":
            if compiled.groups < 1:
                raise InvalidArgumentError(
                    f"expert rule {rule!r}: a 'path' rule needs a capture group for the expert id")
            if layer is not None:
                raise InvalidArgumentError(f"expert rule {rule!r}: 'path' rules have no layer axis")
            out.append(Rule(pattern, None, None))
            continue
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise InvalidArgumentError(f"expert rule {rule!r}: axis must be an int or 'path'")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise InvalidArgumentError(f"expert rule {rule!r}: layer axis must be an int")
        out.append(Rule(pattern, axis, layer))
    return tuple(out)


def strip_nnx(name: str) -> str:
    """``model/blocks/0/moe/w_in/value`` -> ``model/blocks/0/moe/w_in``."""
    parts = name.split("/")
    while len(parts) > 1 and parts[-1] in _NNX_TAILS:
        parts.pop()
    return "/".join(parts)


def model_path(name: str) -> str:
    """A path with its state/optimizer containers removed (``opt_state/1/0/mu/x`` -> ``x``)."""
    parts = name.split("/")
    if any(p in _OPTIMIZER_KEYS for p in parts):
        start = next(i for i, p in enumerate(parts) if p in _OPTIMIZER_KEYS)
        for i in range(start + 1, len(parts)):
            if parts[i] in _MOMENT_KEYS:
                return "/".join(parts[i + 1:])
        # An optimizer leaf with no moment key: drop the container and numeric indices.
        rest = parts[start + 1:]
        while rest and (rest[0].isdigit() or rest[0] in _STATE_KEYS):
            rest = rest[1:]
        return "/".join(rest)
    while len(parts) > 1 and parts[0] in _STATE_KEYS:
        parts = parts[1:]
    return "/".join(parts)


def default_group(name: str) -> str:
    """The default group of an expert leaf path string (see the module docstring)."""
    stripped = strip_nnx(name)
    directory = stripped.rsplit("/", 1)[0] if "/" in stripped else ""
    return model_path(directory) if directory else stripped


@dataclasses.dataclass
class Unit:
    """One stored form of expert state in a group.

    ``stacked``: one leaf (index ``leaf``) whose ``expert_axis`` indexes experts (and
    ``layer_axis`` layers). ``subtree``: one leaf per expert (``members[e]``); ``member`` is
    the path with the expert id replaced by ``{e}``.
    """

    kind: str
    group: str
    leaf: int = -1
    expert_axis: int = 0
    layer_axis: int | None = None
    member: str = ""
    members: dict[int, int] = dataclasses.field(default_factory=dict)
    slot_path: StoredPath = ()  # subtree: where the held experts are stored, stacked

    def describe(self, paths: Sequence[StoredPath]) -> dict[str, Any]:
        """JSON form stored in the manifest's PEC record."""
        if self.kind == "stacked":
            return {"kind": "stacked", "path": path_str(paths[self.leaf]),
                    "expert_axis": self.expert_axis, "layer_axis": self.layer_axis}
        return {"kind": "subtree", "member": self.member}


@dataclasses.dataclass
class Group:
    """One MoE layer (or a scanned stack of ``layers`` MoE layers) with ``n`` experts."""

    name: str
    n: int
    layers: int
    units: list[Unit]


@dataclasses.dataclass
class Layout:
    """Expert groups of a flattened tree; ``expert_leaves`` are the leaves PEC stores itself."""

    groups: dict[str, Group]
    expert_leaves: set[int]

    def signature(self) -> tuple:
        """What must stay equal between saves for per-expert references to be reused."""
        return tuple((g.name, g.n, g.layers, tuple((u.kind, u.leaf, u.expert_axis, u.layer_axis,
                                                      u.member, tuple(sorted(u.members.items())))
                                                     for u in g.units))
                     for g in self.groups.values())


def _norm_axis(axis: int, ndim: int, where: str) -> int:
    if not -ndim <= axis < ndim:
        raise InvalidArgumentError(f"{where}: axis {axis} is out of range for a {ndim}-d leaf")
    return axis % ndim


def plan_layout(
    paths: Sequence[StoredPath],
    shapes: Sequence[tuple[int, ...] | None],
    rules: Sequence[Rule],
    group_fn: Callable[[str], str] | None = None,
    *,
    require_match: bool = True,
) -> Layout:
    """Find expert leaves and their groups; errors name the leaf or group."""
    group_fn = group_fn or default_group
    compiled = [(r, re.compile(r.pattern)) for r in rules]
    used = [False] * len(rules)
    groups: dict[str, Group] = {}
    subtree_ids: dict[str, dict[str, dict[Any, int]]] = {}  # group -> member -> id -> leaf
    expert_leaves: set[int] = set()
    slot_paths: dict[str, StoredPath] = {}
    for i, (path, shape) in enumerate(zip(paths, shapes, strict=True)):
        name = path_str(path)
        if path and path[0][1] == META_KEY:
            continue
        candidates = (name, strip_nnx(name))
        for k, (rule, rx) in enumerate(compiled):
            m = next((m for m in (rx.search(c) for c in candidates) if m), None)
            if m is None:
                continue
            used[k] = True
            if shape is None:
                raise InvalidArgumentError(
                    f"expert leaf {name!r} (rule {rule.pattern!r}) is not an array")
            if rule.by_path:
                eid = m.group(1)
                text = m.string
                head = text[:m.start(1)]
                member = head + "{e}" + text[m.end(1):]
                if group_fn is default_group:  # the path up to the expert's own segment
                    gname = default_group((head.rsplit("/", 1)[0] if "/" in head else "") + "/x")
                else:
                    gname = group_fn(name)
                subtree_ids.setdefault(gname, {}).setdefault(member, {})[eid] = i
                slot_paths.setdefault(member, _slot_path(path, m.start(1), m.end(1)))
            else:
                ndim = len(shape)
                where = f"expert leaf {name!r} (rule {rule.pattern!r})"
                assert rule.expert_axis is not None
                axis = _norm_axis(rule.expert_axis, ndim, where)
                layer = None
                if rule.layer_axis is not None:
                    layer = _norm_axis(rule.layer_axis, ndim, where)
                    if layer == axis:
                        raise InvalidArgumentError(f"{where}: layer axis equals expert axis")
                gname = group_fn(name)
                n = int(shape[axis])
                layers = 1 if layer is None else int(shape[layer])
                g = groups.get(gname)
                if g is None:
                    g = groups[gname] = Group(gname, n, layers, [])
                elif (g.n, g.layers) != (n, layers):
                    raise InvalidArgumentError(
                        f"expert group {gname!r}: leaf {name!r} has {n} experts x {layers} "
                        f"layers, other leaves of the group {g.n} x {g.layers}")
                g.units.append(Unit("stacked", gname, leaf=i, expert_axis=axis,
                                    layer_axis=layer))
            expert_leaves.add(i)
            break
    if group_fn is default_group:
        _merge_suffix_groups(groups, subtree_ids)
    for gname, members in subtree_ids.items():
        ids = sorted({e for per in members.values() for e in per},
                     key=lambda s: (len(s), s) if s.isdigit() else (1 << 30, s))
        index = {e: j for j, e in enumerate(ids)}
        if gname in groups and (groups[gname].n, groups[gname].layers) != (len(ids), 1):
            raise InvalidArgumentError(
                f"expert group {gname!r} mixes stacked leaves and {len(ids)} expert subtrees")
        g = groups.setdefault(gname, Group(gname, len(ids), 1, []))
        for member, per in sorted(members.items()):
            missing = [e for e in ids if e not in per]
            if missing:
                raise InvalidArgumentError(
                    f"expert group {gname!r}: {member.replace('{e}', missing[0])!r} is missing "
                    "(every expert subtree must have the same leaves)")
            shapes_of = {tuple(shapes[leaf] or ()) for leaf in per.values()}
            if len(shapes_of) != 1:
                raise InvalidArgumentError(
                    f"expert group {gname!r}: {member!r} has different shapes per expert "
                    f"{sorted(shapes_of)}")
            g.units.append(Unit("subtree", gname, member=member,
                                members={index[e]: leaf for e, leaf in per.items()},
                                slot_path=slot_paths[member]))
    if require_match:
        for rule, ok in zip(rules, used, strict=True):
            if not ok:
                raise InvalidArgumentError(f"expert rule {rule.pattern!r} matches no leaf")
    for g in groups.values():
        if g.n < 1:
            raise InvalidArgumentError(f"expert group {g.name!r} has no experts")
    return Layout(groups, expert_leaves)


def _slot_path(path: StoredPath, start: int, end: int) -> StoredPath:
    """``path`` with the expert id (characters ``start:end`` of its string) replaced by ``*``."""
    out, offset = [], 0
    for kind, key in path:
        text = str(key)
        lo, hi = offset, offset + len(text)
        if lo <= start and end <= hi:
            out.append(("d", text[:start - lo] + "*" + text[end - lo:]))
        else:
            out.append((kind, key))
        offset = hi + 1
    return tuple(out)


def _merge_suffix_groups(groups: dict[str, Group], subtree_ids: dict[str, Any]) -> None:
    """Merge group ``0/blocks/0/moe`` into ``blocks/0/moe`` (a tuple or extra container in
    front of the parameters but not of the optimizer's copy of the model path)."""
    # sorted by (length, name): every process merges in the same order
    names = sorted(set(groups) | set(subtree_ids), key=lambda s: (len(s), s))
    containers = _STATE_KEYS | _OPTIMIZER_KEYS | _MOMENT_KEYS
    for long in sorted(names, key=lambda s: (len(s), s), reverse=True):
        # only a container prefix (``0/``, ``model/``), never another layer (``layers/3/``)
        short = next((s for s in names if s != long and long.endswith("/" + s) and all(
            p.isdigit() or p in containers for p in long[:-len(s) - 1].split("/"))), None)
        if short is None:
            continue
        if long in groups:
            g = groups.pop(long)
            target = groups.get(short)
            if target is None:
                groups[short] = Group(short, g.n, g.layers, [])
                target = groups[short]
            if (target.n, target.layers) != (g.n, g.layers):
                raise InvalidArgumentError(
                    f"expert group {short!r}: leaves under {long!r} have {g.n} experts x "
                    f"{g.layers} layers, the others {target.n} x {target.layers}")
            for u in g.units:
                u.group = short
            target.units.extend(g.units)
        if long in subtree_ids:
            merged = subtree_ids.setdefault(short, {})
            for member, per in subtree_ids.pop(long).items():
                merged.setdefault(member, {}).update(per)


# ---------------------------------------------------------------------------- rule proposals

def _regex_for(name: str) -> str:
    return "^" + re.escape(strip_nnx(name)) + "$"


def rules_from_shardings(
    tree: Any, mesh_axes: Sequence[str] = ("expert", "experts", "exp", "ep"),
) -> list[tuple[str, int]]:
    """Propose ``(regex, axis)`` rules: leaves with a dim sharded over an expert mesh axis.

    Looks at each ``jax.Array``'s (or ``ShapeDtypeStruct``'s) ``NamedSharding`` spec. A leaf
    whose expert axis is not sharded (MaxText's ``fsdp_shard_on_exp``, an unsharded run) is
    not found: write that rule by hand.
    """
    import jax

    from orbax_lossy.treepaths import flatten

    out = []
    paths, leaves, _ = flatten(tree)
    for path, leaf in zip(paths, leaves, strict=True):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            continue
        for dim, entry in enumerate(sharding.spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            if any(n in mesh_axes for n in names if n is not None):
                out.append((_regex_for(path_str(path)), dim))
                break
    return out


def rules_from_nnx(
    state: Any, logical: Sequence[str] = ("expert", "experts", "exp"),
) -> list[tuple[str, int]]:
    """Propose rules from NNX variable metadata (``out_sharding`` / ``sharding_names``).

    ``state`` is ``nnx.state(model)`` (or a model). A variable annotated with logical axes
    ``("exp", None, "mlp")`` (``nnx.with_partitioning``, MaxText's ``"exp"``) gives
    ``(regex, 0)``.
    """
    from flax import nnx

    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    out = []
    flat = nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()
    for key, var in flat:
        names = None
        meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
        for attr in ("out_sharding", "sharding_names", "sharding"):
            names = meta.get(attr) if isinstance(meta, dict) else None
            if names is None and not isinstance(meta, dict):
                try:
                    names = getattr(var, attr, None)
                except Exception:  # noqa: BLE001 - metadata access differs between versions
                    names = None
            if names:
                break
        if not names or not isinstance(names, (tuple, list)):
            continue
        for dim, n in enumerate(names):
            if n in logical:
                name = "/".join(str(k) for k in key)
                out.append((_regex_for(name) .replace("$", r"(/value)?$"), dim))
                break
    return out


def held_fraction(layout: Layout, k: int) -> float:
    """Fraction of each group's experts a partial save holds (for docs and benchmarks)."""
    if not layout.groups:
        return 1.0
    return float(np.mean([min(k, g.n) / g.n for g in layout.groups.values()]))
