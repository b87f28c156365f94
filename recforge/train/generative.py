"""Recipe: generative retrieval over semantic IDs, ``recipe: generative``.

``model.kind: tiger`` is a TIGER-style encoder-decoder, ``sid_hstu`` a decoder-only HSTU over SID tokens.

    cfg = load_config("configs/beauty-sid-tiger.yaml")
    summary = train(cfg)                  # setup -> epochs of steps -> checkpoints -> final eval
    metrics = evaluate_run(cfg.run_dir)   # what `recforge eval RUN_DIR` runs

Same splits, loop, checkpoints, resume and evaluation protocol as the retrieval recipe. Every
training transition is an example (sliding windows, ``recforge.data.sid_sequences``). The SIDs
(``generative.sids``, made by `recforge sid fit`) are copied into ``RUN_DIR/sids`` so the run
carries the codes its model was trained on.

Evaluation is item-level: beam search generates ``generative.beam`` valid SIDs per user, each
resolves to its items (a SID shared by several items yields them all, cut at the list length),
the user's other history items are excluded (during the search when
``generative.exclude_seen_in_search``), and HR@k / NDCG@k are taken from the target's position
in that list. A target outside the list is a miss; MRR is therefore a lower bound.

``generative.item_id_embedding`` (tiger) also feeds each history item's ID to the encoder: its table has a
row per item of the training catalogue (dense index = row), and the model saves each row's raw ID with its
weights, so serving maps raw IDs to rows without the dataset (an item coded after training reads row 0).

``generative.dense_head`` (tiger, LIGER) trains a dense head on the same encoder: its loss adds
``generative.dense_weight`` x the full-catalogue softmax cross-entropy of the user vector against every
item's row (``sampled_softmax_loss`` with ``negatives=full``, ``loss.temperature``, chunked as
``loss.chunk_size``) to the SID loss. Its table shares the item-ID table's rows and saved raw IDs.
``generative.rescore`` > 0 then re-sorts each user's generated items by ``log p(SID) + rescore *
cos(user, item) / loss.temperature`` (``recforge.generate.beam_search.rescore_items``, the path serving
takes too). ``generative.dense_candidates`` = K > 0 adds the dense head's top K items (not in the user's history)
to the beam's before that ranking (``beam_search.add_dense_candidates``; their log p(SID) teacher forced), so a
target outside the beam can still be hit; it can be set at evaluation only (``recforge eval RUN
generative.dense_candidates=200 --split valid``). The list's metrics are item-level as before.

``generative.dense_init: RUN_DIR`` initialises those item tables from a trained retrieval run's item embeddings
(``recforge.train.dense_init``: rows by raw item ID, leakage checked, width ``generative.item_dim``);
``generative.dense_freeze`` keeps them fixed. ``generative.dense_distill`` = w > 0 also makes that run a frozen teacher
of the dense head: each training step adds w x KL(teacher || dense head) over the whole catalogue
(``recforge.train.dense_distill``); only training (a new or resumed run) loads it.

``generative.dense_scorer: RUN_DIR`` (tiger or sid_hstu, with or without a dense head) makes a trained ID-retrieval run
(SASRec / HSTU, ``recipe: retrieval``, on the same dataset) the dense side of ``rescore`` and ``dense_candidates`` in
place of the dense head: an item's dense logit is that run's user vector for the history (its own
``data.max_seq_len`` most recent items) . its L2-normalised item row / its ``loss.temperature``
(``recforge.generate.dense_scorer.DenseScorer``, checked as ``dense_init``'s run; the Retriever's path too). Every
setup of the run (training, resuming, evaluating) loads it; ``eval.json`` records its provenance (``dense_scorer``:
run directory, checkpoint, step, data and weights digests). It can be set at evaluation only: ``recforge eval RUN
generative.dense_scorer=runs/beauty-sasrec-collab generative.rescore=1 generative.dense_candidates=200 --split valid``.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from recforge.checkpoint import load_checkpoint, resume_candidates
from recforge.config import RunConfig
from recforge.io import atomic_directory
from recforge.data.dataset import load_dataset
from recforge.data.sequences import PROTOCOL_HOLDOUT, UserSequences
from recforge.data.sid_sequences import eval_samples, history_windows, seen_mask, transition_samples
from recforge.data.sids import SIDS_FILE, check_embedding_run, read_sids
from recforge.generate import DenseCandidates, SidTrie, search_items
from recforge.generate.dense_scorer import DenseScorer
from recforge.generate.sid_run import build_sid_model, read_run, sid_dir_of, uses_item_table
from recforge.models.sid_hstu import SIDHSTU
from recforge.models.sid_seq2seq import SIDSeq2Seq
from recforge.jagged.batch import JaggedBatch
from recforge.train.dense_distill import distill_kl, load_teacher
from recforge.train.dense_init import freeze_item_tables, init_item_tables, item_table_from_run
from recforge.train.distributed import DistContext, init_distributed
from recforge.train.losses import sampled_softmax_loss
from recforge.train.loop import prepare_run_dir, run_loop
from recforge.train.metrics import retrieval_metrics
from recforge.train.run_files import check_eval_split, invoked_command, write_eval
from recforge.train.runtime import prepare_runtime
from recforge.train.step import StepRunner


@dataclass
class Setup:
    cfg: RunConfig
    seqs: UserSequences
    item_codes: torch.Tensor  # (num_items + 1, L) SID of each dense item index (row 0: padding, zeros)
    trie: SidTrie  # over items 1..num_items (trie item i = dense item i + 1), on the device
    model: SIDSeq2Seq | SIDHSTU
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    holdout: int
    ctx: DistContext = field(default_factory=DistContext)
    runner: StepRunner | None = None  # the training step (dense wrapper + optimizer, see recforge.train.step)
    teacher: DenseScorer | None = None  # generative.dense_distill's frozen retrieval run (training only)
    scorer: DenseScorer | None = None  # generative.dense_scorer's retrieval run: the dense side of evaluation


@dataclass
class SidBatch:
    """Training examples of the generative recipe: histories as SID digits and the next item's digits."""

    history: torch.Tensor  # (B, T, L) SID digits of each history item (0: padding)
    mask: torch.Tensor  # (B, T) bool, True at real history items
    targets: torch.Tensor  # (B, L) the target item's digits
    num_tokens: int  # SID tokens in the histories (counted on the host)
    items: torch.Tensor | None = None  # (B, T) dense item index of each history item (0: padding); item-ID models only
    target_items: torch.Tensor | None = None  # (B,) dense item index of each target; dense-head models only
    teacher: JaggedBatch | None = None  # the same histories as the distillation teacher's input (dense_distill only)

    def to(self, device: torch.device, non_blocking: bool = False) -> SidBatch:
        move = lambda t: t.to(device, non_blocking=non_blocking) if t is not None else None  # noqa: E731
        return SidBatch(move(self.history), move(self.mask), move(self.targets), self.num_tokens, move(self.items),
                        move(self.target_items), move(self.teacher))  # fmt: skip


def setup(
    cfg: RunConfig, sid_dir: Path | None = None, ctx: DistContext | None = None, *, fresh: bool = False,
    teacher: bool = False,
) -> Setup:  # fmt: skip
    """Load data and SIDs, build the model and its training step (deterministically from ``cfg.train.seed``).
    ``ctx``: the ``torchrun`` job this process is part of (None: one process); ``fresh``: a new training run (only it
    loads ``generative.dense_init``: a resumed or evaluated run reads every weight from its checkpoint); ``teacher``:
    a training run (new or resumed) loads ``generative.dense_distill``'s teacher (evaluation never does). Every setup
    loads ``generative.dense_scorer``'s run (evaluation scores with it)."""
    device = prepare_runtime(cfg)
    ctx = ctx or DistContext()
    dataset = load_dataset(cfg.data.path)
    sids = read_sids(sid_dir or sid_dir_of(cfg))
    check_embedding_run(sids.meta, dataset.events, cfg.data.protocol, cfg.data.path)  # no held-out item shaped the SIDs
    seqs = UserSequences.from_dataset(dataset)
    codes = sids.codes_for(seqs.item_vocab[1:])  # (N, L)
    item_codes = torch.cat([torch.zeros(1, codes.shape[1], dtype=torch.long), codes])
    trie = SidTrie.build(codes, sids.vocab_size, cfg.generative.trie).to(device)
    torch.manual_seed(cfg.train.seed)
    model = build_sid_model(cfg, sids.num_levels, sids.vocab_size, seqs.num_items).to(device)
    if uses_item_table(cfg):  # the tables' rows are the dense item indices
        model.set_item_vocab(torch.from_numpy(seqs.item_vocab).to(device))
    if fresh and cfg.generative.dense_init:
        init_item_tables(model, item_table_from_run(cfg.generative.dense_init, cfg, seqs.item_vocab))
    if cfg.generative.dense_freeze:  # before the optimizer is built: it steps only trainable parameters
        freeze_item_tables(model)
    s = Setup(cfg, seqs, item_codes, trie, model, None, device, PROTOCOL_HOLDOUT[cfg.data.protocol], ctx)
    s.runner = StepRunner(cfg, model, device, ctx, loss_fn=lambda b: _loss(s, b), units_fn=lambda b: b.targets.shape[0])
    s.optimizer = s.runner.optimizer
    if teacher and cfg.generative.dense_distill:
        s.teacher = load_teacher(cfg, seqs, device)
    if cfg.generative.dense_scorer:
        s.scorer = DenseScorer.load(cfg.generative.dense_scorer, cfg, seqs.item_vocab, device,
                                    f"generative.dense_scorer={cfg.generative.dense_scorer}")  # fmt: skip
    return s


def _inputs(s: Setup, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(history codes (B, T, L), mask (B, T), item-ID rows (B, T) or None, targets (B,) on the host) of ``samples``."""
    items, mask, targets = history_windows(s.seqs, samples, s.cfg.data.max_seq_len)
    rows = items.to(s.device) if s.model.reads_item_ids else None
    return s.item_codes[items].to(s.device), mask.to(s.device), rows, targets


def training_batch(s: Setup, samples: torch.Tensor) -> SidBatch:
    """The CPU batch of training transitions ``samples`` (the loop moves it to the device)."""
    items, mask, targets = history_windows(s.seqs, samples, s.cfg.data.max_seq_len)
    history = s.item_codes[items]
    rows = items if s.model.reads_item_ids else None
    target_items = targets if s.cfg.generative.dense_head else None
    teacher = s.teacher.batch(s.seqs, samples) if s.teacher is not None else None
    return SidBatch(history, mask, s.item_codes[targets], int(mask.sum()) * history.shape[2], rows, target_items,
                    teacher)  # fmt: skip


def _loss(s: Setup, batch: SidBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, loss to log) of a device batch: mean cross-entropy over its targets' digits, plus with a dense
    head ``dense_weight`` x its softmax cross-entropy over the whole catalogue, plus with a teacher ``dense_distill`` x
    KL(teacher || dense head) over the whole catalogue (items 1..N on both sides)."""
    if batch.target_items is None:
        loss = s.model.loss(batch.history, batch.mask, batch.targets, batch.items)
        return loss, loss
    sid_loss, user = s.model.loss_and_user(batch.history, batch.mask, batch.targets, batch.items)
    dense_loss = sampled_softmax_loss(
        user, batch.target_items, s.model.dense_item_vectors, s.seqs.num_items, negatives="full",
        temperature=s.cfg.loss.temperature, chunk_size=s.cfg.loss.chunk_size, matmul=s.cfg.loss.matmul,
    )  # fmt: skip
    loss = sid_loss + s.cfg.generative.dense_weight * dense_loss
    if batch.teacher is not None:
        student = s.model.catalogue_dense_logits(user, s.teacher.rows)  # (B, N)
        loss = loss + s.cfg.generative.dense_distill * distill_kl(student, s.teacher.logits(batch.teacher))
    return loss, loss


@torch.no_grad()
def generated_items(s: Setup, samples: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(items (B, k) dense indices (0: empty slot), scores (B, k), targets (B,)) on the host: each sample's
    generated list, its user's earlier items excluded (the target never is, as in ``target_ranks``)."""
    history, mask, rows, targets = _inputs(s, samples)
    seen = seen_mask(s.seqs, samples)
    seen[torch.arange(targets.numel()), targets] = False
    allowed_items = (~seen[:, 1:]).to(s.device)  # over trie items
    was_training = s.model.training
    s.model.eval()
    memory = s.model.start(history, mask, rows)
    # trie item i is dense item i + 1, the dense table's row i + 1 (-1, an empty slot: row 0, no dense term)
    g, dense, candidates = s.cfg.generative, None, None
    if s.scorer is not None and (g.rescore or g.dense_candidates):  # the retrieval run scores in the head's place
        user = s.scorer.user_vectors(s.scorer.batch(s.seqs, samples).to(s.device))  # (B, d)
        dense = lambda trie_items: s.scorer.item_logits(user, trie_items + 1)  # noqa: E731
        if g.dense_candidates:  # the run's top items join the beam's (the Retriever's path too)
            candidates = DenseCandidates.of_scorer(s.scorer, user, s.model, memory, s.item_codes[1:].to(s.device),
                                                   g.dense_candidates)  # fmt: skip
    elif g.dense_head:
        dense = lambda trie_items: s.model.dense_logits(memory.user, trie_items + 1)  # noqa: E731
        if g.dense_candidates:  # the dense head's top items join the beam's (the Retriever's path too)
            rows = torch.arange(1, s.trie.num_items + 1, device=s.device)  # trie item i: dense table row i + 1
            candidates = DenseCandidates.of_model(s.model, memory, rows, s.item_codes[1:].to(s.device),
                                                  g.dense_candidates)  # fmt: skip
    items, scores = search_items(lambda c: s.model.next_token_logprobs(memory, c), s.trie, batch_size=targets.numel(),
                                 beam=g.beam, k=k, item_mask=allowed_items,
                                 search_mask=allowed_items if g.exclude_seen_in_search else None,
                                 dense=dense, rescore=g.rescore, candidates=candidates)  # fmt: skip
    s.model.train(was_training)
    return items.cpu() + 1, scores.cpu(), targets


def generated_ranks(s: Setup, samples: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) 0-based position of each sample's target in its generated item list (``num_items``: a miss)."""
    items, scores, targets = generated_items(s, samples, k)
    hit = items == targets[:, None]  # (B, k); empty slots (0) never match an item
    first = hit.int().argmax(1)
    # items sharing the target's SID (no collision level) tie with it: ties count against the target,
    # as in the ID models' target_ranks, so its rank is the last slot holding its score (re-scored by a dense head,
    # items of one SID tie only when neither has a dense row: the head's scores tell the others apart)
    tied = scores == scores.gather(1, first[:, None])
    last_tie = torch.where(tied, torch.arange(k), -1).amax(1)
    return torch.where(hit.any(1), last_tie, s.seqs.num_items)


def _evaluate(s: Setup, target_from_end: int) -> dict[str, float]:
    users = s.seqs.evaluable_users(target_from_end)
    k = max(s.cfg.eval_ks)
    ranks = [
        generated_ranks(s, eval_samples(s.seqs, users[i : i + s.cfg.eval.batch_size], target_from_end), k)
        for i in range(0, users.numel(), s.cfg.eval.batch_size)
    ]
    all_ranks = torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)
    metrics = retrieval_metrics(all_ranks, s.cfg.eval_ks)
    metrics["num_users"] = int(all_ranks.numel())
    return metrics


def _eval_during_training(s: Setup) -> tuple[str, dict[str, float]]:
    split = "test" if s.cfg.data.protocol == "paper" else "valid"
    return split, _evaluate(s, target_from_end=1 if split == "test" else 2)


def _copy_sids(cfg: RunConfig, run_dir: Path, resume: bool) -> Path:
    """The run's own copy of its SIDs (``RUN_DIR/sids``). A new run replaces it atomically from
    ``generative.sids`` (a copy left by an attempt that never checkpointed must not survive a changed
    setting); a resumed run keeps it and refuses a ``generative.sids`` that now holds other codes."""
    target, source = run_dir / "sids", sid_dir_of(cfg)
    if resume and (target / SIDS_FILE).is_file():
        if (source / SIDS_FILE).is_file() and _digest(source / SIDS_FILE) != _digest(target / SIDS_FILE):
            raise ValueError(
                f"generative.sids={source} holds other SIDs than the ones {run_dir} was trained on; resume with "
                f"generative.sids={target}, or start a new run (another train.output_dir or name)"
            )
        return target
    read_sids(source)  # fails with a clear message when the SIDs are missing
    with atomic_directory(target) as tmp:
        for path in source.iterdir():
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
    return target


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train(cfg: RunConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Train per ``cfg``; return a summary with the final evaluation.

    Example:
        >>> summary = train(load_config("configs/beauty-sid-tiger.yaml", ["train.epochs=1"]))
        >>> summary["ndcg@10"]
    """
    ctx = init_distributed(cfg, prepare_runtime(cfg))
    run_dir = prepare_run_dir(cfg, resume)
    ctx.barrier()  # every rank has checked the run directory before any writes to it
    sid_dir = _copy_sids(cfg, run_dir, resume) if ctx.is_main else run_dir / "sids"
    ctx.barrier()  # rank 0 copied the SIDs every rank reads
    s = setup(cfg, sid_dir, ctx, fresh=not resume, teacher=True)
    if resume and uses_item_table(cfg):
        _check_resumed_catalogue(run_dir, s)
    samples = transition_samples(s.seqs, s.holdout)
    state = run_loop(
        cfg, model=s.model, optimizer=s.optimizer, device=s.device, num_samples=samples.shape[0],
        build=lambda ids: training_batch(s, samples[ids]), step=lambda micro, lr_scale: s.runner(micro, lr_scale),
        evaluate=lambda: _eval_during_training(s), manifest={"num_items": s.seqs.num_items,
        "sid_levels": s.item_codes.shape[1]}, resume=resume, progress=progress, show_keys=("hr@10", "ndcg@10"), ctx=ctx,
    )  # fmt: skip
    ctx.barrier()
    if not ctx.is_main:
        return {"train_minutes": state["train_minutes"]}
    summary = evaluate_run(run_dir)
    summary.update({k: state[k] for k in ("train_minutes", "stop_reason", "stop_message")})
    return summary


def _check_resumed_catalogue(run_dir: Path, s: Setup) -> None:
    """Refuse to resume a run with item tables (``generative.item_id_embedding``, ``dense_head``) on another item
    catalogue: the tables' rows are the training catalogue's items (``item_id_vocab``), and resuming would train
    them as other items."""
    for ckpt in resume_candidates(run_dir)[0]:
        try:
            with safe_open(ckpt / "model.safetensors", "pt") as f:
                saved = f.get_tensor("item_id_vocab") if "item_id_vocab" in f.keys() else None
        except (OSError, SafetensorError):
            continue  # a damaged candidate: the resume goes on to the next one, as loading does
        if saved is not None:
            _check_item_table(ckpt, saved, s, "resume on the dataset the run was trained on, or start a new run")
        return  # the checkpoint the resume loads


def _check_item_table(ckpt: Path, saved_vocab: torch.Tensor, s: Setup, fix: str) -> None:
    """``ValueError`` (saying ``fix``) unless the item tables' raw IDs (``item_id_vocab``) are ``s``'s catalogue."""
    if not torch.equal(saved_vocab.cpu(), torch.from_numpy(s.seqs.item_vocab)):
        raise ValueError(f"{ckpt}: its item tables were trained on another item catalogue than {s.cfg.data.path}'s "
                         f"(generative.item_id_embedding / dense_head); {fix}")  # fmt: skip


def load_run(run_dir: str | Path, checkpoint: str = "auto", overrides: list[str] | None = None) -> tuple[Setup, Path, dict]:
    """(setup with the checkpoint's weights, checkpoint path, manifest) of a generative run."""
    cfg, ckpt = read_run(run_dir, checkpoint, overrides)
    s = setup(cfg, Path(run_dir) / "sids")
    manifest = load_checkpoint(ckpt, s.model, device=s.device)
    if uses_item_table(s.cfg):
        _check_item_table(ckpt, s.model.item_id_vocab, s, "evaluate on the dataset the run was trained on")
    s.model.eval()
    return s, ckpt, manifest


def evaluate_run(
    run_dir: str | Path, *, checkpoint: str = "auto", split: str = "test", command: str | None = None,
    overrides: list[str] | None = None,
) -> dict:  # fmt: skip
    """Evaluate a trained generative run on the test (or validation) target and write ``eval.json``
    (``eval-valid.json`` for the validation split).

    ``overrides`` change the run's config for this evaluation only, e.g. ``["generative.beam=100",
    "eval.ks=[10,50,100]"]`` or ``["generative.dense_scorer=runs/beauty-sasrec-collab", "generative.rescore=1"]``
    (what `recforge eval` runs uses the run's own settings). The result records the settings and, with a dense
    scorer, its provenance (``dense_scorer``: run directory, checkpoint, step, interactions and weights digests).
    """
    s, ckpt, manifest = load_run(run_dir, checkpoint, overrides)
    check_eval_split(s.cfg, split)
    started = time.perf_counter()
    metrics = _evaluate(s, target_from_end=1 if split == "test" else 2)
    result = {
        **metrics, "split": split, "protocol": s.cfg.data.protocol, "model": s.cfg.model.kind,
        "dataset": Path(s.cfg.data.path).name, "checkpoint": ckpt.name, "step": manifest["step"],
        "beam": s.cfg.generative.beam, "rescore": s.cfg.generative.rescore,
        "dense_candidates": s.cfg.generative.dense_candidates, "sids": read_sids(Path(run_dir) / "sids").meta["source"],
        "dense_scorer": s.scorer.provenance if s.scorer is not None else None,
        "eval_seconds": time.perf_counter() - started,
        "command": command or invoked_command(),
    }  # fmt: skip
    write_eval(run_dir, split, result)
    return result
