"""Sub-groups in the order the next forward needs them (issue 52, point 1): recorded in the first forward and
backward, the engine updates and lands them in it, and the next forward's gathers wait for their own sub-groups."""

from __future__ import annotations

import threading
import time

import lightning as L
import pytest
import torch
from helpers import trainer

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.model.need_order import need_order
from lightning_dos.model.plan import Place, Plan
from lightning_dos.recipes.gpt import GPT
from lightning_dos.sim.simstreams import SimStreams

# -- the arithmetic -------------------------------------------------------------------------------------------------


def test_a_sub_group_comes_at_the_first_gather_that_reads_it() -> None:
    # A GPT's layout: the no-decay group (embeddings, norms, biases: 4 and 5) packed last, read by the first gathers.
    gathers = [[4], [5], [5, 0], [0, 1], [5, 2], [2, 3], [5]]
    assert need_order(6, gathers) == (4, 5, 0, 1, 2, 3)


def test_ties_go_by_finality_and_sub_groups_never_read_come_last() -> None:
    assert need_order(5, [[3, 1]], final=[3, 1]) == (3, 1, 0, 2, 4)
    assert need_order(5, [[3, 1]], final=[4, 2, 0]) == (1, 3, 4, 2, 0)
    assert need_order(3, []) == (0, 1, 2)
    with pytest.raises(ValueError, match="sub-group 7"):
        need_order(3, [[7]])


def test_a_plan_lists_its_sub_groups_in_its_order() -> None:
    plan = Plan((Place.HOST, Place.DEVICE, Place.HOST, Place.DEVICE)).in_order((3, 2, 0, 1))
    assert plan.host_indices == [2, 0] and plan.streamed_indices == [3, 1]
    assert Plan((Place.HOST,) * 3).host_indices == [0, 1, 2]
    with pytest.raises(ValueError, match="each once"):
        Plan((Place.HOST,) * 3).in_order((0, 0, 1))


# -- the tiny GPT recipe on the simulated accelerator ----------------------------------------------------------------


class WatchGathers(L.Callback):
    """Slows each host sub-group's update down (so the next forward catches up with the update and waits) and
    records, for every wait of a gather of the next forward, what it read, what of that had not landed yet and the
    host sub-groups that landed from then on."""

    def __init__(self) -> None:
        self.landed: list[int] = []  # the host sub-groups' landings, in order, every update
        self.waits: list[tuple[frozenset[int], frozenset[int], int]] = []  # (read, not landed yet, landings then)
        self.lock = threading.Lock()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = self.engine = trainer.strategy.dos_engine
        land, wait = engine.landing.land, engine.wait_sub_groups

        def on_host(index: int) -> bool:
            progress = engine.progress  # during backward (places not yet set) only host sub-groups are updated
            return progress is not None and (progress.places is None or progress.places[index] == Place.HOST)

        def landing(index: int, event: object) -> None:
            if on_host(index):
                with self.lock:
                    self.landed.append(index)
            land(index, event)

        def waiting(indices: list[int], stream: object = None) -> None:
            with self.lock:
                pending = engine.landing.not_landed(indices)
                if pending is not None and indices:
                    self.waits.append((frozenset(indices), pending, len(self.landed)))
            wait(indices, stream)

        engine.landing.land, engine.wait_sub_groups = landing, waiting
        engine.watch_points(lambda point, index: time.sleep(0.006) if point == "done" and on_host(index) else None)


def waited_for(watch: WatchGathers) -> list[tuple[frozenset[int], set[int]]]:
    """Per wait: the sub-groups it read, and the host sub-groups that landed from the wait's start until the last of
    those it read had landed (what the gather waited for, given the order the update lands them in)."""
    found = []
    for needed, pending, start in watch.waits:
        later = watch.landed[start:]
        last = max((later.index(i) for i in pending if i in later), default=-1)
        found.append((needed, set(later[: last + 1])))
    return found


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (12, 33), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(data, batch_size=2)


@pytest.mark.parametrize("overlap", ["forward", "auto"])
def test_the_next_forwards_gathers_wait_for_their_own_sub_groups_only(overlap: str) -> None:
    """The tiny GPT recipe's model (sub_group_size 50000: 18 sub-groups, the no-decay group last), half the
    sub-groups streamed on the simulated accelerator: every gather of the next forward, its first included, waits for
    none but the sub-groups holding its parameters (updated in index order, the first gather waited for 16 others)."""
    L.seed_everything(0, verbose=False)
    model = GPT(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256)
    strategy = DeepOptimizerStatesStrategy(
        gpu_fraction=0.5,
        sub_group_size=50_000,
        overlap=overlap,
        streams_factory=lambda device: SimStreams(device),
        # Two spare slots (a slot holds the largest sub-group's state and 16-bit result, 0.7 MB): "auto" speculates
        # on two host sub-groups during backward and commits them, in need order, before the step's device side is
        # launched; the other host sub-groups are updated after it, where the next forward can catch up with them.
        speculation_memory=2_000_000,
    )
    watch = WatchGathers()
    trainer(strategy, steps=4, clip=None, callbacks=(watch,)).fit(model, loader())
    engine = watch.engine
    # Recorded: the first gather (the token embedding) reads the no-decay group's first sub-groups, packed last.
    no_decay = [sg.index for sg in engine.sub_groups if sg.param_group == 1]
    assert engine.need_order[0] == no_decay[0] and engine.need_order[:3] != (0, 1, 2), engine.need_order
    waits = waited_for(watch)
    assert sum(1 for _, waited in waits if waited) >= 3, "the forward caught up with the update and waited"
    for needed, waited in waits:
        assert waited <= needed, f"a gather of {sorted(needed)} waited for {sorted(waited - needed)} as well"
