"""torch's CUDA sanitizer classes the race checker builds on (private to torch: checked, with a clear error when a
torch release changed them)."""

from __future__ import annotations

from typing import Any

import torch

#: torch versions whose private ``torch.cuda._sanitizer`` this module was tested with.
TESTED_TORCH = "2.13"


class SanitizerUnavailableError(RuntimeError):
    """torch's private CUDA-sanitizer classes are missing or changed."""


def torch_sanitizer() -> Any:
    """torch's ``StreamSynchronizations`` and ``zip_arguments``, checked; a clear error if they changed."""
    try:
        from torch.cuda import _sanitizer as csan
    except ImportError as error:  # pragma: no cover - depends on the torch build
        raise SanitizerUnavailableError(f"torch {torch.__version__} has no torch.cuda._sanitizer ({error})") from None
    needed = {
        "StreamSynchronizations": (
            "create_stream",
            "create_event",
            "update_seq_num",
            "record_state",
            "stream_wait_for_event",
            "is_ordered_after",
            "_state_wait_for_other",
            "current_sync_states",
        ),
        "zip_arguments": (),
    }
    for name, members in needed.items():
        owner = getattr(csan, name, None)
        probe = owner() if name == "StreamSynchronizations" and owner is not None else owner
        missing = [m for m in members if not hasattr(probe, m)]
        if owner is None or missing:
            raise SanitizerUnavailableError(
                f"torch {torch.__version__}'s torch.cuda._sanitizer.{name} lacks {missing or 'itself'}; the stream "
                f"sanitizer was tested with torch {TESTED_TORCH}"
            )
    return csan
