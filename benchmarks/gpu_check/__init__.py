"""Checks that need a CUDA GPU; run through ``bash scripts/gpu_check.sh`` (``python -m
benchmarks.gpu_check``), bounded to 8 minutes on one H200.

The bound is the run's budget, not a measurement: checks not started within ``--budget-s`` (450 s)
are N/A and ``scripts/gpu_check.sh`` kills the run at 480 s. The whole set has not been timed on
a GPU since check 10 grew to five widths and check 13 was added (the last GPU run, 2026-12-04,
ran checks 1-11 in 188 s: benchmarks/results/gpu-2026-12-04.md).

Writes a Markdown report (``benchmarks/results/gpu-<date>.md``): the command, the machine, one
row per check (target, result, figures, seconds), then each check's full tables. One module per
check (``check_NN_*.py``: its ``NAME``, ``TARGET`` and ``run()``); ``common`` holds what they
share (settings, outcomes, timing, bitwise comparison), ``stack`` and ``deepseek`` the models,
``runner`` the runner and the report.

1. the Triton kernels vs the torch reference, compiled (``TRITON_INTERPRET=0``): the kernel unit
   tests, and one stash and pop per element type at model sizes (bf16, fp16, fp32, FP8 e4m3 and
   e5m2, the MXFP8 scale pool) on fresh, 1F1B and alternating free lists and a host-tier spill;
2. paged stash ON vs OFF (and op-fuser vs unfused) on CUDA, bf16 and MXFP8, ``TEGroupedMLP``
   and ``MoELayer`` (1 rank), bitwise;
3. ``torch.cuda.set_sync_debug_mode("error")`` around the captured step of ``TEGroupedMLP``
   and ``MoELayer`` (1 rank);
4. CUDA-graph capture and replay of ``TEGroupedMLP``'s captured step, bitwise against eager;
5. the same for ``MoELayer`` (1 rank);
6. stash+pop bandwidth vs a device-to-device copy of the same bytes (``stash_report``):
   >= 0.85 of a plain copy from 268 MB moved, >= 0.70 at 134 MB, every free list;
7. step time ON/OFF with and without stream overlap, DeepSeek-like expert layers (<= 1.02 with
   overlap), with a per-kernel profile that attributes ON − OFF to te_paged's stash and pop
   kernels, the other kernels and the device's idle time;
8. peak allocated memory ON/OFF (the CUDA allocator's statistics) vs the capacity model;
9. ``te-paged ab --device cuda`` with one rank, default and op-fuser + recompute paths;
10. Megatron-core 0.19.2's stash copy and pop kernels vs te_paged's Triton kernels at every width
    a DeepSeek-V3 expert layer stashes (7168, 4096, 2048 in bf16; 7168 and 2048 in MXFP8, e4m3
    data with its e8m0 scales): the time ratio, <= 1.0 at every width, size and free list, with
    both sides' registers and occupancy beside it (N/A without megatron-core 0.19.2);
11. te_paged's experts behind Megatron's HybridEP dispatcher with the real ``deep_ep`` (N/A
    where HybridEP or megatron-core does not import);
12. Transformer Engine 2.19's ``GroupedLinear`` cases ported to CPU in tests/unit/grouped, run
    on CUDA bf16 (host ``m_splits`` with a CUDA input, layouts, ``save_original_input``,
    prequantized MXFP8);
13. ``te-paged ab``'s default model with every MoE block compiled (Inductor, and
    ``reduce-overhead``: CUDA graphs): ON vs OFF bitwise, te_paged's stash kernels in the
    compiled step's profile, step time ON/OFF compiled beside eager;
14. Megatron-Bridge's ``pretrain()`` with Transformer Engine's layers and te_paged's MoE layers,
    eager and under the full-iteration CUDA graphs Bridge's perf recipes use: ON vs OFF bitwise
    (N/A without CUDA, megatron-bridge or Transformer Engine).

Each check runs in its own process (a CUDA error cannot poison the next one; ``--in-process``
for debugging), as do the cases of checks 4 and 5 on CUDA; each reports PASS (its target met),
MISS (it ran; a figure missed its target), FAIL (an error) or N/A (it cannot run here, or a
feature it measures is not there yet). Every check runs whatever the others did; once
``--budget-s`` is spent the rest are N/A, and the report is rewritten after each check, so a
run cut short still leaves its figures. ``--cpu-dry-run`` runs everything that can at toy sizes
on the CPU (torch backend; the Triton kernels interpreted) to test the checks without a GPU;
N/A there: checks 3, 4 and 5 (CUDA only), 7's target (stream overlap needs CUDA; its figures
are measured), 11 (without ``deep_ep``), 14 (CUDA only). ``--cpu-dry-run --smoke`` runs each
check's smallest case: tests/benchmarks/test_gpu_check.py runs every check so, in one process.
"""
