"""Temporary: LossyCheckpointHandler with the partial-experts hooks (until handler.py has them)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from orbax_lossy.format.steps import final_path
from orbax_lossy.handler import LossyCheckpointHandler


class PartialExpertsHandler(LossyCheckpointHandler):
    def __init__(self, *a: Any, partial_experts: Any = None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.partial_experts = partial_experts
        self._pec_pending: dict[str, Any] = {}

    async def async_save(self, directory, args):
        pec = self.partial_experts
        if pec is None:
            return await super().async_save(directory, args)
        item_dir = final_path(os.path.abspath(os.fspath(directory)))
        item = os.path.basename(item_dir)
        self._await_reference(item)
        prepared = pec.prepare_save(item_dir, args)
        self._pec_pending[item] = prepared
        return await super().async_save(directory, prepared.args)

    def _choose_reference(self, item_dir, paths, signature, force_base):
        item = os.path.basename(item_dir)
        prepared = self._pec_pending.get(item)
        if prepared is None:
            return super()._choose_reference(item_dir, paths, signature, force_base)
        held = self._references.get(item)
        patched = prepared.reference(held, paths, signature)
        if patched is None:
            self._references.pop(item, None)
        else:
            self._references[item] = patched
        try:
            return super()._choose_reference(item_dir, paths, signature, force_base)
        finally:
            if held is not None:
                self._references[item] = held

    def _record_dependencies(self, item_dir, steps):
        prepared = self._pec_pending.get(os.path.basename(item_dir))
        if prepared is not None and prepared.step is not None:
            steps = set(steps) | set(prepared.extra_dependencies)
        super()._record_dependencies(item_dir, steps)

    def _publish(self, request, signature, encoded):
        item = os.path.basename(request.item_dir)
        prepared = self._pec_pending.pop(item, None)
        if prepared is not None:
            encoded.header = dataclasses.replace(
                encoded.header, extra_dependencies=prepared.extra_dependencies)
        super()._publish(request, signature, encoded)
        if prepared is not None:
            prepared.publish(self._references.get(item))

    def restore(self, directory, args=None):
        if self.partial_experts is not None:
            self._await_reference(os.path.basename(final_path(os.fspath(directory))))
            out = self.partial_experts.restore(self, directory, args)
            if out is not NotImplemented:
                return out
        return super().restore(directory, args)
