"""The op-fuser path of :class:`~te_paged.moe.experts.TEGroupedMLP`: FC1 → activation → FC2 as
one autograd function that saves (and so stashes) its own tensors.

It runs the very forward and backward formulas of the unfused modules — the static methods of
GroupedLinear's and the weighted activations' autograd functions, driven with stand-in contexts —
so the two paths are bit-identical by construction, while autograd sees one node: one
``save_for_backward`` with every tensor the expert MLP keeps, each carrying the marker its
producer set. With ``moe_act`` recompute the activation output is not kept at all: FC2's saved
input (when it is that output, i.e. not an FP8 copy) is dropped and recomputed in backward from
the activation's saved input, the fused equivalent of ``CheckpointWithoutOutput``.

Shape suffixes: ``T`` static rows, ``H`` hidden, ``C`` FC1 width, ``F`` FFN width, ``E`` experts.
"""

from __future__ import annotations

import dataclasses

import torch

from te_paged.grouped.activations import ActivationSpec, load_saved_inputs, static_function
from te_paged.grouped.fp8 import Fp8Recipe
from te_paged.grouped.grouped_mm import FnOptions, GroupedLinearFn
from te_paged.kernels.compiled import save_for_backward, saved_tensors
from te_paged.moe.expert_ops import apply_packed_bias, pre_fc1_probs

__all__ = ["fused_grouped_mlp"]


# Plain functions: called through the class, Dynamo would take them for the autograd entry.
_linear_forward = static_function(GroupedLinearFn, "forward")
_linear_backward = static_function(GroupedLinearFn, "backward")


class _SubCtx:
    """What an autograd function's static forward/backward need from ``ctx``. It only collects
    what the function saves (``defer_paging``: under torch.compile the fused function pages
    what it keeps, once, see :func:`te_paged.kernels.compiled.save_for_backward`)."""

    defer_paging = True

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple[torch.Tensor | None, ...] = ()
        self.saved_tensors: tuple[torch.Tensor | None, ...] = ()
        self.input_saved_at: int | None = None

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        self.to_save = tensors


class _Restored:
    """A forward stand-in's attributes, with the saved tensors backward loaded."""

    def __init__(self, sub: _SubCtx, saved: tuple[torch.Tensor | None, ...]) -> None:
        self._sub = sub
        self.saved_tensors = saved
        self.needs_input_grad = sub.needs_input_grad

    def __getattr__(self, name: str) -> object:
        return getattr(self._sub, name)


@dataclasses.dataclass(frozen=True)
class _Spec:
    fc1_recipe: Fp8Recipe | None
    fc2_recipe: Fp8Recipe | None
    act_recipe: Fp8Recipe | None
    activation: ActivationSpec  # one with a fused kernel (MoEConfig checked)
    limit: float | None
    linear_offset: float
    paged_stash: bool
    recompute_act: bool
    n_w1: int
    n_b1: int
    n_w2: int


def _act_forward(spec: _Spec, ctx: _SubCtx, h_TC, probs_T, num_rows):
    """The registered activation's fused kernel: its forward, driven with a stand-in ctx."""
    return spec.activation.fused_forward(
        ctx, h_TC, probs_T, spec.act_recipe, spec.paged_stash, num_rows, spec.limit,
        spec.linear_offset,
    )  # fmt: skip


def _act_backward(spec: _Spec, ctx: _SubCtx, da_TF):
    return spec.activation.fused_backward(ctx, da_TF)[:2]


class _FusedGroupedMLP(torch.autograd.Function):
    """``y = FC2(act(FC1(x), probs))`` in one node.

    Saves exactly what the unfused modules save (FC1's input or its FP8 parts, the activation's
    input and probabilities, FC2's input or its FP8 parts, offsets, weights), minus FC2's input
    under ``moe_act`` recompute; see :class:`~te_paged.grouped.grouped_mm.GroupedLinearFn`
    and :class:`~te_paged.grouped.activations.WeightedSwiGLUFunction` for the bytes.
    """

    @staticmethod
    def forward(ctx, x_TH, probs_T, offsets_E, num_rows, spec: _Spec, *params):
        w1 = params[: spec.n_w1]
        b1 = params[spec.n_w1 : spec.n_w1 + spec.n_b1]
        w2 = params[spec.n_w1 + spec.n_b1 :]
        needs = ctx.needs_input_grad
        need_x, need_p = needs[0], needs[1]
        p_needs = needs[5:]
        p1, p2 = p_needs[: spec.n_w1 + spec.n_b1], p_needs[spec.n_w1 + spec.n_b1 :]
        need_h = need_x or any(p1)
        c1 = _SubCtx((need_x, False, False, False, *p1))
        c2 = _SubCtx((need_h, need_p, False, False, False, False, False))
        need_a = need_h or need_p
        c3 = _SubCtx((need_a, False, False, False, *p2))
        h_TC = _linear_forward(c1, x_TH, offsets_E, FnOptions(spec.fc1_recipe), spec.n_w1, *w1, *b1)
        a_TF = _act_forward(spec, c2, h_TC, probs_T, num_rows)
        y_TH = _linear_forward(c3, a_TF, offsets_E, FnOptions(spec.fc2_recipe), spec.n_w2, *w2)
        saved3 = c3.to_save
        dropped = ()
        if spec.recompute_act:
            # FC2's saved input, when it is the activation output itself (not an FP8 copy).
            dropped = tuple(i == c3.input_saved_at for i in range(len(saved3)))
            saved3 = tuple(None if d else t for t, d in zip(saved3, dropped))
        ctx.spec, ctx.subs, ctx.dropped = spec, (c1, c2, c3), dropped
        ctx.counts = (len(c1.to_save), len(c2.to_save), len(saved3))
        ctx.num_rows = num_rows
        save_for_backward(ctx, *c1.to_save, *c2.to_save, *saved3)
        for c in (c1, c2, c3):
            # Only the saved copies may keep these alive: the stash has taken (or, under
            # recompute, dropped) each of them, and a reference here would pin the static-size
            # original for the life of the graph, pool and all.
            c.to_save = ()
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        spec, (f1, f2, f3) = ctx.spec, ctx.subs
        saved = saved_tensors(ctx)
        n1, n2, _ = ctx.counts
        # Fresh stand-ins over the forward's (which backward leaves as they are: Dynamo traces
        # backward as a function of what forward kept). Locals: freed with this backward.
        c1, c2 = _Restored(f1, saved[:n1]), _Restored(f2, saved[n1 : n1 + n2])
        saved3 = saved[n1 + n2 :]
        if any(ctx.dropped):
            # Recompute the activation output from the activation's own saved input.
            # With an FP8 store the saved input is already dequantised: apply the activation
            # to it as is (re-quantising could change the scale), exactly as forward did.
            h_TC, probs_T = _recompute_inputs(c2)
            plain = dataclasses.replace(spec, act_recipe=None, paged_stash=False)
            with torch.no_grad():
                a_TF = _act_forward(plain, _SubCtx(c2.needs_input_grad), h_TC, probs_T, None)
            saved3 = tuple(a_TF if d else t for t, d in zip(saved3, ctx.dropped))
        c3 = _Restored(f3, saved3)
        da_TF, _, _, _, *g2 = _linear_backward(c3, dy_TH)
        dh_TC, dprobs_T = (None, None) if da_TF is None else _act_backward(spec, c2, da_TF)
        g1 = [None] * (spec.n_w1 + spec.n_b1)
        dx_TH = None
        if dh_TC is not None:
            dx_TH, _, _, _, *g1 = _linear_backward(c1, dh_TC)
        return (dx_TH, dprobs_T, None, None, None, *g1, *g2)


def _recompute_inputs(c2: _SubCtx) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation's input and probabilities, as its forward received them."""
    x_RC, probs_R = load_saved_inputs(c2)
    return x_RC.to(c2.x_dtype).view(c2.x_shape), probs_R.view(c2.probs_shape)


def fused_grouped_mlp(mlp, x_TH, splits_E, offsets_E, probs_T, num_tokens) -> torch.Tensor:
    """The op-fuser forward of ``mlp`` (a :class:`TEGroupedMLP`); same result as unfused."""
    cfg = mlp.config
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    x_TH, act_probs_T = pre_fc1_probs(cfg, x_TH, probs_T)
    dtype = x_TH.dtype
    for linear in (fc1, fc2):
        linear.check_device_path()
    w1 = [w.to(dtype) for w in fc1.weight_params()]
    b1 = [b.to(dtype) for b in fc1.bias_params()]
    w2 = [w.to(dtype) for w in fc2.weight_params()]
    act_recipe = cfg.fp8_recipe if cfg.activation_func_fp8_input_store else None
    spec = _Spec(
        fc1_recipe=fc1.fp8_recipe,
        fc2_recipe=fc2.fp8_recipe,
        act_recipe=act_recipe,
        activation=cfg.activation_type,
        limit=cfg.activation_func_clamp_value,
        linear_offset=cfg.glu_linear_offset,
        paged_stash=cfg.moe_paged_stash,
        recompute_act=cfg.recompute_moe_act,
        n_w1=len(w1),
        n_b1=len(b1),
        n_w2=len(w2),
    )
    y_TH = _FusedGroupedMLP.apply(
        x_TH.contiguous(), act_probs_T, offsets_E, num_tokens, spec, *w1, *b1, *w2
    )
    biases = fc2.bias_params()
    if not biases:
        return y_TH
    b_EH = biases[0].to(dtype) if len(biases) == 1 else torch.stack([b.to(dtype) for b in biases])
    return apply_packed_bias(y_TH, b_EH, offsets_E, act_probs_T, cfg.moe_paged_stash)
