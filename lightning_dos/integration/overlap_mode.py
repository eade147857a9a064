"""What ``overlap`` runs as, decided once DeepSpeed is up: "auto" begins the step during backward where it can
(speculatively, in spare host memory: DeepSpeed skips a step whose global gradient norm is not finite, which only
backward's end tells), else runs as "forward"; said once.

Every line said fits 80 columns after Lightning's ``INFO: `` prefix.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dos.engine import native
from lightning_dos.engine.loop import InterleavedUpdate
from lightning_dos.host.hostmem import host_memory
from lightning_dos.integration.zero3 import ZeRO3Adapter, backward_overlap_blocker, speculation_reason
from lightning_dos.model.iteration import speculation_of
from lightning_dos.model.overlap import AUTO, FORWARD, OFF, Overlap
from lightning_dos.planning.scheduler import PlacementScheduler


def speculation_budget(overlap: str, speculation_memory: int | str, rank_bytes: int, local_ranks: int) -> int:
    """Host bytes a rank may hold for speculative updates (the pre-flight's part): none unless ``overlap="auto"``
    (every update it begins during backward is speculative); ``speculation_memory`` bytes, or under ``"auto"`` half
    of what the node has spare beyond every local rank's ``rank_bytes``, shared by the ``local_ranks``."""
    if overlap != AUTO:
        return 0
    if speculation_memory != "auto":
        return int(speculation_memory)
    memory = host_memory()
    if memory is None:  # no limit to read (no /proc): speculate only within an explicit speculation_memory
        return 0
    return max(0, memory.headroom - local_ranks * rank_bytes) // (2 * local_ranks)


def resolve_overlap(
    asked: str,
    ds_optimizer: Any,
    speculation_bytes: int,
    speculation_memory: int | str,
    clip_setting: str = "gradient_clip_val",
) -> Overlap:
    """What runs for ``overlap=asked``: "auto" only where the step may begin during backward (speculatively,
    within ``speculation_bytes``), else "forward"; said once, except for "auto" whose line
    :func:`reserve_speculation` says once the engine exists. ``clip_setting``: how the user sets clipping."""
    if asked == OFF:
        rank_zero_info("lightning-dos: overlap='off': each step waits for its update")
        return OFF
    if asked == FORWARD:
        rank_zero_info("lightning-dos: overlap='forward': the update overlaps the next forward")
        return FORWARD
    blocker = backward_overlap_blocker(ds_optimizer)
    if blocker is None and speculation_bytes > 0:
        return AUTO
    if blocker is None:
        spare = "speculation_memory=0" if speculation_memory == 0 else "no host memory is spare"
        blocker = f"{speculation_reason(ds_optimizer, clip_setting)},\nand {spare} for speculative updates"
    _say_forward(blocker)
    return FORWARD


def reserve_speculation(
    adapter: ZeRO3Adapter, ds_optimizer: Any, speculation_bytes: int, clip_setting: str = "gradient_clip_val"
) -> int:
    """Under "auto": reserve the engine's spare slots for the updates begun during backward (all speculative), one at
    most per sub-group such an update may take (:func:`updatable_during_backward`), or run as "forward" when not
    one fits in ``speculation_bytes`` or no sub-group may be taken during backward; say what runs; return the host
    bytes reserved."""
    if adapter.overlap != AUTO:
        return 0
    engine = adapter.engine
    reason = speculation_reason(ds_optimizer, clip_setting)
    early = updatable_during_backward(engine)
    if early == 0:  # all of the state in files: nothing to begin during backward, speculatively or not
        adapter.overlap = FORWARD
        _say_forward("every sub-group's state is on NVMe, read only once backward is over")
        return 0
    slot = engine.speculation_slot_bytes()
    slots = min(early, speculation_bytes // max(1, slot))
    if slots == 0:
        adapter.overlap = FORWARD
        _say_forward(
            f"{reason},\nand one sub-group's state ({_size(slot)}) exceeds the speculation memory "
            f"({_size(speculation_bytes)})"
        )
        return 0
    held = engine.reserve_speculation(slots)
    adapter.speculative = True
    adapter.commit_policy.say = rank_zero_info
    rank_zero_info(
        "lightning-dos: overlap='auto': host sub-groups are updated during backward\n"
        "as their gradients become final, speculatively, as\n"
        f"{reason}:\n"
        f"{_kept_if(reason)}\n"
        f"({slots} of {_sub_groups(engine, early)}, {_size(held)} of host memory)"
    )
    return held


def updatable_during_backward(engine: InterleavedUpdate) -> int:
    """How many of ``engine``'s sub-groups an update begun during backward may take: all but those the NVMe tier
    keeps in files (read only once backward is over, never speculated on); they are the first ones."""
    return len(engine.sub_groups) - (len(engine.files.indices) if engine.files is not None else 0)


def _sub_groups(engine: InterleavedUpdate, early: int) -> str:
    """``early`` sub-groups, said as those not on NVMe where the tier keeps some in files."""
    return f"{early} sub-groups" if early == len(engine.sub_groups) else f"the {early} sub-groups not on NVMe"


def plan_for_speculation(scheduler: PlacementScheduler, adapter: ZeRO3Adapter) -> None:
    """Where the updates begun during backward are speculative, the scheduler plans the iteration for the commit
    rate observed so far (:attr:`~lightning_dos.planning.speculation.CommitPolicy.expected_rate`)."""
    if adapter.speculative:
        policy, footprint = adapter.commit_policy, adapter.engine.footprint
        out_of_place = native.available()  # else torch's kernels copy the state before a speculative update
        scheduler.speculation = lambda: speculation_of(policy.expected_rate, footprint, out_of_place)


def _kept_if(reason: str) -> str:
    """What decides whether a speculative update is kept, as the console says it."""
    if reason.startswith("gradient clipping"):
        return "each update is kept if the step is not clipped, else redone after it"
    return "each update is kept if the step is taken, else dropped with it"


def _say_forward(why: str) -> None:
    rank_zero_info(
        f"lightning-dos: overlap='auto' runs as 'forward' (the update overlaps\nthe next forward, not backward):\n{why}"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
