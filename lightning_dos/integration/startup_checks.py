"""The strategy's checks of the host before any work: the node's host memory against the offloaded optimizer state,
and the NVMe tier's budget, locked-memory limit, drive and libaio (a part of
:class:`~lightning_dos.integration.setup.DOSSetup`, which holds the settings they read). Each
refusal is a :class:`~lightning_dos.errors.DOSConfigError` naming the setting and the fix, raised before DeepSpeed
allocates anything."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dos.engine.swap_files import padding_bound
from lightning_dos.host.disk import check_nvme_path, load_aio, measure_disk, ssd_wear_notice
from lightning_dos.host.hostmem import LIMIT_ENV, check_host_memory, host_memory
from lightning_dos.host.ranks import measure_drive_together, reduce_min_over_ranks
from lightning_dos.integration.nvme_tier import CALIBRATION_BYTES, check_locked_memory, resolve_host_budget
from lightning_dos.integration.optimizers import rule_of
from lightning_dos.integration.overlap_mode import speculation_budget
from lightning_dos.integration.preflight import (
    HostFigure,
    config_footprint,
    figure_for,
    least_rounded_sub_group_size,
    partition_numels,
    pin_backend,
)
from lightning_dos.model.nvme import staging_slots
from lightning_dos.model.plan import ALIGN_ELEMENTS, auto_sub_group_size
from lightning_dos.model.update_rules import Footprint

if TYPE_CHECKING:
    from torch.optim import Optimizer


class StartupChecks:
    """The host memory and NVMe pre-flight of :class:`~lightning_dos.integration.setup.DOSSetup` (its ``config``,
    ``world_size``, ``on_cuda``, ``engine_sub_group_size``, ``overlap``, ``speculation_memory``, ``dos_nvme`` and the
    like)."""

    config: dict[str, Any]

    def _check_host_memory(self, model: torch.nn.Module, optimizer: Optimizer) -> None:
        """Refuse to start, with the figures, when the node's host memory cannot hold the optimizer state.

        Counted per rank (:func:`~lightning_dos.integration.preflight.rank_host_figure`), for every rank on this
        node: every
        buffer DeepSpeed will pin, rounded as its pinning really rounds (torch's caching host allocator: a power
        of two per buffer), and the engine's slabs. The figure is kept as :attr:`dos_host_figure`.
        """
        total = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
        per_rank = -(-total // max(1, self.world_size))
        on_cuda = self.on_cuda
        footprint = config_footprint(self.config, rule_of(optimizer))
        if self.engine_sub_group_size == "auto" and pin_backend(on_cuda) == "torch":
            # DeepSpeed's sub-groups are ours to size here: sized so that their pinned fp32 gradient buffers land
            # at or just under a power of two, which torch's pinned allocator rounds every block up to.
            zero = self.config["zero_optimization"]
            zero["sub_group_size"] = least_rounded_sub_group_size(
                partition_numels(model, optimizer.param_groups, self.world_size),
                int(zero["sub_group_size"]),
                grad_bytes=footprint.master,
            )
        figure = self.dos_host_figure = figure_for(
            model,
            optimizer.param_groups,
            self.config,
            world_size=self.world_size,
            on_accelerator=on_cuda,
            engine_sub_group_size=self.engine_sub_group_size,
            footprint=footprint,
            # The simulated accelerator (SimStreams) gives the engine a GPU's host side on a CPU: its ring too.
            engine_on_accelerator=on_cuda or getattr(self.streams_factory, "is_async", False) is True,
        )
        local_ranks = max(1, len(self.parallel_devices or [None]))
        self._speculation_bytes = speculation_budget(self.overlap, self.speculation_memory, figure.total, local_ranks)
        counted = self._speculation_bytes if self.speculation_memory != "auto" else 0  # "auto" fits by construction
        if self.dos_nvme is not None:
            self._plan_nvme_tier(figure, per_rank, footprint, local_ranks)
        check_host_memory(
            local_ranks * (figure.total + counted),
            what=(
                f"the offloaded optimizer state of {total / 1e6:.1f}M parameters ({per_rank / 1e6:.1f}M per rank, "
                f"{local_ranks} rank(s) on this node: {figure.describe(per_rank)})"
            ),
            fix=(
                "Spread the model over more nodes (ZeRO-3 divides this state by the number of ranks), train a "
                "smaller model, or raise the memory limit of the job; "
                f"{LIMIT_ENV} (bytes) sets a tighter cap when the scheduler enforces one the process cannot read."
            ),
        )

    def _plan_nvme_tier(self, figure: HostFigure, per_rank: int, footprint: Footprint, local_ranks: int) -> None:
        """Resolve the host budget, check ``ulimit -l``, ``nvme_path`` (writable, O_DIRECT, room for every local
        rank's file) and libaio, and count in ``figure`` the host part of the state and the staging slabs instead of
        all of it."""
        tier = self.dos_nvme
        state = footprint.optimizer_state * per_rank
        size = self.engine_sub_group_size
        sub_group = min(per_rank, auto_sub_group_size(per_rank) if size == "auto" else int(size))
        largest = sub_group + ALIGN_ELEMENTS
        # A record pads each tensor to a block and the whole to a block per I/O thread: at most this much more.
        padding = padding_bound(len(footprint.rule.states), tier.threads)
        # The most slabs the adapter opens for this sub-group size (staging_slots), each up to the largest record.
        staging = staging_slots(footprint.optimizer_state * sub_group) * (footprint.optimizer_state * largest + padding)
        startup_share = footprint.master / footprint.optimizer_state  # DeepSpeed's masters of the part in files
        budget = tier.host_bytes = resolve_host_budget(
            tier, state, figure.total - state + staging, host_memory(), local_ranks, startup_share
        )
        if budget < state:  # the measurement's buffer and the slabs are mlock'ed: past the limit an abort, so refused
            check_locked_memory(staging, figure)  # (figure: DeepSpeed's buffers alone, as yet)
        in_files = state - budget + padding * max(1, -(-per_rank // largest) + 1)
        check_nvme_path(tier.path, local_ranks * in_files if budget < state else 0)
        load_aio("offload_optimizer.device='nvme'")  # libaio missing: named, with the command, before any work
        figure.items = [(what, n - (state - budget) if what == "engine slabs" else n) for what, n in figure.items]
        figure.items.append(("NVMe staging slabs", staging))
        measured = ""
        if budget < state:
            # DeepSpeed builds its fp32 master partitions before the engine adopts them: those of the state bound for
            # the file are held until each partition is adopted and written there, at start-up (its peak).
            masters = footprint.master * ((state - budget) // footprint.optimizer_state)
            figure.items.append(("DeepSpeed masters of the NVMe part, until start-up ends", masters))
        # Every rank measures the drive at once (its share of it, as in the update) and all use the slowest rates; a
        # rank whose state all fits its budget takes part all the same.
        path = tier.path
        tier.measurement = measure_drive_together(
            (lambda: measure_disk(path, CALIBRATION_BYTES)) if budget < state else None,
            reduce_min_over_ranks(self.root_device),
        )
        tier.drive = tier.measurement.agreed if tier.measurement is not None else None
        if tier.drive is not None:
            measured = f" (measured {tier.drive.read_bps / 1e9:.2f} GB/s read, {tier.drive.write_bps / 1e9:.2f} write)"
        said = (
            f"lightning-dos: the NVMe tier keeps {_size(budget)} of each rank's {_size(state)} of optimizer state in "
            f"host memory and the rest in {tier.path}{measured}"
        )
        lines = textwrap.wrap(said, 80, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
        rank_zero_info("\n".join(lines))
        if budget < state:  # DeepSpeed's notice, dropped (host.quiet), in 80 columns: true of a run that writes there
            rank_zero_info(ssd_wear_notice(state - budget))


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"
