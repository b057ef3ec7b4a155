"""`ckpt to-universal` with optimizers other than Adam, and what DeepSpeed's loaders do with them.

The runs are real DeepSpeed ZeRO runs on 2 CPU ranks (gloo) with torch SGD(momentum), Adagrad, a one-moment
client optimizer and AdamW with two group LRs (`ckpt_tools/samples/workers/ds_optim.py`), made once per session.
Each conversion is resumed in real DeepSpeed from the universal output and its updates are compared bitwise
with the uninterrupted run made in the same session (the same worker, the same machine): the weights after the
first resumed update are a function of the optimizer state, so they match only if the state continued.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tools.view import logical
from ckpt_tools.errors import CkptError
from ckpt_tools.ops import diff as D
from ckpt_tools.ops import to_universal as U
from ckpt_tools.samples import run_torchrun, worker_env
from ckpt_tools.samples.workers._common import then

from conftest import ROOT, run_cli

WORKER = "ckpt_tools.samples.workers.ds_optim"
NAMES = ("zero2_sgd", "zero1_adagrad", "zero2_onemoment", "zero3_sgd", "zero2_adamw_2lr")
STATE = {
    "zero2_sgd": ("momentum_buffer",),
    "zero1_adagrad": ("sum",),
    "zero2_onemoment": ("exp_avg",),
    "zero3_sgd": ("momentum_buffer",),
    "zero2_adamw_2lr": ("exp_avg", "exp_avg_sq"),
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Path:
    """The uninterrupted runs (checkpoint after update 4, six updates recorded in the manifest)."""
    out = tmp_path_factory.mktemp("ds_optim")
    run_torchrun(WORKER, 2, then(*(["--sample", name, "--out", str(out)] for name in NAMES)))  # one launch
    return out


def history(runs: Path, name: str) -> list[dict]:
    return json.loads((runs / f"{name}.manifest.json").read_text())["extra"]["history"]


def resume_args(src: Path, name: str, record: Path, *, stage: int | None = None, steps: int = 2) -> list[str]:
    args = ["--sample", name, "--resume", str(src), "--record", str(record), "--universal", "--steps", str(steps)]
    return args + (["--stage", str(stage)] if stage else [])


def convert(src: Path, out: Path, **kw) -> U.UniversalPlan:
    plan = U.plan_to_universal(src, out, **kw)
    U.execute(plan, check=lambda root: U.verify_logical(plan, root))  # --verify: logically equal or nothing written
    return plan


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory) -> dict[str, tuple[U.UniversalPlan, Path, list[dict]]]:
    """case -> (the to-universal plan, its output, the records of DeepSpeed resuming that output): every case
    below converted, then all resumed in one launch of the worker (one run per case, each its own engine).

    Cases: each optimizer's state carried (`zero2_sgd`, `zero1_adagrad`, `zero2_onemoment`); the control
    (`zero2_sgd` without its momentum_buffer.pt, 1 step); `zero3_sgd` resumed at ZeRO-2; `zero2_adamw_2lr`
    converted for and resumed at ZeRO-3."""
    tmp = tmp_path_factory.mktemp("resumed")
    cases = {name: (name, {}, {}) for name in ("zero2_sgd", "zero1_adagrad", "zero2_onemoment")}
    cases["control"] = ("zero2_sgd", {}, {"steps": 1})
    cases["zero3_at_zero2"] = ("zero3_sgd", {}, {"stage": 2})
    cases["adamw_2lr_at_zero3"] = ("zero2_adamw_2lr", {"target_stage": 3}, {"stage": 3, "steps": 2})
    plans, parts = {}, []
    for case, (name, convert_kw, resume_kw) in cases.items():
        out = tmp / case / "u"
        plans[case] = convert(runs / name, out, **convert_kw)
        if case == "control":  # momentum_buffer.pt removed: SGD re-initialises the buffer from the gradient
            for f in out.rglob("momentum_buffer.pt"):
                f.unlink()
        parts.append(resume_args(out, name, tmp / case / "records.json", **resume_kw))
    run_torchrun(WORKER, 2, then(*parts))
    return {
        case: (plans[case], tmp / case / "u", json.loads((tmp / case / "records.json").read_text())) for case in cases
    }


@pytest.mark.parametrize("name", ["zero2_sgd", "zero1_adagrad", "zero2_onemoment"])
def test_state_carried_and_continued_in_deepspeed(name, runs, resumed):
    src = runs / name
    plan, out, recs = resumed[name]
    assert plan.state_keys == STATE[name] and plan.stages == (1, 2)
    zero = out / "global_step4_universal" / "zero"
    want_files = {"fp32.pt", *(f"{k}.pt" for k in STATE[name])} | ({"step.pt"} if name == "zero1_adagrad" else set())
    states = logical.optimizer_states(src)
    assert len(states) == 29
    for param, keys in states.items():
        assert {f.name for f in (zero / param).iterdir()} == want_files, param
        for key in STATE[name]:
            got = torch.load(zero / param / f"{key}.pt", weights_only=False)["param"]
            assert torch.equal(got, keys[key].read()), (param, key)  # the source's state, whole
    # no ZeRO-3 model-states name: DeepSpeed's ZeRO-3 universal loader cannot load this state
    assert not list((zero.parent).glob("zero_pp_rank_*")) and any("ZeRO-1/2 loaders only" in n for n in plan.notes)

    want = history(runs, name)[4:6]
    assert [r["step"] for r in recs] == [5, 6]
    assert set(STATE[name]) <= set(recs[0]["state_keys"])
    for r, w in zip(recs, want):  # bitwise: the same run continued, on this machine
        assert r["lr"] == w["lr"] and r["loss"] == w["loss"] and r["params_sha256"] == w["params_sha256"], r["step"]


def test_without_the_state_the_first_update_differs(runs, resumed):
    """The control for the test above: the same universal folder with momentum_buffer.pt removed resumes (SGD
    re-initialises the buffer from the gradient) and the first update no longer matches."""
    _, out, recs = resumed["control"]
    assert not list(out.rglob("momentum_buffer.pt")) and len(recs) == 1
    want = history(runs, "zero2_sgd")[4]
    assert recs[0]["loss"] == want["loss"]  # step 5's loss is computed from the step-4 weights: same
    assert recs[0]["params_sha256"] != want["params_sha256"]  # the update used a fresh momentum: different
    assert "momentum_buffer" in recs[0]["state_keys"]


def test_zero3_source_resumes_at_zero2(runs, resumed):
    plan, _, recs = resumed["zero3_at_zero2"]
    assert plan.state_keys == ("momentum_buffer",) and plan.stages == (1, 2)
    want = history(runs, "zero3_sgd")[4:6]
    assert recs[0]["loss"] == want[0]["loss"]
    # the loss after the first resumed update depends on the momentum carried; ZeRO-2 and ZeRO-3 reduce the
    # same fp32 gradients, so the continued run follows the uninterrupted ZeRO-3 run
    assert recs[1]["loss"] == pytest.approx(want[1]["loss"], rel=1e-6)


def test_zero3_target_refused_for_non_adam_state(runs, tmp_path):
    for name in ("zero2_sgd", "zero1_adagrad", "zero2_onemoment"):
        with pytest.raises(CkptError, match="cannot be loaded at ZeRO-3") as e:
            U.plan_to_universal(runs / name, tmp_path / "u", target_stage=3)
        assert "stage3.py" in str(e.value) and "--target-stage 2" in e.value.one_line()
    r = run_cli("to-universal", runs / "zero2_sgd", tmp_path / "u", "--target-stage", "3", "--yes")
    assert r.returncode == 2 and r.stderr.startswith("ckpt: error: ") and "momentum_buffer" in r.stderr
    assert ": ckpt to-universal: the output cannot be loaded at ZeRO-3" in r.stderr
    assert not (tmp_path / "u").exists()
    doc = json.loads(run_cli("to-universal", runs / "zero2_onemoment", tmp_path / "u", "--dry-run", "--json").stdout)
    assert doc["optimizer_state"] == ["exp_avg"] and doc["loads_at_zero_stages"] == [1, 2]
    assert "exp_avg_sq.pt" in doc["notes"][-1] and not any(m.startswith("zero_pp_rank") for m in doc["model_files"])


def test_deepspeed_converter_cannot_convert_sgd(runs, tmp_path):
    """Why this matters: DeepSpeed's own ds_to_universal assumes Adam's two moments."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(runs / "zero2_sgd" / "global_step4"),
            "--output_folder",
            str(tmp_path / "ds" / "x"),
            "--inject_missing_state",
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        cwd=ROOT,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "KeyError: 'exp_avg'" in proc.stdout + proc.stderr


# --- what DeepSpeed's ZeRO-3 loader does to param groups ---------------------------------------------------------


def test_zero3_group_warnings_function():
    assert U.zero3_group_warnings([]) == [] and U.zero3_group_warnings([{"lr": 1e-3}]) == []
    assert (
        U.zero3_group_warnings(
            [{"lr": 1e-3, "weight_decay": 0.1, "params": [0]}, {"lr": 1e-3, "weight_decay": 0.1, "params": [1]}]
        )
        == []
    )
    w = U.zero3_group_warnings(
        [
            {"lr": 7e-4, "weight_decay": 0.01, "betas": (0.9, 0.95)},
            {"lr": 1.4e-3, "weight_decay": 0.01, "betas": (0.9, 0.95)},
            {"lr": 7e-4, "weight_decay": 0.0, "betas": (0.9, 0.99)},
        ]
    )
    assert w[0].endswith("group 1 will train with lr 0.0007 instead of 0.0014")
    assert w[1].endswith("group 2 will train with weight_decay 0.01 instead of 0")
    assert "betas of group 2 to group 0's (0.9, 0.95)" in w[2] and len(w) == 3
    # stage3.py also hands every group one step tensor, which Adam increments once per group and update
    w = U.zero3_group_warnings([{"lr": 1e-3}, {"lr": 1e-3}, {"lr": 1e-3}], shared_step=True)
    assert len(w) == 1 and "all 3 param groups one shared Adam step tensor" in w[0] and "by 3 instead of 1" in w[0]


def test_zero3_load_uses_group0_lr_as_warned(runs, resumed, tmp_path):
    """Real DeepSpeed: an AdamW run with group LRs [1e-3, 2e-3] converted and loaded at ZeRO-3 trains with
    [1e-3, 1e-3] (stage3.py copies group 0's hyper-parameters) — the LR the warning names."""
    src = runs / "zero2_adamw_2lr"
    plan, _, recs = resumed["adamw_2lr_at_zero3"]
    assert plan.stages == (3,) and len(plan.warnings) == 2
    assert "group 1 will train with lr 0.001 instead of 0.002 and weight_decay 0.01 instead of 0" in plan.warnings[0]
    assert "each update advances the step by 2 instead of 1" in plan.warnings[1]
    assert history(runs, "zero2_adamw_2lr")[4]["lr"] == [0.001, 0.002]
    assert recs[0]["lr"] == [0.001, 0.001]
    # saved at Adam step 4: an uninterrupted run is at 5, then 6; the shared step tensor goes 6, then 8
    assert [r["optimizer_steps"] for r in recs] == [[6, 6], [8, 8]]
    # default (no --target-stage): the output also serves ZeRO-3, so the same warning, conditional
    default = U.plan_to_universal(src, tmp_path / "v")
    assert default.stages == (1, 2, 3) and default.warnings[0].startswith("if loaded at ZeRO-3: ")
    assert U.plan_to_universal(src, tmp_path / "v", target_stage=2).warnings == ()
    r = run_cli("to-universal", src, tmp_path / "w", "--yes")
    said = " ".join(r.stdout.split())  # rich wraps at 80 columns off a terminal
    assert r.returncode == 0 and "warning: if loaded at ZeRO-3" in said and "lr 0.001 instead of 0.002" in said


def test_logical_diff_of_source_and_output(runs, tmp_path):
    convert(runs / "zero2_sgd", tmp_path / "u")
    rep = D.diff(runs / "zero2_sgd", tmp_path / "u")
    assert rep.mode == "logical" and rep.same and rep.tensors_compared == 29 * 2
    f = next((tmp_path / "u").rglob("blocks.1.mlp_fc.weight/momentum_buffer.pt"))
    obj = torch.load(f, weights_only=False)
    obj["param"][0, 0] += 1.0
    torch.save(obj, f)
    rep = D.diff(runs / "zero2_sgd", tmp_path / "u")
    assert [(d.file, d.field) for d in rep.differences] == [("optimizer", "blocks.1.mlp_fc.weight.momentum_buffer")]
    assert rep.differences[0].max_abs_diff == pytest.approx(1.0, rel=1e-3)
