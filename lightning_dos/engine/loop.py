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

The engine's jobs are parts of their own, each owning its state, which :class:`InterleavedUpdate` builds and
calls in order, handing each the step's :class:`~lightning_dos.engine.context.StepContext`: the hand-off to a
background thread and to each sub-group's readers (``in_flight.py``), where each sub-group's state lives
(``homes.py``; with the NVMe tier, ``file_backed.py``), the resident set (``resident.py``), the streamed lane
(``streamed.py``), the host lane (``host_side.py``), backward's early updates (``early.py``), the recovery of an
interrupted step (``recovery.py``) and the device memory budget (``budget.py``). This module holds the step that runs
them, and the engine's public face (docs/how-it-works.md draws the parts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_dos.engine import native
from lightning_dos.engine.arrivals import GradientArrivals
from lightning_dos.engine.atomic import UpdateGuard, UpdateInterrupted
from lightning_dos.engine.budget import DeviceBudget
from lightning_dos.engine.context import PointHook, UpdateSetup
from lightning_dos.engine.file_backed import FileBackedHomes, open_file_tier
from lightning_dos.engine.file_tier import FileTier
from lightning_dos.engine.homes import SlabHomes
from lightning_dos.engine.host_side import HostLane
from lightning_dos.engine.hostslab import Registrar
from lightning_dos.engine.in_flight import UpdateLanding
from lightning_dos.engine.inputs import StepInputs
from lightning_dos.engine.kept_gradients import sub_groups_of
from lightning_dos.engine.kernels import apply_update, host_update
from lightning_dos.engine.observer import EngineObserver
from lightning_dos.engine.pool import BufferPool
from lightning_dos.engine.resident import ResidentSet
from lightning_dos.engine.speculation import SpareSlabs
from lightning_dos.engine.step import StepLoop
from lightning_dos.engine.streamed import StreamedLane
from lightning_dos.engine.streams import Streams, make_streams
from lightning_dos.engine.swap_files import SwapFile
from lightning_dos.model.nvme import nvme_sub_groups
from lightning_dos.model.plan import Plan, SubGroup, split_into_sub_groups
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
            self.flat_offsets[-1], lp_dtype, device, pin, lp_on_host=lp_on_host,
            largest_sub_group=max(self.sizes, default=0), accelerated=self.streams.is_async,
            allocate=self.streams.empty, rule=rule, master_dtype=master_dtype, state_dtype=state_dtype,
        )  # fmt: skip
        #: The update of a sub-group placed on the device (streamed or resident): the accelerator's, the rule's torch
        #: formula (``kernels.apply_update``), whatever device its tensors are on, so a simulated accelerator runs
        #: what a GPU runs; without one (a CPU device, synchronous streams) the device is the host's own CPU and runs
        #: the host's compiled kernel, and every placement computes the same bits.
        device_update = apply_update if self.streams.is_async else host_update
        self.setup = UpdateSetup(
            self.pool, self.streams, self.sub_groups, self.footprint, self.lp_bytes, rule, device, self.lp_downloads
        )
        #: What the update may hold on the device (the planner and the framework tell it what they measure).
        self.budget = DeviceBudget(
            self.sizes, self.footprint, self.lp_bytes, self.lp_downloads, self.streams, gpu_memory_budget
        )
        # Build the compiled host update now, not in the first step; say so once if torch's kernels stand in.
        native.warn_if_unavailable()
        #: Readers of the optimizer state (checkpoints) wait on this while an update is in flight.
        self.guard = UpdateGuard()
        #: The hand-off of an update to its thread and of each sub-group's 16-bit result to its readers.
        self.landing = UpdateLanding(self.streams, self.guard, len(self.sub_groups))
        #: Where each sub-group's state is: the host slabs and spare slots (none until :meth:`reserve_speculation`),
        #: with the NVMe tier once :meth:`keep_in_files` is called.
        self.homes: SlabHomes = SlabHomes(self.pool, self.sub_groups, SpareSlabs(0, 0, master_dtype, (), lp_dtype))
        self._resident = ResidentSet(self.setup, self.landing)
        self._streamed = StreamedLane(self.setup, self.landing)
        self._host = HostLane(self.setup, self.landing)
        #: The step, run through the parts (it owns the step count, the reports and what the framework tells it).
        self.steps = StepLoop(
            self.setup, self.budget, self.landing, self._resident, self._streamed, self._host, device_update
        )
        self._observer = EngineObserver()

    # -- what the framework, the planner and the monitor tell the engine (each part's method says more) ---------

    def watch(self, observer: EngineObserver) -> None:
        """Have ``observer`` called around the engine's entry points (:mod:`~lightning_dos.engine.observer`)."""
        self._observer = observer

    def watch_points(self, hook: PointHook | None) -> None:
        """The test seam (:meth:`StepLoop.watch_points`)."""
        self.steps.watch_points(hook)

    def record_timing(self, enabled: bool) -> None:
        """Record a span per operation (:meth:`StepLoop.record_timing`)."""
        self.steps.record_timing(enabled)

    def use_device_update(self, update: Callable[..., None]) -> None:
        """Run ``update`` as the device update from the next step on (:meth:`StepLoop.use_device_update`)."""
        self.steps.use_device_update(update)

    def set_need_order(self, order: Sequence[int]) -> None:
        """The order the next forward needs sub-groups in (:meth:`StepLoop.set_need_order`)."""
        self.steps.set_need_order(order)

    def take_files_in(self, order: str) -> None:
        """The order the file-backed host sub-groups are taken in (:meth:`StepLoop.take_files_in`)."""
        self.steps.take_files_in(order)

    def use_rates(self, rates: object) -> None:
        """This machine's calibrated rates, measured by the scheduler (:meth:`DeviceBudget.use_rates`)."""
        self.budget.use_rates(rates)

    def overlap_forward(self, overlapping: bool) -> None:
        """Whether the update overlaps the next forward (:meth:`DeviceBudget.overlap_forward`)."""
        self.budget.overlap_forward(overlapping)

    def record_forward_backward_peak(self, peak: int | None) -> None:
        """The device peak of the last forward and backward (:meth:`DeviceBudget.record_forward_backward_peak`)."""
        self.budget.record_forward_backward_peak(peak)

    def mark_torn(self, why: str) -> None:
        """The state in this process mixes two steps (``why``): refuse to step or to be checkpointed."""
        self.steps.mark_torn(why)

    def clear_torn(self) -> None:
        """The host slabs were just loaded whole (a checkpoint): the state is consistent again."""
        self.steps.clear_torn()

    # -- the state the engine holds (read-only) ------------------------------------------------------------------

    on_point = property(lambda self: self.steps.on_point, doc="The test seam :meth:`watch_points` set.")
    timing = property(lambda self: self.steps.timing, doc="Whether steps record a span per operation.")
    need_order = property(lambda self: self.steps.need_order, doc="The order the next forward needs sub-groups in.")
    files_order = property(lambda self: self.steps.files_order, doc="The order file-backed sub-groups are taken in.")
    torn = property(lambda self: self.steps.torn, doc="Why the state mixes two steps, or None.")
    steps_taken = property(lambda self: self.steps.steps_taken, doc="Optimizer steps taken, skipped ones included.")
    last_report = property(lambda self: self.steps.reports.last, doc="The last step's report (None before any).")
    reports_issued = property(lambda self: self.steps.reports.issued, doc="How many step reports were issued.")
    progress = property(lambda self: self.steps.progress, doc="The step under way's progress (None between steps).")
    updated_early = property(lambda self: self.steps.updated_early, doc="Sub-groups the last step updated early.")
    rates = property(lambda self: self.budget.rates, doc="The calibrated rates (None until measured).")
    gpu_memory_budget = property(lambda self: self.budget.gpu_memory_budget, doc="The explicit device budget, or None.")
    device_update = property(lambda self: self.steps.device_update, doc="The update run on the device.")

    def files_backwards(self, step: int) -> bool:
        """Whether step ``step`` takes the file-backed host sub-groups backwards (:meth:`StepLoop.files_backwards`)."""
        return self.steps.files_backwards(step)

    def report_number(self, number: int) -> StepReport | None:
        """The ``number``-th report issued (1-based), while it is among the recent ones; None before it is issued."""
        return self.steps.reports.number(number)

    resident = property(lambda self: self._resident.buffers, doc="Resident sub-groups and their buffers (a copy).")
    spare = property(lambda self: self.homes.spare, doc="The spare slots for speculative updates during backward.")
    files = property(lambda self: self.homes.files, doc="The NVMe tier (None until :meth:`keep_in_files`).")

    def sub_groups_as_needed(self) -> list[SubGroup]:
        """The sub-groups in the order the next forward needs them (:attr:`need_order`; index order when empty)."""
        return [self.sub_groups[i] for i in self.need_order] if self.need_order else list(self.sub_groups)

    # Views into the slabs, one per DeepSpeed flat partition: the adapter points DeepSpeed's master
    # partitions and the inner optimizer's state at these, so DeepSpeed's checkpoints see our state.
    def param_view(self, flat: int) -> torch.Tensor:
        """The master weights of DeepSpeed flat partition ``flat``."""
        return self.pool.param[self.flat_offsets[flat] : self.flat_offsets[flat + 1]]

    def state_view(self, name: str, flat: int) -> torch.Tensor:
        """The rule's state tensor ``name`` for DeepSpeed flat partition ``flat``."""
        return self.pool.state(name)[self.flat_offsets[flat] : self.flat_offsets[flat + 1]]

    def peak_bandwidth(self) -> tuple[float, float] | None:
        """Calibrated peak (host-to-device, device-to-host) bytes/s, once the scheduler has measured them."""
        return self.budget.peak_bandwidth()

    def device_budget(self) -> int | None:
        """Bytes the update may use on the device now (:meth:`DeviceBudget.device_budget`); None: no limit."""
        return self.budget.device_budget()

    def device_bytes(self, plan: Plan, buffers: int) -> int:
        """Device memory ``plan`` needs during the update with ``buffers`` staging buffers."""
        return self.budget.device_bytes(plan, buffers)

    def fit_to_budget(self, plan: Plan, budget: int | None) -> Plan:
        """``plan`` shrunk until it fits ``budget`` (with the calibrated rates once the scheduler has them)."""
        return self.budget.fit_to_budget(plan, budget)

    # -- speculation -----------------------------------------------------------------------------------------------

    def reserve_speculation(self, slots: int) -> int:
        """Allocate ``slots`` spare slots (each the largest sub-group's state and 16-bit result) for updates begun
        during backward before the gradient norm is known; 0 frees them (speculation off). Return the host bytes
        held."""
        if self.in_flight or self.spare.pending:
            raise RuntimeError("the spare slots cannot change while an update is in flight")
        return self.homes.reserve_spare(slots, self.lp_dtype).nbytes

    def speculation_slot_bytes(self) -> int:
        """Host bytes one spare slot holds (:meth:`reserve_speculation`)."""
        states = tuple(state.dtype for state in self.pool.states)
        return SpareSlabs.slot_bytes(max(self.sizes, default=0), self.pool.param.dtype, states, self.lp_dtype)

    # -- the step (:mod:`~lightning_dos.engine.step`) ------------------------------------------------------------

    def skip(self, plan: Plan) -> StepReport:
        """Record a skipped step (fp16 overflow): nothing is touched."""
        return self.steps.skip(plan)

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
        return self._observer.step(lambda *args: self.steps.run(self.homes, *args), plan, inputs, arrivals)

    def take_on_host(self, inputs: StepInputs, interrupted: UpdateInterrupted) -> UpdateInterrupted:
        """Take, whole on the host, a step ``interrupted`` stopped before any change, when the caller has counted it
        already (:func:`~lightning_dos.engine.recovery.take_on_host`); return the post-step error to report."""
        return self.steps.take_on_host(self.homes, inputs, interrupted)

    def release_device_memory(self) -> None:
        """Bring resident state home and free every device buffer the engine holds (at teardown). A torn state is
        not brought home: the host slabs must not take a mix of two steps."""
        if self.steps.torn is None:
            self._resident.evict(self._resident.indices, self.steps.reached)
            self.homes.bring_home(list(self.spare.held))
        else:
            self.drop_resident()
        self.pool.release_staging()

    # -- the update in flight (:mod:`~lightning_dos.engine.in_flight`) ---------------------------------------------

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` (an update: :meth:`step` and what its caller stores with it) on a background thread and return
        at once (:meth:`UpdateLanding.start`); :meth:`wait_sub_groups` and :meth:`wait_all` are the points that wait
        for it."""
        self._observer.start(self._start, work)

    def _start(self, work: Callable[[], None]) -> None:
        self.landing.wait_all()
        self.steps.update_started()
        self.landing.start(work)

    def begin_early(self, work: Callable[[GradientArrivals], None]) -> None:
        """Start a step during backward: ``work(arrivals)`` runs on the background thread (as :meth:`start`) and
        passes ``arrivals`` to :meth:`step`, which updates host sub-groups as :meth:`grads_final` reports their
        gradients final, then waits for :meth:`end_backward` to run (or skip) the rest of the step."""
        arrivals = GradientArrivals()
        self.start(lambda: work(arrivals))
        self.landing.feed(arrivals)

    @property
    def arrivals(self) -> GradientArrivals | None:
        """Backward's hand-over to a step begun during backward; None otherwise."""
        return self.landing.arrivals

    def grads_final(self, index: int, event: object = None) -> None:
        """Sub-group ``index``'s gradient is final (``event``: when its copy lands; None once it has)."""
        self.landing.grads_final(index, event)

    def end_backward(self, proceed: bool, abandoned: bool = False, inv_grad_scale: float | None = None) -> None:
        """Backward is over (:meth:`UpdateLanding.end_backward`)."""
        self.landing.end_backward(proceed, abandoned, inv_grad_scale)

    @property
    def in_flight(self) -> bool:
        """An update started by :meth:`start` has not been waited for by :meth:`wait_all` yet."""
        return self.landing.in_flight

    def wait_sub_groups(self, indices: Sequence[int], stream: object = None) -> None:
        """Block until sub-groups ``indices`` hold the update in flight's result
        (:meth:`UpdateLanding.wait_sub_groups`)."""
        self.landing.wait_sub_groups(indices, stream)

    def wait_device_side(self) -> None:
        """Block until the update in flight has issued its device side (:meth:`UpdateLanding.wait_device_side`)."""
        self.landing.wait_device_side()

    def wait_all(self) -> None:
        """Block until the update in flight is over; raise what interrupted it, here, on the caller's thread."""
        self._observer.wait_all(self.landing.wait_all)

    # -- backward's hand-over of gradients -------------------------------------------------------------------------

    def keep_gradient(self, flat: int, offset: int, grad: torch.Tensor) -> None:
        """Backward made ``grad`` final: elements ``[offset, offset + grad.numel())`` of flat partition ``flat``, on
        the device; resident sub-groups keep their part (:meth:`ResidentSet.keep_gradient`)."""
        self._resident.keep_gradient(flat, offset, grad)

    def backward_ended(self, event: object) -> None:
        """Backward issued its last gradient copy, recorded at ``event`` (:meth:`StepLoop.backward_ended`)."""
        self.steps.backward_ended(event)

    def discard_kept_gradients(self) -> None:
        """Forget the gradients kept so far (a new backward begins, or a step was skipped)."""
        self._resident.forget_kept()

    @property
    def kept_gradient_slots(self) -> list[torch.Tensor]:
        """The device gradient slots :meth:`keep_gradient` wrote since the last step (a race checker models those
        writes on the framework's stream)."""
        return self._resident.kept_slots()

    def sub_groups_of(self, flat: int, offset: int, numel: int) -> list[int]:
        """Indices of the sub-groups overlapping elements ``[offset, offset + numel)`` of flat partition ``flat``."""
        return sub_groups_of(self.sub_groups, flat, offset, numel)

    # -- readers and writers of the host slabs ---------------------------------------------------------------------

    @property
    def state_off_slabs(self) -> bool:
        """Whether some sub-group's current state may not be in the slabs (resident on the device, held in a spare
        slot, or in a swap file): a reader of the slabs must :meth:`flush_resident` first."""
        return len(self._resident) > 0 or self.homes.off_slabs

    def flush_resident(self, indices: Sequence[int] | None = None) -> None:
        """Make the host slabs current (a checkpoint or an accessor is about to read them): resident state is
        copied down and stays resident; state held in spare slots comes home; file-backed state is read into its
        spans (:meth:`release_file_copies`: back). ``indices`` limits it to those sub-groups (None: all)."""
        self._observer.flush(lambda: self._flush(indices))

    def _flush(self, indices: Sequence[int] | None) -> None:
        self._resident.download(self._resident.indices if indices is None else indices, self.steps.reached)
        self.homes.bring_home(list(self.spare.held) if indices is None else indices)
        self.homes.materialize(indices)

    def drop_resident(self, indices: Sequence[int] | None = None) -> None:
        """Forget resident device state and state held in spare slots because the host slabs were just overwritten
        (a checkpoint load, an accessor's write); the next step uses the new values. ``indices`` limits it (None:
        all)."""
        self._observer.drop(lambda: self._drop(indices))

    def _drop(self, indices: Sequence[int] | None) -> None:
        self._resident.drop(indices)
        self.homes.spans_written(indices)

    # -- the NVMe tier (:mod:`~lightning_dos.engine.file_backed`) --------------------------------------------------

    def keep_in_files(
        self, first: int, directory: str, rank: int, aio: object, slots: int = 4, *, write: bool = True, **io: int
    ) -> FileTier | None:
        """Keep sub-groups ``first`` onwards (the slabs' tail) in a swap file under ``directory`` between updates:
        their spans' current contents are written to it and their pages given back (the NVMe tier, see
        :mod:`lightning_dos.engine.file_tier`). Call before the slabs are registered (:meth:`BufferPool.register_host`):
        those spans are never pinned. ``aio`` is DeepSpeed's async I/O op; ``slots`` staging slabs move the records;
        ``io`` is passed to :class:`~lightning_dos.engine.swap_files.SwapFile` (``block_size``, ``queue_depth``,
        ``threads``).
        ``write=False``: the spans do not hold the state yet; the caller writes each one as it fills it
        (:meth:`FileTier.write_spans`, then :meth:`FileTier.settle`), so that start-up never holds all of it at once.
        Return the tier (None when ``first`` leaves nothing to keep in files)."""

        def open_swap(records: list[int], master: torch.dtype, state: torch.dtype, states: int) -> SwapFile:
            return SwapFile(directory, rank, records, master, state, states, slots, aio, **io)

        return self.keep_records_in(first, open_swap, write=write)

    def keep_records_in(self, first: int, open_swap: Callable[..., SwapFile], *, write: bool = True) -> FileTier | None:
        """:meth:`keep_in_files` with the swap file made by ``open_swap(records, master_dtype, state_dtype,
        states)`` (the simulated drive's, :class:`~lightning_dos.sim.simdrive.SimSwapFile`, on the simulator)."""
        if self.files is not None:
            raise RuntimeError("the engine keeps sub-groups in files already")
        tail = self.sub_groups[first:]  # the drive's requests go in the step's timeline (streams.host_span)
        files = open_file_tier(self.pool, tail, self.rule, self.homes.span, open_swap, self.streams.host_span)
        if files is not None:
            self.keep_files_as(files)
            if write:
                files.store_all()
        return files

    def keep_files_as(self, files: FileTier) -> None:
        """The file-backed sub-groups' records are read and written through ``files`` from now on (the tier; after
        fit, the framework's reader of the records it keeps past the tier's close)."""
        self.homes = FileBackedHomes(self.pool, self.sub_groups, self.homes.spare, files, self.streams)

    def register_file_staging(self, registrar: Registrar | None) -> bool:
        """Register the NVMe tier's staging slabs with the accelerator, as the host slabs are
        (:meth:`FileBackedHomes.register`); False when there is no tier or they are not registered."""
        return isinstance(self.homes, FileBackedHomes) and self.homes.register(registrar)

    def first_file_backed(self, host_budget: int) -> int:
        """The first sub-group past what ``host_budget`` bytes of state hold, counted from the first (all when all
        fit): where the NVMe tier begins, as the model counts it (:func:`~lightning_dos.model.nvme.nvme_sub_groups`)."""
        in_files = nvme_sub_groups(self.sizes, host_budget, self.footprint)
        return in_files[0] if in_files else len(self.sub_groups)

    def close_files(self) -> None:
        """Remove the swap file (teardown). Its sub-groups' state is gone with it: the slabs hold zeros there."""
        self.homes.close()

    def materialize_files(self, indices: Sequence[int] | None = None) -> None:
        """Load these file-backed sub-groups (None: all) into their spans, for a reader of the slabs (a checkpoint,
        an accessor); :meth:`release_file_copies` gives the pages back, a write marks them to be written back
        (:meth:`drop_resident`)."""
        self.homes.materialize(indices)

    def release_file_copies(self) -> None:
        """Give back the pages of file-backed sub-groups loaded only to be read (:meth:`materialize_files`)."""
        self.homes.release_copies()
