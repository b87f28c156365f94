"""HTTP `/v1/retrieve` latency: the whole serving path of a generative run, next to the engine alone.

Usage:
    python benchmarks/serve_retrieve.py --quick --out benchmarks/results/serve_retrieve-cpu-2core.json
    python benchmarks/serve_retrieve.py --device cuda --dtype bfloat16 --out benchmarks/results/serve_retrieve-h200.json
    python benchmarks/serve_retrieve.py --model sid_hstu --device cuda --dtype bfloat16 \
        --out benchmarks/results/serve_retrieve-hstu-h200.json

A randomly initialised ``SIDSeq2Seq`` (``--model tiger``) or decoder-only ``SIDHSTU`` (``--model sid_hstu``)
(as ``benchmarks/beam_search.py``: weights do not change the work)
over a random catalogue of ``--items`` items, 3 digits of ``--vocab`` + a collision digit. The server
(``recforge.serve.retrieve_app``, what `recforge serve` runs for a generative run: uvicorn, transport
limits, strict JSON, the batching worker) runs in a child process on loopback. Each round sends
``--batch`` requests at once (one thread and one kept-alive connection each), every request a history
of ``--history`` random items (x 4 = SID tokens; 1,250 items = 5,000 tokens), beam ``--beam``, ``--k``
items back; the worker batches them into one search (``--max-wait-ms``).

- http: per request, from send to parsed response (JSON both ways, queueing, the batched search);
  ``round`` is the slowest request of each round (the batch's wall time).
- engine: ``Retriever.retrieve_requests`` of the same requests in this process (no HTTP), after the
  server has stopped; the difference to ``http`` is the HTTP/JSON/batching overhead.
- the responses' items are compared with the engine's for the same requests (``same_items_fraction``).
- returning users (the history cache, ``generate.HistoryCache``), in this process: ``--batch`` users whose
  histories start at ``--history`` items and grow by 1-2 events every round; each round runs the batch
  cold (``returning_cold``: no cache), then cached (``returning_cached``: the decoder-only model extends
  each user's cached keys/values with the new events' tokens; the encoder-decoder must re-encode a
  changed history, so this is a miss for it), then the same requests again (``repeat_cached``: identical
  histories, a hit for both models). Cached answers must agree with the cold ones up to float rounding
  (``generate.agreement``: the same scores for the same items within ``ATOL``, near-tied items may swap or
  trade places at the cut; checked in float32, reported in bfloat16). The HTTP rows send a new
  ``user_id`` every round, so they stay cold (the server's cache is on).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _machine import cpu_model  # noqa: E402

from recforge.generate import HistoryCache, RetrieveConfig, RetrieveRequest, RetrieveResult, Retriever, SidTrie  # noqa: E402
from recforge.generate.agreement import compare  # noqa: E402
from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig  # noqa: E402
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq  # noqa: E402
from recforge.models.sid_tokenizer import add_collision_level  # noqa: E402
from recforge.io import atomic_write_json


ATOL = 1e-4  # float32 score agreement of two computations of one item's SID log-probability
MIN_OVERLAP = 0.99  # mean shared items: near-ties at an intermediate beam cut may swap a prefix's subtree


def build(args: argparse.Namespace) -> Retriever:
    """The same model and catalogue in every process (seeded)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    codes = add_collision_level(torch.randint(args.vocab, (args.items, 3)))
    vocab = max(args.vocab, int(codes.max()) + 1)
    trie = SidTrie.build(codes, vocab, args.trie).to(device)
    window = max_items(args)
    if args.model == "tiger":
        model = SIDSeq2Seq(Seq2SeqConfig(num_levels=codes.shape[1], vocab_size=vocab, dim=args.dim,
                                         encoder_layers=args.layers, decoder_layers=args.layers, num_heads=args.heads,
                                         ffn_dim=4 * args.dim, dropout=0.0, max_items=window))  # fmt: skip
    else:
        model = SIDHSTU(SIDHSTUConfig(num_levels=codes.shape[1], vocab_size=vocab, dim=args.dim, num_blocks=args.layers,
                                      num_heads=args.heads, dropout=0.0, max_items=window))  # fmt: skip
    model = model.to(device=device, dtype=dtype).eval()
    config = RetrieveConfig(beam=args.beam, max_k=args.k, max_batch=args.batch, max_history=window,
                            max_allowed=max(args.allowed, 1))  # fmt: skip
    retriever = Retriever(model, torch.arange(args.items + 1).numpy(), torch.cat([codes[:1] * 0, codes]), trie, window,
                          config)  # fmt: skip
    retriever.version = "bench"
    return retriever


def max_items(args: argparse.Namespace) -> int:
    """The model's history window: room for the returning users' growth (at most 2 events a round)."""
    return args.history + 2 * (args.warmup + args.rounds)


def returning_users(args: argparse.Namespace) -> dict:
    """Cold vs cached ``Retriever.run`` of returning users whose histories grow by 1-2 events a round."""
    cold = build(args)
    cached = build(args)
    cached.cache = HistoryCache(int(args.cache_mb * 2**20), "bench")
    g = torch.Generator().manual_seed(2)
    histories = [torch.randint(1, args.items + 1, (args.history,), generator=g).tolist() for _ in range(args.batch)]
    times: dict[str, list[float]] = {"returning_cold": [], "returning_cached": [], "repeat_cached": []}
    answers: dict[str, list] = {"returning_cold": [], "returning_cached": [], "repeat_cached": []}
    for round_index in range(args.warmup + args.rounds):
        for h in histories:
            h += torch.randint(1, args.items + 1, (int(torch.randint(1, 3, (1,), generator=g)),), generator=g).tolist()
        requests = [RetrieveRequest(list(h), args.k, user_id=f"u{i}") for i, h in enumerate(histories)]
        outcomes = {}
        for name, retriever in (("returning_cold", cold), ("returning_cached", cached), ("repeat_cached", cached)):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outcomes[name] = retriever.run([retriever.encode(r) for r in requests])
            if round_index >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, results in outcomes.items():
            answers[name] += results
    report = cached.cache.report()
    agreement = {name: compare(answers[name], answers["returning_cold"], ATOL)
                 for name in ("returning_cached", "repeat_cached")}  # fmt: skip
    same = statistics.fmean(a["same_items"] for a in agreement.values())
    return {"summary": {name: summary(t) for name, t in times.items()}, "same_items_fraction": same,
            "agreement": agreement, "cache": report,
            "history_items": [args.history, max(len(h) for h in histories)]}  # fmt: skip


def serve_child(args: argparse.Namespace, port: int) -> None:
    from recforge.serve.retrieve_app import RetrieveSettings, create_retrieve_app
    from recforge.serve.scheduler import SchedulerConfig
    from recforge.serve.server import ServerConfig, serve

    retriever = build(args)
    settings = RetrieveSettings(beam=args.beam, default_k=args.k, max_k=args.k, max_batch=args.batch,
                                max_history=max_items(args), max_allowed=max(args.allowed, 1), cache_mb=args.cache_mb)  # fmt: skip
    if args.cache_mb:
        retriever.cache = HistoryCache(int(args.cache_mb * 2**20), "bench")
    config = ServerConfig(scheduler=SchedulerConfig(max_wait_ms=args.max_wait_ms, max_queue_ms=60_000),
                          request_timeout_ms=60_000.0)  # fmt: skip
    serve(create_retrieve_app(retriever, "bench", config, settings), config, port=port)


def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[float, dict]:
    t0 = time.perf_counter()
    conn.request("POST", "/v1/retrieve", body, {"content-type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"/v1/retrieve answered {response.status}: {answer}")
    return (time.perf_counter() - t0) * 1e3, answer


def pct(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(times: list[float]) -> dict:
    return {"p50_ms": pct(times, 0.5), "p99_ms": pct(times, 0.99), "mean_ms": statistics.fmean(times), "runs": len(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--model", default="tiger", choices=("tiger", "sid_hstu"), help="encoder-decoder or decoder-only")
    p.add_argument("--cache-mb", type=float, default=1024.0, help="history cache bound (server and cached rows)")
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU check")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests per round (and the server's max_batch)")
    p.add_argument("--history", type=int, default=1250, help="history items per request (x 4 SID tokens)")
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--beam", type=int, default=256)
    p.add_argument("--k", type=int, default=100, help="items returned per request")
    p.add_argument("--allowed", type=int, default=0, help="allowed_items per request (0: any item)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--trie", default="dense", choices=("dense", "csr"))
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="how long a batch waits for more requests")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.quick:
        args.history, args.items, args.vocab, args.beam, args.k = 40, 3000, 32, 32, 32
        args.dim, args.layers, args.rounds, args.warmup = 64, 2, 10, 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = mp.get_context("spawn").Process(target=serve_child, args=(args, port), daemon=True)
    server.start()
    g = torch.Generator().manual_seed(1)
    bodies = []
    for i in range(args.batch):
        body = {"user_id": f"u{i}", "history": torch.randint(1, args.items + 1, (args.history,), generator=g).tolist(),
                "k": args.k}  # fmt: skip
        if args.allowed:
            body["allowed_items"] = (torch.randperm(args.items, generator=g)[: args.allowed] + 1).tolist()
        bodies.append(body)

    def raw(round_index: int) -> list[bytes]:  # a new user_id each round: the HTTP rows stay cold
        return [json.dumps({**b, "user_id": f"{b['user_id']}-{round_index}"}).encode() for b in bodies]

    try:
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=120) for _ in bodies]
        deadline = time.monotonic() + 600
        while True:  # the child builds the model and starts uvicorn
            try:
                conns[0].request("GET", "/health")
                health = conns[0].getresponse()
                health.read()
                if health.status == 200:
                    break
            except OSError:
                conns[0].close()
                if time.monotonic() > deadline or not server.is_alive():
                    raise RuntimeError("the retrieve server did not start") from None
                time.sleep(0.5)
        per_request, per_round, answers = [], [], [None] * len(bodies)
        for round_index in range(args.warmup + args.rounds):
            barrier, times, payloads = threading.Barrier(len(bodies)), [0.0] * len(bodies), raw(round_index)

            def one(i: int) -> None:
                barrier.wait()
                times[i], answers[i] = post(conns[i], payloads[i])

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if round_index >= args.warmup:
                per_request += times
                per_round.append(max(times))
        server_ms = [a["latency_ms"] for a in answers]
    finally:
        server.terminate()
        server.join(30)
    retriever = build(args)
    requests = [RetrieveRequest(b["history"], b["k"], b.get("allowed_items")) for b in bodies]
    engine_times = []
    for i in range(args.warmup + args.rounds):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine_results = retriever.retrieve_requests(requests)
        if i >= args.warmup:
            engine_times.append((time.perf_counter() - t0) * 1e3)
    http_vs_engine = compare([RetrieveResult(a["items"], a["scores"]) for a in answers], engine_results, ATOL)
    same = http_vs_engine["same_items"]
    # top-10 overlap: in bfloat16 the server's batches (other compositions, paddings) round differently from
    # the engine's batch of the same requests, so near-tied items deep in the list may swap
    top10 = sum(len(set(a["items"][:10]) & set(r.items[:10])) / max(1, min(10, len(r.items)))
                for a, r in zip(answers, engine_results, strict=True)) / len(bodies)  # fmt: skip
    returning = returning_users(args)
    rows = {"http": summary(per_request), "round": summary(per_round), "engine": summary(engine_times),
            **returning["summary"]}  # fmt: skip
    print(f"{'part':<18}{'p50 ms':>10}{'p99 ms':>10}{'runs':>6}")
    for name, row in rows.items():
        print(f"{name:<18}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{row['runs']:>6}")
    cache = returning["cache"]
    agree = returning["agreement"]["repeat_cached"]
    print(f"returning users ({returning['history_items'][0]}-{returning['history_items'][1]} items): cached answers "
          f"equal the cold ones for {returning['same_items_fraction']:.2%} of requests ({agree['same_up_to_ties']:.2%} "
          f"up to ties, overlap {agree['overlap']:.2%}, max score diff {agree['max_score_diff']:.1e}); cache hits {cache['hits']}, "
          f"extends {cache['extends']}, misses {cache['misses']}, {cache['bytes_used'] / 2**20:.1f} MiB")  # fmt: skip
    print(f"HTTP answers equal the engine's items for {same:.0%} of requests (top-10 overlap {top10:.1%}); "
          "server-side latency of the last "
          f"round {min(server_ms):.1f}-{max(server_ms):.1f} ms")  # fmt: skip
    machine = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else (
        f"{cpu_model()} ({torch.get_num_threads()} threads)")  # fmt: skip
    result = {
        "benchmark": "serve_retrieve", "machine": machine, "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": "python " + " ".join(sys.argv), "torch": torch.__version__, "args": vars(args),
        "sid_tokens_per_request": args.history * 4, "summary": rows, "same_items_fraction": same,
        "top10_overlap": top10, "http_vs_engine": http_vs_engine, "last_round_server_latency_ms": server_ms, "returning_users": returning,
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)
        print(f"wrote {args.out}")
    if args.dtype == "float32":  # what rounding cannot change (generate.agreement); bfloat16 is reported only
        for name, a in [("HTTP answers vs the engine's", http_vs_engine), *(
                (f"{row} vs returning_cold", a) for row, a in returning["agreement"].items())]:  # fmt: skip
            if a["max_score_diff"] > ATOL or a["overlap"] < MIN_OVERLAP:
                raise SystemExit(f"{name} disagree beyond float rounding: {a} (limits: max_score_diff {ATOL}, "
                                 f"overlap {MIN_OVERLAP})")


if __name__ == "__main__":
    main()
