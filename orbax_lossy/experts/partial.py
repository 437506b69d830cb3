"""``PartialExperts``: store all non-expert state and only K experts of every MoE layer.

The handler calls three hooks (see ``orbax_lossy/handler.py``):

* :meth:`PartialExperts.prepare_save` (training thread, before validation): selects the held
  experts, cuts them out of every expert leaf on device (a ``[.., K @ axis, ..]`` *slot* leaf
  under the leaf's own path; for one-subtree-per-expert models the held experts' leaves
  stacked under the path with the expert id replaced by ``*``), adds the PEC record (a small
  ``uint8`` JSON leaf ``__pec__/meta``) and returns a
  :class:`PreparedSave` whose ``args`` the handler saves instead, with the steps holding the
  unheld experts as ``extra_dependencies``;
* :meth:`PreparedSave.reference` (when the handler chooses the reference): the held slots'
  reference is each held expert's *own* last reconstruction (the per-expert mosaic), so a delta
  codec codes expert ``e`` against ``e``, never against whatever the slot held before;
* :meth:`PreparedSave.publish` (once the save's reconstruction exists): the held experts'
  reconstructions go into the mosaic (the closed loop: mosaic == what a restore returns).

:meth:`PartialExperts.restore` (defined in :mod:`orbax_lossy.experts.restore`) restores a step:
non-expert leaves through the normal engine, every expert from its newest holder, then adopts
the result as the next reference. The PEC record and the per-item state shared by both sides
are in :mod:`orbax_lossy.experts.record`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.errors import InvalidArgumentError
from orbax_lossy.experts import accounting, selection
from orbax_lossy.experts import device_ops as ops
from orbax_lossy.experts.record import VERSION, _assemble, _ItemState, _unit_key
from orbax_lossy.experts.restore import _RestoreSide
from orbax_lossy.experts.rules import META_KEY, Layout, Rule, parse_rules, plan_layout
from orbax_lossy.format.steps import step_of
from orbax_lossy.treepaths import StoredPath, flatten, path_str

SELECTIONS = ("sequential", "load_aware")


@dataclasses.dataclass
class PreparedSave:
    """What :meth:`PartialExperts.prepare_save` hands the handler for one save."""

    args: Any  # the LossySave to save instead (expert leaves replaced by held slots)
    extra_dependencies: tuple[int, ...]
    owner: PartialExperts
    item: str
    step: int | None
    full: bool
    held: dict[str, np.ndarray]  # group -> int [layers, K]
    slots: dict[str, tuple[str, int, int | None]]  # slot leaf name -> (unit key, axis, layer)
    ref_values: dict[str, Any]  # leaf name -> per-expert reference value (None: no mosaic)
    shardings: dict[str, Any]  # slot leaf name -> the full expert leaf's sharding (or None)
    state: _ItemState | None  # None: K = N, a normal save
    meta: dict[str, Any]
    # flat slot leaf name -> (its cut, the unit keys of its members)
    cuts: dict[str, tuple[ops.FlatCut, tuple[str, ...]]] = dataclasses.field(
        default_factory=dict)

    def reference(self, held: Any, paths: Sequence[StoredPath], signature: Sequence[Any]) -> Any:
        """The handler's reference with the slots' values replaced by per-expert references.

        ``held`` is the reference the handler holds for this item (None: a base), ``paths``
        and ``signature`` those of the tree being saved.
        """
        if held is None or self.state is None:
            return held
        index = {path_str(p): j for j, p in enumerate(held.paths)}
        values, sig = [], []
        for p, s in zip(paths, signature, strict=True):
            name = path_str(p)
            if name in self.ref_values:
                if self.ref_values[name] is None:
                    return None  # an expert without a reconstruction: a base
                values.append(self.ref_values[name])
                sig.append(s)
            elif name in index:
                values.append(held.values[index[name]])
                sig.append(held.signature[index[name]])
            else:
                return held  # the tree changed: let the handler decide (a base)
        return dataclasses.replace(held, paths=tuple(paths), signature=tuple(sig),
                                   values=values)

    def unit_axes(self, paths: Sequence[StoredPath]) -> dict[int, tuple[int, ...]]:
        """Per saved leaf index, the axes its pieces are cut along per index: a slot's expert
        (and layer) axis, so that every stored piece belongs to one expert of one layer."""
        out: dict[int, tuple[int, ...]] = {}
        for i, p in enumerate(paths):
            name = path_str(p)
            slot = self.slots.get(name)
            if name in self.cuts:
                out[i] = (0,)  # a flat slot: one (member, layer, expert) slice per row
            elif slot is not None:
                _, axis, layer = slot
                out[i] = (axis,) if layer is None else (axis, layer)
        return out

    def publish(self, reference: Any) -> None:
        """Fold this save's reconstruction of the held experts into the mosaic."""
        if self.state is not None:
            self.owner._publish(self, reference)


class PartialExperts(_RestoreSide):
    """Partial Experts Checkpoint (MoC-System, arXiv 2408.04307) for MoE training.

    Args:
      k: experts saved per MoE layer per save (1..N; K >= N saves every expert).
      rules: ``(path regex, expert axis)``, ``(path regex, expert axis, layer axis)`` for
        scanned ``[E, L, ...]`` leaves, or ``(path regex, "path")`` with the expert id as the
        regex's first group for one subtree per expert (see :mod:`orbax_lossy.experts.rules`).
      group: ``callable(path string) -> group name`` overriding the default grouping.
      selection: ``"sequential"`` (interleaved round-robin, the paper's default) or
        ``"load_aware"`` (top-K by unsaved tokens; needs ``expert_tokens``).
      max_staleness: load-aware only: an expert not held for this many saves is held next.
      dynamic_k: double K after a restore whose PLT exceeds ``plt_threshold``.
      plt_threshold: the Dynamic-K threshold (default 3.75%, the paper's).
      total_assignments: the run's total expert assignments per MoE layer (``T_i * TopK_i``;
        an int for every layer, or ``{group: int or [L]}``): the paper's PLT denominator.
        Without it PLT is relative to the assignments seen so far (labelled so).
      full_every: hold every expert every ``full_every`` saves (None: only the first save of a
        run without a restore, and ``LossySave(force_base=True)``).
    """

    def __init__(
        self,
        k: int,
        rules: Sequence[Any],
        *,
        group: Callable[[str], str] | None = None,
        selection: str = "sequential",
        max_staleness: int | None = None,
        dynamic_k: bool = True,
        plt_threshold: float = 0.0375,
        total_assignments: Any = None,
        full_every: int | None = None,
    ) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidArgumentError(f"PartialExperts k must be an int >= 1, got {k!r}")
        if selection not in SELECTIONS:
            raise InvalidArgumentError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 1):
            raise InvalidArgumentError(f"max_staleness must be an int >= 1, got {max_staleness!r}")
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise InvalidArgumentError(f"full_every must be an int >= 1, got {full_every!r}")
        if not rules:
            raise InvalidArgumentError("PartialExperts needs at least one expert rule")
        self.k = k
        self.rules: tuple[Rule, ...] = parse_rules(rules)
        self.group = group
        self.selection = selection
        self.max_staleness = max_staleness
        self.dynamic_k = bool(dynamic_k)
        self.plt_threshold = float(plt_threshold)
        self.total_assignments = total_assignments
        self.full_every = full_every
        self._items: dict[str, _ItemState] = {}
        self._lock = threading.Lock()
        self.last_restore_report: dict[str, Any] | None = None

    def __repr__(self) -> str:
        rules = [(r.pattern, r.expert_axis) for r in self.rules]
        return (f"PartialExperts(k={self.k}, rules={rules}"
                f", selection={self.selection!r})")

    # ------------------------------------------------------------------ public state

    def k_for(self, item: str = "default") -> int:
        """The K the next save of ``item`` uses (Dynamic-K may have raised it)."""
        st = self._items.get(item)
        return self.k if st is None else st.k

    def layout(self, tree: Any) -> Layout:
        """The expert groups of ``tree`` (errors name a leaf, group or rule)."""
        paths, leaves, _ = flatten(tree)
        return plan_layout(paths, [getattr(x, "shape", None) for x in leaves], self.rules,
                           self.group)

    # ------------------------------------------------------------------ save

    def prepare_save(self, item_dir: str, args: Any) -> PreparedSave:
        """Select the held experts and build the tree to save (see the module docstring)."""
        item = os.path.basename(item_dir)
        step = step_of(item_dir)
        if step is None:
            raise InvalidArgumentError(
                f"partial experts save into step directories (<root>/<step>/<item>); "
                f"{item_dir} has no step number")
        paths, leaves, _ = flatten(args.item)
        wrapped = _needs_wrap(paths)
        prefix = "state/" if wrapped else ""
        layout = plan_layout(paths, [getattr(x, "shape", None) for x in leaves], self.rules,
                             self.group)
        tokens = getattr(args, "expert_tokens", None)
        if tokens is not None:
            tokens = accounting.validate_tokens(tokens)
            unknown = sorted(set(tokens) - set(layout.groups))
            if unknown:
                raise InvalidArgumentError(
                    f"expert_tokens names unknown group(s) {unknown}; groups: "
                    f"{sorted(layout.groups)}")
        if self.selection == "load_aware" and tokens is None:
            raise InvalidArgumentError("selection='load_aware' needs LossySave(expert_tokens=...)")
        if self.k >= max(g.n for g in layout.groups.values()):
            # K = N: exactly a normal save (same leaves, bytes and chain; no PEC record).
            return PreparedSave(args, (), self, item, step, True, {}, {}, {}, {}, None, {})
        with self._lock:
            old = self._items.get(item)
        if old is not None:
            self._materialize(old)
        sig = layout.signature()
        if old is None or old.layout_sig != sig:
            st = _ItemState(sig, self.k, 0, {
                g.name: accounting.GroupCounts.empty(g.layers, g.n)
                for g in layout.groups.values()}, {}, [[int(step or 0), self.k]], [])
        else:
            st = old.copy()
        have_mosaic = all(
            _unit_key(g.name, u) in st.mosaic
            for g in layout.groups.values() for u in range(len(g.units)))
        full = (not have_mosaic or bool(args.force_base)
                or (self.full_every is not None and st.saves % self.full_every == 0))
        # 1. Tokens, then selection per (group, layer) row.
        held: dict[str, np.ndarray] = {}
        position = 0
        striped: dict[tuple[int, int, int, str], list[Any]] = {}  # load-aware, K < P
        for g in layout.groups.values():
            c = st.counts[g.name]
            accounting.add_tokens(c, None if tokens is None else tokens.get(g.name), g.name)
            k = min(st.k, g.n)
            shards = _group_shards(g, leaves, k)
            stripes = 1 if shards > 1 else _group_stripes(g, leaves, k)
            if not full and k < g.n and self.selection == "load_aware" and stripes > 1:
                # a scanned group balances its own layers (one flat slot); single-layer groups
                # with the same N balance together (their leaves are bundled)
                striped.setdefault((g.n, k, stripes, g.name if g.layers > 1 else ""),
                                   []).append(g)
            rows = []
            for layer in range(g.layers):
                if full or k >= g.n:
                    rows.append(list(range(g.n)))
                elif self.selection == "sequential":
                    rows.append(selection.sequential(g.n, k, st.cursor, position, shards,
                                                     stripes))
                else:
                    rows.append(selection.load_aware(g.n, k, c.unsaved[layer], c.age[layer],
                                                     self.max_staleness, shards))
                position += 1
            held[g.name] = np.asarray(rows, np.int64)
        for (n, k, stripes, _), groups in striped.items():
            # K < P: balance the shards over the rows of all these groups (else: per row)
            counts = [st.counts[g.name] for g in groups]
            joint = selection.load_aware_balanced(
                n, k, [row for c in counts for row in c.unsaved],
                [row for c in counts for row in c.age], self.max_staleness, stripes)
            if joint is not None:
                offset = 0
                for g in groups:
                    held[g.name] = np.asarray(joint[offset:offset + g.layers], np.int64)
                    offset += g.layers
        if jax.process_count() > 1:  # every process follows the primary's selection
            from jax.experimental import multihost_utils

            held = {g: np.asarray(multihost_utils.broadcast_one_to_all(h)) for g, h in
                    held.items()}
        # 2. Dependencies and the new counts.
        extra: set[int] = set()
        ref_steps: dict[str, list[list[int]]] = {}
        for g in layout.groups.values():
            c = st.counts[g.name]
            h = held[g.name]
            ref_steps[g.name] = [[int(c.holder[layer, e]) for e in h[layer]]
                                 for layer in range(g.layers)]
            extra.update(int(s) for s in c.holder.ravel() if s >= 0)
            for layer in range(g.layers):
                c.age[layer] += 1
                c.age[layer, h[layer]] = 0
                c.unsaved[layer, h[layer]] = 0
                c.holder[layer, h[layer]] = step
        extra.discard(step)
        # 3. The tree to save: held slots in place of expert leaves.
        new_paths: list[StoredPath] = []
        new_leaves: list[Any] = []
        slots: dict[str, tuple[str, int, int | None]] = {}
        ref_values: dict[str, Any] = {}
        replaced: dict[int, Any] = {}
        dropped: set[int] = set()
        extra_leaves: list[tuple[int, StoredPath, Any]] = []
        full_shardings: dict[str, Any] = {}
        cuts: dict[str, tuple[ops.FlatCut, tuple[str, ...]]] = {}
        flat_candidates: list[_FlatMember] = []
        units_meta: dict[str, list[dict[str, Any]]] = {}
        for g in layout.groups.values():
            h = held[g.name]
            units_meta[g.name] = []
            for u, unit in enumerate(g.units):
                key = _unit_key(g.name, u)
                if unit.kind == "stacked":
                    x = leaves[unit.leaf]
                    if not isinstance(x, jax.Array):
                        x = jnp.asarray(x)
                    name = prefix + path_str(paths[unit.leaf])
                    e_axis, l_axis = unit.expert_axis, unit.layer_axis
                    described = {**unit.describe(paths), "path": name}
                    units_meta[g.name].append(described)
                    full_shardings[name] = getattr(x, "sharding", None)
                    if ops.local_plan(x, h, e_axis, l_axis) is None and ops.expert_shards(
                            x, e_axis) > 1:  # K < P: a flat cut, alone or in a bundle
                        flat_candidates.append(_FlatMember(
                            key, unit.leaf, x, h, name, e_axis, l_axis, described,
                            _bundle_path(paths[unit.leaf], g.name)))
                        continue
                    replaced[unit.leaf] = ops.take(x, h, e_axis, l_axis)
                    slots[name] = (key, e_axis, l_axis)
                    mosaic = st.mosaic.get(key)
                    ref_values[name] = None if mosaic is None else ops.take(
                        mosaic, h, e_axis, l_axis)
                else:  # one subtree per expert: the held experts' leaves, stacked
                    name = prefix + path_str(unit.slot_path)
                    first = min(unit.members.values())
                    dropped.update(unit.members.values())
                    extra_leaves.append((first, unit.slot_path, jnp.stack(
                        [jnp.asarray(leaves[unit.members[int(e)]]) for e in h[0]])))
                    slots[name] = (key, 0, None)
                    mosaic = st.mosaic.get(key)
                    ref_values[name] = None if mosaic is None else ops.take(mosaic, h, 0, None)
                    units_meta[g.name].append({
                        "kind": "subtree", "member": unit.member, "path": name,
                        "expert_axis": 0, "layer_axis": None,
                        "paths": {str(e): prefix + path_str(paths[leaf])
                                  for e, leaf in unit.members.items()}})
        for members, cut, path in _flat_cuts(flat_candidates):
            name = members[0].name if path is None else prefix + path_str(path)
            value = ops.take_flat([m.x for m in members], cut) if cut is not None else None
            if cut is None:  # no balanced cut: gathered, as any unbalanced selection
                (m,) = members
                replaced[m.leaf] = ops.take(m.x, m.held, m.axis, m.layer)
                slots[m.name] = (m.key, m.axis, m.layer)
                mosaic = st.mosaic.get(m.key)
                ref_values[m.name] = None if mosaic is None else ops.take(
                    mosaic, m.held, m.axis, m.layer)
                continue
            if len(members) == 1:
                replaced[members[0].leaf] = value
            else:
                dropped.update(m.leaf for m in members)
                extra_leaves.append((min(m.leaf for m in members), path, value))
            cuts[name] = (cut, tuple(m.key for m in members))
            mosaics = [st.mosaic.get(m.key) for m in members]
            ref_values[name] = (None if any(v is None for v in mosaics)
                                else ops.take_flat(mosaics, cut))
            for b, m in enumerate(members):
                if len(members) > 1:  # the member's own path is not in the manifest
                    m.described["leaf_path"] = [list(c) for c in paths[m.leaf]]
                m.described.update(
                    stored=name, shape=list(m.x.shape),
                    rows=[[int(lyr), int(e), r] for r, (mb, lyr, e) in enumerate(cut.rows.tolist())
                          if mb == b])
        at = {first: (p, x) for first, p, x in extra_leaves}
        for i, (p, x) in enumerate(zip(paths, leaves, strict=True)):
            if i in at:
                new_paths.append(at[i][0])
                new_leaves.append(at[i][1])
            if i in dropped:
                continue
            new_paths.append(p)
            new_leaves.append(replaced.get(i, x))
        if not full:
            st.cursor += 1
        st.saves += 1
        plt_now, label = accounting.plt(st.counts, self.total_assignments)
        meta = {
            "version": VERSION, "step": step, "k": int(st.k), "k_config": self.k,
            "selection": self.selection, "wrapped": wrapped, "cursor": st.cursor,
            "saves": st.saves, "full": full,
            "k_history": st.k_history, "restores": st.restores,
            "plt_threshold": self.plt_threshold, "dynamic_k": self.dynamic_k,
            "total_assignments": _jsonable(self.total_assignments),
            "plt_denominator": label, "plt_so_far": plt_now,
            "groups": {g.name: {"n": g.n, "layers": g.layers, "held": held[g.name].tolist(),
                                "ref_step": ref_steps[g.name], "units": units_meta[g.name],
                                **st.counts[g.name].to_json()}
                       for g in layout.groups.values()},
        }
        tree = _assemble(new_paths, new_leaves, _meta_leaf(meta), wrapped)
        save_args = dataclasses.replace(args, item=tree)
        if hasattr(save_args, "expert_tokens"):
            save_args.expert_tokens = None
        return PreparedSave(save_args, tuple(sorted(extra)), self, item, step, full, held,
                            slots, ref_values, full_shardings, st, meta, cuts)

    def _publish(self, prepared: PreparedSave, reference: Any) -> None:
        """Record this save's reconstruction of the held experts (commit thread).

        No device work here: several processes must run device programs in one order, so the
        mosaic is updated on the training thread, at the next save or :meth:`mosaic`.
        """
        st = prepared.state
        assert st is not None
        values: dict[str, Any] = {}
        if reference is not None:
            values = {path_str(p): v for p, v in zip(reference.paths, reference.values,
                                                     strict=True)}
        tree_leaves = {path_str(p): x for p, x in zip(*flatten(prepared.args.item)[:2],
                                                      strict=True)}
        for name, (key, axis, layer) in prepared.slots.items():
            recon = values.get(name)
            slot = tree_leaves[name]
            st.pending.append(("unit", key, axis, layer, slot if recon is None else recon,
                               slot, prepared.held[key.rsplit("#", 1)[0]], prepared.full,
                               prepared.shardings.get(name)))
        for name, (cut, keys) in prepared.cuts.items():
            recon = values.get(name)
            slot = tree_leaves[name]
            st.pending.append(("flat", keys, cut, slot if recon is None else recon, slot))
        with self._lock:
            self._items[prepared.item] = st

    @staticmethod
    def _materialize(st: _ItemState) -> None:
        """Fold published reconstructions into the mosaic (training thread)."""
        for kind, *entry in st.pending:
            if kind == "flat":
                keys, cut, recon, slot = entry
                if isinstance(recon, np.ndarray):
                    recon = jax.device_put(recon, slot.sharding)
                members = ops.put_flat([st.mosaic[k] for k in keys], recon, cut)
                st.mosaic.update(zip(keys, members, strict=True))
                continue
            key, axis, layer, recon, slot, held, full, sharding = entry
            if isinstance(recon, np.ndarray):
                recon = jax.device_put(recon, slot.sharding)
            if full:
                st.mosaic[key] = recon if sharding is None else jax.device_put(recon, sharding)
            else:
                st.mosaic[key] = ops.put(st.mosaic[key], recon, held, axis, layer)
        st.pending = []

    def mosaic(self, item: str = "default") -> dict[str, Any]:
        """Per unit (``"group#i"``), every expert's last reconstruction: what a restore of the
        last save returns for that expert leaf (the per-expert references of the next save)."""
        with self._lock:
            st = self._items.get(item)
        if st is None:
            return {}
        self._materialize(st)
        return dict(st.mosaic)

# ---------------------------------------------------------------------------- helpers


def _group_shards(g: Any, leaves: Sequence[Any], k: int) -> int:
    """Expert shards to balance the held experts over (1: none): the least common multiple of
    the group's stacked leaves' expert-axis splits, if it divides N and K, else the largest
    single split that does (the other leaves are then cut gathered)."""
    splits = {ops.expert_shards(leaves[u.leaf], u.expert_axis) for u in g.units
              if u.kind == "stacked"} - {1}
    if not splits:
        return 1
    lcm = math.lcm(*splits)
    if selection.balanced(g.n, k, lcm):
        return lcm
    fits = [p for p in splits if selection.balanced(g.n, k, p)]
    return max(fits, default=1)


def _group_stripes(g: Any, leaves: Sequence[Any], k: int) -> int:
    """Expert shards to stripe the sequential rotation over (1: none) when no row can be
    balanced: the largest stacked leaf's expert-axis split ``P > K`` dividing N (see
    :mod:`orbax_lossy.experts.selection`)."""
    splits = {ops.expert_shards(leaves[u.leaf], u.expert_axis) for u in g.units
              if u.kind == "stacked"}
    fits = [p for p in splits if selection.striped(g.n, k, p)]
    return max(fits, default=1)


@dataclasses.dataclass
class _FlatMember:
    """A stacked expert leaf whose held slices no row-wise cut keeps shard-local."""

    key: str  # unit key
    leaf: int  # index in the saved tree
    x: Any
    held: np.ndarray
    name: str  # stored name (with the state prefix)
    axis: int
    layer: int | None
    described: dict[str, Any]  # its unit record (rows and stored name are added)
    bundle: StoredPath | None  # its path with the group's part replaced by ``*``


def _bundle_path(path: StoredPath, group: str) -> StoredPath | None:
    """``path`` with the components spelling ``group`` replaced by one ``*`` key (None when
    they are not consecutive components under a dict)."""
    parts = group.split("/")
    keys = [str(k) for _, k in path]
    for i in range(len(keys) - len(parts)):
        if keys[i:i + len(parts)] == parts:
            if path[i][0] not in ("d", "a"):  # under a sequence: no ``*`` key beside indices
                return None
            return (*path[:i], ("d", "*"), *path[i + len(parts):])
    return None


def _flat_cuts(members: Sequence[_FlatMember]):
    """Flat cuts of the K < P leaves: the same leaf of several MoE layers (same bundle path,
    shape, dtype, sharding and axes) as one bundle when that balances the held slices over the
    expert shards, else each leaf alone (its own flat cut, or None: gathered). Yields
    ``(members, cut or None, bundle path or None: the member's own)``."""
    bundles: dict[Any, list[_FlatMember]] = {}
    for m in members:
        key = (None, m.key) if m.bundle is None else (
            m.bundle, m.x.shape, m.x.dtype, m.x.sharding, m.axis, m.layer)
        bundles.setdefault(key, []).append(m)
    for group in bundles.values():
        if len(group) > 1:
            cut = ops.flat_plan([m.x for m in group], [m.held for m in group], group[0].axis,
                                group[0].layer)
            if cut is not None:
                yield group, cut, group[0].bundle
                continue
        for m in group:
            cut = ops.flat_plan([m.x], [m.held], m.axis, m.layer)
            yield [m], cut, None


def _jsonable(x: Any) -> Any:
    if x is None or isinstance(x, (int, float, str)):
        return x
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return np.asarray(x).tolist()


def _meta_leaf(meta: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8).copy()


def _needs_wrap(paths: Sequence[StoredPath]) -> bool:
    """Whether the tree's root is not a string-keyed node (then it is saved under ``state``)."""
    return any(not p or p[0][0] not in "da" or not isinstance(p[0][1], str) or
               p[0][1] == META_KEY for p in paths)

