"""The device formulas on the simulated accelerator (no GPU): device sub-groups run the code a GPU runs, and
nothing in the update's device lanes synchronises the host with the device.

- On the simulated accelerator the engine's device sub-groups (streamed and resident) run the device's update,
  the rule's torch formula (``kernels.apply_update``), not the host's compiled kernel, although their tensors are
  CPU tensors: the bf16 upcasts of ``kernels.torch_update`` and torch's fused Adam run, and the result is the
  all-host run's, to the bit (sub-groups of whole vector widths: see test_stream_sanitizer.py for the tails), but
  for Lion, whose host kernel rounds as DeepSpeed's CPU Lion does (fused multiply-adds): float precision there.
- The checker (``StreamSanitizer``) reports every host synchronisation issued inside a lane on a device stream:
  a host read of a device value (``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``), a host wait,
  a device synchronisation, unless the engine declares why (``streams.host_sync(reason)``). Every rule's device
  formula runs clean; each host read put back into one of them (AST mutations, as the wait mutations of
  test_stream_sanitizer.py) is reported, Adagrad's former ``float(step.item())`` among them.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dos.engine import kernels
from lightning_dos.engine.loop import InterleavedUpdate, StepInputs
from lightning_dos.model import update_rules
from lightning_dos.model.plan import Place, Plan
from lightning_dos.model.update_rules import ADAGRAD, ADAM, LION, Hyper
from lightning_dos.sim.sanitizer import HostSyncError, StreamSanitizer
from lightning_dos.sim.simstreams import SimStreams

H, D, R = Place.HOST, Place.DEVICE, Place.RESIDENT
#: Sub-groups of 16 elements (a whole number of torch's CPU vector widths: no scalar tail in torch's fused Adam).
NUMELS, GROUPS, SUB_GROUP = (48, 32, 64), (0, 1, 1), 16
N_SUB_GROUPS = 9
#: Every placement each step: host, streamed and resident sub-groups side by side, moving between steps.
PLANS = (
    Plan((H, D, R, D, H, R, D, H, R), 2),
    Plan((R, H, D, R, D, H, H, D, R), 1),
    Plan((D, R, H, H, R, D, R, D, H), 2),
)
#: The rules with non-trivial hyperparameters (Adagrad with its lr decay: the formula needs the step number).
CASES = {
    "adam-fp32": (ADAM, torch.float32, torch.float32, Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, True)),
    "adam-bf16-states": (ADAM, torch.bfloat16, torch.bfloat16, Hyper(3e-3, 0.8, 0.95, 1e-6, 0.01, False)),
    "adagrad-lr-decay": (
        ADAGRAD,
        torch.float32,
        torch.float32,
        Hyper(1e-2, eps=1e-10, weight_decay=0.1, lr_decay=0.01),
    ),
    "adagrad-bf16-master": (ADAGRAD, torch.bfloat16, torch.float32, Hyper(1e-2, eps=1e-10, lr_decay=0.05)),
    "lion-fp32": (LION, torch.float32, torch.float32, Hyper(1e-3, 0.9, 0.99, weight_decay=0.1)),
}


def run(case: str, plans: tuple[Plan, ...] = PLANS, streams: SimStreams | None = None, checker: bool = True):  # noqa: ANN201
    """Steps of ``case`` under ``plans`` on the simulated accelerator (under the checker unless ``streams`` is given);
    return the checker (None without one) and the engine, its resident state flushed home."""
    rule, master, state, hyper = CASES[case]
    sanitizer = StreamSanitizer() if checker and streams is None else None
    if sanitizer is None and streams is None:
        streams = SimStreams(torch.device("cpu"))
    engine = InterleavedUpdate(
        NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.bfloat16,
        streams=streams if streams is not None else sanitizer.streams(),
        rule=rule, master_dtype=master, state_dtype=state,
    )  # fmt: skip
    assert len(engine.sub_groups) == N_SUB_GROUPS
    if sanitizer is not None:
        sanitizer.watch(engine)
    gen = torch.Generator().manual_seed(0)
    engine.pool.param.copy_(torch.randn(engine.pool.param.numel(), generator=gen))
    for name in rule.states:  # non-negative, as Adam's second moment and Adagrad's sum are
        engine.pool.state(name).copy_(torch.rand(engine.pool.param.numel(), generator=gen))
    lp = [torch.zeros(n, dtype=torch.bfloat16) for n in NUMELS]
    grads = [torch.zeros(n, dtype=master) for n in NUMELS]  # DeepSpeed's gradient buffers, written every backward
    for step, plan in enumerate(plans, start=1):
        for grad in grads:
            grad.copy_(torch.randn(grad.numel(), generator=gen) * 8)
        engine.step(plan, StepInputs(grads, lp, (hyper, hyper), [step] * len(NUMELS), inv_grad_scale=0.125))
    engine.flush_resident()
    return sanitizer, engine


def state_of(engine: InterleavedUpdate) -> list[torch.Tensor]:
    return [engine.pool.param.clone(), *(s.clone() for s in engine.pool.states)]


class _OpsByLane(TorchDispatchMode):
    """Every aten op, by the engine's lane it was issued in (the simulated streams know it)."""

    def __init__(self, streams: SimStreams) -> None:
        super().__init__()
        self.streams = streams
        self.ops: dict[str, set[str]] = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        operation = self.streams.operation
        self.ops[operation[0] if operation else ""].add(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_device_sub_groups_on_the_simulated_accelerator_run_the_device_formula_and_match_the_host() -> None:
    """Adam with bf16 master weights and states: the device lane upcasts to fp32 and runs torch's fused Adam, the
    host lane runs the compiled kernel (one op); every placement gives the all-host bits."""
    streams = SimStreams(torch.device("cpu"))
    recorder = _OpsByLane(streams)
    with recorder:
        _, engine = run("adam-bf16-states", streams=streams)
    device_ops, host_ops = recorder.ops["device_adam"], recorder.ops["host_adam"]
    assert "aten::_fused_adam_" in device_ops, device_ops  # Adam with an L2 term (not decoupled)
    assert "aten::_to_copy" in device_ops, "the bf16 master weights and states are upcast to fp32 on the device"
    assert not any(op.startswith("lightning_dos::") for op in device_ops), device_ops
    assert any(op.startswith("lightning_dos::") for op in host_ops), host_ops
    _, twin = run("adam-bf16-states", plans=tuple(Plan((H,) * N_SUB_GROUPS) for _ in PLANS), checker=False)
    for ours, theirs in zip(state_of(engine), state_of(twin), strict=True):
        assert ours.dtype == torch.bfloat16
        assert torch.equal(ours, theirs)


def test_without_an_accelerator_device_placements_run_the_hosts_kernel() -> None:
    """A CPU device with synchronous streams: the device is the host's own CPU, so a device placement runs the
    compiled host kernel, whose bits every placement then shares (README: bit for bit on CPU)."""
    engine = InterleavedUpdate(NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.bfloat16)
    assert engine.device_update is kernels.host_update
    assert (
        InterleavedUpdate(
            NUMELS, GROUPS, SUB_GROUP, torch.device("cpu"), torch.bfloat16, streams=SimStreams(torch.device("cpu"))
        ).device_update
        is kernels.apply_update
    )


@pytest.mark.parametrize("case", CASES)
def test_no_host_sync_in_the_device_lanes_of_any_rule(case: str) -> None:
    """Every rule's device formula, streamed and resident, runs race-free with no host synchronisation inside the
    update's device lanes (before the fix the device sub-groups ran the host kernel, which read the step with
    ``.item()``; Adagrad's formula read it the same way)."""
    checker, engine = run(case)
    checker.check()
    assert checker.host_syncs == [] and checker.declared_host_syncs == []
    assert engine.last_report.device_elements > 0 and engine.last_report.host_elements > 0
    _, twin = run(case, plans=tuple(Plan((H,) * N_SUB_GROUPS) for _ in PLANS), checker=False)
    for ours, theirs in zip(state_of(engine), state_of(twin), strict=True):
        if CASES[case][0] is LION:
            # The host kernel rounds as DeepSpeed's CPU Lion (fused multiply-adds), the device formula as torch's
            # kernels do (each product rounded): float precision, not the bits (test_stream_sanitizer.py says where).
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=case)
        else:
            assert torch.equal(ours, theirs), case


# -- mutations: a host read put back into a device formula is reported ----------------------------------------


def _mutated(function: object, statement: str, after: str | None = None) -> object:
    """``function`` with ``statement`` as its first statement (``after``: right after the first statement that binds
    that name, for a function that unpacks its arguments' tensors first), compiled in its own module's namespace."""
    source = textwrap.dedent(inspect.getsource(function))
    tree = ast.parse(source)
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef)
    at = 0
    if after is not None:

        def bound(node: ast.stmt) -> set[str]:
            targets = node.targets if isinstance(node, ast.Assign) else []
            return {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}

        at = next(i for i, node in enumerate(definition.body) if after in bound(node)) + 1
    definition.body.insert(at, ast.parse(statement).body[0])
    definition.decorator_list = []
    module = inspect.getmodule(function)
    namespace = dict(vars(module))
    exec(compile(ast.fix_missing_locations(tree), inspect.getsourcefile(function), "exec"), namespace)  # noqa: S102
    return namespace[definition.name]


#: A host read of a device value of each kind, of the master weights (device memory) or of the step count (a
#: scalar the engine fills in the device lane).
READS = {
    ".item()": "param[0].item()",
    "float()": "float(param[1])",
    "int()": "int(param[2])",
    "bool()": "bool(param[3] > 0)",
    ".tolist()": "param[:4].tolist()",
    "step .item()": "step.item()",
}
#: The device formulas: each rule's (update_rules._TORCH_UPDATES) and the device side's load and store around
#: them (kernels.torch_update).
FORMULAS = {"adam": ("adam-bf16-states", "_adam"), "adagrad": ("adagrad-lr-decay", "_adagrad")}
FORMULAS["lion"] = ("lion-fp32", "_lion")


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("formula", [*FORMULAS, "torch_update"])
def test_a_host_read_put_into_a_device_formula_is_reported(formula: str, read: str, monkeypatch) -> None:  # noqa: ANN001
    if formula == "torch_update":
        case = "adam-fp32"
        # torch_update takes the sub-group's tensors and the step as two objects: the read goes once both are unpacked.
        mutated = _mutated(kernels.torch_update, READS[read], after="step")
        monkeypatch.setattr(kernels, "torch_update", mutated)
    else:
        case, name = FORMULAS[formula]
        mutated = _mutated(getattr(update_rules, name), READS[read])
        monkeypatch.setitem(update_rules._TORCH_UPDATES, formula, mutated)
    checker, _ = run(case)
    assert checker.races == []
    assert checker.host_syncs, f"{read} in {formula} was not reported"
    sync = checker.host_syncs[0]
    assert sync.lane == "device_adam" and sync.reason is None
    assert ("update_rules.py" if formula != "torch_update" else "kernels.py") in sync.where, sync
    with pytest.raises(HostSyncError, match="host sync in the device_adam lane"):
        checker.check()


def test_adagrads_former_read_of_the_step_is_reported(monkeypatch) -> None:  # noqa: ANN001
    """The formula as it was: the learning-rate decay computed from ``float(step.item())`` on the device."""
    assert "float(step_number)" in inspect.getsource(update_rules._adagrad)
    mutated = _mutated(update_rules._adagrad, "step_number = None")  # the step read back from the device tensor
    monkeypatch.setitem(update_rules._TORCH_UPDATES, "adagrad", mutated)
    checker, _ = run("adagrad-lr-decay")
    assert checker.host_syncs and all("_local_scalar_dense" in s.what for s in checker.host_syncs)
    assert {s.lane for s in checker.host_syncs} == {"device_adam"}
    # One per device sub-group and step (the launch loop waited for the device each time).
    device_updates = sum(p != H for plan in PLANS for p in plan.places)
    assert len(checker.host_syncs) == device_updates


# -- the check itself, on the simulated streams ----------------------------------------------------------------


def test_waits_and_synchronisations_count_inside_device_lanes_only_and_a_declared_one_is_not_an_error() -> None:
    checker = StreamSanitizer()
    streams = checker.streams()
    value = streams.empty(4, torch.float32)
    with checker.active():
        value.fill_(1.0)
        event = streams.record(streams.compute)
        with streams.lane("host_adam", 0, 0):  # the host's own lane: reading a device value there is not the hot path
            value.sum().item()
        value.sum().item()  # outside any lane
        assert checker.host_syncs == []
        with streams.lane("cast", 1, 0, streams.compute):
            streams.host_wait(event)
            streams.device_synchronize()
            float(value[0])
            # Another host thread's wait meanwhile (the training thread's wait for sub-groups, under overlap) is not
            # the lane's.
            other = threading.Thread(target=streams.host_wait, args=(event,))
            other.start()
            other.join()
        with streams.lane("download", 2, 0, streams.d2h):
            torch.empty(4).copy_(value)  # blocking: the host waits for the copy
            torch.empty(4).copy_(value, non_blocking=True)  # not a synchronisation
            value.cpu()
        whats = [s.what for s in checker.host_syncs]
        assert len(whats) == 5 and "host wait" in whats[0] and "device synchronisation" in whats[1], whats
        assert "_local_scalar_dense" in whats[2] and "blocking copy" in whats[3] and "cpu()" in whats[4], whats
        assert [(s.lane, s.sub_group) for s in checker.host_syncs] == [("cast", 1)] * 3 + [("download", 2)] * 2
        with streams.lane("download", 2, 0, streams.d2h), streams.host_sync("the test reads it on purpose"):
            value.tolist()
        with pytest.raises(ValueError, match="reason"), streams.host_sync(""):
            pass
    assert len(checker.host_syncs) == 5
    assert [(s.lane, s.reason) for s in checker.declared_host_syncs] == [("download", "the test reads it on purpose")]
    assert "tolist" in checker.declared_host_syncs[0].what
