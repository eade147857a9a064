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
        is_cuda = item.get_closest_marker("cuda") is not None
        if is_cuda and accelerator != "cuda":
            item.add_marker(pytest.mark.skip(reason="CUDA test: runs in the CUDA pass (pytest --accelerator cuda)"))
        elif not is_cuda and accelerator == "cuda":
            item.add_marker(pytest.mark.skip(reason="CPU-DeepSpeed test: runs in the CPU pass (plain pytest)"))
