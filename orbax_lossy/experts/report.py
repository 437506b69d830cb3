"""``partial_experts_report(item_dir)``: what restoring a step would give, from its PEC record.

Reads only the step's manifest and its small ``__pec__/meta`` record (no expert payload).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from orbax_lossy.errors import FormatError
from orbax_lossy.experts import accounting
from orbax_lossy.experts.record import META_NAME, _find
from orbax_lossy.experts.restore import _Context
from orbax_lossy.format.manifest import read_manifest
from orbax_lossy.format.steps import abspath, step_of


def partial_experts_report(
    item_dir: os.PathLike | str, *, total_assignments: Any = None,
) -> dict[str, Any]:
    """Per group, the step each expert would be restored from, the tokens lost, PLT and K.

    Keys: ``step``; ``expert_steps`` ``{group: [step per expert]}`` (``[[...] per layer]`` for
    scanned groups); ``held`` ``{group: experts this step stores}``; ``lost_tokens``
    ``{group: int}`` (tokens whose expert updates a restore of this step loses);
    ``plt`` (cumulative over earlier restores recorded in the step and this one, Eq. 7);
    ``plt_denominator`` (``"total_assignments"`` or ``"tokens_seen"``); ``k`` (K of this
    save), ``k_next`` (K after a restore of this step, Dynamic-K applied), ``k_history``,
    ``restores``, ``tokens_seen`` ``{group: int}``, ``full`` (this save holds every expert),
    ``cursor``, ``selection``, ``depends_on`` (steps a restore reads besides this one).
    """
    item_dir = abspath(item_dir)
    manifest = read_manifest(item_dir)
    if _find(manifest, META_NAME) is None:
        raise FormatError(f"{item_dir} holds no partial-experts record (not a PEC save)")
    ctx = _Context(item_dir, 1, [0])
    meta = ctx.meta(step_of(item_dir), manifest)
    counts = {g: accounting.GroupCounts.from_json(d) for g, d in meta["groups"].items()}
    lost_now = {g: c.unsaved.sum(axis=1) for g, c in counts.items()}
    for c, extra in zip(counts.values(), lost_now.values(), strict=True):
        c.lost_total = c.lost_total + extra
    ta = total_assignments if total_assignments is not None else meta.get("total_assignments")
    plt_value, label = accounting.plt(counts, ta)
    n_max = max(d["n"] for d in meta["groups"].values())
    threshold = meta.get("plt_threshold") if meta.get("dynamic_k", True) else None
    k_next = accounting.next_k(int(meta["k"]), n_max, plt_value, threshold)
    return {
        "step": meta["step"],
        "expert_steps": {g: (d["holder"][0] if d["layers"] == 1 else d["holder"])
                         for g, d in meta["groups"].items()},
        "held": {g: (d["held"][0] if d["layers"] == 1 else d["held"])
                 for g, d in meta["groups"].items()},
        "lost_tokens": {g: int(v.sum()) for g, v in lost_now.items()},
        "tokens_seen": {g: int(np.sum(c.tokens_total)) for g, c in counts.items()},
        "plt": plt_value,
        "plt_denominator": label,
        "k": int(meta["k"]),
        "k_next": k_next,
        "k_history": meta.get("k_history", []),
        "restores": meta.get("restores", []),
        "full": bool(meta.get("full")),
        "cursor": meta.get("cursor"),
        "selection": meta.get("selection"),
        "depends_on": list(manifest.header.depends_on),
    }
