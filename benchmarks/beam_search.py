"""Generative retrieval latency: the whole retrieve path vs a naive host-masked beam loop.

Usage:
    python benchmarks/beam_search.py --quick --out benchmarks/results/beam_search-cpu-2core.json
    python benchmarks/beam_search.py --device cuda --dtype bfloat16 --out benchmarks/results/beam_search-h200.json

A randomly initialised ``SIDSeq2Seq`` (weights do not change the work) and a random catalogue
of ``--items`` items with 3 random digits of ``--vocab`` + a collision digit (4 levels). Each
request is a history of ``--history`` items (x 4 = SID tokens; 1,250 items = 5,000 tokens).

- path: ``Retriever``'s work for a batch: encode the histories once, constrained beam search
  (trie gather + mask + top-k on the device, no host sync inside), SID -> items, one copy of
  the result to the host. p50 / p99 over ``--repeats`` batches.
- engine: the same through the retrieve engine (``Retriever.retrieve_requests``, what ``/v1/retrieve``
  runs): raw-ID requests checked and mapped, the requests' history items excluded inside the
  search (per-request item masks -> allowed trie nodes), one host copy. ``engine_allowed`` adds a
  per-request allowed set of ``--allowed`` items (the seed's dynamic restriction).
- encode / search: the two parts alone (search reuses one encoding).
- naive: the same model and encoding, but each step copies the beams' prefixes to the host,
  looks their valid next digits up in a Python dict trie and writes them into the mask one
  beam at a time (``mask[row, allowed] = 0``), as Hugging Face's ``prefix_allowed_tokens_fn``
  does. Its encoding is not timed, so the ratio isolates the search.
- state: bytes of the decode state kept between steps (digits, scores, trie nodes) and, on CUDA,
  the peak extra memory of a search, per beam width.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _machine import cpu_model  # noqa: E402

from recforge.generate import RetrieveConfig, RetrieveRequest, Retriever, SidTrie, beam_search, resolve_items  # noqa: E402
from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig  # noqa: E402
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq  # noqa: E402
from recforge.models.sid_tokenizer import add_collision_level  # noqa: E402
from recforge.io import atomic_write_json


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def pct(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def naive_search(model: SIDSeq2Seq | SIDHSTU, memory, trie_dict: dict, batch: int, beam: int, levels: int, vocab: int, device):
    """Beam search with the valid-digit mask built on the host, one beam row at a time."""
    scores = torch.zeros(batch, 1, device=device)
    codes = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)
    for level in range(levels):
        logp = model.next_token_logprobs(memory, codes)  # (B, W, V)
        width = logp.shape[1]
        mask = torch.full((batch * width, vocab), float("-inf"), device=device)
        for row, prefix in enumerate(codes.view(batch * width, level).tolist()):  # host sync every step
            allowed = trie_dict.get(tuple(prefix))
            if allowed:
                mask[row, allowed] = 0.0  # one small device write per beam
        cand = (scores[..., None] + logp + mask.view(batch, width, vocab)).view(batch, -1)
        scores, flat = cand.topk(min(beam, width * vocab), dim=1)
        parent, token = flat // vocab, flat % vocab
        codes = torch.cat([codes.gather(1, parent[..., None].expand(-1, -1, level)), token[..., None]], 2)
    return codes, scores


def shape_args(description: str) -> argparse.ArgumentParser:
    """The retrieve-path shapes every generative benchmark takes (the seed's: batch 8, 1,250 items, beam 256)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU check")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--history", type=int, default=1250, help="history items (x 4 SID tokens)")
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--beam", type=int, default=256)
    p.add_argument("--k", type=int, default=256, help="items returned per request")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    p.add_argument("--heads", type=int, default=4)
    return p


def main() -> None:
    p = shape_args(__doc__.split("\n")[0])
    p.add_argument("--model", default="tiger", choices=("tiger", "sid_hstu"),
                   help="tiger: encoder-decoder; sid_hstu: decoder-only HSTU (--layers blocks)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--naive-repeats", type=int, default=5)
    p.add_argument("--state-beams", default="64,128,256,512")
    p.add_argument("--trie", default="dense", choices=("dense", "csr"), help="SidTrie layout")
    p.add_argument("--allowed", type=int, default=20_000, help="engine_allowed: allowed items per request")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.quick:
        args.batch, args.history, args.items, args.vocab, args.beam, args.k = 2, 40, 3000, 32, 32, 32
        args.dim, args.layers, args.repeats, args.naive_repeats, args.state_beams = 64, 2, 5, 2, "8,16,32"
        args.allowed = 500
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    codes = add_collision_level(torch.randint(args.vocab, (args.items, 3)))
    vocab = max(args.vocab, int(codes.max()) + 1)
    levels = codes.shape[1]
    trie = SidTrie.build(codes, vocab, args.trie).to(device)
    trie_dict: dict = {}
    for row in codes.tolist():
        for t in range(levels):
            trie_dict.setdefault(tuple(row[:t]), set()).add(row[t])
    trie_dict = {key: sorted(v) for key, v in trie_dict.items()}
    if args.model == "tiger":
        model = SIDSeq2Seq(Seq2SeqConfig(num_levels=levels, vocab_size=vocab, dim=args.dim, encoder_layers=args.layers,
                                         decoder_layers=args.layers, num_heads=args.heads, ffn_dim=4 * args.dim,
                                         dropout=0.0, max_items=args.history))  # fmt: skip
    else:
        model = SIDHSTU(SIDHSTUConfig(num_levels=levels, vocab_size=vocab, dim=args.dim, num_blocks=args.layers,
                                      num_heads=args.heads, dropout=0.0, max_items=args.history))  # fmt: skip
    model = model.to(device=device, dtype=dtype).eval()
    history_items = torch.randint(args.items, (args.batch, args.history))  # (B, H) item rows, raw ID = row + 1
    history = codes[history_items].to(device)  # (B, H, L)
    engine = Retriever(model, torch.arange(args.items + 1).numpy(), torch.cat([codes[:1] * 0, codes]), trie, args.history,
                       RetrieveConfig(beam=args.beam, max_k=args.k, max_batch=args.batch))  # fmt: skip
    requests = [RetrieveRequest((row + 1).tolist(), k=args.k) for row in history_items]
    allowed = [RetrieveRequest(r.history, k=args.k, allowed_items=torch.randperm(args.items)[: args.allowed].add(1).tolist())
               for r in requests]  # fmt: skip

    @torch.no_grad()
    def path():
        memory = model.start(history, None)
        out = beam_search(lambda c: model.next_token_logprobs(memory, c), trie, batch_size=args.batch, beam=args.beam)
        items, scores = resolve_items(out, trie, args.k)
        return items.cpu(), scores.cpu()

    with torch.no_grad():
        memory = model.start(history, None)
        search = lambda: beam_search(lambda c: model.next_token_logprobs(memory, c), trie, batch_size=args.batch, beam=args.beam)
        naive = lambda: naive_search(model, memory, trie_dict, args.batch, args.beam, levels, vocab, device)
        for fn in (path, search, naive, lambda: engine.retrieve_requests(allowed)):  # warm-up
            fn()
        rows = {
            "path": timed(path, device, args.repeats),
            "engine": timed(lambda: engine.retrieve_requests(requests), device, args.repeats),
            "engine_allowed": timed(lambda: engine.retrieve_requests(allowed), device, args.repeats),
            "encode": timed(lambda: model.start(history, None), device, args.repeats),
            "search": timed(search, device, args.repeats),
            "naive": timed(naive, device, args.naive_repeats),
        }
        fast_codes, naive_codes = search().codes, naive()[0]
        same = float((fast_codes == naive_codes).all(-1).double().mean())
        keep_history = [RetrieveRequest(r.history, k=args.k, exclude_history=False) for r in requests]
        engine_items = [r.items for r in engine.retrieve_requests(keep_history)]  # raw ID = item row + 1
        path_items = [[i + 1 for i in row if i >= 0] for row in path()[0].tolist()]
        same_engine = float(sum(a == b for a, b in zip(engine_items, path_items, strict=True)) / len(path_items))
        state = []
        for w in (int(x) for x in args.state_beams.split(",")):
            persistent = args.batch * w * (levels * 8 + 4 + 8)  # digits int64, scores float32, nodes int64
            peak = None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                beam_search(lambda c: model.next_token_logprobs(memory, c), trie, batch_size=args.batch, beam=w)
                sync(device)
                peak = torch.cuda.max_memory_allocated(device) - base
            state.append({"beam": w, "state_bytes": persistent, "search_peak_bytes": peak})
    summary = {name: {"p50_ms": pct(t, 0.5), "p99_ms": pct(t, 0.99), "mean_ms": statistics.fmean(t), "runs": len(t)}
               for name, t in rows.items()}  # fmt: skip
    speedup = summary["naive"]["p50_ms"] / summary["search"]["p50_ms"]
    print(f"{'part':<16}{'p50 ms':>10}{'p99 ms':>10}{'runs':>6}")
    for name, row in summary.items():
        print(f"{name:<16}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{row['runs']:>6}")
    print(f"search vs naive host-masked loop: {speedup:.1f}x (p50); same SIDs in {same:.1%} of beams")
    print(f"engine without history exclusion returns the path's items for {same_engine:.0%} of requests")
    print(f"{'beam':>6}{'state KiB':>12}{'search peak MiB':>18}")
    for row in state:
        peak = f"{row['search_peak_bytes'] / 2**20:.1f}" if row["search_peak_bytes"] is not None else "-"
        print(f"{row['beam']:>6}{row['state_bytes'] / 1024:>12.1f}{peak:>18}")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()} ({torch.get_num_threads()} threads)"
    result = {
        "benchmark": "beam_search", "machine": machine, "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": "python " + " ".join(sys.argv), "torch": torch.__version__, "args": vars(args),
        "sid_tokens_per_request": args.history * levels, "trie_bytes": trie.nbytes(), "summary": summary,
        "speedup_vs_naive_p50": speedup, "same_sids_fraction": same, "engine_equals_path_fraction": same_engine,
        "state": state,
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
