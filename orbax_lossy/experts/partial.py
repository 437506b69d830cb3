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

:meth:`PartialExperts.restore` restores a step: non-expert leaves through the normal engine,
every expert from its newest holder (decoding per-expert delta chains back only as far as the
oldest holder needed), then adopts the result as the next reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.engine import device, reading
from orbax_lossy.engine import restore as restoring
from orbax_lossy.errors import ChainError, FormatError, InvalidArgumentError, MissingStepError
from orbax_lossy.experts import accounting, selection
from orbax_lossy.experts import device_ops as ops
from orbax_lossy.experts.rules import META_KEY, Layout, Rule, parse_rules, plan_layout
from orbax_lossy.format import payload
from orbax_lossy.format.manifest import LeafEntry, Manifest, read_manifest
from orbax_lossy.format.steps import root_of, step_directories, step_of
from orbax_lossy.treepaths import StoredPath, build_nested, flatten, path_str

META_NAME = f"{META_KEY}/meta"
VERSION = 1
SELECTIONS = ("sequential", "load_aware")


class _Any:
    """A restore target leaf that takes whatever is stored (default sharding)."""


@dataclasses.dataclass
class _ItemState:
    """Per item: the layout, the rotation, the counts and the per-expert mosaic."""

    layout_sig: tuple
    k: int
    cursor: int
    counts: dict[str, accounting.GroupCounts]
    mosaic: dict[str, Any]  # unit key -> full stacked array, or {expert: leaf array}
    k_history: list[list[int]]
    restores: list[dict[str, Any]]
    saves: int = 0
    pending: list[tuple] = dataclasses.field(default_factory=list)  # published, not folded

    def copy(self) -> _ItemState:
        """A copy whose counts can be changed (mosaic arrays are immutable, shared)."""
        return dataclasses.replace(
            self, counts={g: c.copy() for g, c in self.counts.items()},
            mosaic={k: (dict(v) if isinstance(v, dict) else v) for k, v in self.mosaic.items()},
            k_history=[list(x) for x in self.k_history], restores=list(self.restores),
            pending=list(self.pending))


def _unit_key(group: str, index: int) -> str:
    return f"{group}#{index}"


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

    def publish(self, reference: Any) -> None:
        """Fold this save's reconstruction of the held experts into the mosaic."""
        if self.state is not None:
            self.owner._publish(self, reference)


class PartialExperts:
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
        for g in layout.groups.values():
            c = st.counts[g.name]
            accounting.add_tokens(c, None if tokens is None else tokens.get(g.name), g.name)
            k = min(st.k, g.n)
            rows = []
            for layer in range(g.layers):
                if full or k >= g.n:
                    rows.append(list(range(g.n)))
                elif self.selection == "sequential":
                    rows.append(selection.sequential(g.n, k, st.cursor, position))
                else:
                    rows.append(selection.load_aware(g.n, k, c.unsaved[layer], c.age[layer],
                                                     self.max_staleness))
                position += 1
            held[g.name] = np.asarray(rows, np.int64)
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
                    replaced[unit.leaf] = ops.take(x, h, unit.expert_axis, unit.layer_axis)
                    slots[name] = (key, unit.expert_axis, unit.layer_axis)
                    full_shardings[name] = getattr(x, "sharding", None)
                    mosaic = st.mosaic.get(key)
                    ref_values[name] = None if mosaic is None else ops.take(
                        mosaic, h, unit.expert_axis, unit.layer_axis)
                    units_meta[g.name].append({**unit.describe(paths), "path": name})
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
                            slots, ref_values, full_shardings, st, meta)

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
            st.pending.append((key, axis, layer, slot if recon is None else recon, slot,
                               prepared.held[key.rsplit("#", 1)[0]], prepared.full,
                               prepared.shardings.get(name)))
        with self._lock:
            self._items[prepared.item] = st

    @staticmethod
    def _materialize(st: _ItemState) -> None:
        """Fold published reconstructions into the mosaic (training thread)."""
        for key, axis, layer, recon, slot, held, full, sharding in st.pending:
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

    # ------------------------------------------------------------------ restore

    def restore(self, handler: Any, directory: Any, args: Any) -> Any:
        """Restore a PEC step (NotImplemented if the step holds no PEC record)."""
        item_dir = os.path.abspath(os.path.normpath(os.fspath(directory)))
        manifest = read_manifest(item_dir)
        meta_entry = _find(manifest, META_NAME)
        if meta_entry is None:
            return NotImplemented
        reader_bytes = [0]
        ctx = _Context(item_dir, handler.encode_threads, reader_bytes)
        meta = ctx.meta(step_of(item_dir), manifest)
        target = getattr(args, "item", None) if args is not None else None
        groups = meta["groups"]
        # 1. The leaves wanted, in the caller's order, and which are experts.
        if target is None:
            orig_paths, targets, treedef = _paths_without_target(manifest, meta)
        else:
            orig_paths, targets, treedef = flatten(target)
        names = [path_str(p) for p in orig_paths]
        wrapped = bool(meta.get("wrapped"))
        prefix = "state/" if wrapped else ""
        layout = plan_layout(orig_paths, [_shape_of(t, manifest, n) for t, n in zip(
            targets, names, strict=True)], self.rules, self.group, require_match=False)
        for g in layout.groups.values():
            rec = groups.get(g.name)
            if rec is None or (rec["n"], rec["layers"]) != (g.n, g.layers):
                raise InvalidArgumentError(
                    f"restore target group {g.name!r} ({g.n} experts x {g.layers} layers) does "
                    f"not match step {meta['step']} of {item_dir} "
                    f"({None if rec is None else (rec['n'], rec['layers'])})")
        for g in layout.groups.values():  # name a missing holder before the engine walks
            holder = np.asarray(groups[g.name]["holder"], np.int64)
            for e in range(g.n):
                for s in sorted(set(int(x) for x in holder[:, e] if x >= 0)):
                    ctx.dir_of(s, g.name, e)
        # 2. Non-expert leaves through the engine.
        plain = [i for i in range(len(orig_paths)) if i not in layout.expert_leaves]
        # (the record varies in size from save to save: read it alone, never through a chain)
        sub = _assemble([orig_paths[i] for i in plain], [targets[i] for i in plain], None,
                        wrapped)
        restored = restoring.restore_item(item_dir, sub, handler.encode_threads)
        got = {path_str(p): v for p, v in zip(*flatten(restored.tree)[:2], strict=True)}
        out: list[Any] = [None] * len(orig_paths)
        for i in plain:
            out[i] = got[prefix + names[i]]
        # 3. Experts from their newest holders.
        step = step_of(item_dir)
        raw_mosaic: dict[str, Any] = {}
        for g in layout.groups.values():
            rec = groups[g.name]
            holder = np.asarray(rec["holder"], np.int64)
            for u, unit in enumerate(g.units):
                key = _unit_key(g.name, u)
                if unit.kind == "stacked":
                    name = prefix + names[unit.leaf]
                    rows = []
                    for e in range(g.n):
                        per_layer = []
                        for layer in range(g.layers):
                            s = int(holder[layer, e])
                            if s < 0:
                                raise ChainError(
                                    f"group {g.name!r}: expert {e} was never saved before step "
                                    f"{step} ({item_dir})")
                            per_layer.append(ctx.expert(g.name, name, layer, e, s))
                        rows.append(jnp.stack(per_layer))
                    full = ops.from_canonical(jnp.stack(rows), unit.expert_axis,
                                              unit.layer_axis)
                    value = _place(full, targets[unit.leaf])
                    raw_mosaic[key] = value
                    out[unit.leaf] = _cast(value, targets[unit.leaf])
                else:
                    name = prefix + path_str(unit.slot_path)
                    per = []
                    for e in range(g.n):
                        leaf = unit.members[e]
                        value = ctx.expert(g.name, name, 0, e, int(holder[0, e]))
                        per.append(value)
                        out[leaf] = _cast(_place(value, targets[leaf]), targets[leaf])
                    raw_mosaic[key] = jnp.stack(per)
        tree = (build_nested(orig_paths, out) if treedef is None
                else jax.tree_util.tree_unflatten(treedef, out))
        handler.last_restore_bytes_read = restored.bytes_read + reader_bytes[0]
        # 4. Adopt: the handler's reference (for the next delta) and PEC's state.
        stored_expert = set()
        for g in layout.groups.values():
            for unit in g.units:
                if unit.kind == "stacked":
                    stored_expert.add(prefix + names[unit.leaf])
                else:
                    stored_expert.add(prefix + path_str(unit.slot_path))
        plain_stored = {leaf.name for leaf in manifest.leaves
                        if leaf.name != META_NAME and leaf.name not in stored_expert}
        complete = plain_stored <= {prefix + names[i] for i in plain} and all(
            g in {x.name for x in layout.groups.values()} for g in groups)
        if complete:
            values = list(restored.values)
            for j, entry in enumerate(manifest.leaves):
                if entry.name in stored_expert:
                    values[j] = ctx.stored_value(step, entry.name)
            handler._adopt_reference(dataclasses.replace(restored, values=values, complete=True))
        report = self._adopt_state(os.path.basename(item_dir), meta, layout, raw_mosaic,
                                   complete)
        self.last_restore_report = report
        return tree

    def _adopt_state(self, item: str, meta: dict[str, Any], layout: Layout,
                     mosaic: dict[str, Any], complete: bool) -> dict[str, Any]:
        counts = {g: accounting.GroupCounts.from_json(d) for g, d in meta["groups"].items()}
        lost_now = {g: c.unsaved.sum(axis=1) for g, c in counts.items()}
        for g, c in counts.items():
            c.lost_total = c.lost_total + lost_now[g]
            c.unsaved[:] = 0
        plt_value, label = accounting.plt(counts, self.total_assignments)
        k = int(meta["k"])
        n_max = max(d["n"] for d in meta["groups"].values())
        k_next = accounting.next_k(k, n_max, plt_value, self.plt_threshold if self.dynamic_k
                                   else None)
        history = [list(x) for x in meta.get("k_history", [])]
        if k_next != k:
            history.append([int(meta["step"] or 0), k_next])
            warnings.warn(
                f"orbax_lossy partial experts: PLT {plt_value:.2%} after restoring step "
                f"{meta['step']} exceeds {self.plt_threshold:.2%}; Dynamic-K raises K from {k} "
                f"to {k_next}", UserWarning, stacklevel=3)
        restores = list(meta.get("restores", [])) + [{
            "step": meta["step"], "lost_tokens": int(sum(int(v.sum()) for v in
                                                         lost_now.values())),
            "plt": plt_value, "k_next": k_next}]
        report = {
            "step": meta["step"],
            "expert_steps": {g: (d["holder"][0] if d["layers"] == 1 else d["holder"])
                             for g, d in meta["groups"].items()},
            "lost_tokens": {g: int(v.sum()) for g, v in lost_now.items()},
            "plt": plt_value,
            "plt_denominator": label,
            "k": k,
            "k_next": k_next,
            "k_history": history,
            "restores": restores,
        }
        if complete:
            st = _ItemState(layout.signature(), k_next, int(meta["cursor"]), counts, mosaic,
                            history, restores, int(meta.get("saves", 0)))
            with self._lock:
                self._items[item] = st
        return report


# ---------------------------------------------------------------------------- helpers


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


def _assemble(paths: Sequence[StoredPath], leaves: Sequence[Any], meta: Any,
              wrap: bool) -> Any:
    """Nested dicts of ``paths`` plus ``__pec__/meta`` (under ``state`` if ``wrap``)."""
    if wrap:
        paths = [(("d", "state"), *p) for p in paths]
    tree = build_nested(list(paths), list(leaves)) if paths else {}
    if meta is not None:
        tree[META_KEY] = {"meta": meta}
    return tree


def _find(manifest: Manifest, name: str) -> LeafEntry | None:
    for leaf in manifest.leaves:
        if leaf.name == name:
            return leaf
    return None


def _strip_state(name: str, wrapped: bool) -> str:
    return name[len("state/"):] if wrapped and name.startswith("state/") else name


def _paths_without_target(manifest: Manifest, meta: dict[str, Any]):
    """Original paths and default targets when restoring without a target tree."""
    wrapped = bool(meta.get("wrapped"))
    slots: dict[str, dict[str, Any]] = {}
    for rec in meta["groups"].values():
        for unit in rec["units"]:
            slots[unit["path"]] = {**unit, "n": rec["n"]}
    paths: list[StoredPath] = []
    targets: list[Any] = []
    for leaf in manifest.leaves:
        if leaf.name == META_NAME:
            continue
        unit = slots.get(leaf.name)
        if unit is None:
            paths.append(leaf.path[1:] if wrapped else leaf.path)
            targets.append(_Any())
        elif unit["kind"] == "stacked":
            shape = list(leaf.shape)
            shape[unit["expert_axis"]] = unit["n"]
            paths.append(leaf.path[1:] if wrapped else leaf.path)
            targets.append(jax.ShapeDtypeStruct(tuple(shape), leaf.dtype))
        else:  # one subtree per expert: one leaf per expert, of the slot's trailing shape
            for e in sorted(unit["paths"], key=int):
                name = _strip_state(unit["paths"][e], wrapped)
                paths.append(tuple(("d", k) for k in name.split("/")))
                targets.append(jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype))
    return paths, targets, None


def _shape_of(target: Any, manifest: Manifest, name: str) -> tuple[int, ...] | None:
    shape = getattr(target, "shape", None)
    if shape is not None:
        return tuple(shape)
    leaf = _find(manifest, name)
    return None if leaf is None else leaf.shape


def _place(value: jax.Array, target: Any) -> jax.Array:
    sharding = getattr(target, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.device_put(value, sharding)
    return value


def _cast(value: jax.Array, target: Any) -> jax.Array:
    dtype = getattr(target, "dtype", None)
    if dtype is not None and np.dtype(dtype) != value.dtype:
        return value.astype(dtype)
    return value


class _Context:
    """Per restore: manifests, PEC records and decoded slots of the holder steps (memoised)."""

    def __init__(self, item_dir: str, threads: int, bytes_read: list[int]) -> None:
        self.item_dir = item_dir
        self.item = os.path.basename(item_dir)
        self.root = root_of(item_dir)
        self.threads = threads
        self.bytes_read = bytes_read
        self._dirs: dict[int, str] | None = None
        self._manifests: dict[int | None, Manifest] = {}
        self._metas: dict[int | None, dict[str, Any]] = {}
        self._slots: dict[tuple[int | None, str], jax.Array] = {}

    def dir_of(self, step: int | None, group: str, expert: int) -> str:
        if step == step_of(self.item_dir):
            return self.item_dir
        if self._dirs is None:
            self._dirs = {s: os.path.join(d, self.item)
                          for s, d in step_directories(self.root).items()}
        d = None if step is None else self._dirs.get(step)
        if d is None or not os.path.exists(os.path.join(d, "manifest.msgpack")):
            raise MissingStepError(
                f"group {group!r}: expert {expert} is restored from step {step}, whose "
                f"checkpoint is missing under {self.root} (needed by {self.item_dir})",
                step=step)
        return d

    def manifest(self, step: int | None, group: str = "?", expert: int = -1) -> Manifest:
        if step not in self._manifests:
            self._manifests[step] = read_manifest(self.dir_of(step, group, expert))
        return self._manifests[step]

    def meta(self, step: int | None, manifest: Manifest | None = None, group: str = "?",
             expert: int = -1) -> dict[str, Any]:
        if step not in self._metas:
            manifest = manifest or self.manifest(step, group, expert)
            if step is not None and step not in self._manifests:
                self._manifests[step] = manifest
            entry = _find(manifest, META_NAME)
            if entry is None:
                raise FormatError(f"step {step} of {self.item} holds no partial-experts record")
            d = self.item_dir if step == step_of(self.item_dir) else self.dir_of(step, group,
                                                                                 expert)
            reader = payload.PayloadReader(d)
            raw = reading.read_region(reader, entry.pieces, entry.codec, "raw", entry.dtype,
                                      tuple((0, n) for n in entry.shape), {},
                                      f"{d}: {META_NAME}")
            self.bytes_read[0] += reader.bytes_read
            self._metas[step] = json.loads(bytes(np.asarray(raw, np.uint8)).decode())
        return self._metas[step]

    def _decode(self, step: int, name: str, group: str, expert: int,
                ref: Callable[[], jax.Array] | None) -> jax.Array:
        """Decode leaf ``name`` of ``step`` (``ref()`` builds its reference if needed)."""
        manifest = self.manifest(step, group, expert)
        entry = _find(manifest, name)
        if entry is None:
            raise ChainError(f"group {group!r}: step {step} holds expert {expert} but has no "
                             f"leaf {name!r}")
        d = self.dir_of(step, group, expert)
        reader = payload.PayloadReader(d)
        codec = entry.codec
        sharding = reading.target_sharding(None)
        where = f"{d}: leaf {name!r}"
        fields = {f: reading.assemble_field(reader, [p for p in entry.pieces if p.field == f],
                                            codec, f, fdt, entry.shape, sharding, where,
                                            self.threads)
                  for f, fdt in codec.field_dtypes(entry.dtype).items()}
        r = None
        if codec.needs_reference:
            if ref is None:
                raise ChainError(f"{where}: a delta-coded expert without a reference")
            r = jax.device_put(ref(), sharding)
        out = device.decode_tree([fields], [{k: jnp.asarray(v) for k, v in entry.side.items()}],
                                 [r], plan=(codec,), dtypes=(entry.dtype,),
                                 shardings=(sharding,))[0]
        self.bytes_read[0] += reader.bytes_read
        return out

    def slot(self, group: str, name: str, step: int, expert: int) -> jax.Array:
        """The decoded slot leaf ``name`` of ``step`` (its layout: ``[.., K @ axis, ..]``)."""
        key = (step, name)
        if key not in self._slots:
            meta = self.meta(step, group=group, expert=expert)
            rec = meta["groups"][group]
            unit = next(u for u in rec["units"] if u.get("path") == name)
            axis, layer = unit["expert_axis"], unit["layer_axis"]
            held = rec["held"]

            def ref() -> jax.Array:
                rows = []
                for j in range(len(held[0])):
                    rows.append(jnp.stack([
                        self._expert_at(group, name, lyr, held[lyr][j], rec["ref_step"][lyr][j],
                                        step)
                        for lyr in range(len(held))]))
                return ops.from_canonical(jnp.stack(rows), axis, layer)

            self._slots[key] = self._decode(step, name, group, expert, ref)
        return self._slots[key]

    def _expert_at(self, group: str, name: str, layer: int, e: int, step: int,
                   user: int) -> jax.Array:
        if step < 0:
            raise ChainError(f"group {group!r}: expert {e} of step {user} is a delta with no "
                             "earlier copy")
        return self.expert(group, name, layer, e, step)

    def expert(self, group: str, name: str, layer: int, e: int, step: int) -> jax.Array:
        """Expert ``e`` (layer ``layer``) of stacked leaf ``name`` as saved at ``step``."""
        meta = self.meta(step, group=group, expert=e)
        rec = meta["groups"].get(group)
        if rec is None:
            raise ChainError(f"step {step} holds no expert group {group!r}")
        unit = next((u for u in rec["units"] if u.get("path") == name), None)
        if unit is None:
            raise ChainError(f"step {step}: group {group!r} has no leaf {name!r}")
        row = rec["held"][layer]
        if e not in row:
            raise ChainError(f"group {group!r}: step {step} does not hold expert {e}")
        canon = ops.expert_slices(self.slot(group, name, step, e), unit["expert_axis"],
                                  unit["layer_axis"])
        return canon[row.index(e), layer]

    def stored_value(self, step: int | None, name: str) -> jax.Array:
        """The decoded value of an expert leaf as stored at ``step`` (slot or held leaf)."""
        for (s, n), v in self._slots.items():
            if s == step and n == name:
                return v
        raise ChainError(f"{self.item_dir}: leaf {name!r} was not decoded")  # pragma: no cover
