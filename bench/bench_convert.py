"""`ckpt convert --to dcp` vs what users do today (load the run in DeepSpeed, gather, `dcp.save`), in one run.

    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6   # once (~2.2 GB, 581 tensors, DP=2)
    python bench/bench_convert.py [--ckpt bench/out/zero2_2g]

Contenders, each a separate process tree timed from spawn to exit (imports included) with its peak RSS
(`bench/_util.run_measured`: ru_maxrss of the child and the grandchildren it reaped — for torchrun, its
largest rank):

- `ckpt convert --to dcp` (one process, streaming one tensor at a time), and as a torchrun job of 2 ranks (each
  writes a share of the parameters balanced by bytes; rank 0 then verifies the whole and puts it in place), each
  also with `--no-verify` (what the share costs without rank 0's serial logical comparison with the source); the
  job's output is checked to be the same bytes as the one process's (`.metadata` but for its StorageMeta, which
  names OUT);
- **load + save** (the only path without `ckpt`): this file's `--baseline-worker` under torchrun at the
  checkpoint's DP: `deepspeed.initialize` on the same TinyGPT and config (from the manifest that
  make_big_zero.py writes), `engine.load_checkpoint`, every parameter's full fp32 master, exp_avg and
  exp_avg_sq gathered with `deepspeed.utils.safe_get_full_*` (what a user script does to get plain tensors
  out of ZeRO), then rank 0 `dcp.save`s {model, optim, step} (the FSDP2 layout, `no_dist=True`).

Outputs are deleted after each run; the page cache is warm for every contender (the source is read once by
`cp -r` first). Results: stdout table and bench/out/convert_results.json. Both outputs are checked equal by
`ckpt diff` (logical) before they are deleted, so a fast wrong answer cannot pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import OUT_DIR, REPO_ROOT, dir_bytes, fmt_bytes, machine_info, run_measured  # noqa: E402

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


def same_bytes(a: Path, b: Path) -> bool:
    """The same files with the same bytes; `.metadata` compared without its StorageMeta (the OUT path it names)."""
    import filecmp
    import pickle

    def meta(root: Path) -> bytes:
        md = pickle.loads((root / ".metadata").read_bytes())  # written by this benchmark's own run
        md.storage_meta = None
        return pickle.dumps(md)

    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()) or meta(a) != meta(b):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names if n != ".metadata")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=OUT_DIR / "zero2_2g")
    ap.add_argument("--scratch", type=Path, default=OUT_DIR / "convert_scratch")
    ap.add_argument("--results", default="convert_results.json", help="file name under bench/out/")
    ap.add_argument("--skip-baseline", action="store_true", help="leave out the DeepSpeed load + dcp.save run")
    ap.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_worker:
        return baseline_worker(args)
    from ckpt_tools.samples import free_port, worker_env

    ck = args.ckpt.resolve()
    manifest = json.loads(Path(str(ck) + ".manifest.json").read_text())
    dp = int(manifest["topology"]["dp"])
    scratch = args.scratch.resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    env = {**worker_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}

    def torchrun(n: int, *rest: str) -> list[str]:
        return [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(n),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            *rest,
        ]

    runs = {
        "cp -r": ["cp", "-r", str(ck), str(scratch / "cp")],
        "ckpt convert --to dcp": [
            PY,
            "-m",
            "ckpt_cli.main",
            "convert",
            str(ck),
            str(scratch / "ckpt"),
            "--to",
            "dcp",
            "--json",
        ],
        "ckpt convert --to dcp --no-verify": [
            PY,
            "-m",
            "ckpt_cli.main",
            "convert",
            str(ck),
            str(scratch / "ckpt_nv"),
            "--to",
            "dcp",
            "--no-verify",
        ],
        "ckpt convert --to dcp, torchrun 2 ranks": torchrun(
            2, "-m", "ckpt_cli.main", "convert", str(ck), str(scratch / "ckpt_d"), "--to", "dcp", "--json"
        ),
        "ckpt convert --to dcp --no-verify, torchrun 2 ranks": torchrun(
            2, "-m", "ckpt_cli.main", "convert", str(ck), str(scratch / "ckpt_dnv"), "--to", "dcp", "--no-verify"
        ),
        "load in DeepSpeed + dcp.save": torchrun(
            dp,
            str(Path(__file__).resolve()),
            "--baseline-worker",
            "--ckpt",
            str(ck),
            "--out",
            str(scratch / "baseline"),
        ),
    }
    if args.skip_baseline:
        runs.pop("load in DeepSpeed + dcp.save")
    results = {}
    kept = None
    for name, cmd in runs.items():
        m = run_measured(cmd, cwd=REPO_ROOT, env=env)
        out_dir = Path(cmd[-1] if cmd[0] == "cp" else next(a for a in cmd if a.startswith(str(scratch))))
        results[name] = {
            "wall_s": round(m.wall_s, 2),
            "cpu_s": round(m.cpu_s, 2),
            "peak_rss_bytes": m.peak_rss_bytes,
            "output_bytes": dir_bytes(out_dir),
        }
        print(
            f"{name:48s} {results[name]['wall_s']:8.2f} s  {fmt_bytes(results[name]['peak_rss_bytes']):>10s}  "
            f"out {fmt_bytes(results[name]['output_bytes'])}",
            flush=True,
        )
        if name == "ckpt convert --to dcp":
            kept = out_dir  # compared with the job's and the baseline's outputs below
            continue
        if name == "ckpt convert --to dcp, torchrun 2 ranks":
            results[name]["same_bytes_as_one_process"] = same_bytes(kept, out_dir)
        if name.startswith("load in DeepSpeed") and kept is not None:
            results[name]["same_as_ckpt_convert"] = same_dcp(kept, out_dir, scratch)
            shutil.rmtree(kept, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    r = results
    doc = {"checkpoint": str(ck), "checkpoint_bytes": dir_bytes(ck), "machine": machine_info(), "results": r}
    if not args.skip_baseline:
        base = r["load in DeepSpeed + dcp.save"]
        doc["speedup_vs_load_save"] = base["wall_s"] / r["ckpt convert --to dcp"]["wall_s"]
        doc["rss_ratio_vs_load_save"] = r["ckpt convert --to dcp"]["peak_rss_bytes"] / base["peak_rss_bytes"]
    (OUT_DIR / args.results).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("results", "machine")}, indent=1))


if __name__ == "__main__":
    main()
