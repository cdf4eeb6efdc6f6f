"""What a batch of expert reads costs, as a line: seconds = fixed + experts x per_expert. Five running sums
of the synchronous store's batches (a layer's misses each) let a benchmark fit it by least squares over any
span of a run (the sums at its end less those at its start). Knows numbers, not disks or experts."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class ReadBatchFit:
    batches: int = 0
    experts: int = 0  # x summed
    experts_sq: int = 0  # x^2 summed
    seconds: float = 0.0  # y summed
    expert_seconds: float = 0.0  # x * y summed

    def add(self, experts: int, seconds: float) -> None:
        self.batches += 1
        self.experts += experts
        self.experts_sq += experts * experts
        self.seconds += seconds
        self.expert_seconds += experts * seconds

    def since(self, start: "ReadBatchFit") -> "ReadBatchFit":
        """The sums of the batches after `start` (an earlier copy of these sums)."""
        return ReadBatchFit(*(getattr(self, f.name) - getattr(start, f.name) for f in fields(self)))

    def plus(self, other: "ReadBatchFit") -> "ReadBatchFit":
        return ReadBatchFit(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per expert) by least squares over batches of two sizes or more, keeping their total
        time (None without, or with no positive per-expert time); a negative fixed part: none, the mean per expert."""
        n, spread = self.batches, self.batches * self.experts_sq - self.experts ** 2
        if n < 2 or spread <= 0:
            return None
        per_expert = (n * self.expert_seconds - self.experts * self.seconds) / spread
        fixed = (self.seconds - per_expert * self.experts) / n
        if fixed < 0:
            fixed, per_expert = 0.0, self.seconds / self.experts
        return (fixed, per_expert) if per_expert > 0 else None
