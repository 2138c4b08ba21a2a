"""The DeepSeek-like expert layers of checks 7 (step time) and 8 (peak memory): residual
``MoELayer``s on one rank, one model per variant (OFF, ON per stream-overlap setting) with the
same weights."""

from __future__ import annotations

import torch

from .common import RUN, Scale
from .stack import manager, overlap_label, overlaps

CAPACITY, BUFFER = 2.0, 1.10


def sizes() -> dict[str, int]:
    """Hidden 7168, ffn 2048, 8 local experts, top-8, bf16 (toy in a dry run)."""
    if RUN.scale is Scale.SMOKE:  # 4 layers: the reload-adjusted model needs cf - bf > R cf/L
        return {"hidden": 64, "ffn": 128, "experts": 8, "topk": 2, "tokens": 64, "layers": 4}
    if RUN.dry:
        return {"hidden": 256, "ffn": 512, "experts": 8, "topk": 8, "tokens": 128, "layers": 4}
    return {"hidden": 7168, "ffn": 2048, "experts": 8, "topk": 8, "tokens": RUN.step_tokens,
            "layers": 8}  # fmt: skip


class Residual(torch.nn.Module):
    """``h ← h + MoELayer(h)`` per layer (1 rank), loss ``mean(h²)``."""

    def __init__(self, cfg, layers: int, manager) -> None:
        from te_paged.moe import MoELayer

        super().__init__()
        self.manager = manager
        self.layers = torch.nn.ModuleList(
            MoELayer(cfg, None, manager, device=RUN.device, layer_number=i + 1)
            for i in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            y, _ = layer(h)
            h = h + y
        return h.float().square().mean()


def variants() -> dict[str, bool | None]:
    """Label → stream overlap of the models compared (OFF first; None: the manager default)."""
    return {"OFF": None, **{f"ON, {overlap_label(o)}": o for o in overlaps()}}


def models() -> dict[str, Residual]:
    """One model per variant, all with the OFF model's weights."""
    from te_paged.config import MoEConfig

    s = sizes()
    out: dict[str, Residual] = {}
    for label, overlap in variants().items():
        paged = label != "OFF"
        cfg = MoEConfig(
            hidden_size=s["hidden"],
            moe_ffn_hidden_size=s["ffn"],
            num_moe_experts=s["experts"],
            moe_router_topk=s["topk"],
            moe_expert_rank_capacity_factor=CAPACITY,
            moe_paged_stash=paged,
            moe_paged_stash_buffer_size_factor_cuda=BUFFER,
            params_dtype=torch.bfloat16,
            moe_paged_stash_kernel_backend=RUN.backend,
        )
        torch.manual_seed(0)
        model = Residual(cfg, s["layers"], manager(cfg, overlap) if paged else None)
        if out:
            model.load_state_dict(out["OFF"].state_dict())
        out[label] = model
    return out


def batch(step: int) -> torch.Tensor:
    s = sizes()
    g = torch.Generator(device="cpu").manual_seed(step)
    return torch.randn(s["tokens"], s["hidden"], generator=g).to(RUN.device, torch.bfloat16)


def train_step(model: Residual, x: torch.Tensor) -> torch.Tensor:
    """One training step without optimizer; gradients stay allocated (not part of a peak)."""
    if model.manager is not None:
        model.manager.reset()
    model.zero_grad(set_to_none=False)
    loss = model(x)
    loss.backward()
    return loss.detach()


def check_clean(models: dict[str, Residual]) -> None:
    """Every ON model stashed and popped alike, without overflow or invalid input."""
    for label, model in models.items():
        if model.manager is not None:
            s = model.manager.stats()
            if s.overflow or s.invalid or not s.stashes == s.pops > 0:
                raise AssertionError(f"{label}: stash not used cleanly: {s}")


def describe() -> str:
    s = sizes()
    return (f"{s['layers']} residual MoELayers (1 rank), hidden {s['hidden']}, ffn {s['ffn']}, "
            f"{s['experts']} local experts, top-{s['topk']}, bf16, {s['tokens']} tokens "
            f"({s['tokens'] * s['topk']} expert rows) a step, capacity factor {CAPACITY}, "
            f"pool factor {BUFFER}, {RUN.backend} stash kernels")  # fmt: skip
