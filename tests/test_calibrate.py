"""Calibration measures what the engine will see: out-of-cache buffers, and (on CUDA) transfers running."""

from __future__ import annotations

import inspect

import pytest
import torch

from lightning_dos.planning import calibrate as calibration


def test_host_rates_are_timed_on_buffers_of_at_least_256_mb() -> None:
    """Small buffers sit in a big last-level cache and overstate the host; every entry point defaults to big ones."""
    for fn in (calibration.calibrate, calibration.host_rates):
        assert inspect.signature(fn).parameters["numel"].default * 4 >= 256 << 20, fn.__name__


def test_each_host_kernel_is_timed_while_the_background_work_runs() -> None:
    """The CUDA path keeps uploads and downloads queued while host Adam, the cast and memcpy are timed; here the
    background work is a host thread copying memory, which the kernels must have waited for before returning."""
    import threading

    started: list[float] = []
    finished: list[bool] = []

    def busy(seconds: float):  # noqa: ANN202
        started.append(seconds)
        src, dst = torch.ones(1 << 20), torch.empty(1 << 20)
        stop = threading.Event()

        def copy() -> None:
            while not stop.is_set():
                dst.copy_(src)

        worker = threading.Thread(target=copy)
        worker.start()

        def wait() -> None:
            stop.set()
            worker.join()
            finished.append(not worker.is_alive())

        return wait

    adam, cast, memcpy = calibration.host_rates(numel=1 << 18, busy=busy)
    assert len(started) == 3 and all(s > 0 for s in started), "Adam, cast and memcpy each ran under contention"
    assert finished == [True, True, True]
    assert adam > 0 and cast > 0 and memcpy > 0


def test_calibration_buffers_never_outgrow_a_small_model_nor_fall_into_cache() -> None:
    """A rank's whole partition when smaller than 256 MB (the update's real working set), never below 32 MB."""
    assert calibration.calibration_numel(10**12) * 4 == calibration.HOST_BUFFER_BYTES
    assert calibration.calibration_numel(25_000_000) == 25_000_000
    assert calibration.calibration_numel(8_000) * 4 == 32 << 20


def test_calibration_of_another_rule_reports_rates_in_adam_fp32_units() -> None:
    """An engine of any rule and dtype can be calibrated; the rates come back in the unit profiles hold (Adam
    with fp32 state), so a profile from any engine plans any other."""
    from lightning_dos.model.perfmodel import rates_for
    from lightning_dos.model.update_rules import ADAM, LION, Footprint

    bf16 = Footprint(ADAM, 2, 2)
    timed = bf16
    rates = calibration.calibrate(torch.device("cpu"), numel=1 << 16, footprint=bf16)
    assert rates.shared_cpu and rates.host_adam_eps > 0 and rates.device_adam_eps == rates.host_adam_eps
    assert rates_for(rates, timed).host_adam_eps > 0
    # The timed update touches the footprint's own buffers, in its dtypes.
    buffers = calibration._buffers(Footprint(LION, 2, 2), 8, torch.device("cpu"))
    assert [b.dtype for b in buffers] == [torch.bfloat16] * 3


def test_with_a_generic_kernel_calibration_times_the_engines_own_rule_and_dtypes(monkeypatch) -> None:  # noqa: ANN001
    """Calibration times the engine's rule on buffers of its dtypes (through ``kernels.host_update`` and
    ``kernels.apply_update``), and
    converts the rate to Adam fp32 units, so the model gives the measured rate back for that rule. The kernel is
    watched here: the rule's torch formula in fp32, stored back in the buffers' dtypes."""
    from lightning_dos.model.perfmodel import adam_equivalent, rates_for
    from lightning_dos.model.update_rules import LION, Footprint

    seen: list[tuple] = []

    def apply_update(rule, tensors, update_step, tile=0) -> None:  # noqa: ANN001, ARG001
        param, grad, states, lp_out = tensors.param, tensors.grad, tensors.states, tensors.lp_out
        seen.append((rule.name, param.dtype, grad.dtype, tuple(s.dtype for s in states), lp_out is not None))
        p, g, st = param.float(), grad.float() * update_step.inv_grad_scale, [s.float() for s in states]
        rule.torch_update(p, g, st, update_step.step, update_step.hyper, update_step.step_number)
        param.copy_(p)
        for dst, src in zip(states, st):
            dst.copy_(src)
        if lp_out is not None:
            lp_out.copy_(p)

    monkeypatch.setattr(calibration, "apply_update", apply_update)
    monkeypatch.setattr(calibration, "host_update", apply_update)
    lion = Footprint(LION, 2, 2)
    measured = {}
    real_host_rates = calibration.host_rates

    def host_rates(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        measured["rates"] = real_host_rates(*args, **kwargs)
        return measured["rates"]

    monkeypatch.setattr(calibration, "host_rates", host_rates)
    rates = calibration.calibrate(torch.device("cpu"), numel=1 << 14, footprint=lion)
    assert {s[0] for s in seen} == {"lion"}
    assert {s[1:4] for s in seen} == {(torch.bfloat16, torch.bfloat16, (torch.bfloat16,))}
    assert {s[4] for s in seen} == {False, True}, "timed without and with the cast"
    update_eps = measured["rates"][0]
    assert rates_for(rates, lion).host_adam_eps == pytest.approx(update_eps)
    assert rates.host_adam_eps == pytest.approx(adam_equivalent(rates_for(rates, lion), lion).host_adam_eps)
    assert rates.host_adam_eps == pytest.approx(update_eps * 10 / 28)  # Lion bf16 touches 10 bytes, Adam fp32 28


def test_calibration_on_cpu_measures_contention_as_shares_of_each_rate_alone() -> None:
    """The host update on a thread of its own, beside the training thread's small-op loop and beside memcpy copies:
    each share measured for real, a share of the rate alone (never above it, never near zero), and the update on
    the threads asked for while the caller keeps its own count."""
    from lightning_dos.planning.calibrate import MIN_SPEED, measure_contention

    before = torch.get_num_threads()
    rates = calibration.calibrate(torch.device("cpu"), numel=1 << 21)
    shares = (rates.overlap_copy_speed, rates.overlap_host_speed, rates.overlap_launch_speed)
    assert all(MIN_SPEED <= share <= 1.0 for share in shares), shares
    assert shares != (1.0, 1.0, 1.0), "contention measured (a loaded 2-core machine shows it somewhere)"
    contention = measure_contention(torch.device("cpu"), numel=1 << 21, threads=1, sub_group=1 << 19)
    assert contention.threads == 1 and torch.get_num_threads() == before
    assert 1e-11 < contention.host_s_per_element < 1e-6  # 1 G to 1 M elements/s


def test_the_update_measured_beside_the_training_thread_runs_on_a_thread_of_its_own_with_the_threads_asked() -> None:
    """As the engine's update under overlap: not the caller's thread, and torch's count there is the one asked (the
    thread count a core left to the training thread is judged by) while the caller's stays as it was."""
    import threading

    seen: list[tuple[int, bool]] = []

    def work() -> None:
        seen.append((torch.get_num_threads(), threading.current_thread() is threading.main_thread()))

    before = torch.get_num_threads()
    asked = before - 1 if before > 1 else 2
    with calibration._Repeating(work, threads=asked) as repeating:
        repeating.wait_runs(3)
    assert torch.get_num_threads() == before
    assert set(seen) == {(asked, False)}
