"""The `recforge` command: demo | data prepare | sid fit | train | eval | serve | export."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
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
        if not source.exists():
            folder = DEFAULT_SOURCES[args.format]
            raise ValueError(f"no SOURCE given and the default {source} does not exist (the default is "
                             f"$RECFORGE_DATA/{folder}, else shared/data/{folder} beside the recforge checkout); "
                             "pass SOURCE or set RECFORGE_DATA")  # fmt: skip
    out = prepare(args.format, source, args.out, overwrite=args.overwrite, merge_users=args.merge_users)
    meta = json.loads((Path(out) / "dataset.json").read_text())
    print(f"wrote {out}: {meta['num_users']:,} users, {meta['num_items']:,} items, {meta['num_events']:,} events")


def _print_ranking_metrics(metrics: dict) -> None:
    names = ("auc", "gauc", "logloss", "rmse", "bayes_auc", "bayes_gauc")
    print(f"{'task':<12}" + "".join(f"{n:>11}" for n in names))
    for task in dict.fromkeys(k.split("/")[0] for k in metrics if "/" in k):
        cells = [metrics.get(f"{task}/{n}") for n in names]
        print(f"{task:<12}" + "".join(f"{c:>11.4f}" if c is not None else f"{'-':>11}" for c in cells))


def _run_recipe(run_dir: str | Path) -> str:
    """The recipe a run directory was trained with (from its config.yaml); "" for a bare model directory."""
    import yaml

    config_path = Path(run_dir) / "config.yaml"
    if not config_path.is_file():
        return ""
    raw = yaml.safe_load(config_path.read_text()) or {}
    return str(raw.get("recipe", "retrieval")) if isinstance(raw, dict) else ""


def _check_serving_run(run_dir: str, command: str) -> None:
    """``recforge serve/export`` read a ranking run's serving model: say so for another recipe's run."""
    from recforge.train.recipes import get_recipe

    name = _run_recipe(run_dir)
    if name and not get_recipe(name).serving_model:
        raise ValueError(f"{run_dir} is a {name} run; `recforge {command}` takes a ranking run "
                         "(recipe: ranking), whose training exports RUN_DIR/model")  # fmt: skip


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

    from recforge.train.recipes import get_recipe

    cfg = load_config(args.config, args.overrides)
    recipe = get_recipe(cfg.recipe)
    existed = cfg.run_dir.exists()
    try:
        summary = recipe.train(cfg, resume=args.resume, progress=not args.no_progress)
    except BaseException as err:
        _failed_run(cfg.run_dir, existed, err)
        raise
    if not summary.get("is_main", True):  # a torchrun rank other than 0: rank 0 evaluates and prints
        return
    if "stop_message" in summary:
        print(f"training stopped: {summary['stop_message']} ({summary['train_minutes']:.1f} min)")
    if recipe.metrics == "ranking":
        print(f"run {cfg.run_dir}: {summary['split']} split, {int(summary['impressions']):,} impressions, "
              f"checkpoint {summary['checkpoint']}; model slices in {cfg.run_dir / 'model'}")  # fmt: skip
        _print_ranking_metrics(summary)
        return
    print(f"run {cfg.run_dir}: {summary['split']} metrics ({summary['protocol']} protocol, checkpoint {summary['checkpoint']})")
    _print_metrics(summary)


def _failed_run(run_dir: Path, existed: bool, err: BaseException) -> None:
    """After a failed `recforge train`: remove the run directory it created if nothing was written
    there; if training had started (``run.json`` says ``running``), record the failure there (rank 0)."""
    if int(os.environ.get("RANK", "0")) != 0 or not run_dir.is_dir():
        return
    if not existed and not any(p.is_file() for p in run_dir.rglob("*")):
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    from recforge.train.loop import write_run_record

    try:
        record = json.loads((run_dir / "run.json").read_text())
        if record.get("stop_reason") == "running":  # not a refusal before training (e.g. a run already there)
            reason = "interrupted" if isinstance(err, KeyboardInterrupt) else "error"
            write_run_record(run_dir, stop_reason=reason, stop_message=f"{type(err).__name__}: {err}")
    except (OSError, ValueError):
        pass  # no record, or the disk is why it failed: the error itself is what the user needs to see


def cmd_eval(args: argparse.Namespace) -> None:
    from recforge.config import load_config
    from recforge.train.recipes import get_recipe

    config_path = Path(args.run_dir) / "config.yaml"
    if not config_path.is_file():
        raise ValueError(f"{args.run_dir} is not a recforge run directory (no config.yaml)")
    recipe = get_recipe(load_config(config_path).recipe)
    from recforge.train.run_files import eval_file

    extra = {}
    if args.overrides:
        if recipe.name != "generative":
            raise ValueError(f"recforge eval: key=value overrides ({' '.join(args.overrides)}) are for generative runs "
                             f"(beam, re-scoring); {args.run_dir} is a {recipe.name} run: evaluate it as trained")  # fmt: skip
        extra["overrides"] = list(args.overrides)
    result = recipe.evaluate(args.run_dir, checkpoint=args.checkpoint, split=args.split, command=args.command_line,
                             **extra)  # fmt: skip
    written = eval_file(Path(args.run_dir), args.split)
    if recipe.metrics == "ranking":
        print(f"{args.run_dir}: {result['split']} split, {int(result['impressions']):,} impressions, "
              f"checkpoint {result['checkpoint']}")  # fmt: skip
        _print_ranking_metrics(result)
        print(f"wrote {written}")
        return
    print(f"{args.run_dir}: {result['split']} split, {result['protocol']} protocol, {result['num_users']:,} users, "
          f"checkpoint {result['checkpoint']}")  # fmt: skip
    _print_metrics(result)
    print(f"wrote {written}")


def cmd_serve(args: argparse.Namespace) -> None:
    from recforge.serve.config import load_serve_config
    from recforge.serve.engine import RankEngine
    from recforge.serve.server import create_app, serve

    flags = {key: value for key, value in vars(args).items() if key in SERVE_FLAG_KEYS}
    cfg = load_serve_config(args.config, args.overrides, flags)
    if _run_recipe(args.run_dir) == "generative":  # POST /v1/retrieve (recforge/serve/retrieve_app.py)
        return _serve_retrieve(args.run_dir, cfg)
    _check_serving_run(args.run_dir, "serve")
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    server_config = cfg.server_config(args.run_dir)
    workers = _http_workers(cfg.http_workers, cfg.engine.device)
    if workers > 0:  # N front-end processes + one engine process (recforge/serve/procs.py)
        from recforge.serve.model_dir import model_dir_of
        from recforge.serve.procs import serve_processes

        model_dir_of(args.run_dir)  # a wrong path is reported here (exit 2), not from inside the engine process

        def ready(port: int, version: str) -> None:
            print(f"serving {args.run_dir} (model {version}) on http://{cfg.host}:{port} with {workers} HTTP "
                  "front-end processes and one engine process  docs: /docs", flush=True)  # fmt: skip

        raise SystemExit(serve_processes(args.run_dir, cfg.engine_config(), server_config, workers, cfg.host, cfg.port,
                                         cfg.log_level, cfg.threads, on_ready=ready))  # fmt: skip
    engine = RankEngine.from_run(args.run_dir, cfg.engine_config())
    app = create_app(engine, server_config)
    print(f"serving {args.run_dir} (model {engine.version}) on http://{cfg.host}:{cfg.port}  docs: /docs")
    serve(app, server_config, host=cfg.host, port=cfg.port, log_level=cfg.log_level)


def _serve_retrieve(run_dir: str, cfg) -> None:
    """``recforge serve`` on a generative run: one process serving ``POST /v1/retrieve``."""
    from recforge.serve.retrieve_app import create_retrieve_app, load_retriever
    from recforge.serve.server import serve

    if cfg.http_workers != "auto" and int(cfg.http_workers) > 0:
        raise ValueError(f"http_workers={cfg.http_workers}: a generative run is served by one process; use "
                         "--http-workers 0 (or auto)")  # fmt: skip
    if cfg.server.allow_reload:
        raise ValueError("--allow-reload: a generative run's server has no /v1/reload; restart it on the new run")
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    server_config = cfg.server_config(run_dir)
    retriever, version = load_retriever(run_dir, cfg.retrieve, device=cfg.engine.device, dtype=cfg.engine.dtype)
    app = create_retrieve_app(retriever, version, server_config, cfg.retrieve)
    print(f"serving {run_dir} (model {version}, beam {retriever.config.beam}) on http://{cfg.host}:{cfg.port}  "
          "POST /v1/retrieve  docs: /docs", flush=True)  # fmt: skip
    serve(app, server_config, host=cfg.host, port=cfg.port, log_level=cfg.log_level)


# `recforge serve` flags: (flag, config key, type, help); a flag given overrides the key (recforge.serve.config)
SERVE_FLAGS = (
    ("--host", "host", str, "address to listen on (default 127.0.0.1)"),
    ("--port", "port", int, "default 8000"),
    ("--device", "engine.device", str, "cpu | cuda[:N] | auto (default)"),
    ("--dtype", "engine.dtype", str, "float32 (default) | bfloat16 | float16"),
    ("--threads", "threads", int, "torch intra-op threads (0: torch default)"),
    ("--token-budget", "scheduler.token_budget", int, "query tokens per batched engine pass"),
    ("--max-wait-ms", "scheduler.max_wait_ms", float, "how long a pass waits for more requests"),
    ("--prefill-chunk", "scheduler.prefill_chunk", int, "most history tokens of one request per pass"),
    ("--max-queue", "scheduler.max_queue", int, "requests in flight before 503"),
    ("--max-queue-ms", "scheduler.max_queue_ms", float,
     "refuse (503 + Retry-After) a request when the work queued ahead of it would take longer"),
    ("--request-timeout-ms", "server.request_timeout_ms", float,
     "default request deadline (504 after it); clients may set X-Request-Timeout-Ms"),
    ("--max-candidates", "engine.max_candidates", int, "candidates per request before 422"),
    ("--max-history", "engine.max_history_events", int, "events per request before 422"),
    ("--unknown-ids", "engine.unknown_ids", str,
     "unknown item IDs / actions: 422 (error, default) or the 'none' embedding (zero)"),
    ("--unknown-feature-values", "engine.unknown_feature_values", str,
     "user feature values not seen in training (e.g. a new user_id): 'none' (zero, default) or 422 (error)"),
    ("--cache-mb", "cache.device_mb", float, "KV-cache device tier (0: no cache)"),
    ("--host-cache-mb", "cache.host_mb", float, "KV-cache host tier (0: none)"),
    ("--cuda-graphs", "engine.cuda_graphs", int,
     "on CUDA: replay engine passes as CUDA graphs, keeping this many shape buckets (0: off)"),
    ("--gil-switch-ms", "server.gil_switch_interval_ms", float,
     "sys.setswitchinterval for the server process (the HTTP loop and the batching worker share the GIL)"),
    ("--allow-reload", "server.allow_reload", bool, "expose POST /v1/reload"),
    ("--http-workers", "http_workers", str,
     "HTTP front-end processes in front of one engine process; 0: one process (HTTP and the batching worker "
     "share the GIL); auto (default): min(4, cores // 4) on CUDA (0 below 4 cores), 0 on CPU"),
    ("--log-level", "log_level", str, "uvicorn log level (default warning)"),
)  # fmt: skip
SERVE_FLAG_KEYS = {key for _, key, _, _ in SERVE_FLAGS}


def _http_workers(value: str, device: str) -> int:
    from recforge.ops.dispatch import resolve_device
    from recforge.serve.procs import default_http_workers

    if value == "auto":
        return default_http_workers(str(resolve_device(device)))
    return int(value)  # a number, checked by ServeConfig.problems


def cmd_export(args: argparse.Namespace) -> None:
    from recforge.serve.export import export_run

    _check_serving_run(args.run_dir, "export")
    out = export_run(args.run_dir, args.out, formats=tuple(args.formats.split(",")), check=not args.no_check)
    print(f"wrote {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recforge", description="Train and evaluate generative recommenders.")
    _global_flags(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="train a small HSTU on built-in synthetic data and show results")
    p.add_argument("--out", default="runs/demo", help="where data and the run go (default: runs/demo)")
    p.add_argument("--minutes", type=float, default=2.0, help="training time budget (default: 2)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.epochs=5")
    p.set_defaults(func=cmd_demo)

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("prepare", help="convert a public dataset into recforge's Parquet layout")
    p.add_argument("format", help="ml-1m | grouplens | amazon-s3rec | recbole | taobao")
    p.add_argument("source", nargs="?", help="file or directory (default, per format: under $RECFORGE_DATA, else under "
                   "shared/data beside the recforge checkout)")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output directory (refused if it holds files other than a dataset's)")
    p.add_argument("--merge-users", action="store_true",
                   help="sequence files (ml-1m, amazon-s3rec): join the lines of a user listed more than once, in "
                        "file order (default: refuse, naming the lines)")
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
    p.add_argument("overrides", nargs="*", help="generative runs: key=value settings for this evaluation only, e.g. "
                   "generative.rescore=0.5 generative.beam=100 generative.dense_candidates=200, or "
                   "generative.dense_scorer=RETRIEVAL_RUN_DIR (a SASRec/HSTU run on the same dataset scores in the dense "
                   "head's place) (recorded in the result); choose them with --split valid")  # fmt: skip
    p.add_argument("--checkpoint", default="auto", help="auto | best | latest | a checkpoint directory")
    p.add_argument("--split", default="test", choices=("test", "valid"),
                   help="test (writes eval.json) or valid (writes eval-valid.json; refused where the run trained on it)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="write a self-contained HTML report of a run (RUN_DIR/report/index.html + PNGs)")
    p.add_argument("run_dir")
    p.add_argument("--out", help="output directory (default: RUN_DIR/report)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("serve", help="serve a trained ranking run (POST /v1/rank) or generative run (POST /v1/retrieve) "
                       "over HTTP; docs at /docs",
                       description="Settings come from --config (see configs/serve-default.yaml), then key=value "
                       "overrides and the flags below (each flag sets the config key in brackets).")  # fmt: skip
    p.add_argument("run_dir", help="a ranking run directory (or its model/ directory), or a generative run directory")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. scheduler.token_budget=4096 engine.dtype=bfloat16")
    p.add_argument("--config", help="serve config YAML, e.g. configs/serve-default.yaml (default: built-in defaults)")
    for flag, key, kind, help_text in SERVE_FLAGS:
        options = {"action": "store_true"} if kind is bool else {"type": kind, "metavar": key.rsplit(".", 1)[-1].upper()}
        p.add_argument(flag, dest=key, default=argparse.SUPPRESS, help=f"{help_text} [{key}]", **options)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export", help="export a ranking run's slices to torch.export and ONNX")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--formats", default="torch,onnx", help="comma-separated: torch, onnx")
    p.add_argument("--no-check", action="store_true", help="skip running the exported programs against PyTorch")
    p.set_defaults(func=cmd_export)
    _global_flags_everywhere(parser)
    return parser


def _global_flags(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("--no-progress", action="store_true", default=default,
                        help="no progress bar or progress lines; epoch summaries and evaluations still print")
    parser.add_argument("--quiet", action="store_true", default=default, help="print warnings, errors and results only")


def _global_flags_everywhere(parser: argparse.ArgumentParser) -> None:
    """Accept the global flags after any (sub)command too: ``recforge train CFG --no-progress``. The
    subcommands' copies default to SUPPRESS, so they never reset a flag given before the subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _global_flags(sub, argparse.SUPPRESS)
                _global_flags_everywhere(sub)


def cmd_report(args: argparse.Namespace) -> None:
    from recforge.train.report import write_report

    print(f"report: {write_report(args.run_dir, args.out)}")


def main(argv: list[str] | None = None) -> int:
    command_line = None if argv is None else shlex.join(["recforge", *argv])  # None: this process's own sys.argv
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`train CFG --resume train.epochs=5`): argparse leaves them over
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    args.argv, args.command_line = argv, command_line
    args.no_progress = args.no_progress or args.quiet
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("recforge").setLevel(logging.WARNING if args.quiet else logging.NOTSET)
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
