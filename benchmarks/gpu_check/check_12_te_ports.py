"""Check 12: Transformer Engine 2.19's ``GroupedLinear`` cases, ported to CPU in
tests/unit/grouped, on CUDA bf16."""

from __future__ import annotations

import itertools

import torch

from .common import RUN, TargetMissed, all_same, need_cuda, run_cases

NAME = "Transformer Engine 2.19's GroupedLinear cases on CUDA bf16 (the CPU ports' hardware half)"
TARGET = (
    "host m_splits refused with a CUDA input; every port bitwise, or within TE's tolerance "
    "(rtol 1e-2, atol 5e-3) where CUDA sums the bias gradient as a GEMM"
)


def run() -> str:
    """The CUDA side of the ports in tests/unit/grouped (docs/dev/te-2.20-grouped-linear-
    survey.md, step 7): TGL:1701's CPU-tensor m_splits with a CUDA input, and the equivalences
    of TGL:1730 (single vs discrete weight), TGL:2138 (parameter layouts vs the host path),
    TGL:2251 (save_original_input) and TGM:676/746 (prequantized MXFP8 input and gradient)."""
    from te_paged.grouped import GroupedLinear, GroupedTensor, dequantize, quantize

    dev = RUN.device
    bf16, E, F_ = torch.bfloat16, 3, 256
    # A smoke run: each port with the unquantised path and MXFP8 only.
    recipes = (None, "mxfp8") if RUN.smoke else (None, "tensorwise", "mxfp8", "nvfp4")
    splits = [64, 0, 192]  # multiples of 32 (MXFP8) with an empty group; 256 rows of 320
    rows = 320

    def layer(**kw):
        torch.manual_seed(0)
        return GroupedLinear(E, F_, F_, params_dtype=bf16, device=dev, **kw)

    def data(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.rand(rows, F_, device=dev, generator=g, dtype=bf16) - 0.5

    def train(mod, x, m_splits, dy):
        mod.zero_grad(set_to_none=True)
        x = x.detach().clone().requires_grad_()
        if m_splits is None:  # the wire: x with its rowwise MXFP8 copy
            wire = quantize(x.detach(), "mxfp8", rowwise=True)
            y = mod(GroupedTensor.from_splits(x, torch.tensor(splits, device=dev), fp8=wire))
        else:
            y = mod(x, m_splits)
        y.backward(dy)
        grads = []  # per expert, weights then biases, whatever the layout
        for params, grouped_dim in ((mod.weight_params(), 3), (mod.bias_params(), 2)):
            for p in params:
                grads += list(p.grad.unbind(0)) if p.grad.dim() == grouped_dim else [p.grad]
        return [y.detach(), x.grad, *grads]

    def compare(a, b, tolerant=False):
        if all_same(a, b):
            return "bitwise"
        for u, v in zip(a, b):
            torch.testing.assert_close(u.float(), v.float(), rtol=1e-2, atol=5e-3)
        if not tolerant:
            raise TargetMissed("not bitwise")
        return "within TE's tolerance"

    dev_splits = torch.tensor(splits, device=dev)
    x, dy = data(1), data(2)

    def host_splits() -> str:
        need_cuda("a CPU m_splits tensor with a CUDA input")
        mod = layer(single_grouped_weight=True, use_grouped_tensor=True)
        for host in (splits, torch.tensor(splits)):
            try:
                mod(x, host)
            except ValueError as e:
                if "requires" not in str(e) or "CUDA" not in str(e):
                    raise AssertionError(f"wrong message: {e}") from e
            else:
                raise AssertionError(f"host m_splits {type(host).__name__} were accepted")
        return "ValueError for a list and a CPU tensor"

    def single_vs_discrete() -> str:
        out = []
        for recipe in recipes:
            a, b = layer(fp8_recipe=recipe), layer(fp8_recipe=recipe, single_grouped_weight=True)
            b.load_state_dict(a.state_dict())
            got = compare(train(a, x, dev_splits, dy), train(b, x, dev_splits, dy))
            out.append(f"{recipe}: {got}")
        return ", ".join(out)

    def layouts() -> str:
        out = []
        for single_w, single_b in itertools.product((False, True), repeat=2):
            for recipe in (None, "mxfp8"):
                kw = {"bias": True, "fp8_recipe": recipe}
                host = layer(**kw, use_grouped_tensor=False)
                grouped = layer(**kw, single_grouped_weight=single_w, single_grouped_bias=single_b)
                grouped.load_state_dict(host.state_dict())
                got = compare(train(host, x, splits, dy), train(grouped, x, dev_splits, dy), True)
                out.append(f"w{int(single_w)}b{int(single_b)} {recipe}: {got}")
        return ", ".join(out)

    def save_original() -> str:
        out = []
        for recipe in recipes:
            a = layer(fp8_recipe=recipe, single_grouped_weight=True, bias=True)
            b = layer(fp8_recipe=recipe, single_grouped_weight=True, bias=True,
                      save_original_input=True)  # fmt: skip
            b.load_state_dict(a.state_dict())
            got = compare(train(a, x, dev_splits, dy), train(b, x, dev_splits, dy))
            out.append(f"{recipe}: {got}")
        return ", ".join(out)

    def prequantized() -> str:
        mod = layer(fp8_recipe="mxfp8", bias=True)
        x_wire = dequantize(quantize(x, "mxfp8", rowwise=True))
        dy_wire = dequantize(quantize(dy, "mxfp8", rowwise=True))
        ref = train(mod, x_wire, dev_splits, dy_wire)
        got = train(mod, x_wire, None, dy_wire)  # the GroupedTensor with the wire's fp8 copy
        return f"input and gradient: {compare(ref, got)}"

    cases = {"TGL:1701 CPU-tensor m_splits": host_splits, "TGL:1730": single_vs_discrete,
             "TGL:2138": layouts, "TGL:2251": save_original,
             "TGM:676/746": prequantized}  # fmt: skip
    return run_cases(cases)
