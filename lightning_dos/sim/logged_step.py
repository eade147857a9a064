"""The engine run at test size under the stream-race checker, and the log of its steady-state step: what
``lightning-dos simulate`` replays on the virtual node (:mod:`lightning_dos.sim.replay`), scaled to the real
sizes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

import torch

from lightning_dos.engine.kernels import Hyper
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.model.nvme import ALTERNATE, staging_slots
from lightning_dos.model.overlap import begins_in_backward, overlaps_forward
from lightning_dos.model.plan import Plan
from lightning_dos.model.update_rules import ADAM_FP32, Footprint
from lightning_dos.sim.findings import LoggedOp
from lightning_dos.sim.sanitizer import StreamSanitizer
from lightning_dos.sim.simdrive import SimSwapFile

#: Bytes per element of the master weights and states, and their dtypes.
DTYPES = {4: torch.float32, 2: torch.bfloat16}
#: Elements per sub-group in the test-sized run that is logged (the replay scales it to the real size).
SIM_ELEMENTS = 64


def copy_bytes(plan: Plan, sizes: Sequence[int], footprint: Footprint, lp_bytes: int, lp_downloads: bool) -> dict:
    """Bytes the engine copies per ``(sub-group, lane)`` in a steady-state step of ``plan`` for ``footprint``, for the
    copies whose bytes depend on the optimizer: a streamed sub-group's upload (master weights, states, gradient)
    and download (master weights and states, and its 16-bit result when ``lp_downloads``), a resident one's
    upload (its gradient, unless ``footprint`` keeps it on the device)."""
    expected = {}
    for i in plan.streamed_indices:
        expected[i, "upload"] = footprint.streamed_up * sizes[i]
        expected[i, "download"] = (footprint.streamed_down + (lp_bytes if lp_downloads else 0)) * sizes[i]
    for i in plan.resident_indices:
        expected[i, "upload"] = footprint.resident_up * sizes[i]
    return expected


def rescale_copies(log: Sequence[LoggedOp], expected: dict) -> tuple[list[LoggedOp], dict]:
    """``log`` with the copies of each ``(sub-group, lane)`` in ``expected`` scaled to carry those bytes in all,
    and the factor applied to each (1.0 where the engine already moved them).

    Copies of one lane run one after another on one copy engine, so only their sum shapes the replay: scaling
    each in proportion keeps the engine's order, waits and overlap and gives every transfer its real size.
    That is how an engine that runs one rule and dtype is replayed as another (the figures are then the
    schedule of the engine as it is, with the other's bytes)."""
    logged: dict = defaultdict(int)
    for entry in log:
        if entry.kind == "op" and (entry.sub_group, entry.lane) in expected:
            logged[entry.sub_group, entry.lane] += entry.nbytes
    factors = {key: expected[key] / logged[key] for key in expected if logged.get(key)}
    done: dict = defaultdict(int)  # logged bytes of each group seen so far
    out = []
    for entry in log:
        key = (entry.sub_group, entry.lane)
        if entry.kind != "op" or key not in factors:
            out.append(entry)
            continue
        # Rounded on the running sum, so that the group's copies add up to exactly the expected bytes.
        before = round(done[key] * factors[key])
        done[key] += entry.nbytes
        out.append(replace(entry, nbytes=round(done[key] * factors[key]) - before))
    return out, factors


def engine_log(
    sizes: Sequence[int],
    plan: Plan,
    lp_bytes: int,
    sim_elements: int = SIM_ELEMENTS,
    *,
    footprint: Footprint = ADAM_FP32,
) -> tuple[list, float, int]:
    """Run ``plan`` at test size under the checker; return the log of a steady-state step, the scale from
    test size to ``sizes``, and the number of races found.

    ``footprint``: the optimizer's rule and dtypes. The engine built here runs its own (Adam in fp32 until it
    takes a rule; then it is given this one); the optimizer-dependent copies are scaled to ``footprint``'s
    bytes (:func:`rescale_copies`: a factor of 1 when the engine ran it)."""
    scale = max(sizes) / sim_elements
    checker = StreamSanitizer()
    log = steady_step(checker, sizes, plan, lp_bytes, scale, footprint)
    return log, scale, len(checker.races)


def sizes_at_test_scale(sizes: Sequence[int], scale: float) -> list[int]:
    """The logged engine's sub-group sizes: ``sizes`` divided by ``scale``."""
    return [max(1, round(n / scale)) for n in sizes]


def steady_step(
    checker: StreamSanitizer,
    sizes: Sequence[int],
    plan: Plan,
    lp_bytes: int,
    scale: float,
    footprint: Footprint,
    overlap: str = "off",
    clipped: bool | None = None,
    files_from: int | None = None,
    files_order: str = ALTERNATE,
) -> list[LoggedOp]:
    """Build an engine of ``sizes / scale`` elements per sub-group on ``checker``'s streams, watched by it as
    ``overlap`` runs (:meth:`~lightning_dos.sim.sanitizer.StreamSanitizer.watch`), step it twice with ``plan`` and
    return the log of the second step (the steady state: the first brings resident state up), its copies rescaled
    to ``footprint``'s bytes. The engine keeps its 16-bit parameters on the (simulated) device. ``clipped`` (under
    ``auto``): the updates begun during backward are speculative, and each step turns out clipped (True: they are
    redone) or not (False: committed). ``files_from``: sub-groups from this one on keep their state on the
    simulated drive (:class:`~lightning_dos.sim.simdrive.SimSwapFile`, as many staging slabs as the strategy
    opens for ``sizes``: ``model.nvme.staging_slots``), taken in ``files_order`` (``model.nvme.ORDERS``); the engine
    then steps three times and the third is logged: it takes the file-backed sub-groups forwards, after a step that
    took them backwards (alternating) or forwards too."""
    small = sizes_at_test_scale(sizes, scale)
    engine = InterleavedUpdate(
        small,
        [0] * len(small),
        max(small),
        torch.device("cpu"),
        torch.bfloat16 if lp_bytes == 2 else torch.float32,
        streams=checker.streams(),
        rule=footprint.rule,
        master_dtype=DTYPES[footprint.master],
        state_dtype=DTYPES[footprint.state],
        keep_resident_grads=footprint.grads_on_device,
    )
    # The virtual node's forward and backward take the sub-groups in the plan's order, as the engine works them.
    engine.set_need_order(plan.order)
    if files_from is not None:

        def open_swap(records: list[int], master: torch.dtype, state: torch.dtype, states: int) -> SimSwapFile:
            # For the real sizes, not the test's, and the records in files, as the adapter opens them.
            slots = staging_slots(max(sizes) * footprint.optimizer_state, len(records))
            return SimSwapFile(checker, files_from, records, master, state, states, slots=slots)

        engine.keep_records_in(files_from, open_swap)
        engine.take_files_in(files_order)
    early = begins_in_backward(overlap)
    checker.watch(engine, overlap=overlaps_forward(overlap), early=early, clipped=clipped if early else None)
    speculative = early and clipped is not None
    if speculative:  # one spare slot per sub-group, as speculation_memory="auto" gives where host memory allows
        engine.reserve_speculation(len(small))
    hyper = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)]
    grads = [torch.zeros(n, dtype=DTYPES[footprint.master]) for n in small]
    lp = [torch.zeros(n, dtype=engine.lp_dtype) for n in small]
    # The first step brings resident state up; the last is the steady state replayed.
    for step in (1, 2) if files_from is None else (1, 2, 3):
        if footprint.grads_on_device:  # backward's copies on the device, before the update's log begins
            for flat, grad in enumerate(grads):
                engine.keep_gradient(flat, 0, grad)
        checker.log.clear()
        inputs = StepInputs(grads, lp, hyper * len(small), [step] * len(small), speculative=speculative)
        engine.step(plan, inputs)
    assert not engine.lp_downloads and engine.lp_bytes == lp_bytes
    return rescale_copies(checker.log, copy_bytes(plan, small, footprint, lp_bytes, lp_downloads=False))[0]
