"""The `recforge` command: demo | data prepare | sid fit | train | eval | serve | export."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

DEFAULT_SOURCES = {"ml-1m": "ml-1m", "amazon-s3rec": "amazon-beauty", "recbole": "ml-100k", "taobao": "taobao-sample"}
TABLE_KEYS = ("hr@1", "hr@5", "hr@10", "hr@50", "hr@200", "ndcg@5", "ndcg@10", "ndcg@50", "ndcg@200", "mrr")


def _print_metrics(metrics: dict) -> None:
    keys = [k for k in TABLE_KEYS if k in metrics]
    print("  ".join(f"{k:>9}" for k in keys))
    print("  ".join(f"{metrics[k]:>9.4f}" for k in keys))


def cmd_demo(args: argparse.Namespace) -> None:
    from recforge.train.demo import run_demo

    run_demo(args.out, minutes=args.minutes, overrides=args.overrides, progress=not args.no_progress)


def cmd_prepare(args: argparse.Namespace) -> None:
    from recforge.data.converters import default_data_root, prepare

    source = args.source
    if source is None:
        if args.format not in DEFAULT_SOURCES:
            raise ValueError(f"format {args.format!r} has no default source; give SOURCE explicitly")
        source = Path(default_data_root()) / DEFAULT_SOURCES[args.format]
    out = prepare(args.format, source, args.out, overwrite=args.overwrite)
    meta = json.loads((Path(out) / "dataset.json").read_text())
    print(f"wrote {out}: {meta['num_users']:,} users, {meta['num_items']:,} items, {meta['num_events']:,} events")


def _print_ranking_metrics(metrics: dict) -> None:
    names = ("auc", "gauc", "logloss", "rmse", "bayes_auc", "bayes_gauc")
    print(f"{'task':<12}" + "".join(f"{n:>11}" for n in names))
    for task in dict.fromkeys(k.split("/")[0] for k in metrics if "/" in k):
        cells = [metrics.get(f"{task}/{n}") for n in names]
        print(f"{task:<12}" + "".join(f"{c:>11.4f}" if c is not None else f"{'-':>11}" for c in cells))


def _recipe_module(recipe: str):
    if recipe == "ranking":
        from recforge.train import ranking

        return ranking
    if recipe == "generative":
        from recforge.train import generative

        return generative
    if recipe == "retrieval":
        from recforge.train import retrieval

        return retrieval
    raise ValueError(f"recipe {recipe!r} is not known; use retrieval, ranking or generative")


def cmd_sid_fit(args: argparse.Namespace) -> None:
    from recforge.models.sid_tokenizer import TokenizerConfig
    from recforge.train.sid_fit import fit_sids

    config = TokenizerConfig(
        method=args.method, levels=args.levels, codebook_size=args.codebook_size, balanced=args.balanced,
        collision_level=not args.no_collision_level, seed=args.seed, rqvae_epochs=args.rqvae_epochs,
    )  # fmt: skip
    meta = fit_sids(args.data_dir, args.out, source=args.source, config=config, text_dim=args.text_dim,
                    overwrite=args.overwrite)  # fmt: skip
    stats = meta["stats"]
    print(f"wrote {args.out}: {stats['num_items']:,} items, {meta['num_levels']} digits per SID "
          f"(vocab {meta['vocab_size']} per level), source {meta['source']}, {config.method}")  # fmt: skip
    print("codebook usage per level: " + ", ".join(f"{u:.1%}" for u in stats["codebook_usage"]))
    print(f"collision rate (items sharing all {config.levels} codes): {stats['collision_rate']:.2%}, "
          f"most items on one SID: {stats['max_items_per_sid']}")  # fmt: skip
    for p in stats["prefixes"]:
        print(f"  prefix depth {p['depth']}: {p['distinct']:,} distinct, {p['mean_items']:.1f} items each on average, "
              f"max {p['max_items']}")  # fmt: skip


def cmd_sid_add(args: argparse.Namespace) -> None:
    from recforge.train.sid_fit import add_items

    report = add_items(args.sid_dir, args.data_dir)
    print(f"{args.sid_dir}: coded {report['added']:,} new items ({report['num_items']:,} in all); existing SIDs unchanged")


def cmd_synthetic(args: argparse.Namespace) -> None:
    from recforge.data.synthetic import SyntheticConfig, write_synthetic

    config = SyntheticConfig(num_users=args.users, num_items=args.items, seed=args.seed)
    out = write_synthetic(args.out, config, overwrite=args.overwrite, impressions=args.impressions)
    meta = json.loads((Path(out) / "dataset.json").read_text())
    print(f"wrote {out}: {meta['num_users']:,} users, {meta['num_items']:,} items, {meta['num_events']:,} events")


def cmd_synthetic_long(args: argparse.Namespace) -> None:
    from recforge.data.synthetic_long import LongSyntheticConfig, write_long_synthetic

    config = LongSyntheticConfig(num_users=args.users, num_items=args.items, median_seq_len=args.median_len,
                                 max_seq_len=args.max_len, seed=args.seed)  # fmt: skip
    out = write_long_synthetic(args.out, config, overwrite=args.overwrite)
    meta = json.loads((Path(out) / "dataset.json").read_text())
    print(f"wrote {out}: {meta['num_users']:,} users, {meta['num_items']:,} items, {meta['num_events']:,} events")


def cmd_train(args: argparse.Namespace) -> None:
    from recforge.config import load_config

    cfg = load_config(args.config, args.overrides)
    summary = _recipe_module(cfg.recipe).train(cfg, resume=args.resume, progress=not args.no_progress)
    if not summary.get("is_main", True):  # a torchrun rank other than 0: rank 0 evaluates and prints
        return
    if cfg.recipe == "ranking":
        print(f"run {cfg.run_dir}: {summary['split']} split, {int(summary['impressions']):,} impressions, "
              f"checkpoint {summary['checkpoint']}; model slices in {cfg.run_dir / 'model'}")  # fmt: skip
        _print_ranking_metrics(summary)
        return
    print(f"run {cfg.run_dir}: {summary['split']} metrics ({summary['protocol']} protocol, checkpoint {summary['checkpoint']})")
    _print_metrics(summary)


def cmd_eval(args: argparse.Namespace) -> None:
    from recforge.config import load_config

    config_path = Path(args.run_dir) / "config.yaml"
    if not config_path.is_file():
        raise ValueError(f"{args.run_dir} is not a recforge run directory (no config.yaml)")
    recipe = load_config(config_path).recipe
    command = "recforge " + " ".join(args.argv)
    result = _recipe_module(recipe).evaluate_run(args.run_dir, checkpoint=args.checkpoint, split=args.split, command=command)
    if recipe == "ranking":
        print(f"{args.run_dir}: {result['split']} split, {int(result['impressions']):,} impressions, "
              f"checkpoint {result['checkpoint']}")  # fmt: skip
        _print_ranking_metrics(result)
        print(f"wrote {Path(args.run_dir) / 'eval.json'}")
        return
    print(f"{args.run_dir}: {result['split']} split, {result['protocol']} protocol, {result['num_users']:,} users, "
          f"checkpoint {result['checkpoint']}")  # fmt: skip
    _print_metrics(result)
    print(f"wrote {Path(args.run_dir) / 'eval.json'}")


def cmd_serve(args: argparse.Namespace) -> None:
    from recforge.serve.engine import EngineConfig, RankEngine
    from recforge.serve.kv_pool import PoolConfig
    from recforge.serve.scheduler import SchedulerConfig
    from recforge.serve.server import ServerConfig, create_app, serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = RankEngine.from_run(args.run_dir, EngineConfig(
        device=args.device, dtype=args.dtype, prefill_chunk=args.prefill_chunk, max_candidates=args.max_candidates,
        max_history_events=args.max_history, unknown_ids=args.unknown_ids,
        unknown_feature_values=args.unknown_feature_values, cuda_graphs=args.cuda_graphs))  # fmt: skip
    config = ServerConfig(
        scheduler=SchedulerConfig(token_budget=args.token_budget, max_wait_ms=args.max_wait_ms,
                                  prefill_chunk=args.prefill_chunk, max_queue=args.max_queue,
                                  max_queue_ms=args.max_queue_ms),
        pool=PoolConfig(device_mb=args.cache_mb, host_mb=args.host_cache_mb) if args.cache_mb > 0 else None,
        request_timeout_ms=args.request_timeout_ms, allow_reload=args.allow_reload, run_dir=args.run_dir,
        gil_switch_interval_ms=args.gil_switch_ms,
    )  # fmt: skip
    app = create_app(engine, config)
    print(f"serving {args.run_dir} (model {engine.version}) on http://{args.host}:{args.port}  docs: /docs")
    serve(app, config, host=args.host, port=args.port, log_level=args.log_level)


def cmd_export(args: argparse.Namespace) -> None:
    from recforge.serve.export import export_run

    out = export_run(args.run_dir, args.out, formats=tuple(args.formats.split(",")), check=not args.no_check)
    print(f"wrote {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recforge", description="Train and evaluate generative recommenders.")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="train a small HSTU on built-in synthetic data and show results")
    p.add_argument("--out", default="runs/demo", help="where data and the run go (default: runs/demo)")
    p.add_argument("--minutes", type=float, default=2.0, help="training time budget (default: 2)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.epochs=5")
    p.set_defaults(func=cmd_demo)

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("prepare", help="convert a public dataset into recforge's Parquet layout")
    p.add_argument("format", help="ml-1m | grouplens | amazon-s3rec | recbole | taobao")
    p.add_argument("source", nargs="?", help="file or directory (default: $RECFORGE_DATA or ../shared/data, per format)")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=cmd_prepare)

    p = data.add_parser("synthetic", help="generate the built-in synthetic dataset")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--impressions", action="store_true",
                   help="ranking data: click/like/purchase labels with their generating probabilities")
    p.add_argument("--users", type=int, default=3000, help="number of users (default: 3000)")
    p.add_argument("--items", type=int, default=1500, help="number of items (default: 1500)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=cmd_synthetic)

    p = data.add_parser("synthetic-long", help="generate long-history data (lengths up to 100K; periodic re-consumption "
                        "only a long history reveals: see recforge.data.synthetic_long)")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--users", type=int, default=250, help="number of users (default: 250)")
    p.add_argument("--items", type=int, default=50_000, help="number of items (default: 50000)")
    p.add_argument("--median-len", type=int, default=5_000, help="median events per user (default: 5000)")
    p.add_argument("--max-len", type=int, default=100_000, help="most events per user (default: 100000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=cmd_synthetic_long)

    sid = sub.add_parser("sid", help="semantic IDs").add_subparsers(dest="sid_command", required=True)
    p = sid.add_parser("fit", help="fit a SID tokenizer on item vectors and write SID_DIR (sids.parquet, codebooks)")
    p.add_argument("data_dir", help="dataset directory (recforge data prepare)")
    p.add_argument("--out", required=True, help="SID directory to write (the generative recipe reads DATA/sids by default)")
    p.add_argument("--source", default="text",
                   help="embedding (items.parquet column) | text (built-in TF-IDF + SVD of item attributes) | "
                        "run:RUN_DIR (a retrieval run's item embeddings)")
    p.add_argument("--method", default="rkmeans", choices=("rkmeans", "rqvae"))
    p.add_argument("--levels", type=int, default=3, help="quantization levels (default 3)")
    p.add_argument("--codebook-size", type=int, default=256)
    p.add_argument("--balanced", action="store_true", help="rkmeans: at most ceil(items / codebook size) per cluster")
    p.add_argument("--no-collision-level", action="store_true", help="do not append the digit that makes SIDs unique")
    p.add_argument("--text-dim", type=int, default=64, help="--source text: SVD dimensions")
    p.add_argument("--rqvae-epochs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing SID directory")
    p.set_defaults(func=cmd_sid_fit)
    p = sid.add_parser("add", help="code the dataset's items that SID_DIR lacks, keeping existing SIDs")
    p.add_argument("sid_dir")
    p.add_argument("data_dir")
    p.set_defaults(func=cmd_sid_add)

    p = sub.add_parser("train", help="train from a YAML config (several GPUs/nodes: torchrun ... -m recforge.cli train)")
    p.add_argument("config", help="YAML config, e.g. configs/ml1m-hstu.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.epochs=5 model.num_blocks=4")
    p.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a trained run and write RUN_DIR/eval.json")
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default="auto", help="auto | best | latest | a checkpoint directory")
    p.add_argument("--split", default="test", choices=("test", "valid"))
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("serve", help="serve a trained ranking run over HTTP (POST /v1/rank; docs at /docs)")
    p.add_argument("run_dir", help="a ranking run directory (or its model/ directory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (default)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    p.add_argument("--token-budget", type=int, default=8192, help="query tokens per batched engine pass")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="how long a pass waits for more requests")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="most history tokens of one request per pass")
    p.add_argument("--max-queue", type=int, default=1024, help="requests in flight before 503")
    p.add_argument("--max-queue-ms", type=float, default=500.0,
                   help="refuse (503 + Retry-After) a request when the work queued ahead of it would take longer")
    p.add_argument("--request-timeout-ms", type=float, default=2000.0,
                   help="default request deadline (504 after it); clients may set X-Request-Timeout-Ms")
    p.add_argument("--max-candidates", type=int, default=2000)
    p.add_argument("--max-history", type=int, default=100_000, help="events per request before 422")
    p.add_argument("--unknown-ids", default="error", choices=("error", "zero"),
                   help="unknown item IDs / actions: 422 (error, default) or the 'none' embedding (zero)")
    p.add_argument("--unknown-feature-values", default="zero", choices=("error", "zero"),
                   help="user feature values not seen in training (e.g. a new user_id): 'none' (default) or 422")
    p.add_argument("--cache-mb", type=float, default=256.0, help="KV-cache device tier (0: no cache)")
    p.add_argument("--host-cache-mb", type=float, default=1024.0, help="KV-cache host tier (0: none)")
    p.add_argument("--cuda-graphs", type=int, default=32,
                   help="on CUDA: replay engine passes as CUDA graphs, keeping this many shape buckets (0: off)")
    p.add_argument("--gil-switch-ms", type=float, default=0.5,
                   help="sys.setswitchinterval for the server process (the HTTP loop and the batching worker share the GIL)")
    p.add_argument("--allow-reload", action="store_true", help="expose POST /v1/reload")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export", help="export a ranking run's slices to torch.export and ONNX")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--formats", default="torch,onnx", help="comma-separated: torch, onnx")
    p.add_argument("--no-check", action="store_true", help="skip running the exported programs against PyTorch")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except ValueError as err:  # user-facing problems: config, data, paths
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if "torch.distributed" in sys.modules:  # a torchrun job: leave the process group cleanly
            from recforge.train.distributed import shutdown_distributed

            shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
