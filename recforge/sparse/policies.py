"""Admission and eviction policies of a dynamic table, as vectorised functions of per-row counters.

Admission decides, for a batch of unique IDs not yet in the table, which get a row:

    always        every ID on first sight
    count         an ID seen ``threshold`` times (counted across batches in a candidate table)
    probability   each occurrence admits with ``probability`` (n occurrences: 1 - (1 - p)**n)
    show_click    show_weight * shows + click_weight * clicks >= threshold, from ``record_feedback``

Eviction scores live rows (lower = evicted first). A scheduled pass (every ``every_steps``)
evicts the rows whose score is below the policy's threshold; capacity pressure evicts the
lowest-scored rows, as many as the batch needs, never a row used in the current step.

    lru           score = last step seen;         scheduled: unseen for more than ttl_steps
    lfu           score = occurrences;             scheduled: fewer than min_count
    ttl           score = last step (or second) seen; scheduled: older than ttl_steps / ttl_seconds
    l2            score = row L2 norm;             scheduled: norm below l2_threshold
    time_freq     score = count * decay ** age;   scheduled: score below min_score
    show_click    score = show_weight * shows + click_weight * clicks; scheduled: below min_score
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ADMISSIONS = ("always", "count", "probability", "show_click")
EVICTIONS = ("none", "lru", "lfu", "ttl", "l2", "time_freq", "show_click")


@dataclass
class AdmissionConfig:
    """Which unseen IDs get a row."""

    kind: str = "always"  # always | count | probability | show_click
    threshold: float = 1.0  # count: occurrences needed; show_click: score needed
    probability: float = 1.0  # probability: admission chance per occurrence
    show_weight: float = 0.0  # show_click score weights
    click_weight: float = 1.0
    max_candidates: int = 1 << 20  # count/show_click: IDs tracked before admission (the tracker resets when full)

    def validate(self) -> None:
        """Raise ``ValueError`` naming each bad field."""
        if self.kind not in ADMISSIONS:
            raise ValueError(f"admission kind={self.kind!r}: expected one of {ADMISSIONS}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"admission probability={self.probability}: must be in [0, 1]")
        if self.max_candidates <= 0:
            raise ValueError(f"admission max_candidates={self.max_candidates}: must be > 0")

    @property
    def needs_candidates(self) -> bool:
        return self.kind in ("count", "show_click")


@dataclass
class EvictionConfig:
    """Which rows are dropped, on capacity pressure and/or every ``every_steps`` steps."""

    kind: str = "none"  # none | lru | lfu | ttl | l2 | time_freq | show_click
    on_pressure: bool = True  # evict the lowest-scored rows when the table is full
    every_steps: int = 0  # scheduled pass period in table steps (0: none)
    ttl_steps: int = 0  # lru / ttl: rows unseen for more steps are evicted by the scheduled pass
    ttl_seconds: float = 0.0  # ttl: use wall-clock seconds since last seen instead of steps (> 0)
    min_count: int = 1  # lfu: rows seen fewer times are evicted by the scheduled pass
    l2_threshold: float = 0.0  # l2: rows with a smaller norm are evicted by the scheduled pass
    decay: float = 0.99  # time_freq: score = count * decay ** steps_since_seen
    min_score: float = 0.0  # time_freq / show_click: scheduled-pass threshold
    show_weight: float = 0.0  # show_click score weights
    click_weight: float = 1.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming each bad field."""
        if self.kind not in EVICTIONS:
            raise ValueError(f"eviction kind={self.kind!r}: expected one of {EVICTIONS}")
        if self.every_steps < 0 or self.ttl_steps < 0 or self.ttl_seconds < 0:
            raise ValueError("eviction every_steps, ttl_steps and ttl_seconds must be >= 0")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"eviction decay={self.decay}: must be in (0, 1]")


@dataclass
class RowCounters:
    """Per-row (or per-candidate) statistics the policies read; all (R,) on the table's device."""

    count: Tensor  # occurrences in lookups
    last_step: Tensor  # table step of the last lookup
    last_time: Tensor  # float64 seconds (``table.clock``) of the last lookup
    show: Tensor
    click: Tensor

    @classmethod
    def zeros(cls, n: int, device: torch.device) -> RowCounters:
        return cls(
            count=torch.zeros(n, dtype=torch.int64, device=device),
            last_step=torch.zeros(n, dtype=torch.int64, device=device),
            last_time=torch.zeros(n, dtype=torch.float64, device=device),
            show=torch.zeros(n, dtype=torch.float32, device=device),
            click=torch.zeros(n, dtype=torch.float32, device=device),
        )

    def tensors(self) -> dict[str, Tensor]:
        return {"count": self.count, "last_step": self.last_step, "last_time": self.last_time, "show": self.show, "click": self.click}

    def reset(self, rows: Tensor) -> None:
        for t in self.tensors().values():
            t[rows] = 0

    def grown(self, n: int) -> RowCounters:
        """A copy with ``n`` rows (the first rows kept)."""
        out = RowCounters.zeros(n, self.count.device)
        for name, t in self.tensors().items():
            getattr(out, name)[: t.shape[0]] = t
        return out


def admit(
    cfg: AdmissionConfig, occurrences: Tensor, candidates: RowCounters | None, slots: Tensor | None, generator: torch.Generator
) -> Tensor:
    """(U,) bool: which of U unseen IDs are admitted now.

    Args:
        occurrences: (U,) how often each ID occurs in this batch.
        candidates/slots: the candidate counters and each ID's candidate slot (count, show_click);
            the counts already include this batch.
    """
    if cfg.kind == "always":
        return torch.ones_like(occurrences, dtype=torch.bool)
    if cfg.kind == "probability":
        chance = 1.0 - (1.0 - cfg.probability) ** occurrences.double()
        draw = torch.rand(occurrences.shape, generator=generator, device=generator.device, dtype=torch.float64)
        return draw.to(occurrences.device) < chance
    assert candidates is not None and slots is not None
    if cfg.kind == "count":
        return candidates.count[slots] >= cfg.threshold
    score = cfg.show_weight * candidates.show[slots] + cfg.click_weight * candidates.click[slots]
    return score >= cfg.threshold


def eviction_scores(cfg: EvictionConfig, counters: RowCounters, rows: Tensor, step: int, now: float, norms: Tensor | None) -> Tensor:
    """(N,) float64 score of ``rows`` (lower is evicted first)."""
    if cfg.kind == "lfu":
        return counters.count[rows].double()
    if cfg.kind == "l2":
        assert norms is not None
        return norms.double()
    if cfg.kind == "ttl" and cfg.ttl_seconds > 0:
        return counters.last_time[rows]
    if cfg.kind in ("lru", "ttl"):
        return counters.last_step[rows].double()
    if cfg.kind == "time_freq":
        age = (step - counters.last_step[rows]).double()
        return counters.count[rows].double() * cfg.decay**age
    return (cfg.show_weight * counters.show[rows] + cfg.click_weight * counters.click[rows]).double()


def scheduled_threshold(cfg: EvictionConfig, step: int, now: float) -> float | None:
    """Scores below this are evicted by a scheduled pass (None: the policy has no scheduled rule set)."""
    if cfg.kind in ("lru", "ttl"):
        if cfg.kind == "ttl" and cfg.ttl_seconds > 0:
            return now - cfg.ttl_seconds
        return float(step - cfg.ttl_steps) if cfg.ttl_steps > 0 else None
    if cfg.kind == "lfu":
        return float(cfg.min_count)
    if cfg.kind == "l2":
        return cfg.l2_threshold
    if cfg.kind in ("time_freq", "show_click"):
        return cfg.min_score
    return None
