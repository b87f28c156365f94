"""The extra cost of LIGER's dense candidates on the `/v1/retrieve` path (``generative.dense_candidates``).

Usage:
    python benchmarks/retrieve_dense_candidates.py --quick --out benchmarks/results/retrieve_dense_candidates-cpu-2core.json
    python benchmarks/retrieve_dense_candidates.py --device cuda --dtype bfloat16 \
        --out benchmarks/results/retrieve_dense_candidates-h200.json

A randomly initialised ``SIDSeq2Seq`` with a dense head over every item (weights do not change the work) and a
random catalogue of ``--items`` items with 3 random digits of ``--vocab`` + a collision digit, the shapes of
``benchmarks/beam_search.py``. Each row times ``Retriever.retrieve_requests`` (what ``/v1/retrieve`` runs: encode,
beam search with the history excluded, re-scoring, one host copy) for ``--batch`` requests of ``--history`` items,
with ``rescore`` 1 and ``dense_candidates`` 0 (the beam's items only: today's path) and each of ``--candidates``.
``score_only`` / ``catalogue_only`` time the two added parts alone on one encoding: the teacher-forced log p(SID) of
K SIDs per request (one decoder pass) and the dense logits of the whole catalogue (one matmul) with its top-K.

Checks, in the same run (``checks``): a beam SID's teacher-forced score equals the beam's own (largest difference),
and with room for every candidate (``k = beam + K``) each request's list holds its dense top-K (history excluded)
and every item of the K = 0 list with the same score.
"""

from __future__ import annotations

import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _machine import cpu_model  # noqa: E402
from beam_search import pct, shape_args, timed  # noqa: E402

from recforge.generate import RetrieveConfig, RetrieveRequest, Retriever, SidTrie, beam_search  # noqa: E402
from recforge.io import atomic_write_json  # noqa: E402
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq  # noqa: E402
from recforge.models.sid_tokenizer import add_collision_level  # noqa: E402


def checks(model: SIDSeq2Seq, engines: dict[int, Retriever], requests: list[RetrieveRequest], history: torch.Tensor,
           trie: SidTrie, beam: int) -> dict:  # fmt: skip
    """What must hold for the timed rows to mean anything (see the module docstring)."""
    with torch.no_grad():
        memory = model.start(history, None)
        out = beam_search(lambda c: model.next_token_logprobs(memory, c), trie, batch_size=history.shape[0], beam=beam)
        score_diff = float((model.sid_log_probs(memory, out.codes) - out.scores).abs().max())
        rows = torch.arange(1, trie.num_items + 1, device=history.device)  # trie item i: raw ID / dense row i + 1
        logits = model.catalogue_dense_logits(memory.user, rows)
    result = {"max_teacher_forced_vs_beam_score_diff": score_diff}
    base = engines[0].retrieve_requests([RetrieveRequest(r.history, k=beam) for r in requests])
    for count, engine in engines.items():
        if not count:
            continue
        got = engine.retrieve_requests([RetrieveRequest(r.history, k=beam + count) for r in requests])
        has_dense_top, keeps_beam, diff = 0, 0, 0.0
        for row, (req, answer, plain) in enumerate(zip(requests, got, base, strict=True)):
            masked = logits[row].clone()
            masked[torch.tensor(req.history, device=masked.device) - 1] = float("-inf")
            top = (masked.topk(count).indices + 1).tolist()
            has_dense_top += set(top) <= set(answer.items)
            scores = dict(zip(answer.items, answer.scores, strict=True))
            keeps_beam += set(plain.items) <= set(scores)
            diff = max([diff, *(abs(scores[i] - s) for i, s in zip(plain.items, plain.scores, strict=True) if i in scores)])
        result[f"K={count}"] = {"requests_with_dense_top_k": has_dense_top / len(requests),
                                "requests_with_every_beam_item": keeps_beam / len(requests),
                                "max_beam_item_score_diff": diff}  # fmt: skip
    return result


def main() -> None:
    p = shape_args(__doc__.split("\n")[0])
    p.add_argument("--candidates", default="100,500", help="dense_candidates values timed next to 0")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.quick:
        args.batch, args.history, args.items, args.vocab, args.beam, args.k = 2, 40, 3000, 32, 32, 32
        args.dim, args.layers, args.repeats, args.candidates = 64, 2, 5, "10,50"
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    counts = [int(x) for x in args.candidates.split(",")]
    torch.manual_seed(0)
    codes = add_collision_level(torch.randint(args.vocab, (args.items, 3)))
    vocab, levels = max(args.vocab, int(codes.max()) + 1), codes.shape[1]
    trie = SidTrie.build(codes, vocab).to(device)
    model = SIDSeq2Seq(Seq2SeqConfig(num_levels=levels, vocab_size=vocab, dim=args.dim, encoder_layers=args.layers,
                                     decoder_layers=args.layers, num_heads=args.heads, ffn_dim=4 * args.dim, dropout=0.0,
                                     max_items=args.history, dense_items=args.items))  # fmt: skip
    model.set_item_vocab(torch.arange(args.items + 1))  # raw ID r = dense row r (row 0: padding)
    model = model.to(device=device, dtype=dtype).eval()
    history_items = torch.randint(args.items, (args.batch, args.history))  # (B, H) trie items, raw ID = item + 1
    history = codes[history_items].to(device)  # (B, H, L)
    max_k = args.beam + max(counts)
    engines = {count: Retriever(model, torch.arange(args.items + 1).numpy(), torch.cat([codes[:1] * 0, codes]), trie,
                                args.history, RetrieveConfig(beam=args.beam, max_k=max_k, max_batch=args.batch),
                                rescore=1.0, dense_candidates=count)  # fmt: skip
               for count in [0, *counts]}  # fmt: skip
    requests = [RetrieveRequest((row + 1).tolist(), k=args.k) for row in history_items]
    rows_all = torch.arange(1, args.items + 1, device=device)
    with torch.no_grad():
        memory = model.start(history, None)
        rows: dict[str, list[float]] = {}
        for count, engine in engines.items():
            engine.retrieve_requests(requests)  # warm-up
            rows[f"engine_K={count}"] = timed(lambda e=engine: e.retrieve_requests(requests), device, args.repeats)
        for count in counts:
            sids = codes[torch.randint(args.items, (args.batch, count))].to(device)  # (B, K, L)
            model.sid_log_probs(memory, sids)
            rows[f"score_only_K={count}"] = timed(lambda s=sids: model.sid_log_probs(memory, s), device, args.repeats)
            top = lambda c=count: model.catalogue_dense_logits(memory.user, rows_all).topk(c, dim=1)  # noqa: E731
            top()
            rows[f"catalogue_only_K={count}"] = timed(top, device, args.repeats)
    checked = checks(model, engines, requests, history, trie, args.beam)
    summary = {name: {"p50_ms": pct(t, 0.5), "p99_ms": pct(t, 0.99), "mean_ms": statistics.fmean(t), "runs": len(t)}
               for name, t in rows.items()}  # fmt: skip
    base = summary["engine_K=0"]["p50_ms"]
    print(f"{'row':<24}{'p50 ms':>10}{'p99 ms':>10}{'+p50 vs K=0':>14}")
    for name, row in summary.items():
        extra = f"{row['p50_ms'] - base:>+14.2f}" if name.startswith("engine") else ""
        print(f"{name:<24}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{extra}")
    print("checks:", checked)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()} ({torch.get_num_threads()} threads)"
    result = {
        "benchmark": "retrieve_dense_candidates", "machine": machine,
        "date": datetime.datetime.now(datetime.UTC).isoformat(), "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__, "args": vars(args), "summary": summary, "checks": checked,
    }  # fmt: skip
    if args.out:
        atomic_write_json(Path(args.out), result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
