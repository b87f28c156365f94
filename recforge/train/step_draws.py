"""Random inputs of a step (a retrieval batch's sampled negatives) drawn before the step, so a pipeline can
draw them and look them up a step ahead (``recforge.train.pipeline_step``).

A recipe gives ``StepRunner`` a ``draw(batch, seed)``; the runner hands the draws to the loss next to the
batch. Each micro-batch's seed is a hash of (the step's seed, how many steps in a row ran on that seed,
the micro-batch's index):

- the step's seed is ``torch.initial_seed()`` when the step starts: the training loop re-seeds the
  default generator from (``train.seed``, global step) before every step, so the draws are part of the
  run's RNG state and a resumed run draws exactly what an uninterrupted one would, with nothing to save;
- a caller that never re-seeds (a test, a benchmark) still gets new draws each step (the repeat count).

A pipelined step draws its next step's first micro-batch during this step, under the seed that step
will have (the seed's last change repeated: +1 per step under the loop); if the next step then finds
another seed, or another batch, it draws again and the pipeline's staged lookups go unused. So the
draws, and the training, are the same with the pipeline on or off.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

DrawFn = Callable[[Any, int], Any]  # (device batch, seed) -> the batch's draws (e.g. losses.SampledNegatives)


def micro_seed(step_seed: int, repeat: int, micro: int) -> int:
    """The draws' seed of micro-batch ``micro`` of a step with seed ``step_seed`` (its ``repeat``-th in a row)."""
    digest = hashlib.blake2b(f"draws:{step_seed}:{repeat}:{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def rank_seed(seed: int, rank: int) -> int:
    """``seed`` made rank ``rank``'s own (draws that must differ per rank, e.g. per-position negatives)."""
    digest = hashlib.blake2b(f"rank:{seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class StepDraws:
    """Each micro-batch's draws, made at its step or (the first micro-batch) a step ahead.

    Args:
        draw: ``(batch, seed) -> draws``; deterministic given the seed (it makes its own generator).
    """

    def __init__(self, draw: DrawFn) -> None:
        self.draw = draw
        self.seed: int | None = None  # this step's seed
        self.repeat = 0  # steps in a row that ran on ``seed`` before this one
        self.delta: int | None = None  # the seed's last change between two steps
        self._ahead: tuple[Any, int, Any] | None = None  # (batch, seed, draws) drawn for the next step
        self.reused = 0  # draws made a step ahead and used (for logs and tests)

    def begin_step(self) -> None:
        """A step that trains starts: read its seed (the loop's per-step seed)."""
        seed = torch.initial_seed()
        if self.seed is not None:
            self.delta = seed - self.seed
        self.repeat = self.repeat + 1 if seed == self.seed else 0
        self.seed = seed

    def _next_seed(self) -> int:
        """The seed the next step will most likely draw under: this one's last change repeated."""
        if self.delta == 0:
            return micro_seed(self.seed, self.repeat + 1, 0)
        return micro_seed(self.seed + (1 if self.delta is None else self.delta), 0, 0)

    def __call__(self, batch: Any, micro: int) -> Any:
        """The draws of micro-batch ``micro`` of this step: those made ahead if they were for this batch and seed."""
        seed = micro_seed(self.seed, self.repeat, micro)
        if micro == 0 and self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            if ahead[0] is batch and ahead[1] == seed:
                self.reused += 1
                return ahead[2]
        return self.draw(batch, seed)

    def ahead(self, batch: Any) -> Callable[[], Any]:
        """What draws the next step's first micro-batch ``batch`` (run by the pipeline's worker); ``keep`` its result."""
        seed = self._next_seed()
        return lambda: (batch, seed, self.draw(batch, seed))

    def keep(self, drawn: tuple[Any, int, Any] | None) -> None:
        """Hold what ``ahead``'s function returned until the next step (None: forget)."""
        self._ahead = drawn
