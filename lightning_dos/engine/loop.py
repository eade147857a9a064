"""The interleaved update loop: device sub-groups stream through the accelerator while the CPU updates the rest.

One optimizer step, given a :class:`~lightning_dos.model.plan.Plan`:

1. Device sub-groups are launched first, all of them, because on an accelerator every launch is
   asynchronous: for each one the ``h2d`` stream uploads master weights, optimizer state and gradient
   into a staging buffer, the compute stream runs the update and casts the result into DeepSpeed's
   16-bit partition, and the ``d2h`` stream brings master weights and state home. Events chain these so no copy
   races a kernel, and a staging buffer is reused only once its previous download has finished.
2. While that pipeline runs, the CPU works through the host sub-groups: the update on the pinned slabs,
   a cast into pinned 16-bit staging, and an asynchronous upload on the ``lp_h2d`` stream.
3. The step ends when every download and upload has landed, so the host slabs are consistent
   (checkpoints read them) and all 16-bit parameters are in place before the next forward.

A caller may run the step on a background thread (:meth:`InterleavedUpdate.start`) and go on: each sub-group
is marked landed, with the event its 16-bit result lands at, as soon as that result is issued, so a reader
waits for just the sub-groups it needs (:meth:`InterleavedUpdate.wait_sub_groups`), and
:meth:`InterleavedUpdate.wait_all` waits for the rest and raises, on the caller's thread, what interrupted it.

The optimizer is an :class:`~lightning_dos.model.update_rules.UpdateRule` (Adam, Adagrad, Lion): the loop
moves the master weights and whichever state tensors the rule names, in their dtypes, and never branches
on which optimizer it runs. This module knows nothing of Lightning or DeepSpeed: the adapter hands it flat
tensors.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence

import torch

from lightning_dos.engine import native
from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import TornStateError, UpdateGuard, UpdateProgress
from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.kept_gradients import KeptGradients, sub_groups_of
from lightning_dos.engine.kernels import apply_update, host_update, step_tensor
from lightning_dos.engine.pool import BufferPool, DeviceBuffer
from lightning_dos.engine.recovery import settle_interrupted_update
from lightning_dos.engine.streams import Streams, make_streams
from lightning_dos.model.budget_fit import fit_to_budget, plan_device_bytes
from lightning_dos.model.perfmodel import FREE_MEMORY_MARGIN
from lightning_dos.model.plan import Place, Plan, SubGroup, split_into_sub_groups
from lightning_dos.model.step_report import StepReport
from lightning_dos.model.update_rules import ADAM, Footprint, UpdateRule


class InterleavedUpdate:
    """Runs the optimizer over the rank's master partition, sub-group by sub-group, on host and device at once.

    Args:
        flat_numels: element count of each DeepSpeed flat partition, in order.
        flat_param_groups: optimizer param group of each flat partition.
        sub_group_size: largest number of elements per sub-group.
        device: the accelerator device sub-groups are updated on (``cuda:N``, or ``cpu`` with no GPU).
        lp_dtype: dtype of the model's parameters.
        pin: pin host memory when CUDA is available.
        gpu_memory_budget: bytes of device memory the engine may hold at any point of the iteration: resident
            state (kept through forward and backward) plus, during the update, its streaming buffers; so it is
            memory spare at the forward/backward peak. None: the update's streaming buffers are sized from the
            memory free at its start (and, with :attr:`overlapping`, from what was spare at the last forward/backward
            peak), less a 10% margin, and freed once its device side is issued. Streaming buffers are never held
            between updates.
        streams: the streams all asynchronous work is issued through; None picks the real ones for
            ``device`` (CUDA streams on a GPU, synchronous no-ops on CPU). Tests and tools pass a simulated
            accelerator (``lightning_dos.sim``) here; it must be for ``device``.
        lp_device: where the model's 16-bit parameters live when DeepSpeed offloads them (``cpu``): device
            sub-groups are then cast on the device and their 16-bit result is downloaded, and host sub-groups
            are cast straight into them. None: they live on ``device`` (host memory when ``streams`` are
            synchronous; a simulated accelerator's CPU memory stands for device memory).
        rule: the optimizer's update rule (Adam by default).
        master_dtype: dtype of the master weights and gradients: fp32, or bf16 under DeepSpeed's
            ``bf16_master_weights_and_grads``.
        state_dtype: dtype of the rule's state tensors: fp32, or bf16 under ``bf16_optimizer_states``.
        keep_resident_grads: the framework hands each final gradient to :meth:`keep_gradient` during backward, so
            resident sub-groups read their gradient on the device instead of uploading the host copy (the
            performance model counts no upload for them).
    """

    def __init__(
        self,
        flat_numels: Sequence[int],
        flat_param_groups: Sequence[int],
        sub_group_size: int,
        device: torch.device,
        lp_dtype: torch.dtype,
        pin: bool = True,
        gpu_memory_budget: int | None = None,
        streams: Streams | None = None,
        lp_device: torch.device | None = None,
        rule: UpdateRule = ADAM,
        master_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        keep_resident_grads: bool = False,
    ) -> None:
        self.rule = rule
        #: Bytes per element held and moved, for the rule and dtypes (the performance model's and the reports').
        self.footprint = Footprint.of(rule, master_dtype, state_dtype, grads_on_device=keep_resident_grads)
        #: Side streams, made once: the same streams every step, so their order is easy to follow in a profiler.
        self.streams = streams if streams is not None else make_streams(device)
        self.sub_groups: list[SubGroup] = split_into_sub_groups(flat_numels, flat_param_groups, sub_group_size)
        self.sizes = tuple(sg.numel for sg in self.sub_groups)
        self.flat_offsets = [0]
        for numel in flat_numels:
            self.flat_offsets.append(self.flat_offsets[-1] + numel)
        self.device = device
        self.lp_dtype = lp_dtype
        self.lp_bytes = torch.empty((), dtype=lp_dtype).element_size()
        lp_on_host = lp_device.type == "cpu" if lp_device is not None else not self.streams.is_async
        #: Device sub-groups' 16-bit results must come down to host-resident 16-bit parameters.
        self.lp_downloads = lp_on_host and self.streams.is_async
        self.pool = BufferPool(
            self.flat_offsets[-1],
            lp_dtype,
            device,
            pin,
            lp_on_host=lp_on_host,
            largest_sub_group=max(self.sizes, default=0),
            accelerated=self.streams.is_async,
            allocate=self.streams.empty,
            rule=rule,
            master_dtype=master_dtype,
            state_dtype=state_dtype,
        )
        self.gpu_memory_budget = gpu_memory_budget
        #: The update of a sub-group placed on the device (streamed or resident): the accelerator's, the rule's torch
        #: formula (``kernels.apply_update``), whatever device its tensors are on, so a simulated accelerator runs
        #: what a GPU runs; without one (a CPU device, synchronous streams) the device is the host's own CPU and runs
        #: the host's compiled kernel, and every placement computes the same bits.
        self.device_update = apply_update if self.streams.is_async else host_update
        #: The update overlaps the next forward (the framework's ``overlap`` is on): with no ``gpu_memory_budget`` its
        #: staging is sized within what was spare at the forward/backward peak too (:meth:`device_budget`).
        self.overlapping = False
        #: The most device bytes held at once during the last forward and backward (the framework measures it:
        #: ``torch.cuda.max_memory_allocated`` over them); None until known.
        self.forward_backward_peak: int | None = None
        # Build the compiled host update now, not in the first step; say so once if torch's kernels stand in.
        native.warn_if_unavailable()
        #: Record a span per operation (the monitor turns this on; off costs nothing). Read when the step is called,
        #: or when :meth:`start` is, for the update it starts: an overlapped update runs on past the batch that asked.
        self.timing = False
        self._started_timing = False
        self._step_timing = False
        #: How many step reports the engine has issued, and the most recent ones (an overlapped update issues its
        #: report after the step returned: a monitor fetches it by number, :meth:`report_number`).
        self.reports_issued = 0
        self._recent_reports: deque[StepReport] = deque(maxlen=8)
        self.last_report: StepReport | None = None
        self.steps_taken = 0
        #: This machine's calibrated rates (a ``HardwareRates``), set by the scheduler when it measures them.
        self.rates = None
        #: Sub-groups whose state lives on the device across iterations, by index.
        self.resident: dict[int, DeviceBuffer] = {}
        #: Resident sub-groups whose gradient this backward wrote into their device buffer (:meth:`keep_gradient`):
        #: the buffer written and how many of its elements.
        self.kept = KeptGradients(self.sub_groups)
        #: When the gradient copies of the backwards since the last step land (:meth:`backward_ended`).
        self._backward_ends: list[object] = []
        self._warned_fallback = False
        #: Readers of the optimizer state (checkpoints) wait on this while an update is in flight.
        self.guard = UpdateGuard()
        #: Set, with the reason, when an interrupted update could be neither finished nor undone.
        self.torn: str | None = None
        #: Test seam: called as ``on_point(point, sub_group)`` at named points inside the update (a
        #: sub-group's gradient unscaled, its state updated, its download begun, it is done; a resident
        #: sub-group's flush home; the adapter adds ``step_count`` per flat partition as it stores step
        #: counts). Tests fire signals and inject failures there. None costs nothing.
        self.on_point: Callable[[str, int], None] | None = None
        self._progress: UpdateProgress | None = None
        #: Sub-groups of the update in flight whose 16-bit result has been issued, with the event it lands at
        #: (None on a synchronous device); None when no update is in flight. Guarded by :attr:`_landing`.
        self._landed: dict[int, object] | None = None
        #: The last update's landing events, kept once it is over (a race checker's model of the forward reads them).
        self._last_landed: dict[int, object] = {}
        self._landing = threading.Condition()
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        #: Backward's hand-over to a step begun during backward (:meth:`begin_early`); None otherwise.
        self.arrivals: GradientArrivals | None = None
        #: Sub-groups the last step updated during backward, in the order their gradients became final.
        self.updated_early: list[int] = []
        self._early_tail: object = None

    @property
    def last_report(self) -> StepReport | None:
        """The report of the last step the engine finished (or skipped)."""
        return self._last_report

    @last_report.setter
    def last_report(self, report: StepReport | None) -> None:
        self._last_report = report
        if report is not None:
            self.reports_issued += 1
            self._recent_reports.append(report)

    def report_number(self, number: int) -> StepReport | None:
        """The ``number``-th report issued (1-based), while it is among the recent ones; None before it is issued."""
        back = self.reports_issued - number
        return self._recent_reports[-1 - back] if 0 <= back < len(self._recent_reports) else None

    # -- overlapping the update with what follows it ----------------------------------------------

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` (an update: :meth:`step` and what its caller stores with it) on a background thread and
        return at once; :meth:`wait_sub_groups` and :meth:`wait_all` are the points that wait for it.

        The thread holds :attr:`guard` for the whole of ``work``, so readers on other threads wait for it; the
        call returns only once the thread holds it. An exception ``work`` raises is raised by :meth:`wait_all`.
        """
        self.wait_all()
        self._started_timing = self.timing
        with self._landing:
            self._landed = {}
        # Released once the thread holds the guard (a semaphore: a thread's start, not a stream's order).
        holding = threading.Semaphore(0)

        def run() -> None:
            try:
                with self.guard.updating():
                    holding.release()
                    # A new thread's current device is device 0, not the engine's: select it before any stream
                    # operation (leaving a stream context would otherwise make a CUDA context on GPU 0).
                    self.streams.bind_thread()
                    work()
            except BaseException as error:  # noqa: BLE001 - raised on the caller's thread by wait_all
                self._background_error = error
            finally:
                self._end_landing()

        self._background = threading.Thread(target=run, name="lightning-dos-update", daemon=True)
        self._background.start()
        holding.acquire()

    def begin_early(self, work: Callable[[GradientArrivals], None]) -> None:
        """Start a step during backward: ``work(arrivals)`` runs on the background thread (as :meth:`start`) and
        passes ``arrivals`` to :meth:`step`, which updates host sub-groups as :meth:`grads_final` reports their
        gradients final, then waits for :meth:`end_backward` to run (or skip) the rest of the step."""
        arrivals = GradientArrivals()
        self.start(lambda: work(arrivals))
        self.arrivals = arrivals

    def grads_final(self, index: int, event: object = None) -> None:
        """Sub-group ``index``'s gradient is final (``event``: when its copy lands; None once it has)."""
        if self.arrivals is not None:
            self.arrivals.arrive(index, event)

    def end_backward(self, proceed: bool, abandoned: bool = False) -> None:
        """Backward is over: ``proceed`` runs the rest of the step begun by :meth:`begin_early`; False skips it (the
        step's gradient norm is not finite); ``abandoned``: backward never finished, so the step is not taken. No-op
        when no step was begun."""
        arrivals, self.arrivals = self.arrivals, None
        if arrivals is not None:
            ended = GradientArrivals.RUN if proceed else GradientArrivals.SKIP
            arrivals.end(GradientArrivals.ABANDON if abandoned else ended)

    @property
    def in_flight(self) -> bool:
        """An update started by :meth:`start` has not been waited for by :meth:`wait_all` yet."""
        return self._background is not None

    def wait_sub_groups(self, indices: Sequence[int], stream: object = None) -> None:
        """Block until the 16-bit parameters of sub-groups ``indices`` hold the update in flight's result (at
        once when none is in flight); an update that fails is finished or undone before this returns.

        With ``stream`` (the reader's device stream), the host waits only until each result is issued and that
        stream waits for it to land; otherwise the host waits for it to land."""
        with self._landing:
            self._landing.wait_for(lambda: self._landed is None or all(i in self._landed for i in indices))
            landed = self._landed if self._landed is not None else self._last_landed
            events = [landed.get(i) for i in indices]
        for event in events:
            # Issued on the update's thread; the reader waits for it to land before the 16-bit result is read.
            if stream is not None:
                self.streams.wait(stream, event)
            else:
                self.streams.host_wait(event)

    def wait_all(self) -> None:
        """Block until the update in flight (and what its caller stores with it) is over; raise what
        interrupted it, here, on the caller's thread."""
        # A step begun during backward that backward never ended (it failed): nothing more is updated.
        self.end_backward(False, abandoned=True)
        thread, self._background = self._background, None
        if thread is None:
            return
        thread.join()
        error, self._background_error = self._background_error, None
        if error is not None:
            raise error

    def _land(self, index: int, event: object) -> None:
        """Sub-group ``index``'s 16-bit result is issued and lands at ``event``: readers of it may go on."""
        with self._landing:
            if self._landed is not None:
                self._landed[index] = event
                self.streams.landed(index)
                self._landing.notify_all()

    def _end_landing(self) -> None:
        """The update is over (finished, or settled after an interruption): every sub-group is readable.

        Sub-groups not landed by then (an interruption finished or undid them on the host) are released here, after
        the last write to their 16-bit partitions: nothing waiting for them may go on before."""
        with self._landing:
            if self._landed is not None:
                for index in range(len(self.sub_groups)):
                    if index not in self._landed:
                        self.streams.landed(index)
                self._last_landed = self._landed
            self._landed = None
            self._landing.notify_all()

    # Views into the slabs, one per DeepSpeed flat partition: the adapter points DeepSpeed's master
    # partitions and the inner optimizer's state at these, so DeepSpeed's checkpoints see our state.
    def _flat(self, slab: torch.Tensor, flat: int) -> torch.Tensor:
        return slab[self.flat_offsets[flat] : self.flat_offsets[flat + 1]]

    def param_view(self, flat: int) -> torch.Tensor:
        """The master weights of DeepSpeed flat partition ``flat``."""
        return self._flat(self.pool.param, flat)

    def state_view(self, name: str, flat: int) -> torch.Tensor:
        """The rule's state tensor ``name`` for DeepSpeed flat partition ``flat``."""
        return self._flat(self.pool.state(name), flat)

    def peak_bandwidth(self) -> tuple[float, float] | None:
        """Calibrated peak (host-to-device, device-to-host) bytes/s, once the scheduler has measured them."""
        rates = self.rates
        return (rates.h2d_bps, rates.d2h_bps) if rates is not None else None

    def device_budget(self) -> int | None:
        """Bytes the update may use on the device now; None means no limit (a CPU device).

        An explicit ``gpu_memory_budget``, or else the memory free now (the activations backward just freed, and
        what the caching allocator holds unused, count as free) less :data:`FREE_MEMORY_MARGIN`. When the update
        overlaps the next forward (:attr:`overlapping`), its staging may still be allocated while that forward's
        activations grow, so it also stays within what was spare at the last forward/backward peak
        (:attr:`forward_backward_peak`), less the same margin."""
        if self.gpu_memory_budget is not None:
            return self.gpu_memory_budget
        memory = self.streams.device_memory()
        if memory is None:
            return None
        free, capacity = memory
        if self.overlapping and self.forward_backward_peak is not None:
            free = min(free, capacity - self.forward_backward_peak)
        return int(max(0, free) * (1.0 - FREE_MEMORY_MARGIN))

    def device_bytes(self, plan: Plan, buffers: int) -> int:
        """Device memory ``plan`` needs during the update with ``buffers`` staging buffers
        (:func:`~lightning_dos.model.budget_fit.plan_device_bytes`)."""
        return plan_device_bytes(self.sizes, plan, buffers, self.footprint, self.lp_bytes if self.lp_downloads else 0)

    def fit_to_budget(self, plan: Plan, budget: int | None) -> Plan:
        """``plan`` shrunk until it fits ``budget`` (:func:`~lightning_dos.model.budget_fit.fit_to_budget`, with the
        calibrated rates once the scheduler has them)."""
        return fit_to_budget(
            self.sizes, plan, budget, footprint=self.footprint, lp_bytes=self.lp_bytes,
            lp_downloads=self.lp_downloads, rates=self.rates,
        )  # fmt: skip

    def skip(self, plan: Plan) -> StepReport:
        """Record a skipped step (fp16 overflow): nothing is touched."""
        self.kept.forget()
        self._backward_ends.clear()
        self.steps_taken += 1
        self.last_report = StepReport(self.steps_taken, plan, self.sizes, skipped=True)
        return self.last_report

    def step(self, plan: Plan, inputs: StepInputs, arrivals: GradientArrivals | None = None) -> StepReport:
        """Update every sub-group once, placed as ``plan`` says, and return what happened.

        With ``arrivals`` (a step begun during backward, :meth:`begin_early`), host sub-groups are updated as their
        gradients become final, before the rest; when backward ends with ``proceed`` False the step is skipped,
        which is exact only if nothing was updated yet (otherwise the state is torn, and said so).

        The update is atomic: readers of the state wait for it (:attr:`guard`), and an exception inside
        it leaves the state pre-step (nothing had changed yet) or post-step (the remaining sub-groups are
        finished on the host), raised as :class:`~lightning_dos.engine.atomic.UpdateInterrupted` saying
        which. A device out-of-memory error is not raised: the step completes on the host, with a warning.
        """
        if len(plan.places) != len(self.sub_groups):
            raise ValueError(f"plan has {len(plan.places)} places for {len(self.sub_groups)} sub-groups")
        if self.torn is not None:
            raise TornStateError(self.torn)
        with self.guard.updating():
            self.steps_taken += 1
            self._progress = progress = UpdateProgress()
            with self._landing:
                # Run by start() (overlap), the step is part of work that may still rewrite the 16-bit partitions
                # after it returns (its caller takes a step interrupted before any change whole on the host): the
                # thread releases the waiters once that work is over. Called directly, the step releases them.
                releases = self._landed is None
                self._landed = {} if releases else self._landed
            self._step_timing = self.timing if releases else self._started_timing
            try:
                early = None
                if arrivals is not None:
                    early = self._update_as_gradients_arrive(plan, inputs, progress, arrivals)
                    if early.skipped:
                        self.last_report = early
                        return early
                return self._update(plan, inputs, progress, early)
            except TornStateError:
                raise  # backward's phase changed state and the step cannot complete: nothing to finish or undo
            except BaseException as error:  # noqa: BLE001 - every interruption is finished, then re-raised
                return settle_interrupted_update(self, error, inputs, progress)
            finally:
                self._progress = None
                self.kept.forget()  # read by this step (or not at all): the next backward writes anew
                self._backward_ends.clear()  # waited for by this step (or a step skipped during backward)
                if releases:
                    self._end_landing()

    def _new_report(self, plan: Plan, inputs: StepInputs) -> StepReport:
        """This step's report for ``plan``, with the planner's predictions it was chosen by."""
        return StepReport(
            self.steps_taken,
            plan,
            self.sizes,
            predicted_s=inputs.predicted_s,
            predicted_iteration_s=inputs.predicted_iteration_s,
        )

    def _reached_together(self, points: tuple[str, ...], index: int) -> None:
        """Record several points one operation passed at once, then call the test seam for each."""
        if self._progress is not None:
            for point in points:
                self._progress.reached(point, index, None)
        if self.on_point is not None:
            for point in points:
                self.on_point(point, index)

    def _reached(self, point: str, index: int, device_views: tuple[torch.Tensor, ...] | None = None) -> None:
        """Record a sub-group's progress through the update in flight (and call the test seam)."""
        if self._progress is not None:
            self._progress.reached(point, index, device_views)
        if self.on_point is not None:
            self.on_point(point, index)

    def _update_as_gradients_arrive(
        self, plan: Plan, inputs: StepInputs, progress: UpdateProgress, arrivals: GradientArrivals
    ) -> StepReport:
        """Update the plan's host sub-groups as backward reports their gradients final, until backward ends; return
        what was done (``skipped`` when the step is skipped or abandoned, which must find nothing changed)."""
        self.streams.start_timeline(self._step_timing)
        report = self._new_report(plan, inputs)
        self.updated_early = early = []
        self._early_tail = None
        step_tensors: dict[int, torch.Tensor] = {}
        taking, error = True, None
        while (arrival := arrivals.next()) is not None:
            index, landed = arrival
            if not taking or plan.places[index] != Place.HOST or index in plan.after_backward:
                continue
            # DeepSpeed copied the gradient on its own stream: the host reads it once that copy has landed.
            self.streams.host_wait(landed)
            began = time.perf_counter()  # the step's update time counts this work, not the waits for backward
            try:
                if index in self.resident:
                    # Its state was resident on the device last step (this plan moves it home): current only there.
                    self._evict([index])
                # A finite sum means every element is finite (one NaN or infinity makes it NaN or infinite), and it
                # allocates nothing the size of the gradient. A finite gradient whose sum overflows only stops the
                # early updates: the rest of the step still updates it, exactly.
                if not bool(torch.isfinite(self._slices(self.sub_groups[index], inputs)[2].sum())):
                    # The global norm will not be finite either: DeepSpeed skips the step, so update nothing more.
                    taking = False
                    continue
                landed = self._update_host_sub_group(index, inputs, report, step_tensors)
                self._land(index, landed)
                early.append(index)
                self._early_tail = landed if landed is not None else self._early_tail
            except BaseException as failure:  # noqa: BLE001 - raised once backward is over (see below)
                # Finishing the step (recovery) needs every gradient final: wait for the end of backward first.
                taking, error = False, failure
            report.update_s += time.perf_counter() - began
        if arrivals.proceed == GradientArrivals.RUN:
            if error is not None:
                raise error
            return report
        if progress.touched:
            abandoned = arrivals.proceed == GradientArrivals.ABANDON
            why = (
                "backward failed, so the step cannot be completed,"
                if abandoned
                else "the gradient norm is not finite, so DeepSpeed skips the step,"
            )
            self.torn = (
                f"lightning-dos: {why} after overlap='auto' had updated sub-groups {sorted(early)} of optimizer step "
                f"{self.steps_taken} during backward; the optimizer state in this process mixes two steps, so it "
                "refuses to step or to be checkpointed. Resume from the last checkpoint with overlap='forward', "
                "which starts the update only once backward is over and the norm is known."
            )
            raise TornStateError(self.torn) from error
        if arrivals.proceed == GradientArrivals.ABANDON:
            self.steps_taken -= 1  # backward never ended: the step was not taken
        report.skipped = True
        return report

    def _update(
        self, plan: Plan, inputs: StepInputs, progress: UpdateProgress, early: StepReport | None = None
    ) -> StepReport:
        streams = self.streams
        # DeepSpeed copies gradients into the host buffers (and keep_gradient into resident sub-groups' device slots)
        # with non-blocking copies on its reduce stream during backward; the framework records an event there at the
        # end of backward (backward_ended). The host waits for just that work before any host update reads a gradient,
        # any upload re-reads one or any device update reads a kept one: not for the whole device, where (overlap) the
        # training thread goes on queueing the next forward meanwhile.
        ended, self._backward_ends = self._backward_ends, []
        for event in ended:
            streams.host_wait(event)
        if early is None:
            streams.start_timeline(self._step_timing)
        wall_start = time.perf_counter()

        requested = plan
        budget = self.device_budget()
        plan = self.fit_to_budget(plan, budget)
        progress.places = plan.places
        # State leaving the device (the plan moved it, or it no longer fits) comes home first.
        self._evict([i for i in self.resident if plan.places[i] != Place.RESIDENT])
        buffers = self._allocate(plan)
        if buffers is None:
            plan = plan.with_host(plan.streamed_indices)
            buffers = []
        plan = self._make_resident(plan, streams)
        progress.places = plan.places
        report = self._new_report(plan, inputs)
        if early is not None:  # what backward's phase did counts in this step's report
            report.host_elements, report.h2d_bytes = early.host_elements, early.h2d_bytes
            report.update_s = early.update_s
        report.fallback_host = [i for i in requested.device_indices if plan.places[i] == Place.HOST]
        if report.fallback_host:
            self._warn_fallback(f"{len(report.fallback_host)} sub-group(s) did not fit the device memory budget")
        report.device_staging_bytes = self.pool.device_bytes_in_use + self.pool.resident_bytes
        report.pinned_bytes = self.pool.pinned_bytes

        tails = self._run_resident(plan, inputs, streams, report)
        tails += self._launch_device_side(plan, buffers, inputs, streams, report)
        # The device side is all issued (it is launched first, and ends long before the host side): its staging goes
        # back to the caching allocator now, not with the host side's end, so the next forward has that memory.
        self._release_staging(buffers)
        skip = set(self.updated_early) if early is not None else set()
        tails += self._run_host_side(plan, inputs, streams, report, skip)
        # Resident sub-groups end on the compute stream (their cast); with parameter offload their 16-bit
        # downloads are among the tails already.
        tails.append(streams.record(streams.compute))

        # The update ends when the last byte is home: host slabs consistent for checkpoints, every
        # 16-bit parameter in place for the next forward.
        for event in tails:
            streams.host_wait(event)
        report.update_s += time.perf_counter() - wall_start
        report.spans = streams.spans() if self._step_timing else []
        self.last_report = report
        return report

    def _release_staging(self, buffers: list[DeviceBuffer]) -> None:
        """Give this update's staging buffers back to the caching allocator as soon as its device side is issued
        (``buffers`` is emptied: the engine keeps no reference). Work queued on them may still be running, so each
        block is first recorded on the streams that use it (``record_stream``): the allocator hands it out again
        only once that work has run, whatever stream asks for it next (the next forward's, on which it was
        allocated, would otherwise get it at once). Nothing else is held between updates but resident state,
        which only an explicit budget plans."""
        streams = self.streams
        for buf in buffers:
            for tensor in (buf.param, buf.grad, *buf.states, *(() if buf.lp is None else (buf.lp,))):
                for stream in (streams.h2d, streams.compute, streams.d2h):
                    streams.record_stream(tensor, stream)
        buffers.clear()
        self.pool.release_staging()

    def _allocate(self, plan: Plan) -> list[DeviceBuffer] | None:
        """This update's streaming buffers (the plan fits the budget already); None (after one warning) when
        the device is out of memory."""
        device_ids = plan.streamed_indices
        if not device_ids:
            return []
        count = min(plan.device_buffers, len(device_ids))
        try:
            # On h2d, their first user: the allocator may hand out a block whose previous owner's work is still
            # queued on the allocating stream, which the uploads are then ordered after (torch's CUDA sanitizer
            # reports an upload into a block allocated on another stream).
            with self.streams.on(self.streams.h2d):
                return self.pool.staging_for(count, max(self.sizes[i] for i in device_ids))
        except torch.OutOfMemoryError:
            self._warn_fallback("device staging could not be allocated (out of memory)")
            return None

    def release_device_memory(self) -> None:
        """Bring resident state home and free every device buffer the engine holds (at teardown).

        A torn state (see :class:`~lightning_dos.engine.atomic.TornStateError`) is not brought home: the
        host slabs must not take a mix of two steps."""
        if self.torn is None:
            self._evict(list(self.resident))
        else:
            self.drop_resident()
        self.pool.release_staging()

    def _warn_fallback(self, why: str) -> None:
        """Warn once per engine that device sub-groups ran on the host (same result, slower); every step's
        fallback is in its report (``fallback_host``) and logged by the monitor."""
        if not self._warned_fallback:
            warnings.warn(
                f"lightning-dos: {why}; those sub-groups are updated on the host instead. The result is "
                "the same, only slower. Lower gpu_fraction or raise gpu_memory_budget to avoid this; "
                "DOSMonitor logs dos/fallback_subgroups every step.",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned_fallback = True

    # -- resident sub-groups ---------------------------------------------------------------------

    def _make_resident(self, plan: Plan, streams: Streams) -> Plan:
        """Bring the plan's new resident sub-groups' state up; those that do not fit go to the host."""
        failed = []
        for index in plan.resident_indices:
            if index in self.resident:
                continue
            sg = self.sub_groups[index]
            try:
                with streams.on(streams.h2d):  # its first user (see _allocate)
                    buf = self.pool.allocate_resident(sg.numel)
            except torch.OutOfMemoryError:
                self._warn_fallback("resident optimizer state could not be allocated (out of memory)")
                failed.append(index)
                continue
            span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
            with streams.on(streams.h2d):
                for dst, slab in zip((buf.param, *buf.states), (self.pool.param, *self.pool.states)):
                    dst.copy_(slab[span], non_blocking=True)
            self.resident[index] = buf
        return plan.with_host(failed) if failed else plan

    def _run_resident(self, plan: Plan, inputs: StepInputs, streams: Streams, report: StepReport) -> list:
        """Upload only the gradient, update on the device, cast into the 16-bit partition; only that cast
        comes down, and only when the 16-bit parameters live on the host. Returns the tail events."""
        step_tensors: dict[int, torch.Tensor] = {}
        last_download = None
        for index in plan.resident_indices:
            sg, buf = self.sub_groups[index], self.resident[index]
            _, _, grad, lp = self._slices(sg, inputs)
            kept = self.kept.gradient(index, self.resident)
            if kept is None:
                with streams.lane("upload", index, self.footprint.master * sg.numel, streams.h2d):
                    buf.grad.copy_(grad, non_blocking=True)
                report.h2d_bytes += self.footprint.master * sg.numel
            uploaded = streams.record(streams.h2d)
            # The update reads the gradient (and, the first time, the state) the h2d stream brought up.
            streams.wait(streams.compute, uploaded)
            with streams.lane("device_adam", index, self.footprint.master * sg.numel, streams.compute):
                if sg.ds_group not in step_tensors:
                    step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], self.device)
                hyper = inputs.hypers[sg.param_group]
                self.device_update(
                    self.rule, buf.param, buf.grad, buf.states, step_tensors[sg.ds_group], hyper, inputs.inv_grad_scale,
                    step_number=inputs.steps[sg.ds_group],
                )  # fmt: skip
                self._reached("updated", index)
            with streams.lane("cast", index, self.lp_bytes * sg.numel, streams.compute):
                # Into the buffer's 16-bit slot when the 16-bit partition lives on the host (parameter offload).
                (buf.lp if buf.lp is not None else lp).copy_(buf.param)
            self._reached("done", index)
            if buf.lp is not None:
                last_download = self._download_lp(index, buf.lp, lp, report)
            self._land(index, last_download if buf.lp is not None else streams.record(streams.compute))
            report.device_elements += sg.numel
        return [last_download] if last_download is not None else []

    def _download_lp(self, index: int, device_lp: torch.Tensor, lp: torch.Tensor, report: StepReport) -> object:
        """Bring a device-cast 16-bit result down into the host-resident 16-bit partition (parameter offload)."""
        streams = self.streams
        # The download reads the cast the compute stream has just queued.
        streams.wait(streams.d2h, streams.record(streams.compute))
        with streams.lane("download", index, self.lp_bytes * lp.numel(), streams.d2h):
            lp.copy_(device_lp[: lp.numel()], non_blocking=True)
        report.d2h_bytes += self.lp_bytes * lp.numel()
        return streams.record(streams.d2h)

    def _download_resident(self, indices: list[int]) -> None:
        """Copy resident state into the host slabs and wait for it (the host reads them next)."""
        if not indices:
            return
        streams = self.streams
        # No device-side wait: this runs between steps or before a step issues any work, and every step
        # ends with the host waiting on all its streams' tails, so the compute stream's last writes to the
        # resident state are complete before this download is issued (the stream-race test checks it).
        with streams.on(streams.d2h):
            for index in indices:
                sg, buf = self.sub_groups[index], self.resident[index]
                span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
                for slab, src in zip((self.pool.param, *self.pool.states), (buf.param, *buf.states)):
                    slab[span].copy_(src, non_blocking=True)
                self._reached("flush", index)
        streams.host_wait(streams.record(streams.d2h))

    def _evict(self, indices: list[int]) -> None:
        """Bring resident state home and free it on the device."""
        self._download_resident(indices)
        for index in indices:
            self.kept.forget(index)
            self.pool.release_resident(self.resident.pop(index))

    def flush_resident(self, indices: Sequence[int] | None = None) -> None:
        """Make the host slabs current (a checkpoint or an accessor is about to read them); the state stays
        resident. ``indices`` limits it to those sub-groups (None: all)."""
        chosen = list(self.resident) if indices is None else [i for i in indices if i in self.resident]
        self._download_resident(chosen)

    def drop_resident(self, indices: Sequence[int] | None = None) -> None:
        """Forget resident device state because the host slabs were just overwritten (a checkpoint load, an
        accessor's write); the next step uploads the new values. ``indices`` limits it (None: all)."""
        chosen = list(self.resident) if indices is None else [i for i in indices if i in self.resident]
        for index in chosen:
            self.kept.forget(index)
            self.pool.release_resident(self.resident.pop(index))

    def keep_gradient(self, flat: int, offset: int, grad: torch.Tensor) -> None:
        """Backward made ``grad`` final: the gradient of elements ``[offset, offset + grad.numel())`` of flat
        partition ``flat``, on the device (DeepSpeed's reduced partition at the accumulation boundary). Copy the
        part each resident sub-group holds into that sub-group's device gradient slot, on the caller's current
        stream, so that the step reads it there and does not upload the host copy (which DeepSpeed still makes:
        a sub-group the step moves home, or finishes on the host after a failure, reads that one).

        A sub-group uses its kept gradient only if this backward wrote every one of its elements into the buffer
        it still has at the step (padding or a parameter without a gradient leave it to the host copy); the
        end-of-backward event on that stream (:meth:`backward_ended`) orders these copies before the update reads
        them."""
        self.kept.keep(flat, offset, grad, self.resident)

    def backward_ended(self, event: object) -> None:
        """Backward has issued its last gradient copy (into the host buffers, or a kept gradient into a resident
        sub-group's device slot, :meth:`keep_gradient`), and ``event`` was recorded after it on the stream it was
        issued on (DeepSpeed's reduce stream): the next step waits for ``event`` before it reads any gradient, and
        for nothing else queued on the device. None: the copies are complete already (a synchronous device). Called
        after every backward; the step waits for every event handed over since the last step."""
        if event is not None:
            self._backward_ends.append(event)

    def discard_kept_gradients(self) -> None:
        """Forget the gradients kept so far (a new backward begins, or a step was skipped)."""
        self.kept.forget()

    @property
    def kept_gradient_slots(self) -> list[torch.Tensor]:
        """The device gradient slots :meth:`keep_gradient` wrote since the last step (a race checker models those
        writes on the framework's stream)."""
        return self.kept.slots(self.resident)

    def sub_groups_of(self, flat: int, offset: int, numel: int) -> list[int]:
        """Indices of the sub-groups overlapping elements ``[offset, offset + numel)`` of flat partition ``flat``."""
        return sub_groups_of(self.sub_groups, flat, offset, numel)

    def _slices(
        self, sg: SubGroup, inputs: StepInputs
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """A sub-group's host master weights, host states, gradient and 16-bit target."""
        span = slice(sg.slab_offset, sg.slab_offset + sg.numel)
        local = slice(sg.ds_offset, sg.ds_offset + sg.numel)
        return (
            self.pool.param[span],
            tuple(state[span] for state in self.pool.states),
            inputs.grads[sg.ds_group][local],
            inputs.lp_targets[sg.ds_group][local],
        )

    def _launch_device_side(
        self, plan: Plan, buffers: list[DeviceBuffer], inputs: StepInputs, streams: Streams, report: StepReport
    ) -> list:
        """Queue upload -> update + cast -> download for every device sub-group; return the tail events."""
        step_tensors: dict[int, torch.Tensor] = {}
        slot_free: list = [None] * len(buffers)
        for j, index in enumerate(plan.streamed_indices):
            sg = self.sub_groups[index]
            n, slot = sg.numel, j % len(buffers)
            buf = buffers[slot]
            param, states, grad, lp = self._slices(sg, inputs)
            d_param, d_grad = buf.param[:n], buf.grad[:n]
            d_states = tuple(t[:n] for t in buf.states)
            # Reuse the slot only after the download of its previous sub-group has finished.
            streams.wait(streams.h2d, slot_free[slot])
            with streams.lane("upload", index, self.footprint.streamed_up * n, streams.h2d):
                for dst, src in zip((d_param, *d_states, d_grad), (param, *states, grad)):
                    dst.copy_(src, non_blocking=True)
            uploaded = streams.record(streams.h2d)
            # The update reads what the upload wrote.
            streams.wait(streams.compute, uploaded)
            with streams.lane("device_adam", index, self.footprint.master * n, streams.compute):
                if sg.ds_group not in step_tensors:
                    step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], self.device)
                hyper = inputs.hypers[sg.param_group]
                step = step_tensors[sg.ds_group]
                self.device_update(
                    self.rule, d_param, d_grad, d_states, step, hyper, inputs.inv_grad_scale,
                    step_number=inputs.steps[sg.ds_group],
                )  # fmt: skip
                self._reached("computed", index)
            # Cast on the device, straight into DeepSpeed's 16-bit partition: no 16-bit upload needed
            # (into the buffer's 16-bit slot instead when that partition lives on the host; it comes down below).
            with streams.lane("cast", index, self.lp_bytes * n, streams.compute):
                (buf.lp[:n] if buf.lp is not None else lp).copy_(d_param)
            computed = streams.record(streams.compute)
            # The download must not start before the update and the cast have finished with the buffer.
            streams.wait(streams.d2h, computed)
            down = self.footprint.streamed_down * n + (self.lp_bytes * n if buf.lp is not None else 0)
            with streams.lane("download", index, down, streams.d2h):
                self._reached("downloading", index, (d_param, *d_states))
                pairs = list(zip((param, *states), (d_param, *d_states)))
                if buf.lp is not None:
                    pairs.append((lp, buf.lp[:n]))
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                self._reached("done", index)
            slot_free[slot] = streams.record(streams.d2h)
            # The next forward reads only the 16-bit result: cast on the device, it is there once the compute stream
            # has run the cast; the state's download home (which the next backward and checkpoints wait for, with
            # the whole update) need not hold the forward back. Cast into the buffer, it is there once downloaded.
            self._land(index, computed if buf.lp is None else slot_free[slot])
            report.h2d_bytes += self.footprint.streamed_up * n
            report.d2h_bytes += down
            report.device_elements += n
        return [e for e in slot_free if e is not None]

    def _run_host_side(
        self, plan: Plan, inputs: StepInputs, streams: Streams, report: StepReport, skip: set[int]
    ) -> list:
        """The update on the CPU for every host sub-group not in ``skip`` (updated during backward already), each
        followed by an asynchronous 16-bit upload; return the last upload (backward's phase's included: they all
        share the ``lp_h2d`` stream)."""
        step_tensors: dict[int, torch.Tensor] = {}
        last_upload = self._early_tail if skip else None
        for index in plan.host_indices:
            if index not in skip:
                landed = self._update_host_sub_group(index, inputs, report, step_tensors)
                self._land(index, landed)
                last_upload = landed if landed is not None else last_upload
        return [last_upload] if last_upload is not None else []

    def _update_host_sub_group(
        self, index: int, inputs: StepInputs, report: StepReport, step_tensors: dict[int, torch.Tensor]
    ) -> object:
        """Host sub-group ``index``'s update, 16-bit cast and upload; return when its 16-bit result lands."""
        streams = self.streams
        sg = self.sub_groups[index]
        param, states, grad, lp = self._slices(sg, inputs)
        if sg.ds_group not in step_tensors:
            step_tensors[sg.ds_group] = step_tensor(inputs.steps[sg.ds_group], torch.device("cpu"))
        # The 16-bit partition is in host memory already (CPU device, parameter offload): cast straight into
        # it; otherwise into a slot of the pinned staging ring the upload reads, free once the upload that
        # last read it has landed. Unscale, update and cast in one pass over memory.
        staging, slot = lp, 0
        if self.pool.lp_staging is not None:
            slot, staging, last_read = self.pool.lp_staging.acquire(sg.numel)
            # The host is about to overwrite what the slot's previous upload reads.
            streams.host_wait(last_read)
        hyper, step = inputs.hypers[sg.param_group], step_tensors[sg.ds_group]
        with streams.lane("host_adam", index, self.footprint.master * sg.numel):
            host_update(self.rule, param, grad, states, step, hyper, inputs.inv_grad_scale, staging)
        report.host_elements += sg.numel
        # One pass unscaled, updated and (on a CPU device) cast it: every point is recorded before any
        # hook runs, so an interruption at any of them finds the sub-group's true progress.
        self._reached_together(("unscaled", "updated", "done") if staging is lp else ("unscaled", "updated"), index)
        if staging is lp:
            return None
        with streams.lane("lp_upload", index, self.lp_bytes * sg.numel, streams.lp_h2d):
            lp.copy_(staging, non_blocking=True)
        uploaded = streams.record(streams.lp_h2d)
        self.pool.lp_staging.release(slot, uploaded)
        self._reached("done", index)
        report.h2d_bytes += self.lp_bytes * sg.numel
        return uploaded
