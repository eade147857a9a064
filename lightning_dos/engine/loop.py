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

The engine's jobs are classes of their own, which :class:`InterleavedUpdate` is made of: the hand-off to a
background thread and to each sub-group's readers (``in_flight.py``), streamed sub-groups (``streamed.py``),
resident ones (``resident.py``), host ones (``host_side.py``) and the NVMe tier's file-backed ones
(``file_backed.py``); this module holds the state they share and the step that runs them in order.
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
from lightning_dos.engine.file_backed import FileBackedSubGroups
from lightning_dos.engine.file_tier import FileTier
from lightning_dos.engine.host_side import HostSubGroups
from lightning_dos.engine.in_flight import InFlightHandoff
from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.kept_gradients import GradientHandoff, KeptGradients
from lightning_dos.engine.kernels import apply_update, host_update
from lightning_dos.engine.pool import BufferPool, DeviceBuffer
from lightning_dos.engine.recovery import settle_interrupted_update
from lightning_dos.engine.resident import ResidentSubGroups
from lightning_dos.engine.speculation import SpareSlabs
from lightning_dos.engine.streamed import StreamedSubGroups
from lightning_dos.engine.streams import Streams, make_streams
from lightning_dos.model.budget_fit import fit_to_budget, plan_device_bytes
from lightning_dos.model.nvme import ALTERNATE, tiered_plan
from lightning_dos.model.perfmodel import FREE_MEMORY_MARGIN
from lightning_dos.model.plan import Place, Plan, SubGroup, split_into_sub_groups
from lightning_dos.model.step_report import StepReport
from lightning_dos.model.update_rules import ADAM, Footprint, UpdateRule


class InterleavedUpdate(
    InFlightHandoff, ResidentSubGroups, StreamedSubGroups, HostSubGroups, FileBackedSubGroups, GradientHandoff
):
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
        #: Sub-groups the last step updated during backward, in the order their gradients became final (speculated
        #: ones once committed).
        self.updated_early: list[int] = []
        self._early_tail: object = None
        #: Spare slots for speculative updates during backward (none until :meth:`reserve_speculation`).
        self.spare = SpareSlabs(0, 0, master_dtype, (), lp_dtype)
        #: The NVMe tier: the sub-groups whose state lives in a swap file between updates (None until
        #: :meth:`keep_in_files`).
        self.files: FileTier | None = None
        #: The order the file-backed host sub-groups are taken in (``model.nvme.ORDERS``): ``"alternate"`` (reversed
        #: every other step) until the ratio scheduler chooses from the model (``model.nvme.choose_files_order``).
        self.files_order = ALTERNATE
        #: Streamed file-backed sub-groups of the update in flight whose download home was issued, with its event.
        self._downloads_to_store: list[tuple[int, object]] = []
        #: Every sub-group, in the order the next forward needs them (``Plan.order``; recorded by the framework in the
        #: first forward, :func:`~lightning_dos.model.need_order.need_order`): each step launches device work, runs
        #: host work and lands 16-bit results in this order, so that the next forward's first gathers wait for their
        #: own sub-groups, not for the rest of the update. Empty: index order. A plan with an order of its own keeps
        #: it.
        self.need_order: tuple[int, ...] = ()

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

    def sub_groups_as_needed(self) -> list[SubGroup]:
        """The sub-groups in the order the next forward needs them (:attr:`need_order`; index order when empty)."""
        return [self.sub_groups[i] for i in self.need_order] if self.need_order else list(self.sub_groups)

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

    def reserve_speculation(self, slots: int) -> int:
        """Allocate ``slots`` spare slots (each the largest sub-group's state and 16-bit result) for updates begun
        during backward before the gradient norm is known; 0 frees them (speculation off). Return the host bytes
        held."""
        if self.in_flight or self.spare.pending:
            raise RuntimeError("the spare slots cannot change while an update is in flight")
        self._bring_home(list(self.spare.held))
        states = tuple(state.dtype for state in self.pool.states)
        self.spare = SpareSlabs(slots, max(self.sizes, default=0), self.pool.param.dtype, states, self.lp_dtype)
        return self.spare.nbytes

    def speculation_slot_bytes(self) -> int:
        """Host bytes one spare slot holds (:meth:`reserve_speculation`)."""
        states = tuple(state.dtype for state in self.pool.states)
        return SpareSlabs.slot_bytes(max(self.sizes, default=0), self.pool.param.dtype, states, self.lp_dtype)

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
                if self.torn is None:
                    self._settle_files()
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

        plan = plan if plan.order else plan.in_order(self.need_order)
        requested = plan
        if self.files is not None:
            # A resident sub-group's state lives on the device between updates; a file-backed one's in its file.
            plan = tiered_plan(plan, self.files.indices)
        budget = self.device_budget()
        plan = self.fit_to_budget(plan, budget)
        progress.places = plan.places
        # State leaving the device (the plan moved it, or it no longer fits) comes home first.
        self._evict([i for i in self.resident if plan.places[i] != Place.RESIDENT])
        # State held in spare slots (pageable memory) goes to the device from the pinned slabs.
        self._bring_home([i for i in self.spare.held if plan.places[i] != Place.HOST])
        buffers = self._allocate(plan)
        if buffers is None:
            plan = plan.with_host(plan.streamed_indices)
            buffers = []
        plan = self._make_resident(plan, streams)
        progress.places = plan.places
        order = self._host_order(plan)  # before the reads ahead change what the slabs hold
        if self.files is not None:
            # Read ahead in the order the update takes them: streamed ones are launched first.
            done_early = set(self.updated_early) if early is not None else set()
            self.files.begin(
                plan.streamed_indices + [i for i in order if i not in done_early],
                keep=self._kept_unwritten(plan, order),
            )
        report = self._new_report(plan, inputs)
        if early is not None:  # what backward's phase did counts in this step's report
            report.host_elements, report.h2d_bytes = early.host_elements, early.h2d_bytes
            report.update_s = early.update_s
            report.speculated, report.committed, report.early = early.speculated, early.committed, early.early
            report.commit_s = early.commit_s
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
        tails += self._run_host_side(order, inputs, streams, report, skip)
        # Resident sub-groups end on the compute stream (their cast); with parameter offload their 16-bit
        # downloads are among the tails already.
        tails.append(streams.record(streams.compute))

        # The update ends when the last byte is home: host slabs consistent for checkpoints, every
        # 16-bit parameter in place for the next forward.
        for event in tails:
            streams.host_wait(event)
        self._settle_files()
        report.update_s += time.perf_counter() - wall_start
        report.spans = streams.spans() if self._step_timing else []
        self.last_report = report
        return report

    def release_device_memory(self) -> None:
        """Bring resident state home and free every device buffer the engine holds (at teardown).

        A torn state (see :class:`~lightning_dos.engine.atomic.TornStateError`) is not brought home: the
        host slabs must not take a mix of two steps."""
        if self.torn is None:
            self._evict(list(self.resident))
            self._bring_home(list(self.spare.held))
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

    def _slices(
        self, sg: SubGroup, inputs: StepInputs
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """A sub-group's current host master weights and states (a spare slot's when it is held there), gradient
        and 16-bit target."""
        local = slice(sg.ds_offset, sg.ds_offset + sg.numel)
        param, states = self.spare.current(sg.index, *self._home(sg))
        return param, states, inputs.grads[sg.ds_group][local], inputs.lp_targets[sg.ds_group][local]
