"""The step: one optimizer update run through the engine's parts, in order.

:class:`StepLoop` builds the step's :class:`~lightning_dos.engine.context.StepContext` and hands it to each part in
turn: backward's early updates (a step begun during backward), then the device budget and the resident set, the
streamed lane, the host lane, and the recovery when something interrupts them. It owns what lasts from one step to
the next: the step count, the reports, whether the state is torn, the gradient copies the next step waits for, and
what the framework told it (the order the next forward needs sub-groups in, the NVMe tier's order, the test seam,
whether to time each operation).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import PRE_STEP, TornStateError, UpdateInterrupted, UpdateProgress
from lightning_dos.engine.budget import DeviceBudget
from lightning_dos.engine.context import PointHook, StepContext, UpdateSetup
from lightning_dos.engine.early import EarlyOutcome, ExactUpdates, SpeculativeUpdates, update_during_backward
from lightning_dos.engine.file_backed import files_backwards
from lightning_dos.engine.homes import SlabHomes
from lightning_dos.engine.host_side import HostLane
from lightning_dos.engine.in_flight import UpdateLanding
from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.recovery import settle_interrupted_update, take_on_host
from lightning_dos.engine.reports import ReportLog
from lightning_dos.engine.resident import ResidentSet
from lightning_dos.engine.streamed import StreamedLane
from lightning_dos.model.nvme import ALTERNATE
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.step_report import StepReport


class StepLoop:
    """Runs steps through the engine's parts.

    Args:
        setup: what the engine's parts share.
        budget: the device memory the update may use.
        landing: the hand-off of the update to its readers (and the guard readers of the state wait on).
        resident: the resident set.
        streamed: the streamed lane.
        host: the host lane.
        device_update: the update of a sub-group placed on the device (``kernels.apply_update`` on an accelerator;
            the host's compiled kernel when the device is the host's own CPU, so every placement computes the same
            bits).
    """

    def __init__(
        self,
        setup: UpdateSetup,
        budget: DeviceBudget,
        landing: UpdateLanding,
        resident: ResidentSet,
        streamed: StreamedLane,
        host: HostLane,
        device_update: Callable[..., None],
    ) -> None:
        self.setup, self.budget, self.landing = setup, budget, landing
        self._resident, self._streamed, self._host = resident, streamed, host
        self.sizes = tuple(sg.numel for sg in setup.sub_groups)
        self.device_update = device_update
        self.reports = ReportLog()
        #: Optimizer steps taken (skipped ones included); the step under way counts.
        self.steps_taken = 0
        self._timing = self._started_timing = False
        self._on_point: PointHook | None = None
        #: The step under way (None between steps).
        self._ctx: StepContext | None = None
        #: Backward's phase of the last step begun during backward (None before any).
        self._early: EarlyOutcome | None = None
        #: When the gradient copies of the backwards since the last step land (:meth:`backward_ended`).
        self._backward_ends: list[object] = []
        self._warned_fallback = False
        self._torn: str | None = None
        self._files_order = ALTERNATE
        self._need_order: tuple[int, ...] = ()

    def use_device_update(self, update: Callable[..., None]) -> None:
        """Run ``update`` (same arguments as :func:`~lightning_dos.engine.kernels.apply_update`) as the device update
        from the next step on: a seam for tests, which inject a device failure after its kernels are queued."""
        self.device_update = update

    def update_started(self) -> None:
        """An update is started on the engine's thread: it records spans as :meth:`record_timing` asks now (it runs
        on past the batch that asked)."""
        self._started_timing = self._timing

    def backward_ended(self, event: object) -> None:
        """Backward has issued its last gradient copy (into the host buffers, or a kept gradient into a resident
        sub-group's device slot, :meth:`keep_gradient`), and ``event`` was recorded after it on the stream it was
        issued on (DeepSpeed's reduce stream): the next step waits for ``event`` before it reads any gradient, and
        for nothing else queued on the device. None: the copies are complete already (a synchronous device). Called
        after every backward; the step waits for every event handed over since the last step."""
        if event is not None:
            self._backward_ends.append(event)

    def forget_backward(self) -> None:
        """A step was skipped: what its backward handed over is not read."""
        self._resident.forget_kept()
        self._backward_ends.clear()

    @property
    def progress(self) -> UpdateProgress | None:
        """How far each sub-group of the step under way has got (None between steps)."""
        ctx = self._ctx
        return ctx.progress if ctx is not None else None

    @property
    def updated_early(self) -> list[int]:
        """Sub-groups the last step begun during backward updated then, in the order their gradients became final
        (speculated ones once committed)."""
        return self._early.updated if self._early is not None else []

    def watch_points(self, hook: PointHook | None) -> None:
        """Call ``hook(point, sub_group)`` at named points inside the update (a sub-group's gradient unscaled, its state
        updated, its download begun, it is done; a resident sub-group's flush home; a speculation; the adapter adds
        ``step_count`` per flat partition as it stores step counts). A test seam: tests fire signals and inject
        failures there. None (the default) costs nothing."""
        self._on_point = hook

    @property
    def on_point(self) -> PointHook | None:
        """The hook :meth:`watch_points` set (the adapter calls it too, as it stores step counts)."""
        return self._on_point

    def record_timing(self, enabled: bool) -> None:
        """Record a span per operation (the monitor turns this on; off costs nothing). Read when the step is called, or
        when :meth:`start` is, for the update it starts: an overlapped update runs on past the batch that asked."""
        self._timing = enabled

    @property
    def timing(self) -> bool:
        return self._timing

    def set_need_order(self, order: Sequence[int]) -> None:
        """Every sub-group, in the order the next forward needs them (``Plan.order``; recorded by the framework in the
        first forward, :func:`~lightning_dos.model.need_order.need_order`): each step launches device work, runs host
        work and lands 16-bit results in this order, so that the next forward's first gathers wait for their own
        sub-groups, not for the rest of the update. Empty: index order. A plan with an order of its own keeps it."""
        self._need_order = tuple(order)

    @property
    def need_order(self) -> tuple[int, ...]:
        return self._need_order

    def take_files_in(self, order: str) -> None:
        """The order the file-backed host sub-groups are taken in (``model.nvme.ORDERS``): ``"alternate"`` (reversed
        every other step, the default) until the ratio scheduler chooses from the model
        (``model.nvme.choose_files_order``)."""
        self._files_order = order

    @property
    def files_order(self) -> str:
        return self._files_order

    def files_backwards(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) takes the file-backed host sub-groups backwards: every even one, in
        the alternating :attr:`files_order`."""
        return files_backwards(self._files_order, step)

    def mark_torn(self, why: str) -> None:
        """The state in this process mixes two steps (``why``): refuse to step or to be checkpointed."""
        self._torn = why

    def clear_torn(self) -> None:
        """The host slabs were just loaded whole (a checkpoint): the state is consistent again."""
        self._torn = None

    @property
    def torn(self) -> str | None:
        """Why an interrupted update left the state mixing two steps, or None."""
        return self._torn

    def skip(self, plan: Plan) -> StepReport:
        """Record a skipped step (fp16 overflow): nothing is touched."""
        self.forget_backward()
        self.steps_taken += 1
        return self.reports.issue(StepReport(self.steps_taken, plan, self.sizes, skipped=True))

    def run(self, homes: SlabHomes, plan: Plan, inputs: StepInputs, arrivals: GradientArrivals | None) -> StepReport:
        """Update every sub-group once, placed as ``plan`` says, their state where ``homes`` says
        (:meth:`~lightning_dos.engine.loop.InterleavedUpdate.step` explains the step)."""
        if len(plan.places) != len(self.setup.sub_groups):
            raise ValueError(f"plan has {len(plan.places)} places for {len(self.setup.sub_groups)} sub-groups")
        if self._torn is not None:
            raise TornStateError(self._torn)
        with self.landing.guard.updating():
            self.steps_taken += 1
            releases = self.landing.open_for_step()
            ctx = self._ctx = StepContext(
                plan, inputs, UpdateProgress(), self._new_report(plan, inputs), self.setup.streams, homes,
                self.device_update, self._on_point, self._timing if releases else self._started_timing,
            )  # fmt: skip
            try:
                with self._torn_if_raised():
                    try:
                        return self._phases(ctx, arrivals)
                    except TornStateError:
                        raise  # backward's phase changed state and the step cannot complete: nothing to finish or undo
                    except BaseException as error:  # noqa: BLE001 - every interruption is finished, then re-raised
                        return self._settle(ctx, error)
            finally:
                if self._torn is None:
                    homes.settle()
                self._ctx = None
                self._resident.forget_kept()  # read by this step (or not at all): the next backward writes anew
                self._backward_ends.clear()  # waited for by this step (or a step skipped during backward)
                if releases:
                    self.landing.end()

    def _phases(self, ctx: StepContext, arrivals: GradientArrivals | None) -> StepReport:
        """Backward's phase (a step begun during backward), then the update of the rest."""
        early = None
        if arrivals is not None:
            early = self._during_backward(ctx, arrivals)
            if early.report.skipped:
                return self.reports.issue(early.report)
        return self._update(ctx, early)

    @contextlib.contextmanager
    def _torn_if_raised(self) -> Iterator[None]:
        """A :class:`TornStateError` raised inside marks the engine torn (it refuses to step or be checkpointed)."""
        try:
            yield
        except TornStateError as torn:
            self._torn = str(torn)
            raise

    def _new_report(self, plan: Plan, inputs: StepInputs) -> StepReport:
        """This step's report for ``plan``, with the planner's predictions it was chosen by."""
        return StepReport(
            self.steps_taken, plan, self.sizes, predicted_s=inputs.predicted_s,
            predicted_iteration_s=inputs.predicted_iteration_s,
        )  # fmt: skip

    def _during_backward(self, ctx: StepContext, arrivals: GradientArrivals) -> EarlyOutcome:
        """Backward's phase: host sub-groups updated as their gradients become final (:mod:`~.early`), speculatively
        when the step's gradient factor is a guess and spare slots are there to take the results."""
        outcome = self._early = EarlyOutcome(ctx.report)
        speculative = ctx.inputs.speculative and ctx.homes.spare.slots > 0
        updates = SpeculativeUpdates(self._host, ctx.homes.spare) if speculative else ExactUpdates(self._host)
        update_during_backward(ctx, arrivals, outcome, updates, self._resident)
        if outcome.not_taken:
            self.steps_taken -= 1  # backward never ended: the step was not taken
        return outcome

    def _settle(self, ctx: StepContext, error: BaseException) -> StepReport:
        """Leave the state pre-step or post-step after ``error`` interrupted the update (:mod:`~.recovery`)."""
        try:
            report, warning = settle_interrupted_update(ctx, self.setup, self._resident, error)
        except UpdateInterrupted as interrupted:
            if interrupted.state == PRE_STEP:
                self.steps_taken -= 1
            if interrupted.report is not None:  # post-step: the step is taken, and reported
                self.reports.issue(interrupted.report)
            raise
        self.reports.issue(report)
        # The warning names the training loop's call (through step() and the observer's hook).
        warnings.warn(warning, RuntimeWarning, stacklevel=6)
        return report

    def _update(self, ctx: StepContext, early: EarlyOutcome | None) -> StepReport:
        homes = ctx.homes
        streams, resident = self.setup.streams, self._resident
        # DeepSpeed copies gradients into the host buffers (and keep_gradient into resident sub-groups' device slots)
        # with non-blocking copies on its reduce stream during backward; the framework records an event there at the
        # end of backward (backward_ended). The host waits for just that work before any host update reads a gradient,
        # any upload re-reads one or any device update reads a kept one: not for the whole device, where (overlap) the
        # training thread goes on queueing the next forward meanwhile.
        ended, self._backward_ends = self._backward_ends, []
        for event in ended:
            streams.host_wait(event)
        if early is None:
            streams.start_timeline(ctx.timing)
        wall_start = time.perf_counter()

        plan = ctx.plan if ctx.plan.order else ctx.plan.in_order(self._need_order)
        requested = plan
        plan = self.budget.fit_to_budget(homes.placed(plan), self.budget.device_budget())
        ctx.use_plan(plan)
        # State leaving the device (the plan moved it, or it no longer fits) comes home first.
        resident.evict([i for i in resident.indices if plan.places[i] != Place.RESIDENT], ctx.reached)
        # State held in spare slots (pageable memory) goes to the device from the pinned slabs.
        homes.bring_home([i for i in homes.spare.held if plan.places[i] != Place.HOST])
        buffers = self._streamed.allocate(plan)
        if buffers is None:
            self._warn_fallback("device staging could not be allocated (out of memory)")
            plan, buffers = plan.with_host(plan.streamed_indices), []
            ctx.use_plan(plan)
        failed = resident.make_resident(ctx)
        if failed:
            self._warn_fallback("resident optimizer state could not be allocated (out of memory)")
            ctx.use_plan(plan := plan.with_host(failed))
        order = homes.host_order(plan, self.steps_taken, self._files_order)  # before reads ahead change the slabs
        homes.begin(plan, order, early.updated if early is not None else (), self._files_order)
        report = ctx.report = self._new_report(plan, ctx.inputs)
        if early is not None:  # what backward's phase did counts in this step's report
            report.host_elements, report.h2d_bytes = early.report.host_elements, early.report.h2d_bytes
            report.update_s = early.report.update_s
            report.speculated, report.committed = early.report.speculated, early.report.committed
            report.early, report.commit_s = early.report.early, early.report.commit_s
        report.fallback_host = [i for i in requested.device_indices if plan.places[i] == Place.HOST]
        if report.fallback_host:
            self._warn_fallback(f"{len(report.fallback_host)} sub-group(s) did not fit the device memory budget")
        report.device_staging_bytes = self.setup.pool.device_bytes_in_use + self.setup.pool.resident_bytes
        report.pinned_bytes = self.setup.pool.pinned_bytes

        tails = resident.run(ctx)
        tails += self._streamed.launch(ctx, buffers)
        # The device side is all issued (it is launched first, and ends long before the host side): its staging goes
        # back to the caching allocator now, not with the host side's end, so the next forward has that memory.
        self._streamed.release_staging(buffers)
        skip = set(early.updated) if early is not None else set()
        tails += self._host.run(ctx, order, skip, early.tail if early is not None else None)
        # Resident sub-groups end on the compute stream (their cast); with parameter offload their 16-bit
        # downloads are among the tails already.
        tails.append(streams.record(streams.compute))

        # The update ends when the last byte is home: host slabs consistent for checkpoints, every
        # 16-bit parameter in place for the next forward.
        for event in tails:
            streams.host_wait(event)
        homes.settle()
        report.update_s += time.perf_counter() - wall_start
        report.spans = streams.spans() if ctx.timing else []
        return self.reports.issue(report)

    def take_on_host(self, homes: SlabHomes, inputs: StepInputs, interrupted: UpdateInterrupted) -> UpdateInterrupted:
        """Take, whole on the host, a step that ``interrupted`` stopped before it changed anything, when the caller has
        already counted it (:func:`~lightning_dos.engine.recovery.take_on_host`); return the post-step
        :class:`UpdateInterrupted` to report. Raises :class:`TornStateError` (and the engine is torn) if the host
        fails too."""
        self.steps_taken += 1
        all_host = Plan((Place.HOST,) * len(self.setup.sub_groups))
        ctx = StepContext(
            all_host, inputs, UpdateProgress(), self._new_report(all_host, inputs), self.setup.streams, homes,
            self.device_update, self._on_point,
        )  # fmt: skip
        try:
            with self._torn_if_raised():
                report, result = take_on_host(ctx, self.setup, self._resident, interrupted)
        except TornStateError:
            self.steps_taken -= 1
            raise
        self.reports.issue(report)
        return result

    def reached(self, point: str, index: int) -> None:
        """A point passed outside the step's own lanes (a flush home): recorded in the step under way, if any."""
        ctx = self._ctx
        if ctx is not None:
            ctx.reached(point, index)
        elif self._on_point is not None:
            self._on_point(point, index)

    def _warn_fallback(self, why: str) -> None:
        """Warn once per engine that device sub-groups ran on the host (same result, slower); every step's
        fallback is in its report (``fallback_host``) and logged by the monitor."""
        if not self._warned_fallback:
            warnings.warn(
                f"lightning-dos: {why}; those sub-groups are updated on the host instead. The result is "
                "the same, only slower. Lower gpu_fraction or raise gpu_memory_budget to avoid this; "
                "DOSMonitor logs dos/fallback_subgroups every step.",
                RuntimeWarning,
                stacklevel=6,  # the training loop's call of the engine's step (through the observer's hook)
            )
            self._warned_fallback = True

    # -- the update in flight (:mod:`~lightning_dos.engine.in_flight`) ---------------------------------------------
