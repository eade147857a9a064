"""The buffer pool: host slabs the engine owns, a small 16-bit staging ring, and per-update device staging.

Host side, allocated once: a slab of master weights and one per state tensor of the optimizer's update rule
(Adam's two moments, Lion's one, Adagrad's sum), in DeepSpeed's master dtype and the optimizer's state dtype,
holding every sub-group back to back, so DeepSpeed's flat partitions and optimizer state can be views into them.
When the 16-bit parameters live on an accelerator, host-updated sub-groups are cast into a *ring* of a
few staging slots of the largest sub-group's size, each reused once its previous upload has finished,
instead of a full-size copy of the model (2 bytes per parameter saved).

Each host buffer is a :class:`~lightning_dos.engine.hostslab.HostSlab`: a page-aligned mapping of its own,
excluded from forked children, registered with ``cudaHostRegister`` on CUDA. torch's pinned allocator rounds
every block up to a power of two (5e9 elements ask for 70 GB and get 120 GB), while a registered block pins
exactly its own bytes. :attr:`BufferPool.pinned_bytes` reports what is really pinned. Without CUDA nothing is
pinned and the results are identical; a refused registration leaves the slabs pageable, with one warning.
:meth:`BufferPool.release_host` (teardown) unpins every slab at once and frees the 16-bit ring.

Device side: N staging buffers, each able to hold one streamed sub-group's master weights, states and
gradient (and its 16-bit cast when the 16-bit parameters live on the host). They are allocated at the start
of every update, sized from what the update may use, and given back to torch's caching allocator once its device
side is issued (recorded on the streams still using them: the engine's ``_release_staging``):
nothing of them is held through the next forward and backward, whose activations need that memory back
(the blocks stay reserved by torch, so the next forward and the next update reuse them). Resident
sub-groups keep their state on the device across iterations, in blocks of their own; the strategy plans
them only inside an explicit ``gpu_memory_budget``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_dos.engine.hostslab import PAGEABLE_COST, HostSlab, Registrar, default_registrar
from lightning_dos.model.update_rules import ADAM, ADAM_FP32, UpdateRule

FP32_BYTES = 4
#: Device staging bytes per element of a streamed Adam sub-group in fp32: param, exp_avg, exp_avg_sq, grad.
STAGING_BYTES_PER_ELEMENT = ADAM_FP32.device
#: Most slots in the host 16-bit staging ring (None: one per sub-group). A bounded ring makes host Adam wait
#: for a slot whose upload queues behind the device sub-groups' uploads on the same copy engine: replayed on
#: paper-h100x4 (tests/test_simulate.py), 2 slots took the update to 1.4-1.75x the prediction, 4 slots to
#: 1.4-1.7x, one per sub-group to 0.96-1.0x. So every sub-group keeps a slot until a plan-aware ring exists.
LP_STAGING_SLOTS: int | None = None


@dataclass
class DeviceBuffer:
    """One device staging slot: master weights, gradient and the rule's state tensors of up to ``capacity``
    elements, and ``lp``, the 16-bit cast waiting for its download when the 16-bit parameters live on the host."""

    param: torch.Tensor
    grad: torch.Tensor
    states: tuple[torch.Tensor, ...]
    lp: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.param.numel()

    @property
    def nbytes(self) -> int:
        tensors = (self.param, self.grad, *self.states) + ((self.lp,) if self.lp is not None else ())
        return sum(t.numel() * t.element_size() for t in tensors)


class StagingRing:
    """A few host slots for 16-bit casts on their way up; a slot is reused once its upload has landed.

    Args:
        storage: host tensor of ``slots * slot_numel`` elements.
        slots: number of slots.
    """

    def __init__(self, storage: torch.Tensor, slots: int) -> None:
        self.storage = storage
        self.slots = slots
        self.slot_numel = storage.numel() // slots
        self._busy: list[object] = [None] * slots  # the event of each slot's last upload
        self._next = 0
        #: Slots acquired and not released yet: a speculative 16-bit result waits in one until its step commits.
        self._taken: set[int] = set()

    def acquire(self, numel: int) -> tuple[int, torch.Tensor, object]:
        """The next slot not taken as a tensor of ``numel`` elements, and the event of the upload that last read it
        (None: none pending). The caller host-waits for that event before writing the slot; the wait is
        the engine's (issued through its streams), so the race checker sees it."""
        if numel > self.slot_numel:
            raise ValueError(f"a sub-group of {numel} elements does not fit a staging slot of {self.slot_numel}")
        if len(self._taken) == self.slots:
            raise RuntimeError("every slot of the 16-bit staging ring is taken")
        slot = self._next
        while slot in self._taken:
            slot = (slot + 1) % self.slots
        self._next = (slot + 1) % self.slots
        self._taken.add(slot)
        last_read, self._busy[slot] = self._busy[slot], None
        start = slot * self.slot_numel
        return slot, self.storage[start : start + numel], last_read

    @property
    def free(self) -> int:
        """Slots not taken."""
        return self.slots - len(self._taken)

    def release(self, slot: int, upload_done: object) -> None:
        """Record the event after which ``slot`` may be overwritten (None: at once)."""
        self._taken.discard(slot)
        self._busy[slot] = upload_done


class BufferPool:
    """Host slabs for every sub-group's optimizer state, a 16-bit staging ring, and device staging.

    Args:
        total_numel: elements in the rank's master partition (all sub-groups).
        lp_dtype: dtype of the model's parameters (bf16, fp16 or fp32).
        device: the accelerator the engine runs device sub-groups on (``cpu`` when there is none).
        pin: pin the host slabs (ignored, with pageable memory used instead, when CUDA is absent).
        lp_on_host: the 16-bit parameters live in host memory (parameter offload, or no accelerator):
            host sub-groups are cast straight into them and need no staging ring. None: when not ``accelerated``.
        largest_sub_group: elements of the largest sub-group, the size of a staging-ring slot.
        accelerated: device work is issued asynchronously (the streams' ``is_async``: CUDA, or a simulation of
            it on CPU); device buffers then also hold the 16-bit cast when the 16-bit parameters are on the
            host. None decides by the device (not on a CPU device).
        allocate: allocates ``(numel, dtype)`` of device memory; None uses ``torch.empty`` on ``device``.
        rule: the optimizer's update rule: one state slab per tensor it names.
        master_dtype: dtype of the master weights and gradients (DeepSpeed's ``master_weights_and_grads_dtype``).
        state_dtype: dtype of the optimizer's state tensors.
    """

    def __init__(
        self,
        total_numel: int,
        lp_dtype: torch.dtype,
        device: torch.device,
        pin: bool = True,
        lp_on_host: bool | None = None,
        largest_sub_group: int | None = None,
        accelerated: bool | None = None,
        allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None,
        rule: UpdateRule = ADAM,
        master_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = device
        self.rule, self.master_dtype, self.state_dtype = rule, master_dtype, state_dtype
        self.lp_dtype = lp_dtype
        self._allocate = allocate or (lambda numel, dtype: torch.empty(numel, dtype=dtype, device=device))
        self.accelerated = device.type != "cpu" if accelerated is None else accelerated
        self.lp_on_host = not self.accelerated if lp_on_host is None else lp_on_host
        slots, slot = self.ring_shape(total_numel, largest_sub_group, self.lp_on_host)
        # Zero-filled mappings: the moments start at zero, as torch.zeros would, and cost nothing until written.
        self._slabs = [HostSlab(total_numel, master_dtype)] + [HostSlab(total_numel, state_dtype) for _ in rule.states]
        #: The master weights, and the rule's state tensors in ``rule.states`` order, every sub-group back to back.
        self.param = self._slabs[0].tensor
        self.states: tuple[torch.Tensor, ...] = tuple(slab.tensor for slab in self._slabs[1:])
        self.lp_staging: StagingRing | None = None
        self._ring_slab: HostSlab | None = None
        if slots:
            self._ring_slab = HostSlab(slots * slot, lp_dtype)
            self._slabs.append(self._ring_slab)
            self.lp_staging = StagingRing(self._ring_slab.tensor, slots)
        #: Host bytes really pinned (registered), exactly; 0 when nothing is pinned.
        self.pinned_bytes = 0
        #: First element of the file-backed sub-groups (the NVMe tier: their spans hold memory only while loaded, so
        #: they are never registered); None without a file tier (:meth:`keep_tail_in_files`).
        self.file_backed_from: int | None = None
        self.pinned = False
        if pin:
            self.register_host(default_registrar())
        #: Device staging buffers of the update in flight (empty between updates).
        self.staging: list[DeviceBuffer] = []
        #: How many times device staging was allocated (once per update that streams), for tests and logs.
        self.staging_allocations = 0
        #: Device bytes held across iterations by resident sub-groups (param, moments, gradient).
        self.resident_bytes = 0

    @staticmethod
    def ring_shape(total_numel: int, largest_sub_group: int | None, lp_on_host: bool) -> tuple[int, int]:
        """(slots, elements per slot) of the 16-bit staging ring; (0, 0) when the 16-bit parameters are on
        the host."""
        if lp_on_host or total_numel == 0:
            return 0, 0
        slot = total_numel if largest_sub_group is None else min(largest_sub_group, total_numel)
        slots = -(-total_numel // slot)
        return (slots if LP_STAGING_SLOTS is None else min(LP_STAGING_SLOTS, slots)), slot

    def state(self, name: str) -> torch.Tensor:
        """The slab of the rule's state tensor ``name`` (``exp_avg``, ``exp_avg_sq``, ``sum``)."""
        return self.states[self.rule.states.index(name)]

    @classmethod
    def planned_host_bytes(
        cls,
        total_numel: int,
        lp_dtype: torch.dtype,
        lp_on_host: bool,
        largest_sub_group: int | None,
        optimizer_state_bytes: int = ADAM_FP32.optimizer_state,
    ) -> int:
        """Host bytes a pool of these dimensions will allocate (for the pre-flight check);
        ``optimizer_state_bytes`` per element for the master weights and states (``Footprint.optimizer_state``)."""
        slots, slot = cls.ring_shape(total_numel, largest_sub_group, lp_on_host)
        lp_size = torch.empty((), dtype=lp_dtype).element_size()
        return optimizer_state_bytes * total_numel + lp_size * slots * slot

    def keep_tail_in_files(self, first_element: int) -> None:
        """The slabs from element ``first_element`` on are the NVMe tier's: never registered, counted only while
        loaded. Call before :meth:`register_host`."""
        self.file_backed_from = first_element

    def register_host(self, registrar: Registrar | None) -> bool:
        """Register every slab with ``registrar`` (None: nothing to pin); return whether they are pinned.

        Registering faults in and pins every page of the slabs. A pool built with ``pin=False`` is registered
        here later: the adapter does so once DeepSpeed's fp32 master partitions have been copied into the
        slabs and freed, so that they and the registered slabs never coexist (issue 32, point 5).
        """
        if registrar is not None and not self.pinned:
            self.pinned = self._pin(registrar)
        return self.pinned

    def _pin(self, registrar: Registrar) -> bool:
        """Register every slab (of the state slabs, the part before :attr:`file_backed_from`); on a refusal
        unregister those done and stay pageable, with one warning."""
        for slab in self._slabs:
            limit = None
            if slab is not self._ring_slab and self.file_backed_from is not None:
                limit = self.file_backed_from * slab.tensor.element_size()
            code = slab.pin(registrar, limit)
            if code != 0:
                for done in self._slabs:
                    done.unpin()
                total = sum(s.nbytes for s in self._slabs)
                # ulimit -l does not bound these registrations; it does bound the NVMe tier's staging slabs and the
                # drive's measurement (mlock'ed by DeepSpeed's allocator), which the strategy's pre-flight checks.
                warnings.warn(
                    f"lightning-dos: {registrar.name} refused {total / 1e9:.2f} GB of host memory (error {code}), so "
                    f"{PAGEABLE_COST}. The locked-memory limit (ulimit -l) is not what refused it: the NVIDIA driver "
                    "does not charge registrations to it; look at the container runtime's or the host's memory.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.pinned_bytes = 0
                return False
            self.pinned_bytes += slab.pinned_bytes
        return True

    def give_back(self, start: int, numel: int) -> int:
        """Give the kernel back the pages of elements ``[start, start + numel)`` of the master and state slabs (a
        file-backed sub-group's span, its state now in the swap file); return the bytes given back."""
        given = 0
        for slab in self._slabs[: 1 + len(self.states)]:
            size = slab.tensor.element_size()
            given += slab.give_back(start * size, (start + numel) * size)
        return given

    def release_host(self) -> None:
        """Unpin every host slab now and free the 16-bit staging ring (teardown; not left to the garbage collector).

        The fp32 master weights and moments stay readable, as pageable memory, for what reads them after
        training (a checkpoint saved after ``fit``, DeepSpeed's accessors); their mappings go with the last
        tensor that views them.
        """
        for slab in self._slabs:
            slab.unpin()
        self.pinned, self.pinned_bytes = False, 0
        if self._ring_slab is not None:
            self.lp_staging = None
            self._ring_slab.close()

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool allocated: its slabs (pinned while :attr:`pinned`), the 16-bit ring
        included after :meth:`release_host` freed it; not the file-backed sub-groups' spans, which hold memory only
        while loaded."""
        held = sum(slab.nbytes for slab in self._slabs)
        if self.file_backed_from is not None:
            for slab in self._slabs[: 1 + len(self.states)]:
                held -= (slab.tensor.numel() - self.file_backed_from) * slab.tensor.element_size()
        return held

    # -- device staging ----------------------------------------------------------------------

    @property
    def device_bytes_in_use(self) -> int:
        """Device bytes held by the staging buffers (0 between updates)."""
        return sum(b.nbytes for b in self.staging)

    def _new_buffer(self, capacity: int, with_lp: bool) -> DeviceBuffer:
        # One block per dtype: master weights and gradient, then the states (fp32 or bf16 apart from the master).
        count = len(self.rule.states)
        if self.state_dtype == self.master_dtype:
            param, grad, *states = self._allocate((2 + count) * capacity, self.master_dtype).split(capacity)
        else:
            param, grad = self._allocate(2 * capacity, self.master_dtype).split(capacity)
            states = self._allocate(count * capacity, self.state_dtype).split(capacity) if count else ()
        lp = self._allocate(capacity, self.lp_dtype) if with_lp else None
        return DeviceBuffer(param, grad, tuple(states), lp=lp)

    def staging_for(self, count: int, capacity: int) -> list[DeviceBuffer]:
        """``count`` device staging buffers of ``capacity`` elements for one update (may raise OutOfMemoryError).

        One block per buffer, allocated now; an out-of-memory error leaves nothing half-allocated (and no
        staging held). The caller gives them back with :meth:`release_staging` once the update's last copy
        has landed.
        """
        with_lp = self.lp_on_host and self.accelerated
        self.release_staging()
        buffers = [self._new_buffer(capacity, with_lp) for _ in range(count)]
        self.staging = buffers
        self.staging_allocations += 1
        return buffers

    def release_staging(self) -> None:
        """Give the staging buffers back to the caching allocator (once an update's device side is issued, and at
        teardown).

        Only once no queued work reads or writes them, or once each block is recorded on the streams whose queued
        work still uses it (``Streams.record_stream``): the allocator hands a freed block to the next allocation on
        its stream at once."""
        self.staging = []

    def allocate_resident(self, capacity: int) -> DeviceBuffer:
        """Persistent device state for one resident sub-group (may raise OutOfMemoryError)."""
        buffer = self._new_buffer(capacity, with_lp=self.lp_on_host and self.accelerated)
        self.resident_bytes += buffer.nbytes
        return buffer

    def release_resident(self, buffer: DeviceBuffer) -> None:
        self.resident_bytes -= buffer.nbytes

    def describe(self) -> dict[str, int | bool]:
        """What the pool holds, for logs and the monitor."""
        return {
            "host_bytes": self.host_bytes,
            "pinned": self.pinned,
            "pinned_bytes": self.pinned_bytes,
            "elements": self.param.numel(),
            "device_staging_bytes": self.device_bytes_in_use,
            "device_resident_bytes": self.resident_bytes,
        }
