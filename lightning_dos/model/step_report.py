"""What one optimizer step did: bytes moved, time taken, and (when timing is on) a span per operation.

The engine fills a :class:`StepReport` every step. The performance model refines its rates from it,
the monitor callback logs it, and the timeline writer turns its spans into a Chrome trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_dos.model.plan import Plan

#: The lanes of the update pipeline, one per kind of operation. ``host_adam`` covers a host
#: sub-group's Adam and its cast into 16-bit staging; ``host_speculate`` the same done during backward before the
#: gradient norm is known (its untouched state copied first; committed or redone once backward ends);
#: ``upload`` carries device sub-groups' fp32 state up; ``lp_upload`` carries host sub-groups' 16-bit parameters up
#: on a stream of its own.
LANES = ("host_adam", "host_speculate", "upload", "device_adam", "cast", "download", "lp_upload")


@dataclass(frozen=True)
class Span:
    """One operation on one sub-group.

    Attributes:
        lane: one of :data:`LANES`.
        sub_group: index of the sub-group it worked on.
        start_s: start, in seconds since the start of the step's update phase.
        end_s: end, same clock.
        nbytes: bytes moved (transfers) or elements processed times 4 (kernels).
    """

    lane: str
    sub_group: int
    start_s: float
    end_s: float
    nbytes: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class StepReport:
    """The engine's account of one optimizer step.

    Attributes:
        step: the global optimizer step this report belongs to (1-based; skipped steps included).
        plan: the placement that was executed (after any fallback to the host).
        sizes: element count of every sub-group.
        skipped: True when the step was skipped (fp16 loss-scale overflow); nothing was updated.
        update_s: wall time of the engine's update loop, from its first launch to the last byte home.
        predicted_s: the performance model's prediction for this plan, when one was made.
        predicted_iteration_s: the whole iteration's prediction (forward, backward and this update, overlapped as
            the framework runs them) for the measured forward and backward, when the planner made one.
        h2d_bytes: bytes copied host-to-device during the update.
        d2h_bytes: bytes copied device-to-host during the update.
        host_elements: elements updated by host Adam.
        device_elements: elements updated by device Adam.
        device_staging_bytes: device bytes held by staging buffers during the update (peak).
        pinned_bytes: host bytes held by the engine's buffer pool (pinned when pinning works).
        fallback_host: sub-groups the plan put on the device but that ran on the host because device
            staging could not be allocated.
        speculated: host sub-groups updated during backward, before the step's fate was known (whether it is taken,
            and with which gradient factor: clipping, fp16 loss scaling).
        committed: whether those speculative updates were kept (the step was taken and not clipped); None when none
            was made. When False they were undone and updated again with the real factor (or the step was skipped).
        early: the host sub-groups whose update begun during backward is the step's (committed, or exact where the
            engine ran without speculation), in the order they were kept.
        commit_s: seconds the update's thread spent committing the speculative updates once backward ended (each
            16-bit result copied towards the parameters and its upload issued; the state itself is not copied).
        spans: one :class:`Span` per operation, only when timing is enabled.
    """

    step: int
    plan: Plan
    sizes: tuple[int, ...]
    skipped: bool = False
    update_s: float = 0.0
    predicted_s: float | None = None
    predicted_iteration_s: float | None = None
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    host_elements: int = 0
    device_elements: int = 0
    device_staging_bytes: int = 0
    pinned_bytes: int = 0
    fallback_host: list[int] = field(default_factory=list)
    speculated: int = 0
    committed: bool | None = None
    early: tuple[int, ...] = ()
    commit_s: float = 0.0
    spans: list[Span] = field(default_factory=list)

    @property
    def device_share(self) -> float:
        """Share of elements updated on the device this step."""
        total = self.host_elements + self.device_elements
        return self.device_elements / total if total else 0.0
