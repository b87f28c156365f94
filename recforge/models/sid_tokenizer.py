"""Semantic-ID tokenizers: item embedding -> a short tuple of codes (residual quantization).

Two ways to learn the per-level codebooks, one quantizer:

- ``rkmeans`` (residual k-means): level 1 clusters the (standardised) embeddings, level 2
  clusters what level 1 left over, and so on. ``balanced=True`` caps each cluster at
  ceil(N / K) items, which spreads items over the codes and lowers collisions: the fitted
  items keep those capped codes, and each level is fit on the residuals of exactly the codes
  the items get (``fit_encode``); items coded later get their nearest codeword per level.
- ``rqvae`` (RQ-VAE, TIGER): an MLP encoder maps the embedding to a small latent that is
  residually quantized; a decoder reconstructs the embedding. Codebooks start from residual
  k-means of the initial latents; a code no batch used for an epoch is reset to a random
  residual of that level (dead-code reset).

Residual quantization alone can give two items the same tuple (a collision); the optional
collision level appends 0, 1, 2... to the items sharing a tuple, so every item gets a unique SID.

Example:
    >>> tok = SIDTokenizer.fit(embeddings, TokenizerConfig(method="rkmeans", levels=3, codebook_size=256))
    >>> codes = tok.encode(embeddings)                  # (N, 3) int64
    >>> sids = add_collision_level(codes, 256)          # (N, 4), unique rows
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from recforge.models.sid_kmeans import assign, kmeans


@dataclass
class TokenizerConfig:
    method: str = "rkmeans"  # rkmeans | rqvae
    levels: int = 3  # quantization levels (not counting the collision level)
    codebook_size: int = 256  # codes per level (also the collision level's capacity)
    collision_level: bool = True  # append a digit that makes every item's SID unique
    balanced: bool = False  # rkmeans: the fitted items' codes capped at ceil(N / K) per code and level (items added later: nearest)
    seed: int = 0
    kmeans_iters: int = 20
    rqvae_latent_dim: int = 32
    rqvae_hidden: int = 256
    rqvae_epochs: int = 100
    rqvae_batch_size: int = 1024
    rqvae_lr: float = 1e-3
    rqvae_beta: float = 0.25  # commitment weight

    def validate(self) -> None:
        """Raise ``ValueError`` listing every bad field (with its `recforge sid fit` flag where it has one)."""
        problems = []
        if self.method not in ("rkmeans", "rqvae"):
            problems.append(f"method={self.method!r} (--method): expected rkmeans or rqvae")
        if self.levels < 1:
            problems.append(f"levels={self.levels} (--levels): need at least 1 quantization level (default 3)")
        if self.codebook_size < 2:
            problems.append(f"codebook_size={self.codebook_size} (--codebook-size): need at least 2 codes per level (default 256)")
        if self.balanced and self.method != "rkmeans":
            problems.append("balanced=True (--balanced) is an option of --method rkmeans; drop it or use rkmeans")
        for name in ("kmeans_iters", "rqvae_latent_dim", "rqvae_hidden", "rqvae_epochs", "rqvae_batch_size"):
            if getattr(self, name) < 1:
                flag = " (--rqvae-epochs)" if name == "rqvae_epochs" else ""
                problems.append(f"{name}={getattr(self, name)}{flag}: must be >= 1")
        if not self.rqvae_lr > 0 or self.rqvae_beta < 0:
            problems.append(f"rqvae_lr={self.rqvae_lr} must be > 0 and rqvae_beta={self.rqvae_beta} >= 0")
        if problems:
            raise ValueError("SID tokenizer settings: " + "; ".join(problems))


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class SIDTokenizer(nn.Module):
    """A fitted residual quantizer (see the module docstring); ``encode`` is deterministic."""

    def __init__(self, config: TokenizerConfig, embedding_dim: int) -> None:
        super().__init__()
        config.validate()
        self.config = config
        latent = config.rqvae_latent_dim if config.method == "rqvae" else embedding_dim
        self.register_buffer("mean", torch.zeros(embedding_dim))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("codebooks", torch.zeros(config.levels, config.codebook_size, latent))  # (L, K, d)
        self.encoder = self.decoder = None
        if config.method == "rqvae":
            self.encoder = _mlp([embedding_dim, config.rqvae_hidden, config.rqvae_hidden // 2, latent])
            self.decoder = _mlp([latent, config.rqvae_hidden // 2, config.rqvae_hidden, embedding_dim])

    def latent(self, x: Tensor) -> Tensor:
        z = (x - self.mean) / self.scale
        return self.encoder(z) if self.encoder is not None else z

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """(codes (N, L), quantized (N, d)) of latents ``z``: nearest code per level on the residual."""
        residual, quantized, codes = z, torch.zeros_like(z), []
        for book in self.codebooks:
            c = assign(residual, book)
            codes.append(c)
            quantized = quantized + book[c]
            residual = residual - book[c]
        return torch.stack(codes, 1), quantized

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor:
        """(N, levels) int64 codes of embeddings ``x`` (N, embedding_dim)."""
        return self.quantize(self.latent(x.float()))[0]

    @staticmethod
    def fit(x: Tensor, config: TokenizerConfig) -> SIDTokenizer:
        """Fit a tokenizer to embeddings ``x`` (N, D); a pure function of (x, config)."""
        return SIDTokenizer.fit_encode(x, config)[0]

    @staticmethod
    def fit_encode(x: Tensor, config: TokenizerConfig) -> tuple[SIDTokenizer, Tensor]:
        """(tokenizer, (N, levels) codes of the rows of ``x``); a pure function of (x, config).

        The codes are ``encode(x)`` except for balanced residual k-means, where they are the
        capacity-capped codes of the fit: level l's codebook is fit on ``z - sum_{j<l} book_j[code_j]``
        of these very codes, so the codes and the codebooks describe the same residuals.
        """
        config.validate()
        x = x.float()
        if x.ndim != 2 or x.shape[0] < 2 or not torch.isfinite(x).all():
            raise ValueError(f"SID fit needs a finite (items, dim) embedding matrix with >= 2 rows; got {tuple(x.shape)}")
        generator = torch.Generator().manual_seed(config.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            tok = SIDTokenizer(config, x.shape[1])
        tok.mean.copy_(x.mean(0))
        tok.scale.copy_((x - tok.mean).pow(2).sum(1).mean().sqrt().clamp_min(1e-12))
        if config.method == "rqvae":
            _train_rqvae(tok, x, generator)
            return tok.eval(), tok.encode(x)
        books, codes = _residual_kmeans(tok.latent(x), config, generator)
        tok.codebooks.copy_(books)
        return tok.eval(), (codes if config.balanced else tok.encode(x))


def _residual_kmeans(z: Tensor, config: TokenizerConfig, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """((L, K, d) codebooks, (N, L) codes): each level clusters what the levels before left over.

    The residual chain runs on the float32 codebooks that are stored, so the residual a level is
    fit on is exactly ``z`` minus the stored codewords of the codes returned for the earlier levels.
    """
    books, codes, residual = [], [], z.float()
    for _ in range(config.levels):
        centroids, level_codes = kmeans(residual, config.codebook_size, iters=config.kmeans_iters, generator=generator,
                                        balanced=config.balanced)  # fmt: skip
        centroids = centroids.float()
        books.append(centroids)
        codes.append(level_codes)
        residual = residual - centroids[level_codes]
    return torch.stack(books), torch.stack(codes, 1)


def _train_rqvae(tok: SIDTokenizer, x: Tensor, generator: torch.Generator) -> None:
    cfg = tok.config
    with torch.no_grad():
        tok.codebooks.copy_(_residual_kmeans(tok.latent(x), cfg, generator)[0])
    books = nn.Parameter(tok.codebooks.clone())
    params = [*tok.encoder.parameters(), *tok.decoder.parameters(), books]
    optimizer = torch.optim.Adam(params, lr=cfg.rqvae_lr)
    target = (x - tok.mean) / tok.scale
    n = x.shape[0]
    for _ in range(cfg.rqvae_epochs):
        used = torch.zeros(cfg.levels, cfg.codebook_size, dtype=torch.bool)
        last_residuals = []
        for batch in torch.randperm(n, generator=generator).split(cfg.rqvae_batch_size):
            z = tok.encoder(target[batch])
            residual, quantized, loss, last_residuals = z, torch.zeros_like(z), z.new_zeros(()), []
            for level in range(cfg.levels):
                c = assign(residual.detach(), books[level].detach())
                used[level, c] = True
                e = books[level][c]
                loss = loss + (residual.detach() - e).pow(2).mean() + cfg.rqvae_beta * (residual - e.detach()).pow(2).mean()
                last_residuals.append(residual.detach())
                quantized = quantized + e
                residual = residual - e.detach()
            z_q = z + (quantized - z).detach()  # straight-through estimator
            loss = loss + (tok.decoder(z_q) - target[batch]).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():  # dead-code reset: unused codes restart on residuals the level saw
            for level in range(cfg.levels):
                dead = torch.nonzero(~used[level]).flatten()
                if dead.numel():
                    pool = last_residuals[level]
                    books[level, dead] = pool[torch.randint(pool.shape[0], (dead.numel(),), generator=generator)]
    tok.codebooks.copy_(books.detach())


def _rank_within_groups(group: Tensor) -> Tensor:
    """0, 1, 2... for the rows of each group, in row order."""
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    rank = torch.empty_like(group)
    rank[order] = torch.arange(group.numel()) - torch.searchsorted(sorted_group, sorted_group)
    return rank


def add_collision_level(codes: Tensor, capacity: int | None = None, existing: Tensor | None = None) -> Tensor:
    """Append a digit numbering the items that share a code tuple: (N, L) -> (N, L + 1).

    Items sharing a tuple get 0, 1, 2... in row order; with ``existing`` (M, L + 1) SIDs of
    items coded before, new items continue after the digits already taken, so old SIDs never
    change. Raises ``ValueError`` when a tuple would hold more than ``capacity`` items (None: no limit;
    a model trained on the SIDs has ``capacity`` collision tokens, so items added later must fit).
    """
    levels = codes.shape[1]
    old = existing[:, :levels] if existing is not None else codes[:0]
    _, group = torch.unique(torch.cat([old, codes]), dim=0, return_inverse=True)
    old_group, new_group = group[: old.shape[0]], group[old.shape[0] :]
    start = torch.zeros(int(group.max()) + 1 if group.numel() else 0, dtype=torch.long)
    if existing is not None and existing.numel():  # after the largest digit already taken in each tuple
        start.scatter_reduce_(0, old_group, existing[:, levels] + 1, reduce="amax")
    new = start[new_group] + _rank_within_groups(new_group)
    if capacity is not None and new.numel() and int(new.max()) >= capacity:
        raise ValueError(
            f"{int(new.max()) + 1} items share one semantic ID but the collision level holds {capacity}; "
            "refit with `recforge sid fit` (more levels, a larger codebook_size or balanced=True spread items further)"
        )
    return torch.cat([codes, new[:, None]], 1)


def sid_stats(codes: Tensor, codebook_size: int) -> dict:
    """Codebook usage per level, collision rate and prefix sharing of (N, L) quantizer codes."""
    n, levels = codes.shape
    stats: dict = {"num_items": n, "codebook_usage": [], "prefixes": []}
    for level in range(levels):
        stats["codebook_usage"].append(int(codes[:, level].unique().numel()) / codebook_size)
        _, inverse, counts = torch.unique(codes[:, : level + 1], dim=0, return_inverse=True, return_counts=True)
        stats["prefixes"].append({
            "depth": level + 1, "distinct": int(counts.numel()), "mean_items": n / counts.numel(),
            "max_items": int(counts.max()), "items_sharing": float((counts[inverse] > 1).double().mean()),
        })  # fmt: skip
    full = stats["prefixes"][-1]
    stats["collision_rate"] = full["items_sharing"]  # items whose full code tuple another item also has
    stats["max_items_per_sid"] = full["max_items"]
    return stats


def config_dict(config: TokenizerConfig) -> dict:
    return asdict(config)
