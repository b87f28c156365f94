"""Semantic-ID tokenizers: determinism, codebook quality, balance, collision level, adding items."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recforge.data.sid_features import TextFeaturizer
from recforge.models.sid_kmeans import balanced_assign, kmeans
from recforge.models.sid_tokenizer import SIDTokenizer, TokenizerConfig, add_collision_level, sid_stats


def clustered(n: int = 400, dim: int = 8, clusters: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, dim, generator=g) * 4
    return centers[torch.randint(clusters, (n,), generator=g)] + 0.3 * torch.randn(n, dim, generator=g)


@pytest.mark.parametrize("method", ["rkmeans", "rqvae"])
def test_tokenizer_is_deterministic_under_a_seed(method: str) -> None:
    x = clustered()
    cfg = TokenizerConfig(method=method, levels=2, codebook_size=16, seed=3, rqvae_epochs=5, rqvae_latent_dim=8, rqvae_hidden=32)
    a, b = SIDTokenizer.fit(x, cfg), SIDTokenizer.fit(x, cfg)
    assert torch.equal(a.encode(x), b.encode(x))
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), name
    other = SIDTokenizer.fit(x, TokenizerConfig(**{**cfg.__dict__, "seed": 4}))
    assert not torch.equal(other.codebooks, a.codebooks)


def test_residual_kmeans_first_level_recovers_clusters() -> None:
    x = clustered(clusters=16)
    tok = SIDTokenizer.fit(x, TokenizerConfig(levels=2, codebook_size=16, seed=0))
    codes = tok.encode(x)
    g = torch.Generator().manual_seed(0)
    torch.randn(16, 8, generator=g)
    blob = torch.randint(16, (400,), generator=g)  # the blob of each point, drawn as clustered() drew it
    pairs = torch.unique(torch.stack([blob, codes[:, 0]], 1), dim=0)
    assert pairs.shape[0] <= 18  # well-separated blobs: a blob's points share their first digit (a split or two at most)
    stats = sid_stats(codes, 16)
    assert stats["codebook_usage"][0] >= 0.9
    quantized = tok.quantize(tok.latent(x))[1] * tok.scale + tok.mean
    first_only = tok.codebooks[0][codes[:, 0]] * tok.scale + tok.mean
    assert (quantized - x).pow(2).sum(1).mean() < (first_only - x).pow(2).sum(1).mean()


def test_rqvae_resets_dead_codes_and_uses_its_codebook() -> None:
    x = clustered(n=600, clusters=32)
    cfg = TokenizerConfig(method="rqvae", levels=2, codebook_size=32, rqvae_epochs=30, rqvae_latent_dim=8, rqvae_hidden=64)
    stats = sid_stats(SIDTokenizer.fit(x, cfg).encode(x), 32)
    assert stats["codebook_usage"][0] > 0.5 and stats["codebook_usage"][1] > 0.5


def test_balanced_assignment_respects_capacity_and_prefers_near_centroids() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(90, 2, generator=g), torch.randn(10, 2, generator=g) + 10])
    centroids = torch.tensor([[0.0, 0.0], [10.0, 10.0]])
    codes = balanced_assign(x, centroids, capacity=50)
    assert torch.bincount(codes).tolist() == [50, 50]
    assert (codes[90:] == 1).all()  # the far blob stays together; the overflow is the near blob's farthest points
    _, unbalanced = kmeans(x, 4, generator=torch.Generator().manual_seed(0))
    _, balanced = kmeans(x, 4, generator=torch.Generator().manual_seed(0), balanced=True)
    assert torch.bincount(balanced, minlength=4).max() <= 25 < torch.bincount(unbalanced, minlength=4).max()


@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_codes_and_codebooks_describe_the_same_residuals(seed: int) -> None:
    """Independent check of balanced residual k-means: recompute every level's residuals from the
    returned codes alone; each code's codeword is the mean of its items' residuals (k-means at its
    fixed point) and no code holds more than ceil(N / K) items at any level."""
    x = clustered(n=300, dim=6, clusters=8, seed=seed)
    x[:120] = x[0] + 0.3 * torch.randn(120, 6, generator=torch.Generator().manual_seed(seed))  # one crowded blob
    cfg = TokenizerConfig(levels=3, codebook_size=8, balanced=True, seed=seed, kmeans_iters=60)
    tok, codes = SIDTokenizer.fit_encode(x, cfg)
    capacity = math.ceil(300 / 8)
    residual = ((x.double() - tok.mean.double()) / tok.scale.double())  # (N, d), the standardised items
    for level in range(3):
        book = tok.codebooks[level].double()
        assert torch.bincount(codes[:, level], minlength=8).max() <= capacity, level
        for code in codes[:, level].unique():
            members = codes[:, level] == code
            torch.testing.assert_close(residual[members].mean(0), book[code], rtol=0, atol=1e-5, msg=f"level {level}")
        residual = residual - book[codes[:, level]]
    quantized = tok.codebooks.double().gather(1, codes.T[..., None].expand(-1, -1, 6)).sum(0)  # (N, d)
    torch.testing.assert_close(quantized + residual, (x.double() - tok.mean.double()) / tok.scale.double(), rtol=0, atol=1e-9)
    # items coded later get their nearest codeword per level; unbalanced fits emit exactly that
    plain, plain_codes = SIDTokenizer.fit_encode(x, TokenizerConfig(levels=3, codebook_size=8, seed=seed))
    assert torch.equal(plain_codes, plain.encode(x))


def test_collision_level_makes_sids_unique_and_keeps_old_ones() -> None:
    codes = torch.tensor([[1, 2], [1, 2], [0, 0], [1, 2]])
    sids = add_collision_level(codes)
    assert sids[:, 2].tolist() == [0, 1, 0, 2]
    assert torch.unique(sids, dim=0).shape[0] == 4
    new = add_collision_level(torch.tensor([[1, 2], [3, 3], [0, 0], [1, 2]]), capacity=8, existing=sids)
    assert new[:, 2].tolist() == [3, 0, 1, 4]
    assert torch.unique(torch.cat([sids, new]), dim=0).shape[0] == 8
    with pytest.raises(ValueError, match="share one semantic ID"):
        add_collision_level(torch.tensor([[1, 2]] * 3), capacity=2)


def test_stats_report_collisions_and_prefix_sharing() -> None:
    stats = sid_stats(torch.tensor([[0, 0], [0, 0], [0, 1], [1, 0]]), codebook_size=4)
    assert stats["codebook_usage"] == [0.5, 0.5]
    assert stats["collision_rate"] == 0.5 and stats["max_items_per_sid"] == 2
    assert [p["distinct"] for p in stats["prefixes"]] == [2, 3]


def test_text_featurizer_transform_matches_scikit_learn() -> None:
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    docs = [["brand=a", "cat=1"], ["brand=b", "cat=1", "cat=1"], ["brand=a", "cat=2", "word:red"], ["cat=2"], ["brand=c"]]
    feat = TextFeaturizer.fit(docs, dim=3, seed=0)
    tfidf = TfidfVectorizer(analyzer=lambda t: t)
    svd = TruncatedSVD(n_components=3, random_state=0)
    expected = normalize(svd.fit_transform(tfidf.fit_transform(docs)))
    np.testing.assert_allclose(feat.transform(docs), expected, rtol=1e-5, atol=1e-6)
    assert np.allclose(feat.transform([["unknown=token"]]), 0.0)
