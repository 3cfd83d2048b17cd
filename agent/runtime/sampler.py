"""Which dataset samples each rank takes at each iteration.

The unit of sampling is the *global* batch, never the local one. Every epoch has one seeded
permutation of the dataset indices, shared by all ranks (each rank computes it from the same seed).
Global batch ``k`` of the epoch is ``perm[k*B:(k+1)*B]``. Under the plan in force at that iteration,
rank ``r`` takes the contiguous slice that starts at ``sum(b_j for j < r)`` and has length ``b_r``.

Because a plan only decides how one global batch is *split*, changing plans between iterations
never skips or repeats a sample: each epoch consumes every index exactly once, whatever sequence of
plans was used. When ``N % B != 0`` the last global batch of an epoch has ``N % B`` samples; it is
split in proportion to the plan with largest-remainder rounding (:func:`split_count`), so it is
still consumed exactly once, and the gradient is scaled by the actual global count
(:meth:`GlobalBatchSampler.global_count`). With ``drop_last`` (a DataLoader's), an epoch has
``N // B`` full global batches and the ``N % B`` samples left are not used in that epoch.

A stream (an ``IterableDataset``) has no permutation: :class:`StreamSampler` numbers its samples
in the order they come, global batch ``i`` is positions ``[i*B, (i+1)*B)``, and each rank takes
its contiguous slice of them in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def split_count(batch_sizes: Sequence[int], count: int) -> list[int]:
    """Split ``count`` samples across ranks in proportion to ``batch_sizes``.

    Largest-remainder (Hamilton) rounding: every rank gets ``floor(count * b_r / B)``, and the
    samples left over go one each to the ranks with the largest fractional parts, ties to the lower
    rank. The result sums to ``count`` exactly, is deterministic (all ranks compute the same split),
    gives nothing to a rank whose planned size is 0, and never exceeds a rank's planned size. With
    ``count == sum(batch_sizes)`` it returns the plan unchanged.
    """
    total = sum(batch_sizes)
    if total <= 0:
        raise ValueError("batch_sizes must sum to a positive number")
    if any(b < 0 for b in batch_sizes):
        raise ValueError("batch_sizes must be non-negative")
    if not 0 <= count <= total:
        raise ValueError(f"count {count} outside [0, {total}]")
    # Exact integer arithmetic: floor and remainder of count * b / total.
    quotients = [count * b // total for b in batch_sizes]
    remainders = [count * b % total for b in batch_sizes]
    left = count - sum(quotients)
    order = sorted(range(len(batch_sizes)), key=lambda r: (-remainders[r], r))
    for r in order[:left]:
        quotients[r] += 1
    return quotients


def offsets(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: the start of each rank's slice in the global batch."""
    out = []
    acc = 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


@dataclass
class GlobalBatchSampler:
    """Seeded per-epoch permutation, cut into global batches, split by the plan in force.

    ``dataset_size`` is N, ``global_batch`` is B. Iterations are numbered from 0 across epochs:
    iteration ``i`` is global batch ``i % batches_per_epoch`` of epoch ``i // batches_per_epoch``.
    """

    dataset_size: int
    global_batch: int
    seed: int = 0
    drop_last: bool = False
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    """The last two epochs' permutations (loading ahead reads the next epoch's early)."""

    def __post_init__(self) -> None:
        if self.dataset_size < 1:
            raise ValueError("dataset_size must be at least 1")
        if self.global_batch < 1:
            raise ValueError("global_batch must be at least 1")
        if self.drop_last and self.dataset_size < self.global_batch:
            raise ValueError(
                f"drop_last with {self.dataset_size} samples leaves no global batch of "
                f"{self.global_batch}"
            )

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch, the last one partial when ``N % B != 0`` (and dropped
        with ``drop_last``)."""
        if self.drop_last:
            return self.dataset_size // self.global_batch
        return -(-self.dataset_size // self.global_batch)

    def describe(self) -> dict[str, int | bool]:
        """What a checkpoint must agree with to resume this sampler's order exactly."""
        return {
            "dataset_size": self.dataset_size,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def position(self, iteration: int) -> tuple[int, int]:
        """(epoch, global batch index within the epoch) of an iteration."""
        return divmod(iteration, self.batches_per_epoch)

    def global_count(self, iteration: int) -> int:
        """Samples in the global batch of this iteration: B, or fewer for an epoch's last one."""
        _, k = self.position(iteration)
        return min(self.global_batch, self.dataset_size - k * self.global_batch)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of ``range(N)``; identical on every rank for the same seed."""
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator()
            # Distinct, reproducible stream per (seed, epoch).
            g.manual_seed((self.seed * 1_000_003 + epoch) % (2**63 - 1))
            perm = self._perms[epoch] = torch.randperm(self.dataset_size, generator=g)
            for old in sorted(self._perms)[:-2]:
                del self._perms[old]
        return perm

    def local_sizes(self, iteration: int, batch_sizes: Sequence[int]) -> list[int]:
        """Per-rank sample counts for this iteration under a plan summing to B."""
        if sum(batch_sizes) != self.global_batch:
            raise ValueError(
                f"plan sums to {sum(batch_sizes)}, global batch is {self.global_batch}"
            )
        count = self.global_count(iteration)
        if count == self.global_batch:
            return list(batch_sizes)
        return split_count(batch_sizes, count)

    def local_indices(self, iteration: int, batch_sizes: Sequence[int], rank: int) -> torch.Tensor:
        """Dataset indices rank ``rank`` trains on at this iteration (possibly empty)."""
        epoch, k = self.position(iteration)
        sizes = self.local_sizes(iteration, batch_sizes)
        start = k * self.global_batch + offsets(sizes)[rank]
        return self.permutation(epoch)[start : start + sizes[rank]]


@dataclass
class StreamSampler:
    """Positions in a stream: global batch ``i`` is ``[i*B, (i+1)*B)``, split by the plan."""

    global_batch: int
    dataset_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError("global_batch must be at least 1")

    def position(self, iteration: int) -> tuple[int, int]:
        """(epoch, batch): a stream is one epoch."""
        return 0, iteration

    def global_count(self, iteration: int) -> int:
        return self.global_batch

    def local_sizes(self, iteration: int, batch_sizes: Sequence[int]) -> list[int]:
        if sum(batch_sizes) != self.global_batch:
            raise ValueError(
                f"plan sums to {sum(batch_sizes)}, global batch is {self.global_batch}"
            )
        return list(batch_sizes)

    def local_indices(self, iteration: int, batch_sizes: Sequence[int], rank: int) -> torch.Tensor:
        """Stream positions rank ``rank`` trains on at this iteration (possibly none)."""
        sizes = self.local_sizes(iteration, batch_sizes)
        start = iteration * self.global_batch + offsets(sizes)[rank]
        return torch.arange(start, start + sizes[rank])

    def permutation(self, epoch: int) -> torch.Tensor:
        """The stream's order is its own (what a probe starts from)."""
        return torch.arange(self.global_batch)

    def describe(self) -> dict[str, int | bool]:
        return {"stream": True, "global_batch": self.global_batch}


Sampler = GlobalBatchSampler | StreamSampler
