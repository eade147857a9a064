"""Hardware profiles: per-rank rates for the performance model, measured (``lightning-dos calibrate``) or named.

The update rates (``host_adam_eps``, ``device_adam_eps``) are Adam's with fp32 master weights and moments,
whatever optimizer a profile was calibrated with; the model scales them to each optimizer and dtype
(:func:`~lightning_dos.model.perfmodel.rates_for`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from lightning_dos.model.perfmodel import HardwareRates

HERE = Path(__file__).resolve().parent


def named_profiles() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> tuple[HardwareRates, dict[str, Any]]:
    """Load a profile by name (one shipped with the package) or from a YAML/JSON file.

    Returns the per-rank rates and the profile's other keys (``gpus_per_node``, ``device_free_bytes``, ...).
    """
    path = Path(name_or_path)
    if not path.exists():
        path = HERE / f"{name_or_path}.yaml"
    if not path.exists():
        raise FileNotFoundError(
            f"profile {str(name_or_path)!r} is neither a file nor a named profile; named: {', '.join(named_profiles())}"
        )
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict) or "rates" not in data:
        raise ValueError(f"profile {path} has no 'rates' mapping")
    meta = {k: v for k, v in data.items() if k != "rates"}
    return HardwareRates.from_dict(data["rates"]), meta


def save_profile(path: str | Path, rates: HardwareRates, **meta: Any) -> Path:
    """Write a profile as YAML or JSON (by the file's extension)."""
    path = Path(path)
    data = {**meta, "rates": rates.to_dict()}
    path.write_text(json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))
    return path
