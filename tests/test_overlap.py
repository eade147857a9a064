"""``overlap="forward"`` and ``"auto"``: the optimizer update runs on while the next forward starts (and, with
``"auto"``, begins during backward: speculatively with clipping, see test_speculation.py), and nothing changes.

Real Lightning Trainer, real DeepSpeed ZeRO-3 with CPU optimizer offload, on CPU: the engine's update runs on a
background thread, every all-gather of the next forward first waits for the sub-groups it reads, and the next
backward, checkpoints and the end of training wait for the whole update. Under ``"auto"`` each host sub-group is
updated as soon as DeepSpeed has copied its last gradient partition at the accumulation boundary. Parameters,
optimizer state (the engine's slabs) and losses must equal ``overlap="off"`` bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.engine.atomic import UpdateInFlightError
from lightning_dos.errors import DOSConfigError
from lightning_dos.model.iteration_plan import shortest_iteration_plan
from lightning_dos.model.perfmodel import HardwareRates
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem
from lightning_dos.planning.agree import _RATE_FIELDS
from lightning_dos.planning.profiles import load_profile
from lightning_dos.planning.scheduler import PlacementScheduler
from lightning_dos.sim.collectives import inside_backward
from tests.helpers import RandomPlacement, TinyLM, full_parameters, loader, trainer

SUB_GROUP = 700
STEPS = 8
PLACES = (Place.HOST, Place.DEVICE, Place.RESIDENT)


def strategy(overlap: str, **zero: object) -> DeepOptimizerStatesStrategy:
    # No persistent parameters unless a test asks (DeepSpeed's default threshold keeps all of TinyLM's whole).
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    return DeepOptimizerStatesStrategy(gpu_fraction=0.5, sub_group_size=SUB_GROUP, overlap=overlap, config=config)


class KeepState(L.Callback):
    """The engine's slabs (master weights and every state tensor) at the end of training, before teardown, and
    the sub-groups each step updated during backward and kept (from its report, issued once its update is over)."""

    def __init__(self) -> None:
        self.early_by_step: dict[int, list[int]] = {}

    @property
    def early(self) -> list[list[int]]:
        """Per optimizer step, in order: the sub-groups its update began during backward and kept."""
        return [self.early_by_step[step] for step in sorted(self.early_by_step)]

    def _record(self, trainer: L.Trainer) -> None:
        engine = trainer.strategy.dos_engine  # every report issued since the last look (the engine keeps 8)
        for number in range(len(self.early_by_step) + 1, engine.reports_issued + 1):
            report = engine.report_number(number)
            self.early_by_step[report.step] = list(report.early)

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self._record(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.dos_engine
        assert not engine.in_flight, "the update must be over when training ends"
        self._record(trainer)
        engine.flush_resident()  # resident state is current on the device only
        self.slabs = [t.clone() for t in (engine.pool.param, *engine.pool.states)]


def fit(overlap: str, steps: int = STEPS, callbacks=(), ckpt_path=None, zero=None, **kw) -> tuple[TinyLM, KeepState]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    model, keep = TinyLM(), KeepState()
    keep.placement = RandomPlacement(seed=5, places=PLACES, after_backward=True)
    callbacks = [keep.placement, keep, *callbacks]
    run = trainer(strategy(overlap, **(zero or {})), steps=steps, callbacks=callbacks, **kw)
    run.fit(model, loader(), ckpt_path=ckpt_path)
    return model, keep


def assert_identical(a: tuple[TinyLM, KeepState], b: tuple[TinyLM, KeepState]) -> None:
    (model_a, keep_a), (model_b, keep_b) = a, b
    assert model_a.losses == model_b.losses
    for name, value in full_parameters(model_a).items():
        assert torch.equal(value, full_parameters(model_b)[name]), name
    assert len(keep_a.slabs) == len(keep_b.slabs) > 1
    for ours, theirs in zip(keep_a.slabs, keep_b.slabs, strict=True):
        assert torch.equal(ours, theirs)


#: Each value of each setting beside each value of every other (an orthogonal array: 4 fits of the 8 combinations).
PAIRWISE = [("32-true", 0.5, 1), ("32-true", None, 2), ("bf16-mixed", 0.5, 2), ("bf16-mixed", None, 1)]


@pytest.mark.parametrize(("precision", "clip", "accumulate"), PAIRWISE)
def test_overlap_forward_and_auto_are_bit_identical_to_off(precision: str, clip: float | None, accumulate: int) -> None:
    settings = dict(precision=precision, gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    off = fit("off", **settings)
    assert_identical(fit("forward", **settings), off)
    auto = fit("auto", **settings)
    assert_identical(auto, off)
    early = [index for step in auto[1].early for index in step]
    if clip is None:  # host sub-groups were updated during backward, in most steps
        assert sum(1 for step in auto[1].early if step) >= STEPS // 2, auto[1].early
        # ... but never one its plan left for after backward (half of the host sub-groups, at random).
        plans, stepped = auto[1].placement.requested, auto[1].early
        assert len(plans) == len(stepped) and any(plan.after_backward for plan in plans)
        for plan, step in zip(plans, stepped, strict=True):
            assert set(step) <= set(plan.host_indices) - plan.after_backward, (step, plan)
    else:  # TinyLM's every step clips at 0.5: each speculative update was redone (test_speculation.py: commits)
        assert early == []


@pytest.mark.parametrize(("precision", "clip"), [("32-true", 0.5), ("bf16-mixed", None)])
def test_with_persistent_parameters_overlap_is_bit_identical_to_off(precision: str, clip: float | None) -> None:
    settings = dict(precision=precision, gradient_clip_val=clip, accumulate_grad_batches=2, zero=PERSISTENT)
    off = fit("off", **settings)
    assert_identical(fit("forward", **settings), off)
    assert_identical(fit("auto", **settings), off)


def test_auto_with_clipping_speculates_and_says_how(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        model, _ = fit("auto", steps=1, gradient_clip_val=0.5)
    adapter = model.trainer.strategy.dos_adapter
    assert adapter.overlap == "auto" and adapter.speculative
    said = [r.getMessage() for r in caplog.records if "overlap='auto'" in r.getMessage()]
    assert len(said) == 1 and "speculatively" in said[0] and "gradient_clip_val=0.5" in said[0], said
    first, *rest = said[0].splitlines()  # Lightning prefixes the first line with "INFO: "
    assert len("INFO: " + first) <= 80 and all(len(line) <= 80 for line in rest), said


def test_auto_resuming_from_a_checkpoint_saved_mid_run_is_exact(tmp_path: Path) -> None:
    # Two epochs of 4 steps; checkpoints after steps 4 and 8 (the first at the epoch boundary, where a resume
    # starts from the next epoch's first batch, as the uninterrupted run does).
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    settings = dict(limit_train_batches=4, gradient_clip_val=None)
    whole = fit("auto", callbacks=[every], enable_checkpointing=True, **settings)
    assert_identical(whole, fit("off", **settings))
    saved = tmp_path / "step=4.ckpt"
    assert saved.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = fit("auto", ckpt_path=str(saved), default_root_dir=tmp_path / "resumed", **settings)
    # Steps 5 to 8 only, with the whole run's losses: a restart from step 0 would train all 8 and end the same.
    assert resumed[0].losses == whole[0].losses[4:], (resumed[0].losses, whole[0].losses)
    for name, value in full_parameters(resumed[0]).items():
        assert torch.equal(value, full_parameters(whole[0])[name]), name
    for ours, theirs in zip(resumed[1].slabs, whole[1].slabs, strict=True):
        assert torch.equal(ours, theirs)


class NextBatchDuringUpdate(L.Callback):
    """Holds the update of step 2 at its last sub-group until the next training batch has started.

    With the overlap, the step has returned, so Lightning goes on to the next batch (and its forward) and releases
    the update; without it, the next batch cannot start while the update is held, and the wait times out. The
    next batch's start is the probe, not a module's forward: ZeRO-3 may prefetch the first modules' parameters
    from the last sub-groups (two param groups), and that all-gather rightly waits for them.

    ``timeout``: how long the held update waits for the next batch. Without the overlap the training thread is inside
    the step, so the next batch cannot start however long it waits: the control needs only a short one."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.next_batch = threading.Event()
        self.held = False
        self.held_ok = False
        self.order: list[str] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.dos_engine
        last = len(engine.sub_groups) - 1

        def on_point(point: str, index: int) -> None:
            if point == "done" and index == last and engine.steps_taken == 2 and not self.held:
                self.held = True
                self.order.append("update: last sub-group reached")
                self.held_ok = self.next_batch.wait(timeout=self.timeout)
                self.order.append("update: last sub-group done")

        engine.watch_points(on_point)

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        # The batch after step 2's optimizer step (which may have returned before the update reached its last
        # sub-group: then this comes first in the order).
        if trainer.global_step == 2 and not self.next_batch.is_set():
            self.order.append("next batch starts")
            self.next_batch.set()


#: DeepSpeed's default persistence threshold: every TinyLM parameter is kept whole, in every sub-group.
PERSISTENT = {"stage3_param_persistence_threshold": 100_000}


@pytest.mark.parametrize("zero", [None, PERSISTENT], ids=["partitioned", "persistent"])
@pytest.mark.parametrize("overlap", ["auto", "forward", "off"])
def test_the_next_batch_starts_before_the_updates_last_sub_group_finishes(overlap: str, zero: dict | None) -> None:
    # With persistent parameters, DeepSpeed would re-gather them all right after the step, which would wait for
    # the whole update: each is re-gathered when the next forward reaches its module instead.
    probe = NextBatchDuringUpdate(timeout=10 if overlap != "off" else 1)
    model, _ = fit(overlap, steps=3, callbacks=[probe], zero=zero)
    assert probe.held
    if overlap != "off":
        assert probe.held_ok, "the next batch never started while the update ran"
        assert probe.order.index("next batch starts") < probe.order.index("update: last sub-group done")
    else:  # the control: without the overlap the next batch cannot start before the update is over
        assert not probe.held_ok


def test_overlap_is_validated_before_any_work() -> None:
    with pytest.raises(DOSConfigError, match=r"overlap='backward'.*'off', 'forward', 'auto'"):
        DeepOptimizerStatesStrategy(overlap="backward")


class UpdatedDuringBackward(L.Callback):
    """After each backward, before Lightning calls the optimizer step: waits (up to 10 s) until the update thread
    has updated a host sub-group (speculatively, into a spare slot: nothing is final before backward's end), and
    records which; the step has not been called, so that update began during backward."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.dos_engine
        deadline = time.monotonic() + 10
        while not engine.spare.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.arrivals is not None, "the step must not have ended backward's phase yet"
        assert engine.updated_early == [], "an update begun during backward is final before the step's fate is known"
        self.seen.append(sorted(engine.spare.pending))


def test_auto_updates_host_sub_groups_before_the_optimizer_step_is_called() -> None:
    probe = UpdatedDuringBackward()
    auto = fit("auto", steps=3, callbacks=[probe], gradient_clip_val=None)
    assert len(probe.seen) == 3 and all(probe.seen), probe.seen
    assert_identical(auto, fit("off", steps=3, gradient_clip_val=None))


class NonFiniteAt(TinyLM):
    """Makes step ``at``'s gradient not finite: everywhere (``where="loss"``: a NaN loss, as divergence gives), or
    only in the embedding's gradient (``where="embedding"``), which backward makes final last."""

    def __init__(self, at: int, where: str) -> None:
        super().__init__()
        self.at, self.where = at, where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.where == "embedding" and self.trainer.global_step == self.at:
            h = NonFiniteGradient.apply(h, float("inf"))
        h = h + self.mlp(self.norm(h))
        return self.head(h)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.where == "loss" and self.trainer.global_step == self.at else loss


class NonFiniteGradient(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient flowing through by ``value`` (inf, NaN)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, value: float) -> torch.Tensor:  # noqa: ANN001
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad * ctx.value, None


def fit_non_finite(overlap: str, where: str, callbacks=()) -> tuple[TinyLM, KeepState]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    model, keep = NonFiniteAt(at=2, where=where), KeepState()
    callbacks = [RandomPlacement(seed=5, places=PLACES), keep, *callbacks]
    # Small reduce buckets: DeepSpeed reduces gradients as backward produces them, the embedding's last (as on a
    # real model); TinyLM's gradients would otherwise all fit one bucket, reduced at the end in parameter order.
    zero = {"reduce_bucket_size": 600}
    trainer(strategy(overlap, **zero), steps=5, callbacks=callbacks, gradient_clip_val=None).fit(model, loader())
    return model, keep


def test_auto_skips_a_step_with_a_nan_loss_exactly_as_deepspeed_does() -> None:
    auto, off = fit_non_finite("auto", "loss"), fit_non_finite("off", "loss")
    assert auto[1].early[2] == []  # the first gradient backward made final was not finite: nothing was updated
    assert_identical(auto, off)


def test_auto_skips_a_step_whose_late_gradient_is_not_finite_after_earlier_updates_began() -> None:
    """Without clipping, the embedding's gradient (final last) is not finite at step 3: the host sub-groups updated
    during backward before it were speculative, so the step is skipped as DeepSpeed skips it and training goes on,
    bit-identical to overlap="off" (it used to end the run with a TornStateError)."""
    off = fit_non_finite("off", "embedding")  # DeepSpeed skips step 3 and training goes on
    assert off[1].early == [[]] * 5

    class WaitForAnEarlyUpdate(UpdatedDuringBackward):
        def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.global_step == 2:
                super().on_after_backward(trainer, pl_module)

    probe = WaitForAnEarlyUpdate()
    auto = fit_non_finite("auto", "embedding", callbacks=[probe])
    assert len(probe.seen) == 1 and probe.seen[0], "sub-groups were updated during the bad step's backward"
    assert auto[1].early[2] == []  # dropped with the skipped step
    assert_identical(auto, off)


class GatherAfterEachStep(L.Callback):
    """Gathers every parameter with ``deepspeed.zero.GatheredParameters`` right after each optimizer step, while
    the update is slowed (each sub-group's last point sleeps), so under overlap it is still running then."""

    def __init__(self) -> None:
        self.gathered: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.dos_engine.watch_points(lambda point, index: time.sleep(0.02) if point == "done" else None)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        self.in_flight = getattr(self, "in_flight", 0) + int(trainer.strategy.dos_engine.in_flight)
        self.gathered.append(full_parameters(pl_module))


@pytest.mark.parametrize("clip", [0.5, None])
def test_gathering_parameters_outside_the_coordinator_waits_for_the_update_in_flight(clip: float | None) -> None:
    runs = {}
    for overlap in ("auto", "off"):
        gather = GatherAfterEachStep()
        fit(overlap, steps=3, callbacks=[gather], gradient_clip_val=clip)
        runs[overlap] = gather
    assert runs["auto"].in_flight >= 2, "the update must still run when the callback gathers"
    for ours, theirs in zip(runs["auto"].gathered, runs["off"].gathered, strict=True):
        for name, value in ours.items():
            assert torch.equal(value, theirs[name]), name


class ReadStateBeforeTheStep(L.Callback):
    """Reads a parameter's fp32 master copy (DeepSpeed's accessor) between backward and the optimizer step."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        from deepspeed.utils import safe_get_full_fp32_param

        self.read = safe_get_full_fp32_param(pl_module.head.weight)


def test_auto_refuses_a_state_read_between_backward_and_the_step_and_forward_allows_it() -> None:
    with pytest.raises(UpdateInFlightError, match=r"between backward and the optimizer step.*overlap='forward'"):
        fit("auto", steps=2, callbacks=[ReadStateBeforeTheStep()], gradient_clip_val=None)
    read = ReadStateBeforeTheStep()
    fit("forward", steps=2, callbacks=[read], gradient_clip_val=None)  # the previous update is over by then
    assert read.read is not None and torch.isfinite(read.read).all()


class _PlansAsOnTheNode(PlacementScheduler):
    """The strategy's scheduler planning "auto" on this CPU engine as on an accelerator, recording what the adapter
    measured and the rates of each plan."""

    has_accelerator = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.observed: list[tuple[int, float, float]] = []
        self.replans: list[tuple[int, Plan, Plan, HardwareRates, tuple | None]] = []
        self.predictions: list[float | None] = []

    def observe_phases(self, forward_s: float, backward_s: float) -> None:
        self.observed.append((self.engine.reports_issued, forward_s, backward_s))
        super().observe_phases(forward_s, backward_s)

    def _replan(self, step: int) -> None:
        super()._replan(step)
        self.replans.append((step, self.update_plan, self._plan, self.rates, self.phases))
        self.predictions.append(self.iteration_predicted_s)


class _OnTheNode(DeepOptimizerStatesStrategy):
    def _on_optimizer_ready(self, ds_optimizer: object) -> None:
        super()._on_optimizer_ready(ds_optimizer)
        # A paper-h100x4 node 10,000 times slower: TinyLM's update then takes about as long as its forward and
        # backward on this CPU, so where it goes matters to the iteration.
        paper, _ = load_profile("paper-h100x4")
        rates = dataclasses.replace(paper, **{f: getattr(paper, f) / 1e4 for f in _RATE_FIELDS})
        s = self.dos_scheduler
        self.dos_setup.dos_scheduler = _PlansAsOnTheNode(s.spec, s.engine, lambda device: rates, overlap=s.overlap)
        self.dos_adapter.planner = self.dos_scheduler


class _SeesUpdatesInFlight(TinyLM):
    """Records, as each training forward begins, whether an update is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[bool] = []

    def training_step(self, *args: object) -> torch.Tensor:
        self.in_flight.append(self.trainer.strategy.dos_engine.in_flight)
        return super().training_step(*args)


@pytest.mark.parametrize("overlap", ["auto", "forward"])
def test_auto_placement_measures_forward_and_backward_and_plans_the_whole_iteration(overlap: str) -> None:
    """gpu_fraction="auto" with overlap on (planned as on an accelerator): the 2nd iteration's forward and backward
    are timed with no update in flight and handed to the scheduler at its step; from then on "auto" runs the plan
    that minimises the predicted iteration for them (from that step under "forward"; under "auto" from the next,
    whose plan is chosen during its backward), and the update's own best before."""
    L.seed_everything(0, verbose=False)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    ours = _OnTheNode(gpu_fraction="auto", sub_group_size=SUB_GROUP, overlap=overlap, config=config)
    model = _SeesUpdatesInFlight()
    run = trainer(ours, steps=5, accumulate_grad_batches=2, gradient_clip_val=None)
    run.fit(model, loader())
    scheduler, engine = ours.dos_scheduler, ours.dos_engine
    assert [step for step, _, _ in scheduler.observed] == [1], "timed once, in the 2nd iteration"
    _, forward_s, backward_s = scheduler.observed[0]
    assert forward_s > 0 and backward_s > 0 and scheduler.phases == (forward_s, backward_s)
    assert not any(model.in_flight[2:4]), "the timed iteration's micro-batches began with no update in flight"
    # Plans are made at step 1, when the phases arrive (step 2 under "forward", whose plan is chosen at the step;
    # step 3 under "auto", whose plan is chosen before its backward), and again whenever prediction and measurement
    # drift apart (this CPU is no paper node).
    first = 2 if overlap == "forward" else 3
    steps = [step for step, *_ in scheduler.replans]
    assert steps[0] == 1 and first in steps, steps
    for step, update_plan, plan, rates, phases in scheduler.replans:
        if step < first:
            assert phases is None and plan == update_plan
        else:
            assert phases == (forward_s, backward_s)
            assert plan == shortest_iteration_plan(
                UpdateProblem(engine.sizes, rates, 4), update_plan, TrainingPhases(*phases, overlap)
            )
    assert engine.report_number(first).plan == scheduler.replans[steps.index(first)][2]
    # Each step's report carries the iteration predicted for its plan (DOSMonitor logs dos/iteration_predicted_s).
    assert [engine.report_number(n).predicted_iteration_s for n in range(1, first)] == [None] * (first - 1)
    assert engine.report_number(first).predicted_iteration_s == scheduler.predictions[steps.index(first)] > 0
    # Under "forward" the iteration's plan streams other sub-groups than the update's. Under "auto" the host updates
    # sub-groups during backward as they become final, those the next forward needs last first, and those it needs
    # first (this model's recorded order: 11-14, the no-decay group) after backward: the update's own plan (all on
    # the host) may be the iteration's best too.
    if overlap == "forward":
        assert any(plan != update_plan for _, update_plan, plan, _, _ in scheduler.replans[1:]), "no iteration plan"


class _ActivationsOnTheDevice(L.Callback):
    """A device with FREE bytes free, less ACTIVATIONS from each forward's start to the end of its backward (what
    ``torch.cuda.mem_get_info`` would say, through the engine's ``device_budget``)."""

    FREE, ACTIVATIONS = 64 << 20, 48 << 20

    def __init__(self) -> None:
        self.live = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.dos_engine.budget.device_budget = lambda: self.FREE - (self.ACTIVATIONS if self.live else 0)

    def on_train_batch_start(self, *args: object) -> None:
        self.live = True

    def on_after_backward(self, *args: object) -> None:
        self.live = False


class _RecordsWherePlanned(_PlansAsOnTheNode):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        #: (step, device budget planned in, inside backward, thread) of every re-plan.
        self.where: list[tuple[int, int | None, bool, str]] = []

    def _replan(self, step: int) -> None:
        super()._replan(step)
        self.where.append((step, self.budget_bytes, inside_backward(), threading.current_thread().name))


class _OnTheNodeRecordingPlans(_OnTheNode):
    def _on_optimizer_ready(self, ds_optimizer: object) -> None:
        super()._on_optimizer_ready(ds_optimizer)
        s = self.dos_scheduler
        self.dos_setup.dos_scheduler = _RecordsWherePlanned(s.spec, s.engine, s._calibrate, overlap=s.overlap)
        self.dos_adapter.planner = self.dos_scheduler


@pytest.mark.parametrize("overlap", ["auto", "forward"])
def test_plans_are_made_on_the_training_thread_outside_backward_in_the_memory_free_at_the_update(overlap: str) -> None:
    """Under "auto" the step begins during backward, but its plan is made before backward, on the training thread,
    in the device memory free at the update (sampled at the previous step, after backward), not what backward's
    activations leave free: the update may only shrink a plan, so a plan made inside backward would use less of the
    device than "forward" does."""
    L.seed_everything(0, verbose=False)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    ours = _OnTheNodeRecordingPlans(gpu_fraction="auto", sub_group_size=SUB_GROUP, overlap=overlap, config=config)
    device = _ActivationsOnTheDevice()
    run = trainer(ours, steps=5, accumulate_grad_batches=2, gradient_clip_val=None, callbacks=[device])
    run.fit(TinyLM(), loader())
    where = ours.dos_scheduler.where
    assert [step for step, *_ in where][:2] == [1, 2 if overlap == "forward" else 3], where
    assert all(thread == "MainThread" and not backward for _, _, backward, thread in where), where
    # From step 2 on every plan was made in the budget of the update (step 1's, under "auto", in that sampled
    # before any forward, with no limit on a CPU device).
    assert [budget for step, budget, *_ in where if step > 1] == [device.FREE] * (len(where) - 1), where
