"""The producer samples: torchtitan's own Trainer (torchtitan 0.3.0), the PyTorch DCP-recipe layout, and Accelerate
with two models.

The recipe and Accelerate workers have a resume mode that loads a checkpoint the way its producer does (the recipe:
`dcp.load({"app": AppState})`; Accelerate: `accelerator.load_state`) and records the updates it makes.
`producer_resume` launches it; other tests can resume an edited checkpoint with it and compare with an untouched
one. The torchtitan sample is resumed in the real torchtitan Trainer by tests/test_torchtitan_resume.py.

Which saved fields drive the resumed LRs (measured by editing copies, asserted below):
- torchtitan 0.3.0: the saved per-parameter `optimizer.param_groups.<fqn>.lr` drives the first resumed update,
  the job config's LR x the schedule at the saved `last_epoch` every later one (tests/test_torchtitan_resume.py).
- recipe (CosineAnnealingLR, recursive form): `app.optim.param_groups.<i>.lr` drives every resumed update;
  `app.scheduler.eta_min`, `T_max` and `last_epoch` shape the later ones; `app.scheduler.base_lrs` is not read
  (until epoch T_max + 1).
- Accelerate two models: optimizer.bin's lr then scheduler.bin's base_lrs (LambdaLR) for model 0;
  optimizer_1.bin's lr for every update of model 1 (StepLR, recursive); scheduler_1.bin's base_lrs is not read.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import LOSS_REL_TOL, manifest, manifest_of, producer_resume, resume_edit, sample

DCP_SAMPLES = [("dcp", "dcp_recipe_fsdp2")]
ALL_SAMPLES = DCP_SAMPLES + [("accelerate", "accelerate_two_models")]
RESUMED = (5, 6)


def history(man: dict) -> dict[int, dict]:
    """A manifest's per-step history by step."""
    return {h["step"]: h for h in man["extra"]["history"]}


def dcp_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def edit_dcp(src: Path, dst: Path, edit) -> Path:
    """Test-only surgery with torch's own tools: the whole folder as one torch.save dict (dcp_to_torch_save),
    `edit(dict)`, written back as a DCP folder (torch_save_to_dcp: one file, same keys; DCP reshards on load)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    work = dst.parent / f"{dst.name}.work"
    work.mkdir(parents=True)
    dcp_to_torch_save(src, work / "full.pt")
    sd = torch.load(work / "full.pt", weights_only=False)
    edit(sd)
    torch.save(sd, work / "edited.pt")
    torch_save_to_dcp(work / "edited.pt", dst)
    return dst


def assert_resumed_like_history(recs: list[dict], hist: dict[int, dict], *, loss_rel: float) -> None:
    assert [r["step"] for r in recs] == list(RESUMED)
    assert [r["optimizer_step"] for r in recs] == list(RESUMED)  # Adam's step continues from the saved 4
    for r in recs:
        h = hist[r["step"]]
        assert r["lr"] == pytest.approx(h["lr"], rel=1e-12), r["step"]
        assert abs(r["loss"] - h["loss"]) <= loss_rel * abs(h["loss"]), (r["step"], r["loss"], h["loss"])
        if "lr_1" in h:
            assert r["lr_1"] == pytest.approx(h["lr_1"], rel=1e-12), r["step"]
            assert r["optimizer_step_1"] == r["step"]
            assert abs(r["loss_1"] - h["loss_1"]) <= loss_rel * abs(h["loss_1"]), r["step"]


# --- layouts (no training) --------------------------------------------------------------------------------


def _titan() -> tuple[Path, dict]:
    """The full save (step-3) of the sample torchtitan 0.3.0's own Trainer wrote, and its manifest."""
    m = manifest("dcp", "torchtitan_real")
    return sample("dcp", "torchtitan_real") / m["extra"]["full_save"], m


def _fqns(m: dict) -> list[str]:
    """The live parameter names as torchtitan's checkpoint names them (its canonical FQN: without the
    activation-checkpoint wrapper's `_checkpoint_wrapped_module.`)."""
    return [n.replace("_checkpoint_wrapped_module.", "") for n in m["extra"]["live_parameter_names"]]


def test_torchtitan_layout_keys():
    """What torchtitan's CheckpointManager handed to dcp.save (recorded from the live call) is what the folder
    holds: model keys flat at the top level (wqkv saved split as wq/wk/wv), the optimizer flattened per FQN
    (state under the fused wqkv name), lr_scheduler holding only last_epoch."""
    path, m = _titan()
    keys = dcp_keys(path)
    assert keys == set(m["extra"]["saves"][0]["keys"])
    names = _fqns(m)
    assert len(names) == m["parameters"]["tensors"] == 17
    assert {k for k in keys if k.startswith("optimizer.state.")} == {
        f"optimizer.state.{f}.{s}" for f in names for s in ("exp_avg", "exp_avg_sq", "step")
    }
    assert "optimizer.param_groups.0.lr" not in keys  # flattened: keyed by FQN, never by group index
    assert {f"optimizer.param_groups.{f}.lr" for f in names} <= keys
    assert {k for k in keys if k.startswith("lr_scheduler.")} == {"lr_scheduler.last_epoch"}
    model = {k for k in keys if k.split(".")[0] not in ("optimizer", "lr_scheduler", "dataloader", "train_state")}
    assert model == set(m["extra"]["saved_model_keys"]) and len(model) == 21
    assert not any("wqkv" in k for k in model) and any(k.endswith("qkv_linear.wq.weight") for k in model)


def test_torchtitan_saved_values_match_the_manifest(tmp_path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, m = _titan()
    dcp_to_torch_save(path, tmp_path / "t.pt")
    sd = torch.load(tmp_path / "t.pt", weights_only=False)
    assert sd["train_state"] == {"step": m["counters"]["global_step"], "ntokens_seen": m["counters"]["ntokens_seen"]}
    assert sd["lr_scheduler"] == {"last_epoch": m["counters"]["scheduler_last_epoch"]}
    groups = m["extra"]["saves"][0]["lr"]
    norms = [n for n in _fqns(m) if "norm" in n]
    rest = [n for n in _fqns(m) if "norm" not in n]
    assert {sd["optimizer"][f"param_groups.{f}.lr"] for f in norms} == {groups["param_groups"][0]}
    assert {sd["optimizer"][f"param_groups.{f}.lr"] for f in rest} == {groups["param_groups"][1]}
    assert {sd["optimizer"][f"param_groups.{f}.initial_lr"] for f in rest} == {groups["initial_lr"][1]}
    assert {int(sd["optimizer"][f"state.{f}.step"]) for f in _fqns(m)} == {3}
    # the per-rank data-loader pickles, summarized by ckpt without running them; torch's own loader unpickles
    import pickle

    import ckpt_tools

    details = ckpt_tools.open_checkpoint(path).details
    assert details["train_state"] == f"step 3, ntokens_seen {m['counters']['ntokens_seen']}"
    for r in (0, 1):
        state = pickle.loads(sd["dataloader"][f"dp_rank_{r}"])
        ds = state["dataset_state"]
        assert (
            f"dp_rank_{r}: {state['_num_yielded']} batches yielded, sample_idx {ds['sample_idx']}, epoch {ds['epoch']}"
        ) in details["dataloader"]
    assert details["dataloader"].startswith(f"world_size {sd['dataloader']['world_size']}; ")


def test_recipe_layout_keys():
    keys = dcp_keys(sample("dcp", "dcp_recipe_fsdp2"))
    assert {k.split(".")[0] for k in keys} == {"app"}
    assert {k.split(".")[1] for k in keys} == {"model", "optim", "scheduler", "step"}
    assert {
        "app.optim.param_groups.0.lr",
        "app.optim.param_groups.1.lr",
        "app.optim.param_groups.0.params",
        "app.optim.state.wte.weight.exp_avg",
        "app.optim.state.wte.weight.step",
        "app.model.wte.weight",
        "app.scheduler.base_lrs",
        "app.scheduler.T_max",
        "app.scheduler.eta_min",
        "app.scheduler.last_epoch",
        "app.step",
    } <= keys
    assert manifest("dcp", "dcp_recipe_fsdp2")["extra"]["scheduler_kind"] == "CosineAnnealingLR"


def test_accelerate_two_models_files_and_manifest():
    import torch
    from safetensors import safe_open

    ck = sample("accelerate", "accelerate_two_models")
    m = manifest("accelerate", "accelerate_two_models")
    assert sorted(p.name for p in ck.iterdir()) == [
        "custom_checkpoint_0.pkl",
        "model.safetensors",
        "model_1.safetensors",
        "optimizer.bin",
        "optimizer_1.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
        "scheduler_1.bin",
    ]
    models = m["extra"]["models"]
    assert m["parameters"]["count"] == sum(x["parameters"] for x in models)
    for x in models:
        with safe_open(ck / x["file"], "pt") as f:
            assert len(list(f.keys())) == x["tensors"]
            assert sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) == x["parameters"]
    for i, info in enumerate(m["extra"]["optimizers"]):
        suffix = "" if i == 0 else f"_{i}"
        sched = torch.load(ck / f"scheduler{suffix}.bin", weights_only=True)
        opt = torch.load(ck / f"optimizer{suffix}.bin", weights_only=True)
        assert sched["last_epoch"] == info["last_epoch"] == 8  # Accelerate steps it once per process per step
        assert sched["base_lrs"] == info["base_lrs"]
        assert [g["lr"] for g in opt["param_groups"]] == info["lr"]
        assert {int(s["step"]) for s in opt["state"].values()} == {info["optimizer_step"]} == {4}
    assert [x["scheduler"] for x in m["extra"]["optimizers"]] == ["LambdaLR", "StepLR"]
    assert torch.load(ck / "custom_checkpoint_0.pkl", weights_only=True) == m["extra"]["custom_checkpoint_0"]
    # the two optimizers' LRs differ at every resumed step, so a reader mixing them up is caught
    hist = history(manifest("accelerate", "accelerate_two_models"))
    assert all(hist[s]["lr"] != hist[s]["lr_1"] for s in RESUMED)


# --- untouched resumes in the real frameworks -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("group,name", ALL_SAMPLES)
def test_untouched_resume_reproduces_the_manifest(untouched_resume, group, name):
    run = untouched_resume(name)  # made once per run (conftest), shared with the edit tests that compare with it
    assert run["files_changed"] == [], "the resume wrote to the checkpoint"
    recs = run["records"]
    assert_resumed_like_history(recs, history(manifest(group, name)), loss_rel=LOSS_REL_TOL["float32"])
    m = manifest(group, name)
    assert recs[0]["lr"] == m["extra"]["next_lr"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for _, n in ALL_SAMPLES])
def test_fresh_sample_resumes_bitwise(fresh_sample, tmp_path, name):
    """Made on this machine and resumed on it: the same losses, bit for bit, and the same LRs."""
    ck = fresh_sample(name)
    recs = producer_resume(name, ck, tmp_path)
    assert_resumed_like_history(recs, history(manifest_of(ck)), loss_rel=0.0)


# --- which saved fields drive the resumed LRs ---------------------------------------------------------------


# The two edits below are resumed with the untouched copy in one launch of each sample's worker
# (conftest.producer_runs).


@resume_edit("dcp_recipe_fsdp2", "optimizer_lr_halved_base_lrs_1")
def _recipe_edit(ck: Path) -> dict:
    def edit(sd):
        sd["app"]["optim"]["param_groups"][0]["lr"] /= 2
        sd["app"]["scheduler"]["base_lrs"] = [1.0, 1.0]  # the recursive form does not read it at epoch 5

    return {"resume": str(edit_dcp(ck, ck.parent / "edited", edit))}


@pytest.mark.slow
def test_recipe_cosine_lr_follows_the_optimizer_lr_not_base_lrs(producer_runs):
    m = manifest("dcp", "dcp_recipe_fsdp2")
    t_max, eta_min = m["extra"]["scheduler_params"]["T_max"], m["extra"]["scheduler_params"]["eta_min"]
    recs = producer_runs("dcp_recipe_fsdp2")["optimizer_lr_halved_base_lrs_1"]["records"]
    hist = history(manifest("dcp", "dcp_recipe_fsdp2"))
    lr5 = hist[5]["lr"][0] / 2
    assert recs[0]["lr"] == pytest.approx([lr5, hist[5]["lr"][1]], rel=1e-12)
    e = 5  # the scheduler's last_epoch after the first resumed update
    lr6 = (1 + math.cos(math.pi * e / t_max)) / (1 + math.cos(math.pi * (e - 1) / t_max)) * (lr5 - eta_min) + eta_min
    assert recs[1]["lr"] == pytest.approx([lr6, hist[6]["lr"][1]], rel=1e-12)


@resume_edit("accelerate_two_models", "each_optimizer_its_own_files")
def _accelerate_edit(ck: Path) -> dict:
    import torch

    def rewrite(fname, edit):
        sd = torch.load(ck / fname, weights_only=True)
        edit(sd)
        torch.save(sd, ck / fname)

    rewrite("scheduler.bin", lambda sd: sd.__setitem__("base_lrs", [x / 2 for x in sd["base_lrs"]]))
    rewrite("optimizer_1.bin", lambda sd: [g.__setitem__("lr", 1e-4) for g in sd["param_groups"]])
    rewrite("scheduler_1.bin", lambda sd: sd.__setitem__("base_lrs", [1.0, 1.0]))  # StepLR's recursive form
    return {}


@pytest.mark.slow
def test_accelerate_two_models_each_optimizer_from_its_own_files(producer_runs):
    from ckpt_tools.samples.workers import accel_multi

    recs = producer_runs("accelerate_two_models")["each_optimizer_its_own_files"]["records"]
    hist = history(manifest("accelerate", "accelerate_two_models"))
    gamma = accel_multi.GAMMA_1
    assert recs[0]["lr"] == hist[5]["lr"]  # optimizer.bin untouched
    assert recs[1]["lr"] == pytest.approx([x / 2 for x in hist[6]["lr"]], rel=1e-12)
    assert recs[0]["lr_1"] == [1e-4, 1e-4]
    assert recs[1]["lr_1"] == pytest.approx([1e-4 * gamma] * 2, rel=1e-12)  # epoch 9: one StepLR decay
    assert [r["optimizer_step_1"] for r in recs] == [5, 6]
