"""One DeepSpeed accelerator per pytest process, chosen before DeepSpeed is imported.

DeepSpeed picks its accelerator once per process (``DS_ACCELERATOR``, else whatever it detects), and a
CPU-DeepSpeed test cannot run in a process whose DeepSpeed chose CUDA. So the suite runs in passes:
the CPU pass (the default, ``DS_ACCELERATOR=cpu`` whatever the environment says) runs everything but
the CUDA tests; ``pytest --accelerator cuda tests/test_gpu.py`` runs the CUDA tests (marked ``cuda``)
where a GPU is present. ``scripts/test.sh`` runs both passes where CUDA is available.
"""

from __future__ import annotations

import os

import pytest

from lightning_dos.host.extensions import use_own_extensions_dir

# DeepSpeed JIT-builds its CPU ops into torch's extensions folder and rebuilds one (1-2 min) whenever its build file
# names other sources: each DeepSpeed install gets its own folder (a TORCH_EXTENSIONS_DIR already set is kept), as
# the lightning-dos command gives it, so each checkout's ops stay built.
use_own_extensions_dir()

#: Tests that compare the engine's arithmetic with torch's kernels bit for bit: "file::name" -> the probes
#: (tests/torch_probes.py) of what they assume of torch's rounding, by the value of their ``path`` parameter where
#: it changes which kernels they compare ("*": whatever it is). A test skips only where one of its probes, run once
#: at the start of the test run, finds torch rounding otherwise, and the skip says what the probe found.
#:
#: Tests that compare the engine with itself assume nothing of torch's rounding and are not here: on a CPU device
#: every placement runs the host's update (engine/step.py, ``device_update``), so resuming or finishing sub-groups
#: on another side (test_engine_behaviour's checkpoint reloaded with another placement, test_atomic_training's
#: resumes, test_kernels' host and device sides) gives the same bits under any torch.
EXACTNESS_TESTS: dict[str, dict[str, tuple[str, ...]]] = {
    "test_native_kernel.py::test_bit_identical_to_torchs_fused_adam_then_cast": {"*": ("compiled",)},
    "test_native_kernel.py::test_the_engine_host_path_is_the_compiled_kernel_and_agrees_with_torchs_tiles": {
        "*": ("compiled", "tiles")
    },
    "test_native_rules.py::test_bit_identical_to_the_rules_torch_formula_in_every_storage": {"*": ("compiled",)},
    "test_kernels.py::test_fused_update_is_bit_identical_to_three_passes": {"engine": ("engine",), "tiles": ("tiles",)},
    "test_kernels.py::test_non_finite_gradients_propagate_exactly_as_in_the_three_pass_path": {
        "engine": ("engine non-finite",),
        "tiles": ("tiles non-finite",),
    },
}
#: Modules that use torch's private CUDA-sanitizer classes (lightning_dos.sim.sanitizer); skipped only where those
#: classes are not as the checker needs them (it then refuses with SanitizerUnavailableError, which the skip quotes).
SANITIZER_MODULES = ("test_stream_sanitizer.py", "test_simulate.py", "test_device_memory.py")


def probes_of(nodeid: str, params: dict[str, object]) -> tuple[str, ...]:
    """The probes test ``nodeid`` (with parameters ``params``) needs to hold; () for a test that assumes none."""
    name = nodeid.split("/")[-1].split("[")[0]
    by_path = EXACTNESS_TESTS.get(name, {})
    return by_path.get(str(params.get("path")), by_path.get("*", ()))


def torch_skip(nodeid: str, params: dict[str, object]) -> str | None:
    """Why test ``nodeid`` skips under this torch (None: it runs): a probe of what it assumes found otherwise."""
    probes = probes_of(nodeid, params)
    if probes:
        from tests.torch_probes import skip_reason

        return skip_reason(probes)
    if nodeid.split("/")[-1].split("::")[0] in SANITIZER_MODULES:
        from lightning_dos.sim.torch_csan import SanitizerUnavailableError, torch_sanitizer

        try:
            torch_sanitizer()
        except SanitizerUnavailableError as error:
            return f"needs torch.cuda._sanitizer's private classes as the race checker knows them: {error}"
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--accelerator",
        choices=("cpu", "cuda"),
        default="cpu",
        help="DeepSpeed accelerator of this pytest process: 'cpu' (every CPU test) or 'cuda' (tests marked cuda)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs DeepSpeed's CUDA accelerator (the --accelerator cuda pass)")
    os.environ["DS_ACCELERATOR"] = config.getoption("--accelerator")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    accelerator = config.getoption("--accelerator")
    for item in items:
        callspec = getattr(item, "callspec", None)
        reason = torch_skip(item.nodeid, callspec.params if callspec is not None else {})
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        is_cuda = item.get_closest_marker("cuda") is not None
        if is_cuda and accelerator != "cuda":
            item.add_marker(pytest.mark.skip(reason="CUDA test: runs in the CUDA pass (pytest --accelerator cuda)"))
        elif not is_cuda and accelerator == "cuda":
            item.add_marker(pytest.mark.skip(reason="CPU-DeepSpeed test: runs in the CPU pass (plain pytest)"))


def pytest_report_collectionfinish(config: pytest.Config, start_path: object, items: list[pytest.Item]) -> list[str]:
    """One line saying what the probes of torch's rounding found, where the collected tests needed any."""
    import sys

    torch_probes = sys.modules.get("tests.torch_probes")  # imported by torch_skip only where a test needs a probe
    if torch_probes is None:
        return []
    import torch

    found = [f"{name}: {'holds' if torch_probes.result(name) is None else 'differs'}" for name in torch_probes.PROBES]
    return [f"torch {torch.__version__} kernel probes (tests/torch_probes.py): " + ", ".join(found)]


#: Set (as scripts/gpu-check.sh does) to print each failure's report the moment it happens: a run cut off by a
#: device lease's deadline then still says why the tests that failed before it failed.
FAILURES_AT_ONCE = "DOS_TEST_FAILURES_AT_ONCE"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and os.environ.get(FAILURES_AT_ONCE):
        import sys

        report_text = report.longreprtext[-6000:]
        print(f"\n--- {report.nodeid} failed ({report.when}):\n{report_text}", file=sys.stderr, flush=True)


@pytest.fixture
def restore_signal_handlers():  # noqa: ANN201
    """The handlers of the signals tests send themselves (SIGINT, SIGTERM, SIGUSR1, SIGUSR2), put back after."""
    import signal

    sent = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    saved = {signum: signal.getsignal(signum) for signum in sent}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
