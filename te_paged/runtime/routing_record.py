"""The routing a runner records for ``te-paged plan`` (``record_routing=True``): each MoE
layer's ``tokens_per_expert`` per forward pass, gathered over the expert-parallel group after
the step. A mixin of :class:`~te_paged.runtime.runner.PagedStashRunner`."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from te_paged.moe import MoELayer
from te_paged.runtime.planner import RoutingProfile
from te_paged.torch_compat import backward_running

__all__ = ["RoutingRecording"]


class RoutingRecording:
    """Records the router's counts: a forward hook on each layer's router, one host read per
    step (:meth:`_gather_routing`, after the step's flags are reduced)."""

    def _init_routing(self, record_routing: bool) -> None:
        self.record_routing = record_routing
        self.layers = [m for c in self.chunks for m in c.modules() if isinstance(m, MoELayer)]
        self._route_calls: list[tuple[int, torch.Tensor]] = []  # (layer, tokens_per_expert_E)
        self._routing: list[torch.Tensor] = []  # per step, CPU int64 [pass, layer, source, expert]
        self._routed_tokens = 0
        if record_routing:
            if not self.layers:
                raise ValueError(
                    "record_routing needs te_paged MoE layers (their router reports "
                    "tokens_per_expert); the model has none"
                )
            for i, layer in enumerate(self.layers):
                layer.router.register_forward_hook(functools.partial(self._on_route, i))

    def _on_route(self, layer: int, module: nn.Module, inputs: Any, out: Any) -> None:
        if backward_running():
            return  # a recomputation inside backward: this forward was already counted
        self._route_calls.append((layer, out.tokens_per_expert.detach()))

    def _gather_routing(self) -> None:
        calls = [
            [t for i, t in self._route_calls if i == layer] for layer in range(len(self.layers))
        ]
        passes = {len(c) for c in calls}
        if len(passes) != 1:
            raise RuntimeError(
                "record_routing: the MoE layers ran different numbers of times in one step "
                f"({[len(c) for c in calls]}); a profile needs every layer once per forward pass"
            )
        if not calls[0]:
            return
        local = torch.stack([torch.stack(c) for c in calls], dim=1)  # [pass, layer, expert]
        d = self.layers[0].dispatcher
        gathered = [local]
        if d.ep_size > 1:
            gathered = [torch.empty_like(local) for _ in range(d.ep_size)]
            dist.all_gather(gathered, local, group=d.group)
        self._routing.append(torch.stack(gathered, dim=2).cpu())  # the host read
        self._routed_tokens = d.last_num_tokens
        self._route_calls.clear()

    def routing_profile(self) -> RoutingProfile:
        """The routing recorded so far (``record_routing=True``), one profile step per forward
        pass, split by source rank; ``.to_json(path)`` writes it for ``te-paged plan``."""
        if not self.record_routing:
            raise RuntimeError("construct the runner with record_routing=True to record routing")
        if not self._routing:
            raise RuntimeError("no step has been recorded yet")
        d = self.layers[0].dispatcher
        return RoutingProfile(
            num_experts=d.config.num_moe_experts,
            ep_size=d.ep_size,
            top_k=d.config.moe_router_topk,
            tokens_per_rank=self._routed_tokens,
            tokens_by_source=torch.cat(self._routing).tolist(),
        )
