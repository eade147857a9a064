"""DeepSpeed's optimizer state as views of the engine's slabs, and every reader of it kept consistent.

The fp32 master weights and the optimizer's state tensors are adopted into the engine's pinned slabs, as
views DeepSpeed's checkpointing and accessors still find in their usual places; reading or writing them
(checkpoints, ``get_full_hp_param`` and the like) first waits for the update in flight and brings resident
state home.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

from lightning_dos.engine.atomic import TornStateError
from lightning_dos.integration.optimizers import (
    initial_state,
    state_keys,
    uses_tensor_step,
)
from lightning_dos.integration.zero3.kept_files import KeptFiles, keep_files

#: While adopting DeepSpeed's fp32 partitions, hand freed heap memory back after about this many bytes.
TRIM_EVERY_BYTES = 256 << 20


class StateAccess:
    """DeepSpeed's state kept as views of the engine's slabs, and its readers and writers kept in step (a part of
    :class:`~lightning_dos.integration.zero3.adapter.ZeRO3Adapter`, which holds the state it reads)."""

    def _wrap_state_access(self, z: object) -> None:
        """Keep host slabs and resident device state consistent around DeepSpeed's checkpoint code."""
        engine = self.engine
        save, load, refresh = z.state_dict, z.load_state_dict, z.refresh_fp32_params

        def state_dict() -> dict:
            with self.reading_state("the optimizer's state_dict"):
                engine.flush_resident()  # the checkpoint reads the host slabs (file-backed state read into them)
                self._copy_group_settings(self.hyper_source, self.inner)  # the checkpoint holds the live settings
                # The dict holds views of the slabs, file-backed spans included: their pages are given back after the
                # checkpoint is written (the strategy's save_checkpoint), or by the next step.
                return save()

        def load_state_dict(*args: object, **kwargs: object) -> None:
            self._wait_if_main()
            with engine.guard.reading("loading the optimizer's state"):
                engine.materialize_files()  # whatever the load does not overwrite stays as it was
                load(*args, **kwargs)
                engine.drop_resident()  # the host slabs now hold the loaded state
                engine.clear_torn()
                self._copy_group_settings(self.inner, self.hyper_source)  # the next step runs the loaded ones

        def refresh_fp32_params() -> None:
            self._wait_if_main()
            with engine.guard.reading("refreshing the fp32 parameters"):
                engine.materialize_files()  # the master weights are rewritten, the moments stay
                refresh()
                engine.drop_resident()

        z.state_dict, z.load_state_dict, z.refresh_fp32_params = state_dict, load_state_dict, refresh_fp32_params
        self._wrap_param_accessors(z)

    @staticmethod
    def _copy_group_settings(source: object, target: object) -> None:
        """Copy every param-group setting (not the params) from ``source`` to ``target`` when they are two
        optimizers (DeepSpeed's rebuilt Adagrad and the user's): checkpoints save and load the inner one, while
        the user's LR scheduler and the engine use the user's."""
        if source is target or len(source.param_groups) != len(target.param_groups):
            return
        for theirs, ours in zip(source.param_groups, target.param_groups, strict=True):
            ours.update({key: value for key, value in theirs.items() if key != "params"})

    def _wrap_param_accessors(self, z: object) -> None:
        """Keep DeepSpeed's per-parameter accessors consistent with resident device state.

        ``deepspeed.utils.safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, their local
        variants and the ``safe_set_*`` family all go through these four ZeRO-3 methods, which read and
        write the host slabs. Before a read the parameter's resident sub-groups are brought home; after a
        write their device copies are dropped, so the next step uploads the written values.
        """
        engine = self.engine

        def sub_groups(param: torch.Tensor) -> list[int]:
            flat, offset, numel = z.grad_position[z.get_param_id(param)]
            return engine.sub_groups_of(flat, offset, numel)

        def reading(method: Callable) -> Callable:
            def read(param: torch.Tensor, *args: object, **kwargs: object) -> object:
                # Whole, like a checkpoint: after an update in flight on another thread, never a torn state.
                with self.reading_state("reading a parameter's fp32 or optimizer state"):
                    if engine.state_off_slabs and param.requires_grad:
                        engine.flush_resident(sub_groups(param))
                    try:
                        return method(param, *args, **kwargs)
                    finally:
                        engine.release_file_copies()

            return read

        def writing(method: Callable) -> Callable:
            def write(value: torch.Tensor, param: torch.Tensor, *args: object, **kwargs: object) -> object:
                self._wait_if_main()
                with engine.guard.reading("writing a parameter's fp32 or optimizer state"):
                    touched = sub_groups(param) if engine.state_off_slabs and param.requires_grad else []
                    # The rest of each touched sub-group must be current on the host before its copy is dropped.
                    engine.flush_resident(touched)
                    result = method(value, param, *args, **kwargs)
                    engine.drop_resident(touched)
                    return result

            return write

        z.get_full_hp_param = reading(z.get_full_hp_param)
        z.get_local_fp32_param = reading(z.get_local_fp32_param)
        z.set_full_hp_param = writing(z.set_full_hp_param)
        z.set_local_hp_param = writing(z.set_local_hp_param)

    def keep_files_after_fit(self) -> None:
        """Teardown: close the NVMe tier (its staging slabs and the swap file's name go) but keep its records
        readable until the strategy fits again or is released, so that a checkpoint saved after ``fit`` holds them,
        as under stock NVMe offload (:mod:`~lightning_dos.integration.zero3.kept_files`)."""
        engine = self.engine
        if engine.files is None or isinstance(engine.files, KeptFiles):
            return
        kept = None
        if engine.torn is None:  # torn, nothing may read the state: the file just goes
            try:
                kept = keep_files(engine.files, engine.pool.give_back)
            except Exception as error:  # noqa: BLE001 - the fit is over: a save after it is refused, by name, instead
                warnings.warn(
                    f"lightning-dos: the swap file could not be kept past fit ({type(error).__name__}: {error}); a "
                    "checkpoint saved after fit will be refused (checkpoints saved while fitting hold the state)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        engine.close_files()
        if kept is not None:
            engine.keep_files_as(kept)

    @contextlib.contextmanager
    def reading_state(self, what: str) -> Iterator[None]:
        """Read the optimizer state whole: wait for an update in flight on another thread; refuse from
        inside the update itself, or when an interrupted update left the state torn."""
        self._wait_if_main()
        with self.engine.guard.reading(what):
            if self.engine.torn is not None:
                raise TornStateError(f"{what} refused: {self.engine.torn}")
            yield

    def _adopt_master(self, i: int) -> int:
        """Point DeepSpeed's master partition ``i`` at the engine's slab (copying its values in); return the
        bytes of DeepSpeed's own tensor that this frees."""
        view, flat = self.engine.param_view(i), self.flats[i]
        if flat.data.data_ptr() == view.data_ptr():
            return 0
        view.copy_(flat.data.reshape(-1))
        flat.data = view
        return view.numel() * view.element_size()

    def _adopt_state(self, i: int) -> int:
        """Make the inner optimizer's state for partition ``i`` views of the slabs; return its step count.

        Checked every step because loading a checkpoint replaces these tensors with new ones.
        """
        self._adopt_master(i)
        state = self.inner.state[self.flats[i]]
        engine = self.engine
        for name, key in zip(engine.rule.states, state_keys(self.inner), strict=True):
            view, current = engine.state_view(name, i), state.get(key)
            if current is None:
                view.fill_(initial_state(self.inner))
                state[key] = view
            elif current.data_ptr() != view.data_ptr():
                view.copy_(current.reshape(-1))
                state[key] = view
        return int(state.get("step", 0))

    def _store_step(self, i: int, step: int) -> None:
        state = self.inner.state[self.flats[i]]
        state["step"] = torch.tensor(float(step)) if uses_tensor_step(self.inner) else step
