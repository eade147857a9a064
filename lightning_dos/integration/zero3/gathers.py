"""The next forward's all-gathers wait for the sub-groups they read, not for the whole update.

Under ``overlap`` the update goes on while the next forward runs: each of ZeRO-3's all-gathers first waits
for the sub-groups holding the parameters it gathers (the engine's per-sub-group landing), and the
persistent parameters' gather after the step is deferred to the first forward that reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ForwardGathers:
    """The next forward's parameter gathers, ordered after the sub-groups they read (a part of
    :class:`~lightning_dos.integration.zero3.adapter.ZeRO3Adapter`, which holds the state it reads)."""

    def _sub_groups_of_params(self, params: object) -> list[int]:
        """The engine's sub-groups holding ``params``' partitions (parameters without a gradient hold none)."""
        z, engine, found = self.zero, self.engine, set()
        for param in params:
            key = id(param)
            if key not in self._param_sub_groups:
                position = z.grad_position.get(z.get_param_id(param)) if param.requires_grad else None
                self._param_sub_groups[key] = engine.sub_groups_of(*position) if position is not None else []
            found.update(self._param_sub_groups[key])
        return sorted(found)

    def _wait_before_gathers(self, z: object) -> None:
        """Make every all-gather of ZeRO-3's parameter coordinator wait for the sub-groups it reads.

        The wait sits in the coordinator's all-gather rather than in a module pre-hook so that the parameters it
        prefetches for the modules after the current one are covered too."""
        coordinator = z.parameter_offload.get_param_coordinator()
        name = "_PartitionedParameterCoordinator__all_gather_params"
        gather = getattr(coordinator, name)
        engine = self.engine
        # On a GPU the gather's own stream waits for each sub-group's landing event (the host only waits until it
        # is issued), so the host goes on queueing the forward; elsewhere the host waits.
        stream = getattr(coordinator, "_PartitionedParameterCoordinator__allgather_stream", None)
        stream = stream if engine.device.type == "cuda" and isinstance(stream, torch.cuda.Stream) else None

        def all_gather_params(params: object, forward: bool) -> None:
            # During backward (arrivals open) the sub-groups updated early are those whose gradients are final:
            # backward has used their parameters already and gathers only the others, which nothing writes yet.
            if engine.in_flight and engine.arrivals is None:
                engine.wait_sub_groups(self._sub_groups_of_params(params), stream)
            return gather(params, forward)

        setattr(coordinator, name, all_gather_params)
        # deepspeed.zero.GatheredParameters (users' callbacks, checkpoint helpers) gathers through each parameter's
        # own all_gather, outside the coordinator: it waits for the update in flight's sub-groups too.
        for group in z.fp16_groups:
            for param in group:
                param.all_gather = self._waiting_all_gather(param, param.all_gather)
        self._defer_persistent_gather(z)

    def _defer_persistent_gather(self, z: object) -> None:
        """Leave DeepSpeed's re-gather of its persistent parameters at the end of the step to the next forward.

        DeepSpeed keeps small parameters (below ``stage3_param_persistence_threshold``: norms, biases) whole on
        every rank and re-gathers them all at the end of the step (``_post_step``). They sit in nearly every
        sub-group, so that gather would wait for the whole update in flight. The step's start
        (``_partition_all_parameters``) released them with every other parameter, so when the step's gather is
        left out, the coordinator gathers each when the next forward reaches its module, after waiting for just
        its sub-groups, like any other parameter."""
        engine, post_step = self.engine, z._post_step

        def deferred_post_step(timer_names: object) -> None:
            persistent = z.persistent_parameters
            if not engine.in_flight or not persistent:
                return post_step(timer_names)
            z.persistent_parameters = []  # _post_step's own gather is the only use of the list there
            try:
                return post_step(timer_names)
            finally:
                z.persistent_parameters = persistent

        z._post_step = deferred_post_step

    def _waiting_all_gather(self, owner: object, gather: Callable) -> Callable:
        engine = self.engine

        def all_gather(param_list: object = None, *args: object, **kwargs: object) -> object:
            if engine.in_flight and engine.arrivals is None:
                engine.wait_sub_groups(self._sub_groups_of_params(param_list or [owner]))
            return gather(param_list, *args, **kwargs)

        return all_gather
