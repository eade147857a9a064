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

#: The torch CI runs (pyproject pins it). A GPU machine may only have its own preinstalled torch (a CUDA wheel
#: cannot be carried there), under which the tests below, which pin this torch's internals, skip by name.
PINNED_TORCH = "2.13"
_KERNEL_BITS = (
    "compares the compiled host update bit for bit with torch {pinned}'s fused Adam CPU kernel "
    "(torch._fused_adamw_/_fused_adam_), whose rounding another torch may change; "
    "tests/test_equivalence.py still holds every placement to torch.optim.AdamW(fused=True) at 1e-5"
)
_PLACEMENT_BITS = (
    "resumes or finishes sub-groups on another side than the straight run, so is bit-exact only while the compiled "
    "host update equals torch {pinned}'s fused Adam CPU kernel bit for bit; tests/test_equivalence.py and "
    "tests/test_gpu.py's resume test hold the same paths to float precision"
)
_KERNEL_TESTS = {
    "test_native_kernel.py": (
        "test_bit_identical_to_torchs_fused_adam_then_cast",
        "test_the_engine_host_path_is_the_compiled_kernel_and_agrees_with_torchs_tiles",
    ),
    "test_kernels.py": (
        "test_fused_update_is_bit_identical_to_three_passes",
        "test_non_finite_gradients_propagate_exactly_as_in_the_three_pass_path",
        "test_host_and_device_sides_compute_bit_identical_results",
    ),
}
_PLACEMENT_TESTS = {
    "test_engine_behaviour.py": ("test_checkpoint_written_mid_run_reloads_with_another_placement",),
    "test_atomic_training.py": (
        "test_a_signal_handler_that_saves_a_checkpoint_mid_update_saves_a_whole_step_that_resumes",
        "test_ctrl_c_mid_update_with_on_exception_checkpoint_saves_a_whole_step_that_resumes",
        "test_an_exception_mid_update_leaves_a_whole_step_as_reported_and_resumes",
        "test_a_device_out_of_memory_mid_stream_completes_the_step_on_the_host_and_training_goes_on",
    ),
}
#: Test ("file::name", any parametrisation) -> why it needs torch PINNED_TORCH.
PINNED_TORCH_TESTS = {
    f"{module}::{name}": why
    for tests, why in ((_KERNEL_TESTS, _KERNEL_BITS), (_PLACEMENT_TESTS, _PLACEMENT_BITS))
    for module, names in tests.items()
    for name in names
}
#: Modules that use torch's private CUDA-sanitizer classes (lightning_dos.sim.sanitizer); skipped under another
#: torch only where those classes changed (the checker then refuses with SanitizerUnavailableError).
SANITIZER_MODULES = ("test_stream_sanitizer.py", "test_simulate.py", "test_device_memory.py")


def pinned_torch_skip(nodeid: str, version: str) -> str | None:
    """Why test ``nodeid`` skips under torch ``version`` (None: it runs)."""
    if version.split("+")[0].startswith(PINNED_TORCH + "."):
        return None
    name = nodeid.split("/")[-1].split("[")[0]
    why = PINNED_TORCH_TESTS.get(name)
    if why is not None:
        return f"pins torch {PINNED_TORCH}: {why.format(pinned=PINNED_TORCH)} (torch {version} here)"
    if name.split("::")[0] in SANITIZER_MODULES:
        from lightning_dos.sim.torch_csan import SanitizerUnavailableError, torch_sanitizer

        try:
            torch_sanitizer()
        except SanitizerUnavailableError as error:
            return f"pins torch {PINNED_TORCH}'s torch.cuda._sanitizer classes: {error}"
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
    import torch

    accelerator = config.getoption("--accelerator")
    for item in items:
        pinned = pinned_torch_skip(item.nodeid, torch.__version__)
        if pinned is not None:
            item.add_marker(pytest.mark.skip(reason=pinned))
        is_cuda = item.get_closest_marker("cuda") is not None
        if is_cuda and accelerator != "cuda":
            item.add_marker(pytest.mark.skip(reason="CUDA test: runs in the CUDA pass (pytest --accelerator cuda)"))
        elif not is_cuda and accelerator == "cuda":
            item.add_marker(pytest.mark.skip(reason="CPU-DeepSpeed test: runs in the CPU pass (plain pytest)"))


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
