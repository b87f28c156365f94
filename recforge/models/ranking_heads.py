"""Ranking postfixes (task heads on the target tokens): a shared MLP, MMoE, PLE, and
``CandidateTower``, which adds a candidate-only tower beside any of them."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recforge.models.slices import build_slice, slice_spec


class MultiTaskMLP(nn.Module):
    """Shared MLP tower, one output per task."""

    def __init__(self, dim: int, num_tasks: int, hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"dim": dim, "num_tasks": num_tasks, "hidden": hidden, "dropout": dropout}
        self.net = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.SiLU(), nn.Dropout(dropout), nn.Linear(hidden, num_tasks)
        )

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _expert(dim: int, hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Dropout(dropout))


class MMoE(nn.Module):
    """Multi-gate mixture of experts (Ma et al. 2018): shared experts, one softmax gate and tower per task."""

    def __init__(self, dim: int, num_tasks: int, num_experts: int = 4, hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"dim": dim, "num_tasks": num_tasks, "num_experts": num_experts, "hidden": hidden, "dropout": dropout}
        self.norm = nn.LayerNorm(dim)
        self.experts = nn.ModuleList(_expert(dim, hidden, dropout) for _ in range(num_experts))
        self.gates = nn.Linear(dim, num_tasks * num_experts)
        self.towers = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(num_tasks))
        self.num_tasks, self.num_experts = num_tasks, num_experts

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        experts = torch.stack([e(x) for e in self.experts], 1)  # (N, E, h)
        gates = self.gates(x).view(-1, self.num_tasks, self.num_experts).softmax(-1)  # (N, K, E)
        mixed = torch.einsum("nke,neh->nkh", gates, experts)
        return torch.cat([tower(mixed[:, k]) for k, tower in enumerate(self.towers)], 1)


class PLE(nn.Module):
    """Progressive layered extraction (Tang et al. 2020), one extraction layer (CGC).

    Each task mixes its own experts with the shared ones through its own gate; task-specific
    experts reduce the negative transfer of MMoE's fully shared pool.
    """

    def __init__(
        self, dim: int, num_tasks: int, shared_experts: int = 2, task_experts: int = 1, hidden: int = 128,
        dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.kwargs = {
            "dim": dim, "num_tasks": num_tasks, "shared_experts": shared_experts, "task_experts": task_experts,
            "hidden": hidden, "dropout": dropout,
        }  # fmt: skip
        self.norm = nn.LayerNorm(dim)
        self.shared = nn.ModuleList(_expert(dim, hidden, dropout) for _ in range(shared_experts))
        self.specific = nn.ModuleList(
            nn.ModuleList(_expert(dim, hidden, dropout) for _ in range(task_experts)) for _ in range(num_tasks)
        )
        self.gates = nn.ModuleList(nn.Linear(dim, shared_experts + task_experts) for _ in range(num_tasks))
        self.towers = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(num_tasks))

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        shared = [e(x) for e in self.shared]
        outs = []
        for specific, gate, tower in zip(self.specific, self.gates, self.towers):
            experts = torch.stack(shared + [e(x) for e in specific], 1)  # (N, E, h)
            weights = gate(x).softmax(-1).unsqueeze(2)  # (N, E, 1)
            outs.append(tower((weights * experts).sum(1)))
        return torch.cat(outs, 1)


HEADS = {"mlp": MultiTaskMLP, "mmoe": MMoE, "ple": PLE}


class CandidateTower(nn.Module):
    """Postfix with a second, candidate-only tower: an ensemble of the sequence model and an
    item-only scorer inside one model, on shared embeddings.

    Input (N, 2d) = [target encoder output, candidate prefix embedding]. ``parts`` gives the two
    towers' outputs, each trained with the task losses on its own (so the candidate tower is a
    non-personalised item scorer, not a correction of the main one); the score mixes them:
    ``(1 - weight) * main + weight * candidate``. RankingModel feeds this input when the postfix
    has ``takes_candidate``.
    """

    takes_candidate = True

    def __init__(self, main: dict, candidate: dict, weight: float = 0.5) -> None:
        super().__init__()
        self.kwargs = {"main": main, "candidate": candidate, "weight": weight}
        self.main = build_slice(main["class"], main["kwargs"])
        self.candidate = build_slice(candidate["class"], candidate["kwargs"])
        self.weight = weight

    @classmethod
    def wrap(cls, main: nn.Module, candidate: nn.Module, weight: float) -> CandidateTower:
        tower = cls(slice_spec(main), slice_spec(candidate), weight)
        tower.main, tower.candidate = main, candidate
        return tower

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def parts(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(main tower outputs, candidate tower outputs), each (N, K)."""
        dim = self.kwargs["main"]["kwargs"].get("dim")
        if dim is not None and x.shape[1] != 2 * dim:
            raise ValueError(
                f"CandidateTower reads [target encoder output, candidate prefix embedding] of width {2 * dim}, got "
                f"{x.shape[1]}: feed it RankingModel.postfix_inputs(batch), not the encoder output alone"
            )
        h, e = x.chunk(2, dim=1)  # (N, d) each
        return self.main(h), self.candidate(e)

    def forward(self, x: Tensor) -> Tensor:
        main, candidate = self.parts(x)
        return (1 - self.weight) * main + self.weight * candidate


__all__ = ["HEADS", "PLE", "CandidateTower", "MMoE", "MultiTaskMLP"]
