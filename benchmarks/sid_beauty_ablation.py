"""Amazon Beauty semantic-ID tokenizer ablation at equal training steps, on one GPU.

Four SID sets: {residual k-means (balanced), RQ-VAE} x {attribute text (TF-IDF + SVD),
collaborative (item embeddings of a clean-protocol SASRec run)}; one TIGER-style model per SID set
and seed, every run trained for exactly ``--steps`` steps (cosine schedule over those steps, no
wall-clock stop) and evaluated once at the end (validation picks nothing: the last checkpoint is the
only one evaluated), then tested: ``RUN/eval.json`` as `recforge eval` writes it.

Jobs run as separate processes (each ``OMP_NUM_THREADS=--threads``): at most ``--parallel`` GPU jobs
at once, all sharing the one GPU, plus the SID fits on the CPU beside them. The SASRec run and the
fits start first; each training starts as soon as its SIDs exist and a GPU slot is free.
Measured on the H200 host (16 cores): text fits 23 s (balanced k-means) / 40 s (RQ-VAE), SASRec 40
epochs 105 s, six TIGER trainings at once ~14 steps/s each plus ~16 s of evaluation; 1,500 steps
per run puts the whole ablation (12 runs) at about 7 minutes. At the end ``benchmarks/sid_ablation_table.py`` prints mean ± 95% t-interval per SID set.

Usage (the lead's H200, from the repo root; ~8 minutes):
    bash benchmarks/sid_beauty_ablation.sh
CPU check at a tiny size (synthetic data, a few steps):
    python benchmarks/sid_beauty_ablation.py --tiny --work /tmp/abl/work --data /tmp/abl/data --steps 4 --seeds 1 2 --sasrec-epochs 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SID_SETS = {  # name -> (--source kind, sid fit arguments)
    "text-rk": ("text", ["--balanced"]),
    "text-rqvae": ("text", ["--method", "rqvae"]),
    "collab-rk": ("collab", ["--balanced"]),
    "collab-rqvae": ("collab", ["--method", "rqvae"]),
}
TINY_FIT = ["--codebook-size", "8", "--levels", "2", "--rqvae-epochs", "3"]
TINY_MODEL = ["model.dim=16", "model.num_blocks=1", "model.num_heads=2", "model.ffn_dim=32", "data.max_seq_len=10",
              "eval.batch_size=256", "optim.warmup_steps=0"]  # fmt: skip


@dataclass
class Job:
    name: str
    command: list[str]
    needs: list[str] = field(default_factory=list)
    gpu: bool = True  # counts against --parallel (SID fits run on the CPU beside them)
    process: subprocess.Popen | None = None
    started: float = 0.0
    state: str = "waiting"  # waiting | running | done | failed | skipped


def plan(args: argparse.Namespace) -> list[Job]:
    """Every job of the ablation in priority order (a job starts once the jobs it needs are done)."""
    rf = [args.python, "-m", "recforge.cli", "--no-progress"]
    work, data = Path(args.work), Path(args.data)
    threads = f"train.threads={args.threads}"
    jobs = [Job("sasrec", [*rf, "train", "configs/beauty-sasrec.yaml", f"data.path={data}", "name=sasrec",
                           f"train.output_dir={work / 'sasrec'}", f"train.epochs={args.sasrec_epochs}",
                           "train.eval_every=5", threads, *(["model.dim=16", "model.ffn_dim=16"] if args.tiny else [])])]  # fmt: skip
    tiny_fit = TINY_FIT if args.tiny else []
    for name, (kind, fit_args) in SID_SETS.items():
        source = "text" if kind == "text" else f"run:{work / 'sasrec'}"
        jobs.append(Job(f"fit-{name}", [*rf, "sid", "fit", str(data), "--out", str(work / f"sids-{name}"), "--source", source,
                                        *fit_args, *tiny_fit, "--overwrite"], ["sasrec"] if kind == "collab" else [],
                        gpu=False))  # fmt: skip
    for name in SID_SETS:
        for seed in args.seeds:
            run = f"tiger-{name}-s{seed}"
            overrides = [f"data.path={data}", f"generative.sids={work / f'sids-{name}'}", f"name={run}",
                         f"train.output_dir={work / run}", f"train.seed={seed}", f"train.max_steps={args.steps}",
                         "train.epochs=1000", "train.max_minutes=0", "train.eval_every=0", threads,
                         *(TINY_MODEL if args.tiny else []), *args.overrides]  # fmt: skip
            jobs.append(Job(run, [*rf, "train", "configs/beauty-sid-tiger.yaml", *overrides], [f"fit-{name}"]))
    return jobs


def run_jobs(jobs: list[Job], parallel: int, threads: int, logs: Path, budget_s: float) -> bool:
    """Run ``jobs`` respecting ``needs``, at most ``parallel`` GPU jobs at once; True when all succeeded.

    Past ``budget_s`` the running jobs are stopped and the waiting ones skipped, so the table of what
    finished still prints inside a bounded command (a stopped run has no eval.json)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    by_name = {j.name: j for j in jobs}
    t0 = time.monotonic()
    while any(j.state in ("waiting", "running") for j in jobs):
        if time.monotonic() - t0 > budget_s:
            for job in jobs:
                if job.state == "running":
                    job.process.terminate()
                    job.process.wait()
                if job.state in ("running", "waiting"):
                    job.state = "failed"
                    print(f"[{time.monotonic() - t0:6.0f}s] {job.name}: stopped at the {budget_s:.0f}s budget", flush=True)
            break
        for job in jobs:
            if job.state == "running" and job.process.poll() is not None:
                job.state = "done" if job.process.returncode == 0 else "failed"
                print(f"[{time.monotonic() - t0:6.0f}s] {job.name}: {job.state} after {time.monotonic() - job.started:.0f}s"
                      + ("" if job.state == "done" else f" (see {logs / job.name}.log)"), flush=True)  # fmt: skip
        for job in jobs:
            if job.state == "waiting" and any(by_name[n].state in ("failed", "skipped") for n in job.needs):
                job.state = "skipped"
                print(f"[{time.monotonic() - t0:6.0f}s] {job.name}: skipped (a job it needs failed)", flush=True)
        for job in jobs:
            busy = sum(j.state == "running" and j.gpu for j in jobs)
            if job.state == "waiting" and all(by_name[n].state == "done" for n in job.needs) and (not job.gpu or busy < parallel):
                with open(logs / f"{job.name}.log", "w") as log:
                    job.process = subprocess.Popen(job.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                job.state, job.started = "running", time.monotonic()
                print(f"[{time.monotonic() - t0:6.0f}s] {job.name}: started", flush=True)
        time.sleep(0.5)
    print(f"all jobs ended after {time.monotonic() - t0:.0f}s", flush=True)
    return all(j.state == "done" for j in jobs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=".gpu_data/amazon-beauty", help="amazon-s3rec source (Beauty.txt, ...)")
    p.add_argument("--data", default="data/beauty", help="prepared dataset directory (made from --src if missing)")
    p.add_argument("--work", default="runs/sid-ablation", help="SID sets and runs go here")
    p.add_argument("--steps", type=int, default=1500, help="training steps of every generative run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--parallel", type=int, default=6, help="processes at once (sharing the GPU)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS and train.threads of each process")
    p.add_argument("--sasrec-epochs", type=int, default=40)
    p.add_argument("--tiny", action="store_true", help="CPU check: synthetic data, tiny models and fits")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", default="benchmarks/results/sid_beauty_ablation.json", help="the table as JSON")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of every generative run")
    p.add_argument("--overwrite", action="store_true", help="delete --work first (an earlier ablation's runs)")
    p.add_argument("--budget-minutes", type=float, default=9.0, help="stop what still runs after this long")
    args = p.parse_args(argv)
    work, data = Path(args.work), Path(args.data)
    if work.exists() and any(work.glob("*/checkpoints")):
        if not args.overwrite:
            print(f"{work} holds runs of an earlier ablation; pass --overwrite to delete them or --work elsewhere", file=sys.stderr)
            return 2
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    rf = [args.python, "-m", "recforge.cli", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not (data / "dataset.json").is_file():
        if args.tiny:
            make = [*rf, "data", "synthetic", "--users", "150", "--items", "200", "--out", str(data)]
        else:
            make = [*rf, "data", "prepare", "amazon-s3rec", args.src, "--out", str(data)]
        subprocess.run(make, cwd=ROOT, env=env, check=True)
    ok = run_jobs(plan(args), args.parallel, args.threads, work / "logs", args.budget_minutes * 60)
    table = [args.python, str(ROOT / "benchmarks/sid_ablation_table.py"), str(work), "--steps", str(args.steps), "--out", args.out]
    subprocess.run(table, cwd=ROOT, env=env, check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
