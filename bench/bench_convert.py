"""`ckpt convert --to dcp` at 1, 2, ... processes vs `cp -r` (the floor) and what users do today (load the run in
DeepSpeed, gather, `dcp.save`), in one run.

    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6   # once (~2.2 GB, 581 tensors, DP=2)
    python bench/bench_convert.py [--ckpt bench/out/zero2_2g] [--nprocs 1,2] [--skip-baseline] [--no-verify]
    python bench/bench_convert.py --nprocs 1,2,4,8,16 --skip-baseline       # the scaling table, 16 cores

Contenders, each a separate process tree timed from spawn to exit (imports included) with its CPU seconds and the
peak RSS of its largest process (`bench/_util.run_measured`), the machine's load read before it (`_scaling`):

- `cp -r` of the source + `sync -f` (the floor: the converters fsync what they write);
- `ckpt convert --to dcp` in one process, and with `--nproc N` (a one-node torchrun job: each rank writes a share of
  the parameters balanced by bytes and compares its share of the output with the source); each N-process output is
  checked to have the same bytes as the 1-process one (sha256 of every file; every run writes the same OUT path,
  which DCP's `.metadata` names); `--no-verify` leaves the logical comparison out of every run;
- **load + save** (the only path without `ckpt`; leave it out with --skip-baseline, it holds the whole state in
  memory): this file's `--baseline-worker` under torchrun at the checkpoint's DP: `deepspeed.initialize` on the same
  TinyGPT and config (from the manifest that make_big_zero.py writes), `engine.load_checkpoint`, every parameter's
  full fp32 master, exp_avg and exp_avg_sq gathered with `deepspeed.utils.safe_get_full_*` (what a user script does
  to get plain tensors out of ZeRO), then rank 0 `dcp.save`s {model, optim, step} (the FSDP2 layout,
  `no_dist=True`); its output is checked equal to ckpt's by torch's own DCP reader.

Outputs are deleted after each run (one on disk at a time, two for the baseline's check); the page cache is warm
for every contender (the source is read once by `cp -r` first). Results: stdout table and
bench/out/convert_results.json (or --results), with bytes/s per process and parallel efficiency (speed-up / N).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scaling import floor, measure_once, parse_nprocs, print_row, scaling  # noqa: E402
from _util import OUT_DIR, REPO_ROOT, dir_bytes, machine_info, run_measured  # noqa: E402

PY = sys.executable


def baseline_worker(args: argparse.Namespace) -> None:
    """One torchrun rank of the load-in-DeepSpeed-then-save path."""
    import deepspeed
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt_tools.resume.workers.deepspeed import full_state
    from ckpt_tools.train.models import GPTConfig, TinyGPT
    from ckpt_tools.samples.workers import _common as c

    manifest = json.loads(Path(str(args.ckpt) + ".manifest.json").read_text())
    extra = manifest.get("extra", manifest)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(**extra["model_config"])
    torch.manual_seed(c.SEED)
    model = TinyGPT(cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=c.param_groups(model), config=extra["ds_config"]
    )
    engine.load_checkpoint(str(args.ckpt))
    # DeepSpeed links each parameter to its optimizer-state fragments at the first step; a conversion script
    # that never steps links them itself (ZeRO-1/2) before `safe_get_full_optimizer_state` can see them
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    names = {id(p): n for n, p in model.named_parameters()}
    step = torch.tensor(float(c.adam_step(engine.optimizer)))
    # every parameter's fp32 master and Adam moments gathered whole on every rank (safe_get_full_*, with the
    # check that each rank holds a fragment of each state, as `ckpt resume`'s worker does)
    full = full_state(engine, engine.module, ("exp_avg", "exp_avg_sq"))
    weights = {n: e.pop("fp32") for n, e in full.items()}
    state = {n: {**e, "step": step.clone()} for n, e in full.items()}
    groups = []
    for g in engine.optimizer.param_groups:
        groups.append(
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[id(p)] for p in g["params"] if id(p) in names],
            }
        )
    if c.rank() == 0:
        dcp.save(
            {"model": weights, "optim": {"state": state, "param_groups": groups}, "step": int(engine.global_steps)},
            checkpoint_id=args.out,
            no_dist=True,
        )
    c.shutdown()


def same_dcp(a: Path, b: Path, scratch: Path) -> bool:
    """Whether two DCP folders hold the same model weights and Adam state, read by torch's own DCP reader
    (`dcp_to_torch_save`; after the timings, so its memory does not count)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    loaded = []
    for i, d in enumerate((a, b)):
        f = scratch / f"cmp{i}.pt"
        dcp_to_torch_save(d, f)
        loaded.append(torch.load(f, mmap=True, weights_only=False))  # our own files, just written
    x, y = loaded
    if set(x["model"]) != set(y["model"]) or any(not torch.equal(x["model"][k], y["model"][k]) for k in x["model"]):
        return False
    sx, sy = x["optim"]["state"], y["optim"]["state"]
    return set(sx) == set(sy) and all(torch.equal(sx[p][k], sy[p][k]) for p in sx for k in ("exp_avg", "exp_avg_sq"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=OUT_DIR / "zero2_2g")
    ap.add_argument("--nprocs", default="1,2", help="counts of processes to measure, e.g. 1,2,4,8,16 (1 always)")
    ap.add_argument("--no-verify", action="store_true", help="pass --no-verify (no logical comparison with the source)")
    ap.add_argument("--scratch", type=Path, default=OUT_DIR / "convert_scratch")
    ap.add_argument("--results", default="convert_results.json", help="file name under bench/out/ (or a path)")
    ap.add_argument("--skip-baseline", action="store_true", help="leave out the DeepSpeed load + dcp.save run")
    ap.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_worker:
        return baseline_worker(args)
    from ckpt_tools.samples import free_port, worker_env

    nprocs = parse_nprocs(args.nprocs)
    ck = args.ckpt.resolve()
    scratch = args.scratch.resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    out = scratch / "out"  # every run of one command writes the same path: a DCP .metadata names it
    env = {**worker_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}

    def convert(n: int, dest: Path) -> list[str]:
        cmd = [PY, "-m", "ckpt_cli.main", "convert", str(ck), str(dest), "--to", "dcp", "--json"]
        return cmd + (["--no-verify"] if args.no_verify else []) + (["--nproc", str(n)] if n > 1 else [])

    results = {"cp -r + sync": floor(ck, out)}
    results.update(scaling("ckpt convert --to dcp", convert, out, nprocs, env=env))
    if not args.skip_baseline:
        manifest = json.loads(Path(str(ck) + ".manifest.json").read_text())
        dp = int(manifest["topology"]["dp"])
        cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", str(dp), "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(free_port()), str(Path(__file__).resolve()), "--baseline-worker"]
        cmd += ["--ckpt", str(ck), "--out", str(scratch / "baseline")]
        row = measure_once(cmd, scratch / "baseline", nproc=dp, env=env)
        print_row("load in DeepSpeed + dcp.save", row)
        # the same state as ckpt's output (written again, untimed, to compare; both deleted after)
        run_measured(convert(1, out), cwd=REPO_ROOT, env=env)
        row["same_as_ckpt_convert"] = same_dcp(out, scratch / "baseline", scratch)
        results["load in DeepSpeed + dcp.save"] = row
    shutil.rmtree(scratch, ignore_errors=True)
    one = results["ckpt convert --to dcp, 1 process"]
    doc = {
        "checkpoint": str(ck),
        "checkpoint_bytes": dir_bytes(ck),
        "nprocs": nprocs,
        "verify": not args.no_verify,
        "scratch": str(scratch),
        "machine": machine_info(),
        "results": results,
        "convert_1_process_vs_cp": round(one["wall_s"] / results["cp -r + sync"]["wall_s"], 3),
    }
    if not args.skip_baseline:
        base = results["load in DeepSpeed + dcp.save"]
        doc["speedup_vs_load_save"] = base["wall_s"] / one["wall_s"]
        doc["rss_ratio_vs_load_save"] = one["peak_rss_bytes"] / base["peak_rss_bytes"]
    same = [r["same_bytes_as_1_process"] for r in results.values() if "same_bytes_as_1_process" in r]
    doc["all_outputs_same_bytes_as_1_process"] = all(same)
    path = Path(args.results) if "/" in args.results else OUT_DIR / args.results
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("results", "machine")}, indent=1))
    print(f"results: {path}")
    if not all(same):
        raise SystemExit("an N-process output differs from the 1-process one")


if __name__ == "__main__":
    main()
