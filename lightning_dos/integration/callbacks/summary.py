"""Lightning's rich model summary without the columns that say nothing here, sized to the console.

Under ZeRO-3 Lightning summarises with its ``DeepSpeedSummary``, which does not count FLOPs: its table has a
FLOPs column of zeros and a ``Total FLOPs: 0`` line, which read as a measurement. On one rank, "Params per
Device" repeats "Params". Both are left out when they carry nothing, so the table is narrower (it fits 80
columns for the recipes) and every figure in it is one; rich wraps a column rather than cut the table when it
is still too wide for the console.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

#: Columns right-aligned in the table (numbers).
_RIGHT = {"Params", "Params per Device", "FLOPs", "In sizes", "Out sizes"}


class DOSModelSummary(RichModelSummary):
    """:class:`~lightning.pytorch.callbacks.RichModelSummary` without an all-zero FLOPs column (and its
    ``Total FLOPs: 0`` line) or a "Params per Device" column equal to "Params".

    Args:
        max_depth: the deepest level of module nesting listed; 0 turns the summary off.
        **summarize_kwargs: ``header_style`` (rich style of the header row, as Lightning's).
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        columns = informative_columns(summary_data, total_flops)
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(
                name or " ",
                justify="right" if name in _RIGHT else "left",
                style="dim" if name == " " else None,
                overflow="fold",  # a name too long for the console wraps, it is not cut
            )
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        lines = [
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        ]
        if total_flops:
            lines.append(("Total FLOPs", get_human_readable_count(total_flops)))
        for label, value in lines:
            console.print(f"[bold]{label}[/]: {value.strip()}", highlight=False)


def informative_columns(summary_data: list[tuple[str, list[str]]], total_flops: int) -> list[tuple[str, list[str]]]:
    """``summary_data`` (Lightning's (column, values) pairs) less FLOPs when none were counted, and less
    "Params per Device" when it equals "Params"."""
    by_name = dict(summary_data)
    kept = []
    for name, values in summary_data:
        if name == "FLOPs" and not total_flops and all(str(v).strip() in ("0", "n/a") for v in values):
            continue
        if name == "Params per Device" and list(values) == list(by_name.get("Params", [])):
            continue
        kept.append((name, values))
    return kept


__all__ = ["DOSModelSummary", "informative_columns"]
