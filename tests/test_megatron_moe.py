"""Megatron-core Mixture-of-Experts checkpoints, written by Megatron-LM core_v0.16.1's own `save_checkpoint` after
real training (sample_ckpts/megatron_lm/megatron_moe_ep2_torch_dist: 4 experts, top-2, SequentialMLP, expert
parallel 2 over 2 CPU ranks, plain Adam; made by ckpt_tools/samples/workers/megatron_lm.py).

The optimizer of such a run is Megatron's ChainedOptimizer (dense, expert): torch_dist's common.pt keeps its inner
optimizers as `optimizer[0]` / `optimizer[1]`, each with its own param groups and common Adam step. Checked here:
every group's LR and the step as Megatron recorded them at save time (the manifest), the conversions that must
carry every group and every parameter's step (read back), the refusals (a copy that lost an inner optimizer's
groups, `convert --to megatron`), and — with MEGATRON_LM_DIR — the sample remade and reloaded by Megatron itself."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_tools
from ckpt_tools.read import pickle_reader as pr
from ckpt_tools.samples import free_port, worker_env
from ckpt_tools.view import logical as L
from ckpt_tools.write import pickle_writer as pw

from conftest import ROOT, run_cli, sample

EP2 = "megatron_moe_ep2_torch_dist"
COMMON = Path("iter_0000010") / "common.pt"


def _manifest() -> dict:
    return json.loads((sample("megatron_lm", EP2).parent / f"{EP2}.manifest.json").read_text())


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / EP2
    shutil.copytree(sample("megatron_lm", EP2), dst)
    return dst


def _rewrite_common(run: Path, edit) -> None:
    """Change common.pt with ckpt's own pickle writer (no megatron import, no torch.load)."""
    path = run / COMMON
    obj = pr.load(path).obj
    edit(obj)
    tmp = path.with_name(path.name + ".new")
    pw.rewrite_torch_zip(path, tmp, obj)
    tmp.replace(path)


def _steps(ck) -> dict[str, float]:
    """Each parameter's Adam step as the view reads it back (a scalar, or a 0-d tensor read)."""
    scalars, states = L.optimizer_scalars(ck), L.optimizer_states(ck)
    out = {}
    for name in set(scalars) | set(states):
        value = scalars.get(name, {}).get("step")
        if value is None and "step" in states.get(name, {}):
            value = states[name]["step"].read().item()
        if value is not None:
            out[name] = float(value)
    return out


def test_inspect_json_shows_every_groups_lr_and_the_adam_step():
    """What Megatron's live optimizer and scheduler held at save time (the manifest): 4 param groups (dense wd /
    no-wd, expert wd / no-wd), their LR, peak and next LR (OptimizerParamScheduler.get_lr), the Adam step of
    both inner optimizers; no warning (the step is saved: no 'step lost')."""
    m = _manifest()
    proc = run_cli("inspect", "--json", sample("megatron_lm", EP2))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["format"] == "megatron_torch_dist"
    assert len(m["lr"]["param_groups"]) == 4
    assert got["lr"]["param_groups"] == pytest.approx(m["lr"]["param_groups"], rel=1e-12)
    assert got["lr"]["base_lrs"] == pytest.approx(m["lr"]["max_lr"], rel=1e-12)
    assert got["lr"]["last_lr"] == pytest.approx(m["lr"]["next_lr"], rel=1e-12)  # computed as Megatron does
    assert m["counters"]["optimizer_step"] == m["counters"]["iteration"] == 10  # no skipped iteration in the run
    assert got["counters"]["optimizer_step"] == m["counters"]["optimizer_step"]
    assert got["counters"]["global_step"] == m["counters"]["iteration"]
    assert got["warnings"] == []
    assert "optimizer-state-missing" not in proc.stdout
    assert got["parameters"]["count"] == m["parameters"]["count"]
    assert (got["topology"]["ep"], got["topology"]["dp"], got["topology"]["tp"]) == (2, 2, 1)


def test_every_parameter_sits_in_its_dense_or_expert_group_with_its_step():
    """The groups are Megatron's: is_expert_parallel as the run recorded it, the routed experts (stacked
    [experts, ...] per layer) in the expert groups, the router and the rest in the dense ones; every parameter
    has its fp32 master, both Adam moments and the step."""
    m = _manifest()
    ck = ckpt_tools.open_checkpoint(sample("megatron_lm", EP2))
    groups = L.param_groups(ck)
    assert [g["is_expert_parallel"] for g in groups] == [g["is_expert_parallel"] for g in m["extra"]["param_groups"]]
    assert [g["wd_mult"] for g in groups] == [g["wd_mult"] for g in m["extra"]["param_groups"]]
    model = set(ck.get("model").children)
    assert sorted(n for g in groups for n in g["params"]) == sorted(model)  # each parameter in exactly one group
    for g in groups:
        assert all((".mlp.experts." in n) == g["is_expert_parallel"] for n in g["params"]), g["params"]
    assert "decoder.layers.0.mlp.router.weight" in groups[0]["params"]
    assert tuple(ck.get("model").children["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].shape) == (
        4,
        64,
        32,
    )
    state = ck.get("optimizer.state").children
    assert set(state) == model
    assert all({"fp32", "exp_avg", "exp_avg_sq", "step"} <= set(e.children) for e in state.values())
    assert set(_steps(ck).values()) == {float(m["counters"]["optimizer_step"])}


@pytest.mark.parametrize("to", ["dcp", "deepspeed-universal", "torch"])
def test_convert_carries_every_param_group_and_every_step(tmp_path, to):
    """Read back: the output holds the 4 groups with the same members and LRs, and every parameter's step."""
    src = sample("megatron_lm", EP2)
    out = tmp_path / "out"
    proc = run_cli("convert", src, "--to", to, out)
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout
    want, got = L.param_groups(src), L.param_groups(out)
    assert len(got) == len(want) == 4
    assert [sorted(g["params"]) for g in got] == [sorted(g["params"]) for g in want]
    assert [g["lr"] for g in got] == [g["lr"] for g in want]
    assert [g["weight_decay"] for g in got] == [g["weight_decay"] for g in want]
    src_steps, out_steps = _steps(ckpt_tools.open_checkpoint(src)), _steps(L.open_any(out))
    assert len(src_steps) == 32 and out_steps == src_steps


def test_verify_fails_an_output_that_lost_the_groups_or_the_steps(tmp_path):
    """The verify path of `convert` (a logical diff of source and output) names an output without param groups
    and parameters without their step: before, a side with no groups was only 'not compared', and a step one
    side lacks was skipped, so a conversion of 0 groups and no step said 'verified'."""
    torch = pytest.importorskip("torch")
    from ckpt_tools.ops import convert

    src = sample("megatron_lm", EP2)
    plan = convert.plan_convert(src, tmp_path / "out.pt", to="torch")
    convert.execute(plan)
    assert convert.verify_logical(plan, tmp_path / "out.pt") == []
    saved = torch.load(tmp_path / "out.pt", weights_only=True)
    no_steps = {
        **saved,
        "optimizer": {
            "param_groups": saved["optimizer"]["param_groups"],
            "state": {i: {k: v for k, v in e.items() if k != "step"} for i, e in saved["optimizer"]["state"].items()},
        },
    }
    torch.save(no_steps, tmp_path / "no_steps.pt")
    problems = convert.verify_logical(plan, tmp_path / "no_steps.pt")
    assert sum(p.startswith("optimizer ") and ".step: removed" in p for p in problems) == 32, problems
    assert "optimizer step: the source's parameters hold Adam's step, no parameter of the output does" in problems
    # without its groups the output's state (keyed by torch's ids) names no parameter: read as no state at all
    saved["optimizer"]["param_groups"] = saved["optimizer"]["param_groups"][:2]
    torch.save(saved, tmp_path / "two_groups.pt")
    problems = convert.verify_logical(plan, tmp_path / "two_groups.pt")
    assert "param_groups: 4 groups planned -> 2 groups written" in problems, problems
    saved["optimizer"]["param_groups"] = []
    torch.save(saved, tmp_path / "no_groups.pt")
    problems = convert.verify_logical(plan, tmp_path / "no_groups.pt")
    assert "param_groups: 4 groups planned -> 0 groups written" in problems, problems
    assert "optimizer: the output holds no per-parameter optimizer state; the source's was planned" in problems


@pytest.mark.parametrize(
    "inner, missing", [(1, "expert wd_mult 0, expert wd_mult 1"), (0, "dense wd_mult 0, dense wd_mult 1")]
)
def test_a_copy_without_one_inner_optimizers_groups_is_refused(tmp_path, inner, missing):
    """Declared (num_experts, expert_model_parallel_size, the model's parameters) vs found: one line, exit 2,
    naming the groups that are gone, for every command that opens it."""
    run = _copy(tmp_path)
    _rewrite_common(run, lambda o: o["optimizer"][inner]["optimizer"].update(param_groups=[]))
    for cmd in (("inspect",), ("convert", "--to", "dcp")):
        args = (*cmd, run) if cmd[0] == "inspect" else (cmd[0], run, *cmd[1:], tmp_path / "out")
        proc = run_cli(*args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "declares 4 param groups" in proc.stderr and f"{missing} missing" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_copy_without_the_expert_optimizer_is_refused(tmp_path):
    """The whole second inner optimizer gone (common.pt's optimizer = {0: dense})."""
    run = _copy(tmp_path)
    _rewrite_common(run, lambda o: o["optimizer"].pop(1))
    proc = run_cli("inspect", run)
    assert proc.returncode == 2 and "expert wd_mult 0, expert wd_mult 1 missing" in proc.stderr, proc.stderr


def test_a_lost_step_of_one_inner_optimizer_is_named(tmp_path):
    """Each inner optimizer keeps its own common step: the expert one's gone is a warning naming it, and its
    parameters show no step while the dense ones keep theirs."""
    run = _copy(tmp_path)
    _rewrite_common(run, lambda o: o["optimizer"][1]["optimizer"]["state"].pop("common_step"))
    ck = ckpt_tools.open_checkpoint(run)
    assert [w.code for w in ck.warnings] == ["optimizer-state-missing"]
    assert "inner optimizer 1 (of 2)" in ck.warnings[0].message
    steps = _steps(ck)
    assert set(steps.values()) == {10.0} and all(".mlp.experts." not in n for n in steps)
    assert len(steps) == sum(".mlp.experts." not in n for n in ck.get("model").children)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_convert_to_megatron_refuses_naming_moe(tmp_path, fmt):
    """Not written yet (expert-parallel rank folders, chained optimizers): one line naming MoE, no traceback."""
    proc = run_cli("convert", sample("megatron_lm", EP2), "--to", "megatron", "--ckpt-format", fmt, tmp_path / "o")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Mixture-of-Experts" in proc.stderr and "expert_model_parallel_size=2" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_set_lr_edits_both_inner_optimizers(tmp_path):
    """Every group of both inner optimizers and the scheduler, read back through the reader."""
    run = _copy(tmp_path)
    before = ckpt_tools.open_checkpoint(run).lr
    proc = run_cli("set-lr", run, "--scale", "0.5", "--yes")
    assert proc.returncode == 0, proc.stderr
    after = ckpt_tools.open_checkpoint(run).lr
    assert len(after.base_lrs) == 4
    assert list(after.base_lrs) == pytest.approx([x / 2 for x in before.base_lrs], rel=1e-12)
    assert list(after.last_lr) == pytest.approx([x / 2 for x in before.last_lr], rel=1e-12)


MEGATRON = os.environ.get("MEGATRON_LM_DIR")
needs_megatron = pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout: its training code "
    "is not on the package registries)",
)


def _worker(*args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "ckpt_tools.samples.workers.megatron_lm",
        "--sample",
        EP2,
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@needs_megatron
def test_megatron_reloads_the_bundled_sample_as_the_manifest_says():
    """Megatron's own load_checkpoint restores the 4 groups' LRs and the Adam step the manifest (and inspect) give."""
    proc = _worker("--check", str(sample("megatron_lm", EP2)))
    assert proc.stdout.count("-> MATCH") == 2, proc.stdout[-3000:]


@needs_megatron
def test_a_fresh_sample_reads_as_its_own_manifest(tmp_path):
    """The sample remade by Megatron's pretrain + save_checkpoint: read against the manifest of that run."""
    _worker("--out", str(tmp_path))
    m = json.loads((tmp_path / f"{EP2}.manifest.json").read_text())
    ck = ckpt_tools.open_checkpoint(tmp_path / EP2)
    assert not ck.warnings, ck.warnings
    assert ck.counters.optimizer_step == m["counters"]["optimizer_step"]
    assert list(ck.lr.param_groups) == pytest.approx(m["lr"]["param_groups"], rel=1e-12)
    assert list(ck.lr.last_lr) == pytest.approx(m["lr"]["next_lr"], rel=1e-12)
    assert ck.parameter_count == m["parameters"]["count"]
    assert [bool(g["is_expert_parallel"]) for g in L.param_groups(ck)] == [False, False, True, True]


def test_a_legacy_rank_file_with_a_chained_optimizer_is_refused_by_name(tmp_path):
    """Legacy rank files save a ChainedOptimizer as a list of inner state dicts; until they are mapped they are
    refused by name, never read as a checkpoint without optimizer state."""
    name = "megatron_tp2_legacy"
    run = tmp_path / name
    shutil.copytree(sample("megatron_lm", name), run)
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = run / "iter_0000010" / rank / "model_optim_rng.pt"
        obj = pr.load(path).obj
        obj["optimizer"] = [obj["optimizer"], obj["optimizer"]]
        pw.rewrite_torch_zip(path, path.with_name("new"), obj)
        path.with_name("new").replace(path)
    proc = run_cli("inspect", run)
    assert proc.returncode == 2 and "ChainedOptimizer of 2" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
