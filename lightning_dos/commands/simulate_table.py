"""``lightning-dos simulate``'s tables: the engine's schedule on the virtual node, and the whole iteration per overlap
mode (the command's JSON summary, printed)."""

from __future__ import annotations

from typing import Any


def print_summary(s: dict[str, Any]) -> None:
    """The summary of ``lightning-dos simulate`` (its JSON, as a dict) as tables."""
    from lightning_dos.host.console import trimmed

    with trimmed() as console:  # wraps at the terminal's width, or COLUMNS, or 80 in a pipe or a log file
        _render_summary(s, console)


def _order_line(order: list[int] | None) -> str:
    """How the sub-groups are ordered: as the recipe's forward needs them (the first few named), or by index."""
    if not order:
        return "by index (--params has no model; a recipe's forward gives its own)"
    first = ", ".join(map(str, order[:4]))
    return f"as the recipe's forward needs them ({first}, ... of 0-{len(order) - 1})"


def _render_summary(s: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    plan = s["plan"]
    budget = s.get("budget_gb")
    if budget is not None and s.get("budget_kind") == "update only":
        memory = (
            f"default settings: nothing resident, the update's buffers within {budget:.1f} GB "
            "(free after backward, less 10%)"
        )
    elif budget is not None:
        memory = f"--budget {budget:.1f} GB spare at the forward/backward peak: resident state and the update's buffers"
    else:
        memory = "no device memory limit"
    console.print(
        f"SIMULATED (not measured): {s['params'] / 1e9:.1f}B params on {s['gpus']} rank(s), profile {s['profile']}\n"
        f"optimizer: {s.get('precision', 'Adam, fp32 master and states')}\n"
        f"per rank: {s['sub_groups_per_rank']} sub-groups, {plan['streamed']} streamed through "
        f"{plan['device_buffers']} buffer(s), {plan['resident']} resident, {plan['host']} on the host\n"
        f"order: {_order_line(s.get('need_order'))}\n"
        f"device memory: {memory}",
        markup=False,
    )
    table = Table(title="the engine's schedule on a virtual node")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("update s (engine schedule replayed)", f"{s['update_s']:.3f}")
    table.add_row("update s (perfmodel.predict)", f"{s['predicted_s']:.3f}")
    table.add_row("replay / prediction", f"{s['replay_over_prediction']:.3f}")
    for lane, share in s["busy_share"].items():
        table.add_row(f"busy share: {lane}", f"{share:.0%}")
    table.add_row("GB host->device", f"{s['h2d_bytes'] / 1e9:.2f}")
    table.add_row("GB device->host", f"{s['d2h_bytes'] / 1e9:.2f}")
    table.add_row("GB on the GPU during the update", f"{s['update_device_bytes'] / 1e9:.2f}")
    table.add_row("GB held through forward and backward", f"{s['held_between_updates_bytes'] / 1e9:.2f}")
    table.add_row("stream races found", str(s["races"]))
    console.print(table)
    if "iteration_s" in s:
        _print_iteration(console, s)
    if s.get("nvme") is not None:
        from lightning_dos.commands.simulate_nvme import print_nvme_simulation

        print_nvme_simulation(s["nvme"], console)
    console.print(f"trace: {s['trace']} (open in https://ui.perfetto.dev)", markup=False)
    for mode, plan in s.get("iteration_plans", {}).items():
        if "trace" in plan:
            console.print(f"trace of one iteration, overlap={mode}: {plan['trace']}", markup=False)


def _print_iteration(console: Any, s: dict[str, Any]) -> None:
    from rich.table import Table

    title = f"iteration s, forward {s['forward_s']:g} s + backward {s['backward_s']:g} s"
    table = Table(title=title)
    for column in ("overlap", "replayed", "predicted", "floor", "vs off", "vs stock"):
        table.add_column(column, justify="left" if column == "overlap" else "right")
    replayed, predicted, floor = s["iteration_s"], s["iteration_predicted_s"], s["iteration_floor_s"]
    for mode in ("stock", "off", "forward", "auto"):
        table.add_row(
            mode,
            f"{replayed[mode]:.3f}",
            f"{predicted[mode]:.3f}",
            f"{floor[mode]:.3f}" if mode in floor else "",
            f"{replayed[mode] / replayed['off']:.2f}x",
            f"{replayed[mode] / replayed['stock']:.2f}x",
        )
    table.add_row("forward + backward", f"{s['forward_backward_s']:.3f}", "", "", "", "")
    console.print(table)
    if "commit_rate" in s:
        console.print(
            f"auto: speculative updates during backward, commit rate {s['commit_rate']:g}, spare slots "
            f"{s['speculation_bytes'] / 1e9:.2f} GB of host memory per rank",
            markup=False,
        )
