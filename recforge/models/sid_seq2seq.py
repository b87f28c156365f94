"""TIGER-style generative retrieval: history SID tokens -> bidirectional encoder -> decoder of one item's SID.

The history's items become ``L`` tokens each (token id ``1 + level * V + digit``, 0 = padding),
plus a level embedding and the item's position counted from the most recent item. With
``num_item_ids > 0`` (``generative.item_id_embedding``) each of an item's tokens also gets a learned
embedding of the item's ID (hybrid ID + SID input, as in LIGER / COBRA): a table row per training item,
row 0 (zeros) for padding and for items the table does not hold (coded after training). The decoder
reads ``[BOS, d_0, ..., d_{t-1}]`` and predicts digit ``d_t`` with a per-level output head.

With ``dense_items > 0`` (``generative.dense_head``, LIGER) the model also has a dense head: a user vector
(the encoder's output at the history's last token, the most recent item's last digit, projected and
L2-normalised) and an L2-normalised item table over the training catalogue (row 0: padding / unknown), scored
as ``cos(user, item) / dense_temperature`` (``dense_logits``). Both item tables share one row mapping
(``item_id_vocab``: raw ID of each row, ``set_item_vocab``, ``item_rows``) and one width, ``item_dim`` (default
``dim``; another width, e.g. an ID-retrieval run's table loaded into them, adds the projections named there).

Beam search shares each request's encoding across its beams: ``encode`` runs once per request,
``memory_kv`` projects the encoder output to every decoder layer's cross-attention keys/values
once, and the ``W`` beams' decoder queries attend to them as ``W * t`` query rows of the same
request (no per-beam copy of the history: decode state is O(B * W * L * d), not O(B * W * S * d)).

Attention kernels: histories of different lengths are left-padded, so the encoder and the
cross-attention take a key mask. Every attention runs under ``SDPA_BACKENDS`` (flash, memory-efficient,
math: not cuDNN), because PyTorch's first choice on H100/H200 (cuDNN attention, when its cuDNN is new
enough) builds an execution plan for every new shape (tens of ms each), and serving and training see a
new key length (and batch size) in nearly every batch. Masked key lengths are padded to a multiple of
``KEY_ALIGN`` with masked zero tokens, so the memory-efficient kernel takes the (B, 1, 1, S) mask as a
broadcast bias without copying it. At inference in bfloat16 on CUDA the mask instead rides in
the head dimension (``attention``): flash attention takes no mask, and with one the memory-efficient
kernel ran a batch of varying lengths 2x slower than flash on the same keys unmasked (H200). All of
this only changes float rounding (tested: padded == unpadded, folded == masked).

Example:
    >>> model = SIDSeq2Seq(Seq2SeqConfig(num_levels=4, vocab_size=256))
    >>> loss = model.loss(history_codes, history_mask, target_codes)       # (B, H, L), (B, H), (B, L)
    >>> memory = model.start(history_codes, history_mask)                  # once per request
    >>> logp = model.next_token_logprobs(memory, codes)                    # (B, W, t) -> (B, W, V)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernels SIDSeq2Seq's attention may use (None: PyTorch's default dispatch, cuDNN first on H100/H200).
SDPA_BACKENDS: list[SDPBackend] | None = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
KEY_ALIGN = 16  # masked key lengths are padded to a multiple of this (1: no padding)


@dataclass
class Seq2SeqConfig:
    num_levels: int  # digits per SID (the collision level included)
    vocab_size: int  # digits per level
    dim: int = 128
    encoder_layers: int = 4
    decoder_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 512
    dropout: float = 0.1
    max_items: int = 50  # history items the position embedding covers (older ones are cut by the caller)
    num_item_ids: int = 0  # > 0: item-ID embedding rows 1..num_item_ids added to the history's SID tokens; 0: none
    dense_items: int = 0  # > 0: dense head over items 1..dense_items (= num_item_ids when both are on); 0: none
    dense_temperature: float = 0.05  # dense logits are cosine / this (loss.temperature)
    # width of both item tables (0: dim). Another width (that of a loaded ID-retrieval table, generative.dense_init)
    # makes the dense user tower project to it and adds a learned projection of the item-ID embedding to dim
    item_dim: int = 0

    @property
    def item_width(self) -> int:
        """Width of the item tables: ``item_dim``, or ``dim`` when it is 0."""
        return self.item_dim or self.dim


def _split_heads(x: Tensor, heads: int) -> Tensor:
    b, n, d = x.shape
    return x.view(b, n, heads, d // heads).transpose(1, 2)  # (B, H, N, dh)


def _merge_heads(x: Tensor) -> Tensor:
    b, h, n, dh = x.shape
    return x.transpose(1, 2).reshape(b, n, h * dh)


def _kernels(device: torch.device):
    """The attention kernel choice of the module docstring (a context for the model's SDPA calls).

    ``sdpa_kernel`` sets process-wide flags (and restores them on exit), so it is entered only where it
    changes something: on CUDA while cuDNN attention is still enabled. Serving processes call
    ``disable_cudnn_attention`` once at start, so their threads (batching, reload probes) never flip
    the flags under each other."""
    if SDPA_BACKENDS is None or device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return contextlib.nullcontext()
    return sdpa_kernel(SDPA_BACKENDS)


def disable_cudnn_attention() -> None:
    """Turn PyTorch's cuDNN SDPA backend off for this process (see the module docstring: it plans per
    shape). For processes recforge owns (``recforge serve``); a library caller keeps its own flags."""
    if SDPA_BACKENDS is not None and SDPBackend.CUDNN_ATTENTION not in SDPA_BACKENDS:
        torch.backends.cuda.enable_cudnn_sdp(False)


def pad_keys(x: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (B, S, ...) and its key mask (B, 1, 1, S) left-padded to a multiple of ``KEY_ALIGN`` keys
    (zeros, masked out): the real tokens stay right-aligned. Not under ``torch.compile`` (``train.compile``
    traces dynamic lengths; the compiled graph picks its own kernels)."""
    extra = -x.shape[1] % KEY_ALIGN
    if torch.compiler.is_compiling() or not extra:
        return x, key_mask
    x = torch.cat([x.new_zeros(x.shape[0], extra, *x.shape[2:]), x], 1)
    return x, torch.cat([key_mask.new_zeros(*key_mask.shape[:3], extra), key_mask], 3)


MASK_DIMS = 8  # head-dimension columns that carry a folded key mask (flash takes head dims in multiples of 8)


def fold_key_mask(q: Tensor) -> bool:
    """Whether ``attention`` folds the key mask into the head dimension for ``q``: at inference, in bfloat16,
    on CUDA (where flash attention would run but for the mask). Not float16: its largest finite offset
    (-16,376) would suppress a masked key only while its logit stays within ~16k of the real keys'."""
    return q.is_cuda and q.dtype == torch.bfloat16 and not torch.is_grad_enabled()


def attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention`` of q (B, H, Q, dh) over k, v (B, H, S, dh) with the key mask
    (B, 1, 1, S) (True = a real key) or None.

    Where ``fold_key_mask(q)``, the mask rides in ``MASK_DIMS`` extra head-dimension columns instead: q gains
    (1, 0, ...), k (0 or a huge negative, 0, ...), v zeros, so each logit is q.k plus 0 for a real key and
    minus ~8e37 for a masked one; softmax gives masked keys exactly 0 weight, the scale stays 1/sqrt(dh),
    and the output drops the extra columns. With no mask tensor, SDPA can pick flash attention. Every
    row must have a real key (a request's history is never empty): a row without one would average the
    masked values where SDPA returns zeros."""
    if key_mask is None or not fold_key_mask(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=dropout_p)
    b, heads, s, dh = k.shape
    masked = -0.25 * torch.finfo(k.dtype).max
    k_extra = k.new_zeros(b, 1, s, MASK_DIMS)
    k_extra[..., 0].masked_fill_(~key_mask.expand(b, 1, 1, s).reshape(b, 1, s), masked)  # fill_: no host scalar copy
    q_extra = q.new_zeros(1, 1, 1, MASK_DIMS)
    q_extra[..., 0].fill_(1.0)
    q = torch.cat([q, q_extra.expand(*q.shape[:3], MASK_DIMS)], -1)
    k = torch.cat([k, k_extra.expand(b, heads, s, MASK_DIMS)], -1)
    v = torch.cat([v, v.new_zeros(1, 1, 1, MASK_DIMS).expand(b, heads, s, MASK_DIMS)], -1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=dh**-0.5)[..., :dh]


class _FFN(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim))


class EncoderBlock(nn.Module):
    """Pre-norm bidirectional self-attention + FFN over the padded history tokens."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.heads, self.dropout = cfg.num_heads, cfg.dropout
        self.norm = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.ffn = _FFN(cfg.dim, cfg.ffn_dim, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        q, k, v = (_split_heads(t, self.heads) for t in self.qkv(self.norm(x)).chunk(3, -1))  # (B, H, S, dh)
        p = self.dropout if self.training else 0.0
        x = x + self.drop(self.out(_merge_heads(attention(q, k, v, key_mask, p))))
        return x + self.drop(self.ffn(x))


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention within each beam, cross-attention to the request's history, FFN."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.heads, self.dropout = cfg.num_heads, cfg.dropout
        self.norm_self, self.norm_cross = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.self_out = nn.Linear(cfg.dim, cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.cross_out = nn.Linear(cfg.dim, cfg.dim)
        self.ffn = _FFN(cfg.dim, cfg.ffn_dim, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv(memory).chunk(2, -1)
        return _split_heads(k, self.heads), _split_heads(v, self.heads)  # (B, H, S, dh) each

    def forward(self, x: Tensor, kv: tuple[Tensor, Tensor], key_mask: Tensor | None) -> Tensor:
        b, w, t, d = x.shape
        p = self.dropout if self.training else 0.0
        flat = x.reshape(b * w, t, d)
        q, k, v = (_split_heads(z, self.heads) for z in self.qkv(self.norm_self(flat)).chunk(3, -1))  # (BW, H, t, dh)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.self_out(_merge_heads(attn))).view(b, w, t, d)
        q = _split_heads(self.q(self.norm_cross(x).reshape(b, w * t, d)), self.heads)  # (B, H, W*t, dh)
        attn = attention(q, kv[0], kv[1], key_mask, p)
        x = x + self.drop(self.cross_out(_merge_heads(attn))).view(b, w, t, d)
        return x + self.drop(self.ffn(x))


@dataclass
class Memory:
    """A batch of encoded histories: every decoder layer's cross-attention keys/values and the key mask."""

    kv: list[tuple[Tensor, Tensor]]
    key_mask: Tensor | None  # (B, 1, 1, S) bool, True = a real token; None when nothing is padded
    user: Tensor | None = None  # (B, item_width) L2-normalised dense user vectors (models with a dense head), else None


class SIDSeq2Seq(nn.Module):
    """Encoder-decoder over semantic IDs (see the module docstring)."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.cfg = cfg
        L, V, d = cfg.num_levels, cfg.vocab_size, cfg.dim
        self.token_embedding = nn.Embedding(1 + L * V, d, padding_idx=0)
        self.level_embedding = nn.Embedding(L, d)
        self.position_embedding = nn.Embedding(cfg.max_items, d)
        self.encoder = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.encoder_layers))
        self.encoder_norm = nn.LayerNorm(d)
        self.decoder_embedding = nn.Embedding(1 + L * V, d)  # 0 = BOS
        self.decoder_position = nn.Embedding(L, d)
        self.decoder = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.decoder_layers))
        self.decoder_norm = nn.LayerNorm(d)
        self.heads = nn.Parameter(torch.randn(L, V, d) * d**-0.5)  # per-level output projection
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.num_item_ids > 0 and cfg.dense_items > 0 and cfg.num_item_ids != cfg.dense_items:
            raise ValueError(f"num_item_ids ({cfg.num_item_ids}) and dense_items ({cfg.dense_items}) must both be the "
                             "training catalogue's size: the two item tables share one row mapping")  # fmt: skip
        # built last: every other weight draws the same initial values as without them
        if cfg.num_item_ids > 0:
            self.item_embedding = nn.Embedding(1 + cfg.num_item_ids, cfg.item_width, padding_idx=0)  # row 0: padding
        if self.item_table_rows:
            # raw item ID of each row (row 0: -1), saved with the weights so any checkpoint maps raw IDs to its rows
            self.register_buffer("item_id_vocab", torch.full((self.item_table_rows,), -1, dtype=torch.long))
        if cfg.dense_items > 0:
            self.dense_user = nn.Linear(d, cfg.item_width)  # encoder output at the last history token -> user vector
            self.dense_items = nn.Embedding(1 + cfg.dense_items, cfg.item_width)  # row 0: padding / unknown (never a class)
        if cfg.num_item_ids > 0 and cfg.item_width != d:
            self.item_id_projection = nn.Linear(cfg.item_width, d, bias=False)  # item-ID embedding -> the token width

    @property
    def reads_item_ids(self) -> bool:
        """Whether the encoder adds an item-ID embedding (callers then pass ``history_items``)."""
        return self.cfg.num_item_ids > 0

    @property
    def has_dense_head(self) -> bool:
        """Whether the model has a dense user vector and item table (``generative.dense_head``)."""
        return self.cfg.dense_items > 0

    @property
    def item_table_rows(self) -> int:
        """Rows of the model's item tables (training items + the padding row 0); 0 when it has none."""
        n = max(self.cfg.num_item_ids, self.cfg.dense_items)
        return n + 1 if n else 0

    def set_item_vocab(self, item_vocab: Tensor) -> None:
        """Name the raw item ID of each table row: ``item_vocab`` (item_table_rows,) int64, [0] the padding row."""
        if not self.item_table_rows or item_vocab.shape != self.item_id_vocab.shape:
            raise ValueError(f"item_vocab of shape {tuple(item_vocab.shape)} does not fit a model with "
                             f"{max(self.item_table_rows - 1, 0)} item-table rows")  # fmt: skip
        self.item_id_vocab.copy_(item_vocab)
        self.item_id_vocab[0] = -1

    def item_rows(self, raw_item_ids: Tensor) -> Tensor:
        """Table row of each raw item ID (same shape, int64): 0 for an ID the table does not hold."""
        if not self.item_table_rows:
            raise ValueError("this model has no item-ID embedding nor dense head (generative.item_id_embedding and "
                             "generative.dense_head are off)")  # fmt: skip
        order = torch.argsort(self.item_id_vocab[1:])  # num_item_ids >= 1 rows
        sorted_ids = self.item_id_vocab[1:][order]
        raw = raw_item_ids.to(sorted_ids.device, torch.long)
        pos = torch.searchsorted(sorted_ids, raw).clamp(max=sorted_ids.numel() - 1)
        return torch.where(sorted_ids[pos] == raw, order[pos] + 1, 0)

    def _token_ids(self, codes: Tensor) -> Tensor:
        levels = torch.arange(codes.shape[-1], device=codes.device)
        return 1 + levels * self.cfg.vocab_size + codes

    def encode(
        self, history_codes: Tensor, history_mask: Tensor | None, history_items: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """(memory (B, S, d), key mask (B, 1, 1, S) or None) of right-aligned histories.

        ``S`` is ``H * L``, or with a mask ``H * L`` rounded up to a multiple of ``KEY_ALIGN`` (masked
        tokens on the left).

        Args:
            history_codes: (B, H, L) SIDs of each request's last H items, most recent last.
            history_mask: (B, H) bool, False for padding (on the left); None when nothing is padded.
            history_items: (B, H) item-ID table rows of the same items (0: padding or unknown); needed by,
                and only read by, a model with ``num_item_ids > 0``. Rows outside the table count as unknown.
        """
        b, h, L = history_codes.shape
        if h > self.cfg.max_items:
            raise ValueError(f"history of {h} items > max_items {self.cfg.max_items}; keep the most recent ones")
        tokens = self._token_ids(history_codes)  # (B, H, L)
        recency = torch.arange(h - 1, -1, -1, device=tokens.device)  # 0 = the most recent item
        x = self.token_embedding(tokens) + self.level_embedding.weight + self.position_embedding(recency)[:, None]
        if self.reads_item_ids:
            x = x + self._item_embedding(history_items, (b, h))[:, :, None]  # (B, H, 1, d): on each of the L tokens
        x = self.drop(x.view(b, h * L, -1))  # (B, S, d)
        key_mask = None
        if history_mask is not None:
            key_mask = history_mask[:, :, None].expand(b, h, L).reshape(b, 1, 1, h * L)
            x, key_mask = pad_keys(x, key_mask)
        with _kernels(x.device):
            for block in self.encoder:
                x = block(x, key_mask)
        return self.encoder_norm(x), key_mask

    def _item_embedding(self, history_items: Tensor | None, shape: tuple[int, int]) -> Tensor:
        """(B, H, d) item-ID embeddings; rows outside the table read the zero row 0 (never an index error)."""
        if history_items is None:
            raise ValueError("this model adds an item-ID embedding to its history (generative.item_id_embedding): "
                             "pass history_items, the (B, H) table rows of the history's items")  # fmt: skip
        if tuple(history_items.shape) != shape:
            raise ValueError(f"history_items has shape {tuple(history_items.shape)}, the history {shape}")
        rows = torch.where((history_items >= 0) & (history_items <= self.cfg.num_item_ids), history_items, 0)
        x = self.item_embedding(rows)  # (B, H, item_width)
        return self.item_id_projection(x) if self.cfg.item_width != self.cfg.dim else x

    def start(self, history_codes: Tensor, history_mask: Tensor | None, history_items: Tensor | None = None) -> Memory:
        """Encode the histories once and project them for every decoder layer (what beams share); with a dense
        head also the user vectors."""
        memory, key_mask = self.encode(history_codes, history_mask, history_items)
        user = self.user_vectors(memory) if self.has_dense_head else None
        return Memory([block.memory_kv(memory) for block in self.decoder], key_mask, user)

    def user_vectors(self, encoded: Tensor) -> Tensor:
        """(B, item_width) L2-normalised dense user vectors of encoder outputs (B, S, d): the projected output at the
        last token (histories are right-aligned, so it is always the most recent item's last digit, never padding)."""
        return F.normalize(self.dense_user(encoded[:, -1]).float(), dim=-1)

    def dense_item_vectors(self, rows: Tensor | None = None) -> Tensor:
        """L2-normalised dense item vectors of table ``rows`` (any shape, + (d,)); None: the whole table (N+1, d)."""
        table = self.dense_items.weight if rows is None else self.dense_items(rows)
        return F.normalize(table.float(), dim=-1)

    def dense_logits(self, user: Tensor, rows: Tensor) -> Tensor:
        """(B, K) float32 ``cos(user, item) / dense_temperature`` of each request's items, given as dense-table
        ``rows`` (B, K); 0 for row 0 and rows outside the table (padding, or an item without a row)."""
        if not self.has_dense_head:
            raise ValueError("this model has no dense head (generative.dense_head is off)")
        known = (rows > 0) & (rows <= self.cfg.dense_items)
        items = self.dense_item_vectors(torch.where(known, rows, 0))  # (B, K, d)
        logits = torch.bmm(items, user.float()[:, :, None]).squeeze(2) / self.cfg.dense_temperature  # (B, K)
        return torch.where(known, logits, 0.0)

    def catalogue_dense_logits(self, user: Tensor, rows: Tensor) -> Tensor:
        """(B, N) float32 ``cos(user, item) / dense_temperature`` of N items given as dense-table ``rows`` (N,), by one
        matmul over the table; -inf for row 0 and rows outside the table (items without a dense row)."""
        if not self.has_dense_head:
            raise ValueError("this model has no dense head (generative.dense_head is off)")
        known = (rows > 0) & (rows <= self.cfg.dense_items)
        logits = (user.float() @ self.dense_item_vectors().T).div_(self.cfg.dense_temperature)  # (B, rows of the table)
        return logits[:, torch.where(known, rows, 0)].masked_fill_(~known, float("-inf"))  # the gather is a fresh tensor

    def decode(self, memory: Memory, codes: Tensor) -> Tensor:
        """(B, W, t+1, d) decoder states after reading ``[BOS, codes]`` (codes: (B, W, t))."""
        b, w, t = codes.shape
        bos = torch.zeros(b, w, 1, dtype=torch.long, device=codes.device)
        tokens = torch.cat([bos, self._token_ids(codes)], 2)  # (B, W, t+1)
        x = self.drop(self.decoder_embedding(tokens) + self.decoder_position.weight[: t + 1])
        with _kernels(x.device):
            for block, kv in zip(self.decoder, memory.kv, strict=True):
                x = block(x, kv, memory.key_mask)
        return self.decoder_norm(x)

    def next_token_logprobs(self, memory: Memory, codes: Tensor) -> Tensor:
        """(B, W, V) log-probabilities of digit ``t`` after each beam's prefix ``codes`` (B, W, t)."""
        t = codes.shape[2]
        last = self.decode(memory, codes)[:, :, t]  # (B, W, d)
        return (last @ self.heads[t].T).float().log_softmax(-1)

    def sid_log_probs(self, memory: Memory, codes: Tensor) -> Tensor:
        """(B, K) float32 log p(SID) of whole SIDs ``codes`` (B, K, L), teacher forced: one decoder pass reads
        ``[BOS, d_0 .. d_{L-2}]`` per SID; the causal decoder's state at digit t is the one a beam step at level t
        computes, so a beam's SID gets the beam's score up to float rounding (summed in the beam's order)."""
        states = self.decode(memory, codes[:, :, :-1])  # (B, K, L, d)
        total = torch.zeros(codes.shape[:2], device=codes.device)
        for level in range(codes.shape[2]):  # one (B, K, V) level at a time, as the beam step computes it
            logprobs = (states[:, :, level] @ self.heads[level].T).float().log_softmax(-1)
            total = total + logprobs.gather(2, codes[:, :, level, None]).squeeze(2)
        return total

    def loss(
        self, history_codes: Tensor, history_mask: Tensor | None, target_codes: Tensor, history_items: Tensor | None = None
    ) -> Tensor:  # fmt: skip
        """Mean cross-entropy of each target SID's digits given the history (teacher forcing)."""
        return self.loss_and_user(history_codes, history_mask, target_codes, history_items)[0]

    def loss_and_user(
        self, history_codes: Tensor, history_mask: Tensor | None, target_codes: Tensor, history_items: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """(``loss``, the (B, item_width) dense user vectors or None without a dense head) from one encoder pass: the
        dense head's loss (``recforge.train.losses``) scores the user vectors against ``dense_item_vectors()``."""
        memory = self.start(history_codes, history_mask, history_items)
        states = self.decode(memory, target_codes[:, None, :-1])[:, 0]  # (B, L, d)
        logits = torch.einsum("bld,lvd->blv", states, self.heads)  # (B, L, V)
        return F.cross_entropy(logits.float().flatten(0, 1), target_codes.flatten()), memory.user
