"""A small MoE stack in plain JAX, ring-of-experts style, with paged stash of ``moe_mlpwo``.

Shape suffixes: ``G`` tokens this device sees (``ep × tokens``: the ring all-gathers every EP
rank's tokens), ``H`` hidden, ``F`` expert FFN, ``E`` experts, ``X`` local experts
(``E / ep``, experts ``0 … X−1``), ``K`` top-k, ``R`` buffer rows (``G × K``, the worst case:
every routed slot lands here), ``L`` layers.

One layer (``h_GH`` in, ``h_GH + combine`` out)::

    norm        x_GH = h_GH / rms(h_GH)
    router      logits_GE = x_GH @ wr_HE + bias_E; top-K of softmax, renormalised
    dispatch    the G×K slots sorted by expert, local experts first: the first num_tokens
                rows of x_RH are real, the rest zero (num_tokens = Σ group sizes, traced)
    experts     wo_RH = ragged_dot(silu(a) · b, w2), [a b] = ragged_dot(x_RH, w1): SwiGLU
                under jax.checkpoint(nothing_saveable) — recomputed in backward
    combine     y_GH = Σ over slots of weight × wo_RH[slot], scattered to the slot's token

The combine's backward needs ``wo_RH`` (``moe_mlpwo``: ``R × H`` elements per layer at the
static shape, ``ep`` times the balanced rows). With paged stash the combine runs under
:func:`~te_paged.jax.paged_checkpoint`: its actual rows go to one pool shared by the ``L`` layers
of the ``lax.scan``, sized by the planner like the torch manager sizes it after its capture step,
``ceil(buffer_factor × L × ceil(K × tokens / page))`` pages. Everything else is the same ON and
OFF, so gradients are bitwise equal and the saving is ``(ep − buffer_factor) × S``, ``S`` the
balanced-case bytes of ``moe_mlpwo`` over the layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_paged.jax.checkpoint import paged_checkpoint, paged_scope
from te_paged.jax.pool import _FLOAT_EXACT as _POOL_ROW_LIMIT
from te_paged.jax.pool import PagedPool, make_pool, reset_pool
from te_paged.kernels.layout import Flag, State
from te_paged.runtime.pool_plan import SavedTensor, pipeline_pool_plan
from te_paged.runtime.records import InvalidCountsError, StepRecord

#: Weights (``wr``, ``w1``, ``w2``, stacked over layers) and a batch (``x``, ``target``,
#: ``bias``): plain dicts of arrays, pytrees as they are.
Params = dict[str, jax.Array]
Batch = dict[str, jax.Array]

__all__ = [
    "Batch",
    "PagedStepRunner",
    "Params",
    "RingMoEConfig",
    "StepOutput",
    "forward",
    "init_params",
    "make_batch",
    "make_train_step",
]


def _require_number(name: str, value: object) -> None:
    """A real number (not a bool, not a string that looks like one), else TypeError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


def check_pool_rows(cfg: RingMoEConfig, *, grow_pool: bool) -> None:
    """A differentiable pool counts its rows in float32, exact below 2**24: the first pool must
    stay below, and with ``grow_pool`` so must the largest it may grow to (every layer's static
    buffer whole). ``ValueError`` naming the sizes, before anything is built."""
    pages = static_pool_pages(cfg) if grow_pool else cfg.pool_pages()
    rows = pages * cfg.page_size
    if rows >= _POOL_ROW_LIMIT:
        what = "may grow to" if grow_pool else "needs"
        raise ValueError(
            f"the pool {what} {rows} rows ({cfg.layers} layers, {cfg.ep} x {cfg.tokens} tokens "
            f"x top-{cfg.topk}, pages of {cfg.page_size}): a differentiable pool counts in "
            "float32, exact only below 2**24 rows; use fewer tokens, ranks or layers"
            + (", or --no-grow-pool (grow_pool=False)" if grow_pool else "")
        )


def static_pool_pages(cfg: RingMoEConfig) -> int:
    """The pool that holds every layer's static buffer whole: growth stops there."""
    return cfg.layers * -(-cfg.max_rows // cfg.page_size)


@dataclasses.dataclass(frozen=True)
class RingMoEConfig:
    """The model and its paged stash. ``capacity_factor`` is not a knob: under ring-of-experts
    the buffer holds every EP rank's tokens, ``ep`` times the balanced load."""

    layers: int = 4
    experts: int = 8
    topk: int = 2
    hidden: int = 64
    ffn: int = 64
    tokens: int = 64  # per EP rank; this device sees ep × tokens
    ep: int = 4
    page_size: int = 16
    buffer_factor: float = 1.10
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "experts", "topk", "hidden", "ffn", "tokens", "ep", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.experts % self.ep:
            raise ValueError(f"experts={self.experts} do not split over ep={self.ep} ranks")
        if self.topk > self.experts:
            raise ValueError(f"topk={self.topk} exceeds experts={self.experts}")
        for name in ("buffer_factor", "lr"):
            _require_number(name, getattr(self, name))
        if not (math.isfinite(self.buffer_factor) and self.buffer_factor > 0):
            raise ValueError(f"buffer_factor must be > 0, got {self.buffer_factor!r}")
        check_pool_rows(self, grow_pool=False)  # the first pool

    @property
    def global_tokens(self) -> int:
        return self.ep * self.tokens

    @property
    def max_rows(self) -> int:
        """``R``: the static buffer, every slot of every EP rank's tokens."""
        return self.global_tokens * self.topk

    @property
    def balanced_rows(self) -> int:
        """``N·k``: the rows a device receives under perfect balance."""
        return self.tokens * self.topk

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def capacity_factor(self) -> float:
        return self.max_rows / self.balanced_rows

    @property
    def saved(self) -> SavedTensor:
        """What a layer stashes: ``moe_mlpwo``, one float32 row of width H per routed slot."""
        return SavedTensor(f"float32x{self.hidden}", 4 * self.hidden)

    def pool_pages(self) -> int:
        """The planner's pool for the ``L`` layers live at the end of forward."""
        (plan,) = pipeline_pool_plan(
            pipeline_parallel=1,
            microbatches=1,
            num_layers=self.layers,
            balanced_rows=self.balanced_rows,
            saved=[self.saved],
            page_size=self.page_size,
            buffer_factor=self.buffer_factor,
            capacity_factor=self.capacity_factor,
            skip_immediate_backward=False,  # the JAX port pages every layer
        )
        return plan.pool_pages[self.saved.key]

    def s_bytes(self) -> int:
        """``S``: balanced-case bytes of ``moe_mlpwo`` over all layers."""
        return self.layers * self.balanced_rows * self.saved.row_bytes

    def make_pool(self) -> PagedPool:
        return make_pool(self.pool_pages(), self.page_size, self.hidden, differentiable=True)


def init_params(cfg: RingMoEConfig) -> Params:
    """Weights of the ``L`` layers, stacked for ``lax.scan`` (the local experts only)."""
    k = jax.random.split(jax.random.key(cfg.seed), 3)
    L, H, F, E, X = cfg.layers, cfg.hidden, cfg.ffn, cfg.experts, cfg.local_experts
    return {
        # Small router weights: near-uniform routing, so a device's load is near N·k.
        "wr": 0.01 * jax.random.normal(k[0], (L, H, E)),
        "w1": jax.random.normal(k[1], (L, X, H, 2 * F)) / math.sqrt(H),
        "w2": jax.random.normal(k[2], (L, X, F, H)) / math.sqrt(F),
    }


def make_batch(cfg: RingMoEConfig, step: int, skew: float = 0.0) -> Batch:
    """Step ``step``'s data: inputs and targets of the ``G`` tokens, and the router bias
    (``skew`` on expert 0, a local expert: forces more rows here than the pool holds)."""
    k = jax.random.split(jax.random.key(1_000_003 * (cfg.seed + 1) + step), 2)
    shape = (cfg.global_tokens, cfg.hidden)
    return {
        "x": jax.random.normal(k[0], shape),
        "target": jax.random.normal(k[1], shape),
        "bias": jnp.zeros((cfg.experts,)).at[0].set(skew),
    }


def _route(cfg: RingMoEConfig, wr_HE, h_GH, bias_E):
    """Top-K routing and the dispatch order: slot → token, weight, group sizes, num_tokens."""
    probs_GE = jax.nn.softmax(h_GH @ wr_HE + bias_E, axis=-1)
    top_p_GK, top_e_GK = jax.lax.top_k(probs_GE, cfg.topk)
    weight_GK = top_p_GK / jnp.sum(top_p_GK, axis=-1, keepdims=True)
    expert_R = top_e_GK.reshape(-1)
    x = cfg.local_experts
    group_R = jnp.where(expert_R < x, expert_R, x)  # every remote expert sorts last, as X
    order_R = jnp.argsort(group_R, stable=True)
    group_sizes_X = jnp.bincount(group_R, length=x + 1)[:x].astype(jnp.int32)
    num_tokens = jnp.sum(group_sizes_X)
    real_R = jnp.arange(cfg.max_rows) < num_tokens
    token_R = (order_R // cfg.topk).astype(jnp.int32)
    weight_R = jnp.where(real_R, weight_GK.reshape(-1)[order_R], 0.0)
    return token_R, weight_R, real_R, group_sizes_X, num_tokens


def _experts(w1_XHF, w2_XFH, h_GH, token_R, real_R, group_sizes_X):
    """``moe_mlpwo``: the local experts' SwiGLU MLP on the dispatched rows, zero past them."""
    x_RH = jnp.where(real_R[:, None], h_GH[token_R], 0.0)
    a_RF = jax.lax.ragged_dot(x_RH, w1_XHF, group_sizes_X)
    gate, up = jnp.split(a_RF, 2, axis=-1)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w2_XFH, group_sizes_X)


def _combine(tokens: int, wo_RH, weight_R, token_R):
    """Each slot's expert output times its weight, summed into its token's row."""
    return (
        jnp.zeros((tokens, wo_RH.shape[1]), wo_RH.dtype).at[token_R].add(wo_RH * weight_R[:, None])
    )


def forward(
    cfg: RingMoEConfig, params: Params, batch: Batch, pool: PagedPool | None
) -> tuple[tuple[jax.Array, jax.Array], PagedPool | None]:
    """``((loss, num_tokens_L), pool)``: the residual stack scanned over layers, paged stash
    on (a pool threaded through the scan carry) or off (``pool=None``)."""
    experts = jax.checkpoint(_experts, policy=jax.checkpoint_policies.nothing_saveable)
    combine = functools.partial(_combine, cfg.global_tokens)

    def layer(carry, p):
        h_GH, pool = carry
        # Pre-norm (RMS, no scale): a skewed router that sends every token here must not make
        # the residual stream grow layer after layer.
        x_GH = h_GH * jax.lax.rsqrt(jnp.mean(jnp.square(h_GH), axis=-1, keepdims=True) + 1e-6)
        token_R, weight_R, real_R, sizes_X, num_tokens = _route(cfg, p["wr"], x_GH, batch["bias"])
        wo_RH = experts(p["w1"], p["w2"], x_GH, token_R, real_R, sizes_X)
        y_GH, pool = paged_checkpoint(combine, wo_RH, num_tokens, pool, weight_R, token_R)
        return (h_GH + y_GH, pool), num_tokens

    (h_GH, pool), num_tokens_L = jax.lax.scan(layer, (batch["x"], pool), params)
    loss = jnp.mean(jnp.square(h_GH - batch["target"]))
    return (loss, num_tokens_L), pool


class StepOutput(NamedTuple):
    """What a step function returns (device arrays; nothing read to the host)."""

    params: Params  # after the SGD update
    grads: Params
    loss: jax.Array
    grad_norm: jax.Array
    num_tokens_L: jax.Array  # rows routed to this device per layer
    flags: jax.Array  # the pool's flags after forward (zeros without paged stash)
    pool: PagedPool | None  # as backward left it: every page free again


def make_train_step(
    cfg: RingMoEConfig, paged: bool, on_trace: Callable[[], None] | None = None
) -> Callable[..., StepOutput]:
    """``step(params, batch, pool) -> StepOutput``: loss, gradients, an SGD update. Jitted;
    ``pool`` (``None`` when not ``paged``) is donated and comes back reset by backward's pops.
    ``on_trace`` is called whenever JAX traces the step (tests count compilations with it)."""

    def step(params, batch, pool):
        if on_trace is not None:
            on_trace()
        if paged:
            scoped = paged_scope(functools.partial(forward, cfg))

            def loss_fn(p, pool):
                (loss, num_tokens_L), flags = scoped(p, batch, pool)
                return loss, (num_tokens_L, flags)

            # The "gradient" with respect to the pool is the pool as backward left it (see
            # paged_scope); reset outside loss_fn, whose gradient would not pass through it.
            (loss, (num_tokens_L, flags)), (grads, pool) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True
            )(params, reset_pool(pool))
        else:

            def loss_fn(p):
                (loss, num_tokens_L), _ = forward(cfg, p, batch, None)
                return loss, num_tokens_L

            (loss, num_tokens_L), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            flags = jnp.zeros((len(Flag),), jnp.float32)
        leaves = jax.tree.leaves(grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in leaves))
        new = jax.tree.map(lambda w, g: w - cfg.lr * g, params, grads)
        return StepOutput(new, grads, loss, grad_norm, num_tokens_L, flags, pool)

    return jax.jit(step, donate_argnums=(2,))


class PagedStepRunner:
    """Runs steps with paged stash; reads the flags once per step (the one host read) and,
    when a stash overflowed, reruns the step without paged stash — the result is the step
    that never overflowed. Both step functions compile once per pool size, for every token
    count.

    With ``grow_pool`` (the default, as the torch runner's) the pool sizes itself from what the
    steps needed (``State.DEMAND_HWM``: the pages outstanding at the step's peak, stored or
    not): after the first step ("capture"), after an overflow ("overflow") and after a kept step
    that left less than ``grow_headroom`` free ("headroom"), it grows to that need x
    ``grow_headroom``, never past the static worst case, and ``StepRecord.pool_growth`` says
    from, to, needed and why. The next step allocates it (one more compilation). A token count
    the static buffer cannot hold (``flags[INVALID]``) raises :class:`InvalidCountsError`: a
    rerun would see it again."""

    def __init__(
        self,
        cfg: RingMoEConfig,
        on_trace: Callable[[bool], None] | None = None,
        *,
        grow_pool: bool = True,
        grow_headroom: float = 1.10,
    ):
        if not isinstance(grow_pool, bool):  # a string such as "no" would read as True
            raise TypeError(f"grow_pool must be True or False, got {grow_pool!r}")
        _require_number("grow_headroom", grow_headroom)
        if not (math.isfinite(grow_headroom) and grow_headroom >= 1):
            raise ValueError(f"grow_headroom must be >= 1, got {grow_headroom!r}")
        check_pool_rows(cfg, grow_pool=grow_pool)
        self.cfg, self.grow_pool, self.grow_headroom = cfg, grow_pool, grow_headroom

        def traced(paged: bool):
            return None if on_trace is None else functools.partial(on_trace, paged)

        self.paged_step = make_train_step(cfg, True, traced(True))
        self.plain_step = make_train_step(cfg, False, traced(False))
        self.pool = cfg.make_pool()
        self.steps = 0
        self.last_num_tokens: list[int] = []

    @property
    def static_pages(self) -> int:
        """The pool that holds every layer's static buffer whole: growth stops there."""
        return static_pool_pages(self.cfg)

    def step(self, params: Params, batch: Batch) -> tuple[StepOutput, StepRecord]:
        """One step: the output of the kept attempt and the torch runner's
        :class:`~te_paged.runtime.StepRecord` of it (one device: rank counts are 0 or 1).
        ``last_num_tokens`` keeps the rows each layer routed here in the kept attempt."""
        cfg, key = self.cfg, self.cfg.saved.key
        out = self.paged_step(params, batch, self.pool)
        self.pool = out.pool
        # The step's one host read: flags after forward and after backward, the high-water
        # marks, the token counts.
        flags, after, state, num_tokens = jax.device_get(
            (out.flags, out.pool.flags, out.pool.state, out.num_tokens_L)
        )
        if int(flags[Flag.INVALID]):
            raise InvalidCountsError(
                f"step {self.steps}: {int(flags[Flag.INVALID])} stash(es) got a token count "
                f"outside [0, {cfg.max_rows}] (the static buffer's rows; per layer: "
                f"{[int(n) for n in num_tokens]}): the routing's counts are wrong, which a "
                "rerun would repeat, so the step is not kept"
            )
        if int(after[Flag.INVALID]):
            raise RuntimeError(
                f"step {self.steps}: backward popped {int(after[Flag.INVALID])} record(s) whose "
                "pages the pool no longer owned (a record popped twice): the gradients are wrong"
            )
        overflow = int(flags[Flag.OVERFLOW]) != 0
        peak = int(max(num_tokens))
        record = StepRecord(
            step=self.steps,
            attempt=1,
            enabled=True,
            stash_overflow_ranks=int(overflow),
            overbudget_ranks=0,  # the ring-of-experts buffer is the worst case: never over
            host_spill_ranks=0,
            will_retry=overflow,
            pool_high_water_pages={key: int(state[State.HWM])},
            pool_pages={key: self.pool.num_pages},
            peak_tokens=peak,
            budget_tokens=cfg.max_rows,
            balanced_tokens=cfg.balanced_rows,
            pool_demand_pages={key: int(state[State.DEMAND_HWM])},
        )
        if overflow:
            # As the torch runner suggests it: a factor that would hold every layer at the
            # step's peak, with 5 % headroom.
            record.suggested_buffer_size_factor_cuda = (
                math.ceil(100 * peak / cfg.balanced_rows * 1.05) / 100
            )
        if self.grow_pool:
            need = int(state[State.DEMAND_HWM])
            why = "overflow" if overflow else "capture" if self.steps == 0 else "headroom"
            self._grow(record, need, why)
        if overflow:
            out = self.plain_step(params, batch, None)
            record.attempt, record.enabled = 2, False
            num_tokens = jax.device_get(out.num_tokens_L)
        self.last_num_tokens = [int(n) for n in num_tokens]
        self.steps += 1
        return out, record

    def _grow(self, record: StepRecord, need: int, why: str) -> None:
        """A new pool of ``need x grow_headroom`` pages (at most the static worst case) when
        the step needed more than the pool / headroom; recorded in ``record.pool_growth``."""
        cfg, pages = self.cfg, self.pool.num_pages
        want = min(math.ceil(need * self.grow_headroom), self.static_pages)
        if want <= pages:
            return
        record.pool_growth[cfg.saved.key] = {
            "from": pages, "to": want, "needed": need, "why": why,
        }  # fmt: skip
        self.pool = make_pool(want, cfg.page_size, cfg.hidden, differentiable=True)
