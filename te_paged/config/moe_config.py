"""`MoEConfig`: the MoE expert-layer configuration, with Megatron `TransformerConfig` field names.

Every invalid combination is rejected in `__post_init__` (and therefore also by
`dataclasses.replace`) with one `ValueError` that lists each problem: the field(s), the value(s)
and the fix. Nothing downstream re-checks these with `assert`.

Choice-valued fields are stored as plain strings (as Megatron does) and validated against the
enums below or, for `activation` and `moe_paged_stash_kernel_backend`, against the registries of
:mod:`te_paged.grouped.activations` and :mod:`te_paged.kernels`; `activation_type` returns the
registered activation, `fp8_recipe` the enum member. Passing an enum member instead of its
string is accepted and normalised to the string.

Static token budget (see DESIGN.md §1 and :mod:`te_paged.config.budget`), for one rank with `T`
input tokens:

    max_num_tokens = ceil(T × moe_router_topk × moe_expert_rank_capacity_factor)   [↑32 for MXFP8]
    avg_num_tokens = floor(max_num_tokens / moe_expert_rank_capacity_factor)       (balanced case)

te_paged's own dispatcher sends equal blocks over an all-to-all: each rank may send each rank at
most `C = ceil(T × moe_router_topk × a2a_capacity_factor) / P` rows (its wire budget) and pads
the received rows to the expert buffer's `max_num_tokens`, so `a2a_capacity_factor <=
moe_expert_rank_capacity_factor`. `moe_a2a_capacity_factor=None` (the default) is "auto": the
wire starts at `moe_expert_rank_capacity_factor` and te_paged's runner sets it once from the first
step's largest pair demand × `capacity_headroom`; a value starts it there. Either way the runner
raises it as routing needs (docs/design.md, "The wire").

Both use the decimal value of the factor, not its binary float: with 100 tokens, top-2 and factor
1.1 the budget is 220 rows (float math gives 221) and `avg_num_tokens(220)` is 200 (float `//`
gives 199).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from te_paged.config.budget import balanced_rows, rank_rows
from te_paged.grouped.activations import (
    ACTIVATIONS,
    ActivationSpec,
    activation_for_function,
    get_activation,
)
from te_paged.grouped.fp8 import NVFP4_BLOCK, Fp8Recipe
from te_paged.kernels.backends import backend_choices
from te_paged.markers import MXFP8_SCALE_BLOCK


class Activation(str, enum.Enum):
    """The built-in expert activations by name, for convenience: the registry
    (:mod:`te_paged.grouped.activations`) is what every check and path reads, and any name
    registered there is valid where one of these is."""

    SWIGLU = "swiglu"
    GEGLU = "geglu"
    QUICK_GEGLU = "quick_geglu"
    REGLU = "reglu"
    SQUARED_REGLU = "squared_reglu"
    SILU = "silu"
    GELU = "gelu"
    QUICK_GELU = "quick_gelu"
    RELU = "relu"
    SQUARED_RELU = "squared_relu"

    @property
    def spec(self) -> ActivationSpec:
        return get_activation(self.value)

    @property
    def is_gated(self) -> bool:
        return self.spec.gated

    @property
    def function(self) -> str:
        """The elementwise function's name (Megatron's ``activation_func.__name__``)."""
        return self.spec.function

    @property
    def has_fused_kernel(self) -> bool:
        return self.spec.fused is not None

    @classmethod
    def from_function(cls, function: str, gated: bool) -> Activation:
        """The built-in activation of Megatron's ``(activation_func, gated_linear_unit)``."""
        return cls(activation_for_function(function, gated).name)


class RecomputeGranularity(str, enum.Enum):
    """Activation recompute granularity (`recompute_granularity=None` means no recompute)."""

    SELECTIVE = "selective"
    FULL = "full"


class RecomputeModule(str, enum.Enum):
    """Module names accepted in `recompute_modules` (selective recompute)."""

    MOE_ACT = "moe_act"
    MOE = "moe"
    MLP = "mlp"
    LAYERNORM = "layernorm"
    CORE_ATTN = "core_attn"
    SHARED_EXPERTS = "shared_experts"


# Activations whose saved tensors would be owned twice (offload and stash) under paged stash.
PAGED_STASH_FORBIDDEN_OFFLOAD_MODULES: tuple[str, ...] = (
    "expert_fc1",
    "moe_act",
    "fused_group_mlp",
)
PARAMS_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _allowed(enum_cls: type[enum.Enum]) -> str:
    return ", ".join(repr(m.value) for m in enum_cls)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """Configuration of one MoE expert layer and its paged activation stash.

    Frozen: change a field with ``dataclasses.replace`` (which validates the new config).
    Construction normalises what it is given (an enum member becomes its string, a list of
    module names a tuple) and then validates; validation changes nothing."""

    # Model sizes.
    hidden_size: int = 64
    moe_ffn_hidden_size: int = 128
    num_moe_experts: int = 8
    moe_router_topk: int = 2
    # Activation.
    gated_linear_unit: bool = True
    activation: str = "swiglu"
    activation_func_clamp_value: float | None = None  # QuickGeGLU clamp limit
    glu_linear_offset: float = 0.0  # QuickGeGLU linear offset
    # Expert MLP execution.
    bias_activation_fusion: bool = True
    use_fused_weighted_squared_relu: bool = False  # Megatron's fused kernel for squared_relu
    add_bias_linear: bool = False
    moe_mlp_glu_interleave_size: int | None = None
    moe_apply_probs_on_input: bool = False
    moe_use_grouped_tensor: bool = True
    use_transformer_engine_op_fuser: bool = False
    # Static budget and paged stash.
    moe_expert_rank_capacity_factor: float | None = None
    # te_paged's padded all-to-all: the pair budget's factor (None: auto, see the module doc).
    moe_a2a_capacity_factor: float | None = None
    moe_paged_stash: bool = False
    moe_paged_stash_page_size: int = 64
    moe_paged_stash_buffer_size_factor_cuda: float = 1.10
    moe_paged_stash_buffer_size_factor_cpu: float = 0.0
    # Recompute and offloading.
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] = ()
    cpu_offloading: bool = False
    offload_modules: tuple[str, ...] = ()
    # Precision, parallelism, kernels.
    fp8: str | None = None
    activation_func_fp8_input_store: bool = False  # store the activation's saved input as FP8
    params_dtype: torch.dtype = torch.float32
    expert_model_parallel_size: int = 1
    moe_paged_stash_kernel_backend: str = "auto"
    # Keep unpaged the tensors of the layer whose backward follows its forward at once
    # (PagedStashManager's skip_immediate_backward).
    moe_paged_stash_skip_immediate_backward: bool = True
    # The largest microbatch of any step, in tokens per rank entering the MoE layers (None: not
    # declared). The paged stash sizes its pools for it from the capture step
    # (PagedStashManager's max_tokens_per_rank; undeclared, the runner grows them at each new
    # maximum), and te_paged's dispatcher its static buffers (a smaller microbatch is padded:
    # the ranks of an expert-parallel group may then bring different token counts).
    moe_max_tokens_per_rank: int | None = None

    def __post_init__(self) -> None:
        # Normalise what construction was given (frozen: through object.__setattr__, here only).
        # Lists become tuples, so a caller's list is not aliased; a bare string is left for
        # validate() to reject rather than split into characters.
        def _value(v: object) -> object:
            return v.value if isinstance(v, enum.Enum) else v

        for name in ("activation", "moe_paged_stash_kernel_backend", "fp8",
                     "recompute_granularity"):  # fmt: skip
            object.__setattr__(self, name, _value(getattr(self, name)))
        for name in ("recompute_modules", "offload_modules"):
            value = getattr(self, name)
            if not isinstance(value, str):
                object.__setattr__(self, name, tuple(_value(m) for m in value))
        self.validate()

    # ----------------------------------------------------------------------------------------------
    # Derived values.

    @property
    def num_local_experts(self) -> int:
        return self.num_moe_experts // self.expert_model_parallel_size

    @property
    def recompute_moe_act(self) -> bool:
        return RecomputeModule.MOE_ACT.value in self.recompute_modules

    @property
    def fc1_output_size(self) -> int:
        return 2 * self.moe_ffn_hidden_size if self.gated_linear_unit else self.moe_ffn_hidden_size

    @property
    def activation_type(self) -> ActivationSpec:
        """The registered activation (:mod:`te_paged.grouped.activations`)."""
        return get_activation(self.activation)

    @property
    def fp8_recipe(self) -> Fp8Recipe | None:
        return None if self.fp8 is None else Fp8Recipe(self.fp8)

    @property
    def kernel_backend(self) -> str:
        """The stash kernel backend's name (registered in :mod:`te_paged.kernels`, or auto)."""
        return self.moe_paged_stash_kernel_backend

    @property
    def budget_block(self) -> int:
        """Row multiple of every static budget: one MXFP8 scale row covers 32 token rows."""
        return MXFP8_SCALE_BLOCK if self.fp8 == Fp8Recipe.MXFP8.value else 1

    def max_num_tokens(self, num_tokens: int) -> int:
        """Static per-rank expert-input rows for `num_tokens` input tokens (see module doc)."""
        factor = self._require_capacity_factor("max_num_tokens")
        if not _is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int; got {num_tokens!r}")
        return rank_rows(num_tokens, self.moe_router_topk, factor, self.budget_block)

    def avg_num_tokens(self, max_num_tokens: int) -> int:
        """Balanced-case rows for a static budget of `max_num_tokens` rows."""
        factor = self._require_capacity_factor("avg_num_tokens")
        if not _is_int(max_num_tokens) or max_num_tokens < 0:
            raise ValueError(f"max_num_tokens must be a non-negative int; got {max_num_tokens!r}")
        return balanced_rows(max_num_tokens, factor)

    @property
    def a2a_capacity_factor(self) -> float | None:
        """The wire budget's factor of te_paged's padded all-to-all (see the module docstring):
        ``moe_a2a_capacity_factor``, or ``moe_expert_rank_capacity_factor`` when that is None;
        None without a rank factor."""
        cf = self.moe_expert_rank_capacity_factor
        if cf is None:
            return None
        if self.moe_a2a_capacity_factor is not None:
            return self.moe_a2a_capacity_factor
        return cf

    def _require_capacity_factor(self, what: str) -> float:
        if self.moe_expert_rank_capacity_factor is None:
            raise ValueError(
                f"{what}() needs moe_expert_rank_capacity_factor, which is None; "
                "set it, e.g. moe_expert_rank_capacity_factor=1.5"
            )
        return self.moe_expert_rank_capacity_factor

    # ----------------------------------------------------------------------------------------------
    # Validation.

    def validate(self) -> None:
        """Raise `ValueError` listing every problem; called by `__post_init__`."""
        problems: list[str] = []
        self._check_choices(problems)
        self._check_sizes(problems)
        self._check_reals(problems)
        self._check_activation(problems)
        self._check_recompute_and_offload(problems)
        self._check_paged_stash(problems)
        if len(problems) == 1:
            raise ValueError(f"invalid MoEConfig: {problems[0]}")
        if problems:
            raise ValueError("invalid MoEConfig:\n  - " + "\n  - ".join(problems))

    def _check_sizes(self, problems: list[str]) -> None:
        names = (
            "hidden_size",
            "moe_ffn_hidden_size",
            "num_moe_experts",
            "moe_router_topk",
            "expert_model_parallel_size",
            "moe_paged_stash_page_size",
        )
        bad = False
        for name in names:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                problems.append(f"{name} must be a positive int; got {value!r}")
                bad = True
        most = self.moe_max_tokens_per_rank
        if most is not None and (not _is_int(most) or most <= 0):
            problems.append(f"moe_max_tokens_per_rank must be None or a positive int; got {most!r}")
        if bad:
            return  # the relations below would only repeat the same problem
        experts, ep = self.num_moe_experts, self.expert_model_parallel_size
        if experts % ep != 0:
            problems.append(
                f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}; "
                "choose an expert_model_parallel_size that divides num_moe_experts"
            )
        # top-k vs the number of experts is the router's to check (TopKRouter does): an expert
        # module, e.g. one local expert of an EP group, is valid whatever the routing.
        interleave = self.moe_mlp_glu_interleave_size
        if interleave is not None and (not _is_int(interleave) or interleave <= 0):
            problems.append(
                f"moe_mlp_glu_interleave_size must be None or a positive int; got {interleave!r}"
            )
        block = {Fp8Recipe.NVFP4.value: NVFP4_BLOCK, Fp8Recipe.MXFP8.value: MXFP8_SCALE_BLOCK}
        if self.fp8 in block:
            size = block[self.fp8]
            for name in ("hidden_size", "moe_ffn_hidden_size"):
                if getattr(self, name) % size != 0:
                    problems.append(
                        f"fp8={self.fp8!r} needs {name} to be a multiple of {size} (got "
                        f"{getattr(self, name)}); pad {name} to a multiple of {size} "
                        "or use fp8='tensorwise'"
                    )

    def _check_choices(self, problems: list[str]) -> None:
        for name, registered in (
            ("activation", tuple(ACTIVATIONS)),
            ("moe_paged_stash_kernel_backend", backend_choices()),
        ):
            value = getattr(self, name)
            if value not in registered:
                problems.append(f"{name}={value!r} is not registered; use one of "
                                f"{', '.join(repr(n) for n in registered)}")  # fmt: skip
        choices: tuple[tuple[str, type[enum.Enum], bool], ...] = (
            ("fp8", Fp8Recipe, True),
            ("recompute_granularity", RecomputeGranularity, True),
        )
        for name, enum_cls, nullable in choices:
            value = getattr(self, name)
            if value is None and nullable:
                continue
            if value not in {m.value for m in enum_cls}:
                none = "None or " if nullable else ""
                problems.append(
                    f"{name}={value!r} is not supported; use {none}one of {_allowed(enum_cls)}"
                )
        for name in ("recompute_modules", "offload_modules"):
            if isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a list of names, e.g. ['moe_act']; got a str")
        modules = self.recompute_modules
        for module in () if isinstance(modules, str) else modules:
            if module not in {m.value for m in RecomputeModule}:
                problems.append(
                    f"recompute_modules contains unknown module {module!r}; "
                    f"allowed: {_allowed(RecomputeModule)}"
                )
        if self.activation_func_fp8_input_store and self.fp8 is None:
            problems.append(
                "activation_func_fp8_input_store=True needs an FP8 recipe: set fp8 to "
                f"one of {_allowed(Fp8Recipe)} or leave the store off"
            )
        if self.params_dtype not in PARAMS_DTYPES:
            problems.append(
                f"params_dtype={self.params_dtype!r} is not a supported floating dtype; "
                f"use one of {', '.join(str(d) for d in PARAMS_DTYPES)}"
            )

    def _check_reals(self, problems: list[str]) -> None:
        # (field, may be None, lower bound, bound is strict, example of a good value)
        reals: tuple[tuple[str, bool, float, bool, str], ...] = (
            ("moe_expert_rank_capacity_factor", True, 0.0, True, "1.5"),
            ("moe_a2a_capacity_factor", True, 0.0, True, "1.25"),
            # Megatron's sign convention: > 0 × the balanced peak, < 0 × the observed peak.
            ("moe_paged_stash_buffer_size_factor_cuda", False, -math.inf, False, "1.10"),
            ("moe_paged_stash_buffer_size_factor_cpu", False, -math.inf, False, "0.0"),
            ("activation_func_clamp_value", True, 0.0, True, "7.0"),
            ("glu_linear_offset", False, -math.inf, False, "0.0"),
        )
        for name, nullable, low, strict, example in reals:
            value = getattr(self, name)
            if value is None and nullable:
                continue
            ok = _is_real(value) and math.isfinite(value)
            if not ok or value < low or (strict and value == low):
                bound = "" if low == -math.inf else f" {'>' if strict else '>='} {low:g}"
                none = "None or " if nullable else ""
                problems.append(
                    f"{name} must be {none}a finite number{bound}; got {value!r} (e.g. {example})"
                )
        a2a, cf = self.moe_a2a_capacity_factor, self.moe_expert_rank_capacity_factor
        if _is_real(a2a) and _is_real(cf) and a2a > cf:
            problems.append(
                f"moe_a2a_capacity_factor={a2a} is larger than moe_expert_rank_capacity_factor="
                f"{cf}: the all-to-all's received rows must fit the expert buffer; set it <= {cf} "
                "(or None for te_paged's default)"
            )
        if self.moe_paged_stash and self.moe_paged_stash_buffer_size_factor_cuda == 0:
            problems.append(
                "moe_paged_stash=True with moe_paged_stash_buffer_size_factor_cuda=0 leaves no "
                "device pages, so every stash would spill or overflow; set it > 0 (x the "
                "balanced peak, default 1.10), < 0 (x the capture step's observed peak, e.g. "
                "-1.2) or moe_paged_stash=False"
            )

    def _check_activation(self, problems: list[str]) -> None:
        if self.activation not in ACTIVATIONS:
            return  # already reported by _check_choices
        act = get_activation(self.activation)
        glu_only = (
            ("activation_func_clamp_value", self.activation_func_clamp_value is not None, "None"),
            ("glu_linear_offset", self.glu_linear_offset != 0, "0.0"),
        )
        fused = [s.name for s in ACTIVATIONS.values() if s.fused is not None]
        fused_names = " or ".join(repr(n) for n in fused)
        uses_fused = act.fused is not None and (
            self.bias_activation_fusion or self.use_transformer_engine_op_fuser
        )
        for name, is_set, default in glu_only:
            if is_set and not act.gated:
                problems.append(
                    f"{name}={getattr(self, name)!r} only applies to a gated activation (got "
                    f"activation={act.name!r}); set {name}={default} or a gated activation"
                )
            elif is_set and uses_fused and not act.fused_clamp:
                problems.append(
                    f"{name}={getattr(self, name)!r}: the fused {act.name!r} kernel has no clamp "
                    "or offset (as Megatron's); set bias_activation_fusion=False (and "
                    f"use_transformer_engine_op_fuser=False) or {name}={default}"
                )
        if self.activation_func_fp8_input_store and not (
            (self.bias_activation_fusion or self.use_transformer_engine_op_fuser)
            and act.fused is not None
        ):
            problems.append(
                "activation_func_fp8_input_store=True needs the fused kernels: "
                f"bias_activation_fusion=True with activation {fused_names} (got "
                f"bias_activation_fusion={self.bias_activation_fusion}, activation={act.name!r})"
            )
        if self.use_transformer_engine_op_fuser and act.fused is None:
            problems.append(
                f"use_transformer_engine_op_fuser=True fuses an activation with a fused kernel "
                f"({fused_names}); got activation={act.name!r}: use the non-op-fuser path for it"
            )
        if self.use_fused_weighted_squared_relu and act.name != Activation.SQUARED_RELU.value:
            problems.append(
                "use_fused_weighted_squared_relu=True needs activation='squared_relu' (got "
                f"activation={act.name!r}); set use_fused_weighted_squared_relu=False"
            )
        if act.gated != self.gated_linear_unit:
            kind = "gated" if act.gated else "not gated"
            gated = ", ".join(repr(s.name) for s in ACTIVATIONS.values() if s.gated)
            problems.append(
                f"activation={act.name!r} is {kind} but gated_linear_unit="
                f"{self.gated_linear_unit}; set gated_linear_unit={act.gated} (gated: {gated})"
            )

    def _check_recompute_and_offload(self, problems: list[str]) -> None:
        if self.recompute_modules and self.recompute_granularity != "selective":
            problems.append(
                f"recompute_modules={list(self.recompute_modules)!r} is only honoured with "
                f"recompute_granularity='selective' (got {self.recompute_granularity!r}); "
                "set recompute_granularity='selective' or recompute_modules=[]"
            )
        if not self.moe_paged_stash:
            return
        if self.cpu_offloading:
            problems.append(
                "moe_paged_stash=True is incompatible with cpu_offloading=True (both would own "
                "the expert activations); set cpu_offloading=False or moe_paged_stash=False"
            )
        offload = self.offload_modules
        offload = (offload,) if isinstance(offload, str) else offload
        clash = [m for m in offload if m in PAGED_STASH_FORBIDDEN_OFFLOAD_MODULES]
        if clash:
            problems.append(
                f"moe_paged_stash=True is incompatible with offload_modules containing {clash!r} "
                f"(forbidden: {', '.join(PAGED_STASH_FORBIDDEN_OFFLOAD_MODULES)}); remove them "
                "from offload_modules or set moe_paged_stash=False"
            )

    @property
    def _paged_stash_non_op_fuser(self) -> bool:
        return self.moe_paged_stash and not self.use_transformer_engine_op_fuser

    def _check_paged_stash(self, problems: list[str]) -> None:
        if not self.moe_paged_stash:
            return
        if self.moe_expert_rank_capacity_factor is None:
            problems.append(
                "moe_paged_stash=True requires moe_expert_rank_capacity_factor (got None), the "
                "static per-rank budget; set it, e.g. moe_expert_rank_capacity_factor=1.5"
            )
        if not self._paged_stash_non_op_fuser:
            return
        # The non-op-fuser path relies on the device-initiated GroupedLinear marking its own
        # saved input; the activations mark theirs (fused or not, every activation).
        interleave = self.moe_mlp_glu_interleave_size
        requirements: tuple[tuple[bool, str, str], ...] = (
            (
                not self.moe_use_grouped_tensor,
                "moe_use_grouped_tensor=True (device-initiated GroupedLinear)",
                "set moe_use_grouped_tensor=True",
            ),
            (
                interleave is not None,
                f"no GLU interleaving, got moe_mlp_glu_interleave_size={interleave!r}",
                "set moe_mlp_glu_interleave_size=None",
            ),
        )
        for violated, requirement, fix in requirements:
            if violated:
                problems.append(
                    "moe_paged_stash=True with use_transformer_engine_op_fuser=False requires "
                    f"{requirement}; {fix} or set use_transformer_engine_op_fuser=True"
                )
