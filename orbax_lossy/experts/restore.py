"""The restore side of partial experts: every expert from its newest holder.

:meth:`PartialExperts.restore <orbax_lossy.experts.partial.PartialExperts.restore>` (defined
here on ``_RestoreSide``, a base class of ``PartialExperts``) restores a step: non-expert leaves
through the normal engine, every expert from its newest holder (decoding per-expert delta
chains back only as far as the oldest holder needed; ``_Context`` reads and memoises the holder
steps' manifests, records and slots), assembles the per-expert mosaic, then adopts the result
as the next reference and builds the restore report (PLT, Dynamic-K).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_lossy.engine import device, reading
from orbax_lossy.engine import restore as restoring
from orbax_lossy.errors import ChainError, FormatError, InvalidArgumentError, MissingStepError
from orbax_lossy.experts import accounting
from orbax_lossy.experts import device_ops as ops
from orbax_lossy.experts.record import META_NAME, _assemble, _find, _ItemState, _unit_key
from orbax_lossy.experts.rules import Layout, Rule, plan_layout
from orbax_lossy.format import payload
from orbax_lossy.format.manifest import Manifest, read_manifest
from orbax_lossy.format.steps import abspath, exists, root_of, step_directories, step_of
from orbax_lossy.treepaths import StoredPath, build_nested, flatten, path_str


class _Any:
    """A restore target leaf that takes whatever is stored (default sharding)."""



class _RestoreSide:
    """The restore hooks of :class:`~orbax_lossy.experts.partial.PartialExperts`."""

    rules: tuple[Rule, ...]
    group: Callable[[str], str] | None
    dynamic_k: bool
    plt_threshold: float
    total_assignments: Any
    _items: dict[str, _ItemState]
    _lock: threading.Lock
    last_restore_report: dict[str, Any] | None

    def restore(self, handler: Any, directory: Any, args: Any) -> Any:
        """Restore a PEC step (NotImplemented if the step holds no PEC record)."""
        item_dir = abspath(directory)  # a URI keeps its scheme://
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
        slot_names = {n for rec in groups.values() for u in rec["units"]
                      for n in (u.get("path"), u.get("stored")) if n}
        restored = restoring.restore_item(item_dir, sub, handler.encode_threads,
                                          loose=slot_names)
        got = {path_str(p): v for p, v in zip(*flatten(restored.tree)[:2], strict=True)}
        out: list[Any] = [None] * len(orig_paths)
        for i in plain:
            out[i] = got[prefix + names[i]]
        # 3. Experts from their newest holders (first: which rows of which slots are needed,
        #    so that a slot is read and decoded once, for those rows only).
        step = step_of(item_dir)
        for g in layout.groups.values():
            holder = np.asarray(groups[g.name]["holder"], np.int64)
            for unit in g.units:
                name = prefix + (names[unit.leaf] if unit.kind == "stacked"
                                 else path_str(unit.slot_path))
                for e in range(g.n):
                    for layer in range(g.layers if unit.kind == "stacked" else 1):
                        if holder[layer, e] >= 0:
                            ctx.need(g.name, name, layer, e, int(holder[layer, e]))
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
        stored_expert = {u["stored"] for rec in groups.values() for u in rec["units"]
                         if "stored" in u}  # flat slots and bundles
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
        report["expert_bytes_read"] = dict(sorted(ctx.step_bytes.items()))
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


def _strip_state(name: str, wrapped: bool) -> str:
    return name[len("state/"):] if wrapped and name.startswith("state/") else name


def _paths_without_target(manifest: Manifest, meta: dict[str, Any]):
    """Original paths and default targets when restoring without a target tree."""
    wrapped = bool(meta.get("wrapped"))
    slots: dict[str, dict[str, Any]] = {}
    bundles: dict[str, list[dict[str, Any]]] = {}  # stored name -> member units
    for rec in meta["groups"].values():
        for unit in rec["units"]:
            slots[unit["path"]] = {**unit, "n": rec["n"]}
            if "leaf_path" in unit:
                bundles.setdefault(unit["stored"], []).append(slots[unit["path"]])
    paths: list[StoredPath] = []
    targets: list[Any] = []
    for leaf in manifest.leaves:
        if leaf.name == META_NAME:
            continue
        for unit in bundles.get(leaf.name, ()):  # the same leaf of several MoE layers
            path = tuple((k, key) for k, key in unit["leaf_path"])
            paths.append(path)
            targets.append(jax.ShapeDtypeStruct(tuple(unit["shape"]), leaf.dtype))
        if leaf.name in bundles:
            continue
        unit = slots.get(leaf.name)
        if unit is None:
            paths.append(leaf.path[1:] if wrapped else leaf.path)
            targets.append(_Any())
        elif unit["kind"] == "stacked":
            shape = list(unit.get("shape") or leaf.shape)  # a flat slot records the leaf's
            shape[unit["expert_axis"]] = unit["n"]
            paths.append(leaf.path[1:] if wrapped else leaf.path)
            targets.append(jax.ShapeDtypeStruct(tuple(shape), leaf.dtype))
        else:  # one subtree per expert: one leaf per expert, of the slot's trailing shape
            for e in sorted(unit["paths"], key=int):
                name = _strip_state(unit["paths"][e], wrapped)
                paths.append(tuple(("d", k) for k in name.split("/")))
                targets.append(jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype))
    return paths, targets, None


def _unit(rec: dict[str, Any], name: str) -> dict[str, Any]:
    """The unit record of slot leaf ``name`` in a group record."""
    return next(u for u in rec["units"] if u.get("path") == name)


def _flat_rows(unit: dict[str, Any], held: list[list[int]]) -> dict[tuple[int, int], int] | None:
    """For a flat slot member (``unit["rows"]``: ``[layer, expert, row]`` of each held slice),
    the slot row of every held position ``(layer, j)``; None for a ``[K @ axis]`` slot."""
    rows = unit.get("rows")
    if rows is None:
        return None
    where = {(int(lyr), int(e)): int(r) for lyr, e, r in rows}
    return {(lyr, j): where[lyr, int(e)] for lyr, h in enumerate(held) for j, e in enumerate(h)}


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
        self._need: dict[tuple[int, str], set[tuple[str, str, int, int]]] = {}
        self.step_bytes: dict[int, int] = {}  # bytes read per step (records and slots)

    def dir_of(self, step: int | None, group: str, expert: int) -> str:
        if step == step_of(self.item_dir):
            return self.item_dir
        if self._dirs is None:
            self._dirs = {s: os.path.join(d, self.item)
                          for s, d in step_directories(self.root).items()}
        d = None if step is None else self._dirs.get(step)
        if d is None or not exists(os.path.join(d, "manifest.msgpack")):
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
                                      tuple((0, n) for n in entry.shape),
                                      f"{d}: {META_NAME}")
            self._count(step, reader.bytes_read)
            self._metas[step] = json.loads(bytes(np.asarray(raw, np.uint8)).decode())
        return self._metas[step]

    def _count(self, step: int | None, n: int) -> None:
        self.bytes_read[0] += n
        if step is not None:
            self.step_bytes[step] = self.step_bytes.get(step, 0) + n

    def _entry(self, step: int, name: str, group: str, expert: int):
        entry = _find(self.manifest(step, group, expert), name)
        if entry is None:
            raise ChainError(f"group {group!r}: step {step} holds expert {expert} but has no "
                             f"leaf {name!r}")
        return entry

    def _row(self, group: str, name: str, layer: int, e: int, step: int) -> tuple[dict, int]:
        """The PEC group record of ``step`` and the slot row holding expert ``e``."""
        meta = self.meta(step, group=group, expert=e)
        rec = meta["groups"].get(group)
        if rec is None:
            raise ChainError(f"step {step} holds no expert group {group!r}")
        if not any(u.get("path") == name for u in rec["units"]):
            raise ChainError(f"step {step}: group {group!r} has no leaf {name!r}")
        row = rec["held"][layer]
        if e not in row:
            raise ChainError(f"group {group!r}: step {step} does not hold expert {e}")
        return rec, row.index(e)

    def need(self, group: str, name: str, layer: int, e: int, step: int) -> None:
        """Plan to read expert ``e`` (layer ``layer``) of slot leaf ``name`` at ``step``, and
        the copies a delta-coded slot row is decoded against (back to an exact copy)."""
        while True:
            rec, j = self._row(group, name, layer, e, step)
            stored = _unit(rec, name).get("stored", name)
            rows = self._need.setdefault((step, stored), set())
            if (group, name, layer, j) in rows:
                return
            rows.add((group, name, layer, j))
            if not self._entry(step, stored, group, e).codec.needs_reference:
                return
            ref_step = int(rec["ref_step"][layer][j])
            if ref_step < 0:
                raise ChainError(f"group {group!r}: expert {e} of step {step} is a delta with "
                                 "no earlier copy")
            step = ref_step

    def _decode(self, step: int, name: str, group: str, expert: int,
                ref: Callable[[], jax.Array] | None, regions: list | None) -> jax.Array:
        """Decode leaf ``name`` of ``step`` (``ref()`` builds its reference if needed); with
        ``regions``, only the pieces overlapping them are read (the rest decodes from zeros
        and must not be used)."""
        entry = self._entry(step, name, group, expert)
        d = self.dir_of(step, group, expert)
        reader = payload.PayloadReader(d)
        codec = entry.codec
        sharding = reading.target_sharding(None)
        where = f"{d}: leaf {name!r}"
        fields = {}
        for f, fdt in codec.field_dtypes(entry.dtype).items():
            pieces = [p for p in entry.pieces if p.field == f]
            if regions is None:
                fields[f] = reading.assemble_field(reader, pieces, codec, f, fdt, entry.shape,
                                                   sharding, where, self.threads)
            else:
                fields[f] = jax.device_put(reading.read_regions(
                    reader, pieces, codec, f, fdt, entry.shape, regions, where, self.threads),
                    sharding)
        r = None
        if codec.needs_reference:
            if ref is None:
                raise ChainError(f"{where}: a delta-coded expert without a reference")
            r = jax.device_put(ref(), sharding)
        out = device.decode_tree([fields], [{k: jnp.asarray(v) for k, v in entry.side.items()}],
                                 [r], plan=(codec,), dtypes=(entry.dtype,),
                                 shardings=(sharding,))[0]
        self._count(step, reader.bytes_read)
        return out

    def slot(self, group: str, name: str, step: int, expert: int) -> jax.Array:
        """The decoded slot leaf holding ``name``'s experts at ``step``: ``[.., K @ axis, ..]``,
        or a flat ``[R, ...]`` slot (one leaf's or a bundle's, ``unit["stored"]``).

        Only the rows planned with :meth:`need` are read and valid (all rows when none was
        planned); slot rows are whole pieces (:func:`orbax_lossy.format.grid.split_units`).
        """
        meta = self.meta(step, group=group, expert=expert)
        unit = _unit(meta["groups"][group], name)
        stored = unit.get("stored", name)
        key = (step, stored)
        if key not in self._slots:
            shape = self._entry(step, stored, group, expert).shape
            # every position the slot holds: (group, leaf name, layer, j) -> its box
            boxes: dict[tuple[str, str, int, int], tuple[tuple[int, int], ...]] = {}
            for g, rec in meta["groups"].items():
                for u in rec["units"]:
                    if u.get("stored", u.get("path")) != stored:
                        continue
                    flat = _flat_rows(u, rec["held"])
                    for lyr, row in enumerate(rec["held"]):
                        for j in range(len(row)):
                            box = [(0, n) for n in shape]
                            if flat is not None:
                                box[0] = (flat[lyr, j], flat[lyr, j] + 1)
                            else:
                                box[unit["expert_axis"]] = (j, j + 1)
                                if unit["layer_axis"] is not None:
                                    box[unit["layer_axis"]] = (lyr, lyr + 1)
                            boxes[g, u["path"], lyr, j] = tuple(box)
            wanted: list[tuple[str, str, int, int]] = sorted(self._need.get(key) or boxes)
            regions = None if set(wanted) == set(boxes) else [boxes[w] for w in wanted]

            def ref() -> jax.Array:
                got = {}
                for g, n, lyr, j in wanted:
                    rec = meta["groups"][g]
                    got[g, n, lyr, j] = self._expert_at(g, n, lyr, rec["held"][lyr][j],
                                                        rec["ref_step"][lyr][j], step)
                blank = jnp.zeros_like(next(iter(got.values())))
                if "rows" in unit:
                    at = {boxes[w][0][0]: w for w in boxes}
                    return jnp.stack([got.get(at[r], blank) for r in range(shape[0])])
                held = meta["groups"][group]["held"]
                return ops.from_canonical(jnp.stack([
                    jnp.stack([got.get((group, name, lyr, j), blank) for lyr in range(len(held))])
                    for j in range(len(held[0]))]), unit["expert_axis"], unit["layer_axis"])

            self._slots[key] = self._decode(step, stored, group, expert, ref, regions)
        return self._slots[key]

    def _expert_at(self, group: str, name: str, layer: int, e: int, step: int,
                   user: int) -> jax.Array:
        if step < 0:
            raise ChainError(f"group {group!r}: expert {e} of step {user} is a delta with no "
                             "earlier copy")
        return self.expert(group, name, layer, e, step)

    def expert(self, group: str, name: str, layer: int, e: int, step: int) -> jax.Array:
        """Expert ``e`` (layer ``layer``) of stacked leaf ``name`` as saved at ``step``."""
        rec, j = self._row(group, name, layer, e, step)
        unit = _unit(rec, name)
        flat = _flat_rows(unit, rec["held"])
        if flat is not None:
            return self.slot(group, name, step, e)[flat[layer, j]]
        canon = ops.expert_slices(self.slot(group, name, step, e), unit["expert_axis"],
                                  unit["layer_axis"])
        return canon[j, layer]

    def stored_value(self, step: int | None, name: str) -> jax.Array:
        """The decoded value of an expert leaf as stored at ``step`` (slot or held leaf)."""
        for (s, n), v in self._slots.items():
            if s == step and n == name:
                return v
        raise ChainError(f"{self.item_dir}: leaf {name!r} was not decoded")  # pragma: no cover
