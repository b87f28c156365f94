"""Retrieve latency when a batch's histories differ in length: fixed vs varying lengths, old vs new attention.

Usage:
    python benchmarks/retrieve_lengths.py --quick --out benchmarks/results/retrieve_lengths-cpu-quick.json
    python benchmarks/retrieve_lengths.py --device cuda --dtype bfloat16 --out benchmarks/results/retrieve_lengths-h200.json

The encoder-decoder ``SIDSeq2Seq`` (random weights, as ``benchmarks/serve_retrieve.py``) behind
``Retriever.run``, ``--batch`` requests a round, beam ``--beam``, ``--k`` items back. Cases, every round:

- fixed: every history is ``--history`` items (no padding: attention runs without a mask);
- varying: lengths drawn uniformly from [``--min-history``, ``--max-history``] anew every round (left
  padding and a key mask; a new key length nearly every round, as in serving);
- varying_cached: the same varying batch again, its encodings now in a ``HistoryCache`` (the encoder is
  skipped; the decoder reads the assembled memory), as serve_retrieve's ``repeat_cached``.

Modes, interleaved every round on the same requests:

- old: PyTorch's default attention dispatch (cuDNN attention first on H100/H200 with a recent cuDNN),
  unpadded key lengths (``sid_seq2seq.SDPA_BACKENDS = None``, ``KEY_ALIGN = 1``);
- masked: flash / memory-efficient / math, masked keys padded to ``KEY_ALIGN``, the key mask passed to SDPA
  (so a padded batch runs the memory-efficient kernel);
- new: recforge's: as masked, and at inference in bfloat16 on CUDA the key mask folded into the head
  dimension (``sid_seq2seq.attention``), so flash attention runs on padded batches too.

The backend PyTorch picks for the encoder's attention in each mode is recorded, and the modes' answers
are compared (``generate.agreement``; in float32 they must agree up to rounding).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _machine import cpu_model  # noqa: E402

from recforge.generate import HistoryCache, RetrieveConfig, RetrieveRequest, Retriever, SidTrie  # noqa: E402
from recforge.generate.agreement import compare  # noqa: E402
from recforge.models import sid_seq2seq  # noqa: E402
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq  # noqa: E402
from recforge.models.sid_tokenizer import add_collision_level  # noqa: E402
from recforge.io import atomic_write_json

NEW = (sid_seq2seq.SDPA_BACKENDS, sid_seq2seq.KEY_ALIGN, sid_seq2seq.fold_key_mask)
MODES = ("old", "masked", "new")
CASES = ("fixed", "varying", "varying_cached")


def set_mode(mode: str) -> None:
    never = lambda q: False  # noqa: E731
    sid_seq2seq.SDPA_BACKENDS, sid_seq2seq.KEY_ALIGN, sid_seq2seq.fold_key_mask = (
        (None, 1, never) if mode == "old" else (*NEW[:2], never) if mode == "masked" else NEW)


def backend_choice(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, masked: bool) -> str:
    """The SDPA backend PyTorch picks for the encoder's attention (varying: masked, S = max history tokens)."""
    s = (args.max_history if masked else args.history) * 4
    mask = None
    if masked:
        s += -s % sid_seq2seq.KEY_ALIGN
        mask = torch.ones(args.batch, 1, 1, s, dtype=torch.bool, device=device)
        mask[1:, ..., : s // 4] = False
    qkv = torch.randn(args.batch, s, 3 * args.dim, device=device, dtype=dtype)
    q, k, v = (t.view(args.batch, s, args.heads, -1).transpose(1, 2) for t in qkv.chunk(3, -1))
    with torch.no_grad():
        if mask is not None and sid_seq2seq.fold_key_mask(q):  # what attention() hands SDPA: wider heads, no mask
            q, k, v = (torch.cat([t, t.new_zeros(*t.shape[:3], sid_seq2seq.MASK_DIMS)], -1) for t in (q, k, v))
            mask = None
    with sid_seq2seq._kernels(device):
        return SDPBackend(torch._fused_sdp_choice(q, k, v, mask)).name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU check")
    p.add_argument("--modes", default="old,masked,new", help="comma-separated: old, masked, new")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--history", type=int, default=1250, help="fixed: history items (x 4 SID tokens)")
    p.add_argument("--min-history", type=int, default=1000)
    p.add_argument("--max-history", type=int, default=1500)
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--beam", type=int, default=256)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.quick:
        args.history, args.min_history, args.max_history, args.items, args.vocab = 40, 30, 50, 3000, 32
        args.beam, args.k, args.dim, args.layers, args.rounds, args.warmup = 32, 32, 64, 2, 6, 1
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or not modes:
        raise SystemExit(f"--modes: a comma-separated subset of {','.join(MODES)}; got {args.modes!r}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    codes = add_collision_level(torch.randint(args.vocab, (args.items, 3)))
    vocab = max(args.vocab, int(codes.max()) + 1)
    trie = SidTrie.build(codes, vocab, "dense").to(device)
    window = max(args.history, args.max_history)
    model = SIDSeq2Seq(Seq2SeqConfig(num_levels=codes.shape[1], vocab_size=vocab, dim=args.dim, encoder_layers=args.layers,
                                     decoder_layers=args.layers, num_heads=args.heads, ffn_dim=4 * args.dim, dropout=0.0,
                                     max_items=window)).to(device=device, dtype=dtype).eval()  # fmt: skip
    retriever = Retriever(model, torch.arange(args.items + 1).numpy(), torch.cat([codes[:1] * 0, codes]), trie, window,
                          RetrieveConfig(beam=args.beam, max_k=args.k, max_batch=args.batch))  # fmt: skip
    retriever.cache = HistoryCache(4 << 30, "bench")
    g = torch.Generator().manual_seed(1)

    def history(n: int) -> list[int]:
        return torch.randint(1, args.items + 1, (n,), generator=g).tolist()

    times = {f"{m}/{c}": [] for m in modes for c in CASES}
    answers = {f"{m}/{c}": [] for m in modes for c in CASES}
    lengths_seen = set()
    with torch.no_grad():
        for round_index in range(args.warmup + args.rounds):
            fixed = [RetrieveRequest(history(args.history), args.k) for _ in range(args.batch)]
            lengths = torch.randint(args.min_history, args.max_history + 1, (args.batch,), generator=g).tolist()
            lengths_seen.add(max(lengths))
            varying = [history(n) for n in lengths]
            for mode in modes:
                set_mode(mode)
                users = [RetrieveRequest(h, args.k, user_id=f"{mode}-{round_index}-{i}") for i, h in enumerate(varying)]
                for case, requests in (("fixed", fixed), ("varying", users), ("varying_cached", users)):
                    encoded = [retriever.encode(r) for r in requests]
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    results = retriever.run(encoded)  # one host copy at the end: synchronised
                    if round_index >= args.warmup:
                        times[f"{mode}/{case}"].append((time.perf_counter() - t0) * 1e3)
                        answers[f"{mode}/{case}"] += results
    set_mode("new")
    summary = {name: {"p50_ms": pct(t, 0.5), "p99_ms": pct(t, 0.99), "mean_ms": statistics.fmean(t), "runs": len(t)}
               for name, t in times.items()}  # fmt: skip
    atol = 1e-4 if args.dtype == "float32" else 0.1
    agreement = {}
    for other in (m for m in modes if m != "new" and "new" in modes):  # each mode's answers against new's
        agreement |= {f"new vs {other}: {case}": compare(answers[f"new/{case}"], answers[f"{other}/{case}"], atol)
                      for case in CASES}  # fmt: skip
    for mode in modes:
        agreement[f"{mode}: cached vs varying"] = compare(answers[f"{mode}/varying_cached"], answers[f"{mode}/varying"], atol)
    backends = {}
    for mode in modes:
        set_mode(mode)
        backends[mode] = {"fixed": backend_choice(args, device, dtype, False), "varying": backend_choice(args, device, dtype, True)}
    set_mode("new")
    print(f"{'mode/case':<22}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'runs':>6}")
    for name, row in summary.items():
        print(f"{name:<22}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{row['mean_ms']:>10.2f}{row['runs']:>6}")
    for mode in modes:
        ratio = summary[f"{mode}/varying"]["p50_ms"] / summary[f"{mode}/fixed"]["p50_ms"]
        print(f"{mode}: varying / fixed p50 {ratio:.2f}x; encoder attention backend {backends[mode]}")
    for name, a in agreement.items():
        print(f"agreement {name}: same items {a['same_items']:.2%}, up to ties {a['same_up_to_ties']:.2%}, "
              f"overlap {a['overlap']:.2%}, max score diff {a['max_score_diff']:.1e}")  # fmt: skip
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()} ({torch.get_num_threads()} threads)"
    result = {
        "benchmark": "retrieve_lengths", "machine": machine, "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": "python " + " ".join(sys.argv), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None, "args": vars(args),
        "distinct_max_lengths": len(lengths_seen), "summary": summary, "backends": backends, "agreement": agreement,
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)
        print(f"wrote {args.out}")
    if args.dtype == "float32":
        bad = {name: a for name, a in agreement.items() if a["max_score_diff"] > atol or a["overlap"] < 0.99}
        if bad:
            raise SystemExit(f"answers disagree beyond float rounding: {bad}")


def pct(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
