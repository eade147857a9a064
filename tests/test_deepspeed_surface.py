"""The adapter's start-up check names every attribute of DeepSpeed's ZeRO-3 optimizer the project reads, and no
module but the adapter reaches into DeepSpeed's privates (issue 33, point 3)."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_dos.integration.zero3 import OPTIONAL_ATTRIBUTES, REQUIRED_ATTRIBUTES

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dos"
#: Attributes the adapter only assigns on the optimizer (its own step, the norm DeepSpeed reports), never reads.
WRITTEN_ONLY = {"_global_grad_norm"}


def _reads(source: str) -> set[str]:
    """Attributes read on the ZeRO-3 optimizer (``z.name`` or ``self.zero.name``), in ``source``."""
    names = set(re.findall(r"\b(?:z|self\.zero|zero_optimizer)\.([A-Za-z_][A-Za-z0-9_]*)", source))
    guarded = r"(?:hasattr|getattr)\((?:z|self\.zero|zero_optimizer), \"([A-Za-z_][A-Za-z0-9_]*)\""
    names |= set(re.findall(guarded, source))
    return names - WRITTEN_ONLY


def test_the_start_up_check_covers_every_attribute_the_adapter_reads() -> None:
    read = set().union(*(_reads(path.read_text()) for path in (PACKAGE / "integration" / "zero3").glob("*.py")))
    unchecked = read - set(REQUIRED_ATTRIBUTES) - set(OPTIONAL_ATTRIBUTES)
    assert not unchecked, f"read by the adapter, not in REQUIRED_ATTRIBUTES or OPTIONAL_ATTRIBUTES: {sorted(unchecked)}"
    assert {"parameter_offload", "persistent_parameters", "dtype", "dp_process_group"} <= set(REQUIRED_ATTRIBUTES)


def test_no_module_but_the_adapter_reads_deepspeeds_privates() -> None:
    private = re.compile(r"get_accelerator\(\)\._|\b(?:z|zero_optimizer|self\.zero)\._[a-z]")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if "zero3" not in path.relative_to(PACKAGE).parts
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if private.search(line)
    ]
    assert not offenders, offenders
