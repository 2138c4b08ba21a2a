"""The runner's one collective per step: every rank's flags and figures in one slot of a
fixed-length device vector, gathered by one ``all_reduce(SUM)`` and one host read.

Slot layout (:data:`_SLOT` entries): ``[step, stage, invalid, overflow, overbudget, spill,
peak_tokens, peak_pair_tokens, max_microbatch_tokens, peak_pair_share, varied, peak_share]``,
then per pool key ``(key code, pages,
high-water pages, demanded pages, balanced pages)``, zero-padded to :data:`_MAX_KEYS` keys,
so ranks whose pipeline stages hold different pools reduce vectors of one length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from te_paged.kernels.layout import Flag, State
from te_paged.runtime.records import InvalidCountsError, StepDesyncError
from te_paged.stash import StashKey
from te_paged.stash.buffer import MAX_KEYS, key_code, key_from_code

_FLAGS = 3  # per rank: stash overflow, over budget, host spill
_HEAD = 12  # per rank: step, stage, invalid, the _FLAGS flags, peak tokens, peak pair tokens,
# the largest microbatch (tokens per rank), the peak pair share, whether a dispatch's token count
# differed from what its static sizes were for (the shares then size the budgets), the peak
# receive share
_MAX_KEYS = MAX_KEYS  # pool keys (dtype, row width) a rank may hold: the reduction's fixed room
_PER_KEY = 5  # per pool key: code, pages, high-water pages, demanded pages, balanced pages
_SLOT = _HEAD + _PER_KEY * _MAX_KEYS  # one rank's entries in the per-step reduction


class _PoolFigures(NamedTuple):
    """One pool key's figures of one rank's step, from the per-step reduction."""

    pages: int  # the pool's device pages
    high_water: int  # pages in use at the peak (State.HWM)
    demand: int  # pages needed at the peak, stored or not (State.DEMAND_HWM)
    balanced: int  # the capture step's balanced-case peak pages


class _RankStats(NamedTuple):
    stage: int
    peak_tokens: int
    peak_pair_tokens: int
    pools: dict[StashKey, _PoolFigures]
    max_tokens: int = 0  # the rank's largest microbatch of the step, tokens per rank
    pair_share: int = 0  # peak pair demand over the balanced pair count, in SHARE_ONE units
    varied: int = 0  # 1: a dispatch's token count was not the one its static sizes were for
    share: int = 0  # peak rows at this rank over the balanced count, in SHARE_ONE units

    def demand(self) -> dict[StashKey, int]:
        """The pages each pool key's step needed at its peak."""
        return {k: f.demand for k, f in self.pools.items()}


class StepReduction:
    """Part of :class:`~te_paged.runtime.PagedStashRunner` (mixed into it; uses its
    attributes): see the module docstring."""

    def _world(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def microbatch_tokens(self) -> list[int]:
        """This rank's microbatches so far in the step, tokens per rank each: the forward
        dispatches of its first dispatcher (the first MoE layer: one per microbatch; host ints,
        no read)."""
        return list(getattr(self.dispatchers[0], "step_num_tokens", ())) if self.dispatchers else []

    def _local_stats(self, device: torch.device) -> torch.Tensor:
        """This rank's slot, a device vector of :data:`_SLOT` entries whatever pools the rank
        holds: [step, stage, invalid, overflow, overbudget, spill, peak_tokens, peak_pair],
        then :data:`_MAX_KEYS` pairs (key code, high-water pages), zero-padded. Ranks whose
        pipeline stages hold different pool keys (an FP8 layer on one stage only, say) reduce
        vectors of one length; the key codes say which pool each high-water mark is of."""
        zero = torch.zeros((), dtype=torch.int64, device=device)
        overflow = spill = invalid = zero
        hwm: dict[StashKey, torch.Tensor] = {}  # (HWM, DEMAND_HWM) per key, on the device
        const: dict[StashKey, tuple[int, int]] = {}  # (pages, balanced pages): host constants
        keys = list(dict.fromkeys(k for m in self.managers for k in m.buffers))
        if len(keys) > _MAX_KEYS:
            raise ValueError(
                f"this rank holds {len(keys)} paged-stash pools ({', '.join(map(str, keys))}); "
                f"the runner's per-step reduction has room for {_MAX_KEYS} (one pool per "
                "dtype and row width)"
            )
        for manager in self.managers:
            manager.join_side_streams()  # the flags and pool states are the side streams' too
            overflow = overflow + (manager.flags[Flag.OVERFLOW] > 0).long()
            spill = spill + (manager.flags[Flag.HOST_SPILL] > 0).long()
            invalid = invalid + (manager.flags[Flag.INVALID] > 0).long()
            for key, buf in manager.buffers.items():
                # Basic indexing: a list index would copy the index to the device first.
                h = torch.stack([buf.state[State.HWM], buf.state[State.DEMAND_HWM]]).to(device)
                hwm[key] = torch.maximum(hwm[key], h) if key in hwm else h
                figures = (buf.num_pages, manager.sizing_peaks(key)[0])
                const[key] = max(const.get(key, (0, 0)), figures)
        over = peak = peak_pair = share = recv_share = zero
        for d in self.dispatchers:
            over = over + (d.over_budget > 0).long().to(device)
            invalid = invalid + (d.invalid_indices > 0).long().to(device)
            peak = torch.maximum(peak, d.peak_tokens.to(device).long())
            peak_pair = torch.maximum(peak_pair, d.peak_pair_tokens.to(device).long())
            if hasattr(d, "peak_pair_share"):
                share = torch.maximum(share, d.peak_pair_share.to(device).long())
                recv_share = torch.maximum(recv_share, d.peak_share.to(device).long())
        for flag in self.participants.invalid_flags:
            invalid = invalid + (flag > 0).long().to(device)
        flags = [(overflow > 0).long(), (over > 0).long(), (spill > 0).long()]
        varied = any(
            n != d.last_num_tokens
            for d in self.dispatchers
            for n in getattr(d, "step_num_tokens", ())
        )
        head = [self.step_index, self.stage, max(self.microbatch_tokens(), default=0), int(varied)]
        step = torch.tensor(head, dtype=torch.int64, device=device)  # one host-to-device copy
        mine = [step[:2], (invalid > 0).long().reshape(1), *(f.reshape(1) for f in flags)]
        mine += [peak.reshape(1), peak_pair.reshape(1), step[2:3], share.reshape(1), step[3:],
                 recv_share.reshape(1)]  # fmt: skip
        if hwm:  # (code, pages, hwm, demand, balanced): one host-to-device copy, no read
            host = [(key_code(k), *const[k]) for k in hwm]
            host = torch.tensor(host, dtype=torch.int64, device=device)
            per_key = torch.cat([host[:, :2], torch.stack(list(hwm.values())), host[:, 2:]], 1)
            mine.append(per_key.reshape(-1))
        out = torch.cat(mine)
        return torch.cat([out, out.new_zeros(_SLOT - out.numel())])

    def _reduce(self) -> tuple[list[list[int]], list[_RankStats]]:
        """One ``all_reduce(SUM)`` over one slot per rank (zero elsewhere, so the sum is a
        gather) with its step index, pipeline stage, flags and statistics. Returns, per flag
        [overflow, overbudget, spill], the ranks that raised it; and each rank's statistics
        ``(stage, peak, pair, {pool key: high-water pages})``."""
        local = self._local_stats(self._device())
        per_rank = self._gather_rows(local, "the flags")
        rank = self._world()[0]
        self._check_step_indices([r[0] for r in per_rank], rank)
        invalid = [r for r, row in enumerate(per_rank) if row[2]]
        if invalid:
            here = self._invalid_here() if rank in invalid else ""
            raise InvalidCountsError(
                f"rank {rank}: rank(s) {invalid} saw token counts that cannot be right "
                "(tokens_per_expert negative or summing past the expert buffer, an expert id "
                "out of range, or a stash record popped twice): the step's result is wrong and "
                f"a rerun would repeat it{here}. Check what the dispatcher hands the experts"
            )
        flag_ranks = [[r for r, row in enumerate(per_rank) if row[3 + f]] for f in range(_FLAGS)]
        stats = []
        for row in per_rank:
            keys = [row[i : i + _PER_KEY] for i in range(_HEAD, _SLOT, _PER_KEY)]
            pools = {key_from_code(k[0]): _PoolFigures(*k[1:]) for k in keys if k[0]}
            stats.append(
                _RankStats(
                    row[1], row[3 + _FLAGS], row[4 + _FLAGS], pools, *row[5 + _FLAGS : _HEAD]
                )
            )
        return flag_ranks, stats

    def _gather_rows(self, local: torch.Tensor, what: str) -> list[list[int]]:
        """``local`` (an int64 vector, as long on every rank) of every rank of the runner's
        group, read on the host: one ``all_reduce(SUM)`` over one slot per rank (zero
        elsewhere, so the sum is a gather), waited on for at most ``timeout``."""
        rank, world = self._world()
        n = local.numel()
        vec = torch.zeros(world * n, dtype=torch.int64, device=local.device)
        vec[rank * n : (rank + 1) * n] = local
        if world > 1:
            if local.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
                raise RuntimeError("the NCCL group needs the manager on a CUDA device")
            work = dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            try:
                work.wait(self.timeout) if self.timeout is not None else work.wait()
            except RuntimeError as e:
                raise StepDesyncError(
                    f"rank {rank}: {what} of step {self.step_index} were not reduced within "
                    f"{self.timeout}: a rank stopped, died or skipped the step ({e})"
                ) from e
        values = vec.tolist()  # one device -> host read
        return [values[r * n : (r + 1) * n] for r in range(world)]

    def _invalid_here(self) -> str:
        """What this rank saw, for the error (host reads: the error path only)."""
        seen = []
        for manager in self.managers:
            for layer, n, max_tokens in manager.invalid_counts():
                where = "a layer" if layer is None else f"layer {layer}"
                seen.append(f"{where}: num_tokens {n} for a buffer of {max_tokens} tokens")
        for d in self.dispatchers:
            if int(d.invalid_indices) > 0:
                seen.append(f"{int(d.invalid_indices)} expert id(s) out of range")
        reported = sum(int(flag) for flag in self.participants.invalid_flags)
        if reported:
            seen.append(f"{reported} invalid count(s) reported by the layers' grouped GEMMs")
        if any(int(m.flags[Flag.INVALID]) > 0 for m in self.managers) and not seen:
            seen.append("a stash record popped twice")
        return f"; on this rank: {'; '.join(seen)}" if seen else ""

    def _check_step_indices(self, steps: list[int], rank: int) -> None:
        if len(set(steps)) <= 1:
            return
        by_step: dict[int, list[int]] = {}
        for r, s in enumerate(steps):
            by_step.setdefault(s, []).append(r)
        where = "; ".join(f"rank(s) {ranks} at step {s}" for s, ranks in sorted(by_step.items()))
        raise StepDesyncError(
            f"rank {rank}: the ranks reduced the flags of different steps ({where}): a rank "
            "skipped or repeated a step, so its collectives were paired with another step's. "
            "Every rank must call the runner once per step."
        )
