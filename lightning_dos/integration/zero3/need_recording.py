"""The order the next forward needs the engine's sub-groups in, recorded in the first training forward and backward.

The forward's modules, each to the sub-groups holding its parameters (through ZeRO-3's partition offsets, as the
gathers wait for them), and, in the first backward at an accumulation boundary, the order DeepSpeed's copies make
each sub-group's gradient final; :func:`~lightning_dos.model.need_order.need_order` turns them into the engine's
:attr:`~lightning_dos.engine.loop.InterleavedUpdate.need_order`, which the planner plans with too.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dos.model.need_order import need_order
from lightning_dos.planning.forward_order import ForwardRecorder


class NeedRecording:
    """Records the need order (a part of :class:`~lightning_dos.integration.zero3.adapter.ZeRO3Adapter`, which holds
    the state it reads: ``zero``, ``engine``, ``_sub_groups_of_params``, ``_expected``)."""

    def _record_need_order(self, z: object) -> None:
        """Hook the model's modules (ZeRO-3's offload holds the module it was initialised with)."""
        self._forward_record: ForwardRecorder | None = ForwardRecorder(z.parameter_offload.module)
        #: Sub-groups in the order the first boundary's gradient copies made them final; None once recorded.
        self._final_record: list[int] | None = []
        self._final_missing: list[int] | None = None

    def _need_forward_begins(self) -> None:
        """A training forward begins: record it if none was recorded yet."""
        record = self._forward_record
        if record is not None and not record.calls:
            record.recording = True

    def _need_backward_begins(self) -> None:
        """Backward begins: the forward is recorded; the engine takes its order now (ties by index until backward's
        finality is known)."""
        record = self._forward_record
        if record is not None and record.recording:
            record.remove()
            self._set_need_order()

    def _need_gradient_copied(self, overlaps: object) -> None:
        """DeepSpeed copied a reduced gradient (``overlaps``: (sub-group, elements) pairs) at the first boundary:
        note the sub-groups it made final."""
        final = self._final_record
        if final is None:
            return
        if self._final_missing is None:
            self._final_missing = list(self._expected)
        for index, count in overlaps:
            self._final_missing[index] -= count
            if self._final_missing[index] == 0:
                final.append(index)

    def _need_backward_ended(self) -> None:
        """The first boundary's backward is over: ties in the order go by its finality from now on."""
        if self._final_record and self._forward_record is not None and self._forward_record.calls:
            self._set_need_order(self._final_record)
            self._final_record = None

    def _set_need_order(self, final: Sequence[int] = ()) -> None:
        record = self._forward_record
        gathers = record.gathers(self._sub_groups_of_params)
        if any(gathers):
            self.engine.set_need_order(need_order(len(self.engine.sub_groups), gathers, final))
