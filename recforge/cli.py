"""The `recforge` command: demo | data prepare | train | eval."""

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


def cmd_train(args: argparse.Namespace) -> None:
    from recforge.config import load_config
    from recforge.train.retrieval import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, resume=args.resume, progress=not args.no_progress)
    print(f"run {cfg.run_dir}: {summary['split']} metrics ({summary['protocol']} protocol, checkpoint {summary['checkpoint']})")
    _print_metrics(summary)


def cmd_eval(args: argparse.Namespace) -> None:
    from recforge.train.retrieval import evaluate_run

    command = "recforge " + " ".join(args.argv)
    result = evaluate_run(args.run_dir, checkpoint=args.checkpoint, split=args.split, command=command)
    print(f"{args.run_dir}: {result['split']} split, {result['protocol']} protocol, {result['num_users']:,} users, "
          f"checkpoint {result['checkpoint']}")  # fmt: skip
    _print_metrics(result)
    print(f"wrote {Path(args.run_dir) / 'eval.json'}")


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

    p = sub.add_parser("train", help="train from a YAML config")
    p.add_argument("config", help="YAML config, e.g. configs/ml1m-hstu.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.epochs=5 model.num_blocks=4")
    p.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a trained run and write RUN_DIR/eval.json")
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default="auto", help="auto | best | latest | a checkpoint directory")
    p.add_argument("--split", default="test", choices=("test", "valid"))
    p.set_defaults(func=cmd_eval)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
