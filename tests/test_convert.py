"""`ckpt convert`: DeepSpeed ZeRO / pipeline -> torch DCP (FSDP2, torchtitan, recipe layouts) and -> one torch
training dict, checked by the logical diff against the source and by resuming in the target framework (FSDP2,
2 gloo ranks) next to DeepSpeed resuming the source in the same test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ckpt_tools.view import logical as L
from ckpt_tools.ops import convert as C
from ckpt_tools.ops.diff import iter_lines, logical_diff
from ckpt_tools.samples import run_torchrun
from ckpt_tools.samples.workers._common import then

from conftest import assert_history_matches, manifest, run_cli, sample

WORKER = "ckpt_tools.resume.workers.convert_resume"

LAYOUT_CASES = [
    ("deepspeed", "zero2_lambdalr", "fsdp2"),
    ("deepspeed", "zero2_bf16", "torchtitan"),
    ("deepspeed", "zero1_bf16", "recipe"),
    ("deepspeed", "zero3_bf16", "fsdp2"),
    ("deepspeed", "zero2_warmuplr", "torchtitan"),
    ("megatron", "gpt_tp2_pp2", "fsdp2"),
]


def _diff_lines(src: Path, out: Path) -> list[str]:
    return [f"{s} {n}: {w}" for s, n, w in iter_lines(logical_diff(src, out))]


@pytest.mark.parametrize("group,name,layout", LAYOUT_CASES)
def test_convert_to_dcp_equals_source(tmp_path, group, name, layout):
    src = sample(group, name)
    out = tmp_path / "out"
    r = run_cli("convert", src, out, "--to", "dcp", "--layout", layout, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verified"] is True and doc["layout"] == layout
    assert doc["optimizer_state"] == ["exp_avg", "exp_avg_sq", "step"]
    assert doc["step"] == manifest(group, name)["counters"]["global_step"]
    # the logical diff of source and output: equal, but for the initial_lr a torch scheduler needs (added)
    lines = _diff_lines(src, out)
    assert all(".initial_lr: added" in x for x in lines), lines
    if doc["scheduler"] is None or name == "zero2_lambdalr":
        assert lines == []
    # the layout's top-level keys, as the frameworks save them (read with the project's reader)
    from ckpt_tools.formats.dcp import logical_path
    from ckpt_tools.write.dcp_write import DcpFolder

    folder = DcpFolder(out)
    tops = {logical_path(k, folder.planner)[0] for k in folder.sdm}
    want = {"fsdp2": {"model", "optim", "step"}, "torchtitan": {"optimizer", "train_state"}, "recipe": {"app"}}[layout]
    if layout == "torchtitan":  # torchtitan 0.3.0's layout: the model's keys flat at the top level
        model = {t.name for t in L.model_tensors(src)}
        assert model <= tops and "model" not in tops
        tops -= model
    assert want <= tops and tops - want <= {"scheduler", "lr_scheduler"}
    # no stray file: only what DCP writes: the values in __0_0, parameter i in __0_<i+1> (and its second dim-0
    # chunks in __1_<i+1>), as DCP names a rank's files
    names = {p.name for p in out.iterdir()}
    assert {".metadata", "__0_0.distcp", "__0_1.distcp", "__1_1.distcp"} <= names
    assert all(re.fullmatch(r"__[01]_\d+\.distcp", n) for n in names - {".metadata"}), names
    assert not list(tmp_path.glob(".ckpt-staging-*"))


def test_ckpt_diff_cli_says_same(tmp_path):
    src = sample("deepspeed", "zero2_lambdalr")
    out = tmp_path / "dcp"
    assert run_cli("convert", src, out, "--to", "dcp").returncode == 0
    r = run_cli("diff", src, out)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dcp_loads_with_dcp_load(tmp_path):
    """torch's own reader (single process) reads every tensor back equal to the source's logical value."""
    import torch.distributed.checkpoint as dcp

    from ckpt_tools.view import logical as L

    src = sample("megatron", "gpt_tp2_pp2")
    plan = C.plan_convert(src, tmp_path / "o", to="dcp")
    C.execute(plan)
    model = {t.name: t.read() for t in L.model_tensors(src)}
    states = L.optimizer_states(src)
    target = {
        "model": {k: torch.zeros_like(v) for k, v in model.items()},
        "optim": {
            "state": {
                p: {k: torch.zeros_like(t.read()) for k, t in ks.items() if k != "fp32"} for p, ks in states.items()
            }
        },
    }
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=tmp_path / "o")
    for k, v in model.items():
        assert torch.equal(target["model"][k], v), k
    for p, ks in states.items():
        for k, t in ks.items():
            if k != "fp32":
                assert torch.equal(target["optim"]["state"][p][k], t.read()), (p, k)


def test_dry_run_reports_what_cannot_move(tmp_path):
    src = sample("megatron", "gpt_tp2_pp2")
    out = tmp_path / "o"
    r = run_cli("convert", src, out, "--to", "dcp", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert not out.exists() and not list(tmp_path.iterdir())
    doc = json.loads(r.stdout)
    assert doc["scheduler"] == "LinearLR"
    assert any("WarmupLR" in n and "LinearLR" in n for n in doc["notes"])
    moved = " ".join(doc["not_moved"])
    assert "torch_rng_state" in moved and "tokens" in moved and "ds_config" in moved
    assert len(doc["params"]) == 53 and all(p["states"] == ["exp_avg", "exp_avg_sq", "step"] for p in doc["params"])
    human = run_cli("convert", src, out, "--to", "dcp", "--dry-run")
    assert human.returncode == 0 and "not moved" in human.stdout and "LinearLR" in human.stdout
    assert not out.exists()


def test_refusals_exit_2_write_nothing(tmp_path):
    src = sample("deepspeed", "zero2_bf16")
    inside = run_cli("convert", src, src / "x", "--to", "dcp")
    assert inside.returncode == 2 and "inside the checkpoint" in inside.stderr
    assert not (src / "x").exists()
    exists = tmp_path / "there"
    exists.mkdir()
    r = run_cli("convert", src, exists, "--to", "dcp")
    assert r.returncode == 2 and "already exists" in r.stderr
    r = run_cli("convert", sample("fsdp", "fsdp2_dcp"), tmp_path / "a", "--to", "dcp")
    assert r.returncode == 2 and "already a DCP" in r.stderr
    r = run_cli("convert", src, tmp_path / "b", "--to", "dcp", "--layout", "nope")
    assert r.returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]


def test_warmuplr_translation_follows_deepspeed():
    """DeepSpeed's WarmupLR stopped mid-warmup, translated to LinearLR: the same LR at every later step."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    def opt():
        return torch.optim.AdamW(
            [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=1.0
        )

    cfg = {
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 6, "warmup_type": "linear"},
        }
    }
    ds_opt = opt()
    ds = WarmupLR(ds_opt, warmup_min_lr=1e-4, warmup_max_lr=3e-3, warmup_num_steps=6, warmup_type="linear")
    for _ in range(3):
        ds_opt.step()
        ds.step()
    state, cls, notes, gone = C.translate_scheduler(ds.state_dict(), cfg, [{}, {}])
    assert cls == "LinearLR" and not gone and notes
    t_opt = opt()
    for g, lr in zip(t_opt.param_groups, [g["lr"] for g in ds_opt.param_groups]):
        g["lr"] = lr
        g["initial_lr"] = 3e-3
    t = torch.optim.lr_scheduler.LinearLR(t_opt, start_factor=0.5, total_iters=1)
    t.load_state_dict(state)
    for g, lr in zip(t_opt.param_groups, [g["lr"] for g in ds_opt.param_groups]):
        g["lr"] = lr  # what set_state_dict restores from the converted param groups
    for _ in range(6):
        ds_opt.step()
        ds.step()
        t_opt.step()
        t.step()
        assert [g["lr"] for g in t_opt.param_groups] == pytest.approx([g["lr"] for g in ds_opt.param_groups], rel=1e-12)


def test_to_torch_training_dict(tmp_path):
    from ckpt_tools.train.models import GPTConfig, TinyGPT
    from ckpt_tools.samples.workers import _common as c

    src = sample("deepspeed", "zero2_lambdalr")
    out = tmp_path / "run.pt"
    r = run_cli("convert", src, out, "--to", "torch", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]
    assert _diff_lines(src, out) == []
    sd = torch.load(out, weights_only=True)
    assert set(sd) == {"model", "optimizer", "scheduler", "step"} and sd["step"] == 4
    model = TinyGPT(GPTConfig())
    model.load_state_dict(sd["model"])
    optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))
    optimizer.load_state_dict(sd["optimizer"])
    scheduler.load_state_dict(sd["scheduler"])
    assert c.adam_step(optimizer) == 4 and scheduler.last_epoch == 4
    assert c.current_lrs(optimizer) == manifest("deepspeed", "zero2_lambdalr")["lr"]["param_groups"]
    names = dict(model.named_parameters())
    for g, saved in zip(optimizer.param_groups, sd["optimizer"]["param_groups"]):
        assert [id(p) for p in g["params"]] == [id(names[n]) for n in saved["param_names"]]


# --- resumed in FSDP2, next to DeepSpeed resuming the source -----------------------------------------------


def _resume(framework: str, ckpt: Path, spec: Path, work: Path, tag: str, *extra: str) -> tuple[list, dict | None]:
    return _resumes(work, [(framework, ckpt, spec, tag, *extra)])[0]


def _resumes(work: Path, runs: list[tuple]) -> list[tuple[list, dict | None]]:
    """Each (framework, ckpt, spec, tag, *extra) resumed on 2 ranks, all in one launch of the worker (`--then`:
    each run its own engine or FSDP2 model); per run its records and its state after the first update."""
    argv = then(
        *(
            ["--framework", framework, "--ckpt", str(ckpt), "--spec", str(spec)]
            + ["--record", str(work / f"{tag}.json"), "--state", str(work / f"{tag}.pt"), *extra]
            for framework, ckpt, spec, tag, *extra in runs
        )
    )
    run_torchrun(WORKER, 2, argv, log_path=work / f"{runs[0][3]}.log")
    out = []
    for _, _, _, tag, *_ in runs:
        record, state = work / f"{tag}.json", work / f"{tag}.pt"
        out.append((json.loads(record.read_text()), torch.load(state, weights_only=True) if state.exists() else None))
    return out


RESUME_CASES = [
    ("deepspeed", "zero2_lambdalr", "fsdp2"),
    ("megatron", "gpt_tp2_pp2", "fsdp2"),
    ("deepspeed", "zero2_bf16", "torchtitan"),
]


@pytest.mark.parametrize("group,name,layout", RESUME_CASES)
def test_fsdp2_resume_matches_deepspeed(tmp_path, group, name, layout):
    """The converted checkpoint in FSDP2 (fully_shard, 2 ranks, dcp.load + set_state_dict) and the source in
    DeepSpeed (2 ranks; the pipeline through its universal checkpoint, TP merged) train the same replica with
    the same synthetic gradient: the first update (fp32 master, exp_avg, exp_avg_sq) is the same to fp32
    tolerance, the Adam step and the LR continue as DeepSpeed's do."""
    from ckpt_tools.resume.workers.convert_resume import spec_from_checkpoint

    src = sample(group, name)
    out = tmp_path / "dcp"
    plan = C.plan_convert(src, out, to="dcp", layout=layout)
    C.execute(plan)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_from_checkpoint(src, scheduler_class=plan.scheduler_class)))
    ds_ckpt, ds_extra = src, []
    if group == "megatron":
        ds_ckpt = tmp_path / "universal"
        r = run_cli("to-universal", src, ds_ckpt)
        assert r.returncode == 0, r.stderr
        ds_extra = ["--universal"]
    (ds_rec, ds_state), (fs_rec, fs_state) = _resumes(
        tmp_path, [("deepspeed", ds_ckpt, spec, "ds", *ds_extra), ("fsdp2", out, spec, "fsdp2", "--layout", layout)]
    )
    saved = manifest(group, name)["counters"]
    assert [r["step"] for r in fs_rec] == [saved["global_step"] + 1, saved["global_step"] + 2]
    assert [r["optimizer_step"] for r in fs_rec] == [saved["optimizer_step"] + 1, saved["optimizer_step"] + 2]
    assert [r["optimizer_step"] for r in fs_rec] == [r["optimizer_step"] for r in ds_rec]
    assert fs_rec[0]["lr"] == manifest(group, name)["lr"]["param_groups"]
    for a, b in zip(fs_rec, ds_rec):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        # DeepSpeed's forward runs the bf16 module weights, FSDP2's the fp32 ones: bf16 rounding apart
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
    assert set(fs_state) == set(ds_state) and len(fs_state) == len(plan.params)
    for n in ds_state:
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fs_state[n][k], ds_state[n][k], rtol=1.3e-6, atol=1e-8, msg=f"{n}.{k}")


def test_fsdp2_resume_loss_continues(tmp_path):
    """The real model on the real batches: FSDP2 (bf16 mixed precision, as the DeepSpeed bf16 run) resumed from
    the converted zero2_lambdalr continues the uninterrupted DeepSpeed run's loss and LR."""
    from ckpt_tools.resume.workers.convert_resume import spec_from_checkpoint

    src = sample("deepspeed", "zero2_lambdalr")
    out = tmp_path / "dcp"
    C.execute(C.plan_convert(src, out, to="dcp"))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_from_checkpoint(src)))
    rec, _ = _resume("fsdp2", out, spec, tmp_path, "gpt", "--model", "tinygpt")
    history = manifest("deepspeed", "zero2_lambdalr")["extra"]["history"]
    assert [r["optimizer_step"] for r in rec] == [5, 6]
    assert_history_matches(
        [{"step": r["step"], "loss": r["loss"], "lr": r["lr"]} for r in rec], history[4:6], "bfloat16"
    )


# --- DCP -> DeepSpeed universal, resumed in DeepSpeed at DP=2 and DP=1 --------------------------------------

DCP_SOURCES = [("fsdp", "fsdp2_dcp", "fsdp2"), ("dcp", "dcp_recipe_fsdp2", "recipe")]


@pytest.mark.parametrize("group,name,layout", DCP_SOURCES)
def test_convert_dcp_to_universal_equals_source(tmp_path, group, name, layout):
    src = sample(group, name)
    out = tmp_path / "univ"
    r = run_cli("convert", src, out, "--to", "deepspeed-universal", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verified"] and doc["step"] == 4
    assert _diff_lines(src, out) == []
    tag = (out / "latest_universal").read_text()
    assert tag == "global_step4_universal"
    files = {p.name for p in (out / tag).iterdir()}
    assert files == {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero"}
    assert {p.name for p in (out / tag / "zero" / "wte.weight").iterdir()} == {
        "fp32.pt",
        "exp_avg.pt",
        "exp_avg_sq.pt",
        "step.pt",
    }


def test_real_torchtitan_fused_state_is_refused_by_name(tmp_path):
    """torchtitan 0.3.0 saves a fused wqkv's weights split (wq/wk/wv) and its Adam state fused, rows interleaved per
    KV-head group, and records no n_kv_heads: convert and resume refuse in one line naming the parameter, write
    nothing; export still writes the weights as saved."""
    src = sample("dcp", "torchtitan_real") / "step-3"
    for argv in (
        ["convert", src, tmp_path / "u", "--to", "deepspeed-universal"],
        ["convert", src, tmp_path / "d", "--to", "dcp"],
        ["resume", src],
    ):
        r = run_cli(*argv)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
        assert "layers.0.attention.qkv_linear.wqkv.weight" in r.stderr and "n_kv_heads" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_real_torchtitan_fused_state_splits_with_n_kv_heads(tmp_path):
    """With --n-kv-heads the fused wqkv's Adam state is split into the rows that train wq, wk and wv (torchtitan's
    FusedQKVLinear groups them per KV head): to universal, every split parameter has its own exp_avg / exp_avg_sq /
    step; to a torch file and back to the torchtitan layout, the fused state is rebuilt bit for bit (the logical diff
    of the two torchtitan checkpoints compares the fused rows as saved). A count the row shapes rule out exits 2."""
    import torch

    from ckpt_tools.view import logical as L
    from ckpt_tools.read import qkv

    src = sample("dcp", "torchtitan_real") / "step-3"
    fused = "layers.0.attention.qkv_linear.wqkv.weight"
    saved = L.optimizer_states(src)[fused]["exp_avg"].read()
    r = run_cli("convert", src, tmp_path / "bad", "--to", "deepspeed-universal", "--n-kv-heads", "3")
    assert r.returncode == 2 and "--n-kv-heads 3" in r.stderr and not (tmp_path / "bad").exists(), r.stderr
    r = run_cli("convert", src, tmp_path / "u", "--to", "deepspeed-universal", "--n-kv-heads", "4", "--json")
    assert r.returncode == 0, r.stderr
    zero = next((tmp_path / "u").glob("global_step*_universal")) / "zero"
    rows = qkv.row_index(64, 64, 4)
    for part, idx in zip(("wq", "wk", "wv"), rows):
        name = f"layers.0.attention.qkv_linear.{part}.weight"
        got = torch.load(zero / name / "exp_avg.pt", weights_only=True)
        got = got["param"] if isinstance(got, dict) else got
        assert torch.equal(got, saved[torch.tensor(idx)]), name
        assert float(torch.load(zero / name / "step.pt", weights_only=True)) == 3
    assert not (zero / fused).exists()
    r = run_cli("convert", src, tmp_path / "t.pt", "--to", "torch", "--n-kv-heads", "4")
    assert r.returncode == 0, r.stderr
    r = run_cli(
        "convert",
        tmp_path / "t.pt",
        tmp_path / "titan" / "step-3",
        "--to",
        "dcp",
        "--layout",
        "torchtitan",
        "--n-kv-heads",
        "4",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fused"][fused] == [
        f"layers.0.attention.qkv_linear.{p}.weight" for p in ("wq", "wk", "wv")
    ]
    assert _diff_lines(src, tmp_path / "titan" / "step-3") == []
    back = L.optimizer_states(tmp_path / "titan" / "step-3")[fused]["exp_avg"].read()
    assert torch.equal(back, saved)


def test_convert_to_universal_from_deepspeed_is_to_universal(tmp_path):
    src = sample("deepspeed", "zero2_bf16")
    r = run_cli("convert", src, tmp_path / "u", "--to", "deepspeed-universal", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["loads_at_zero_stages"] == [1, 2, 3]  # `ckpt to-universal`'s own report
    assert _diff_lines(src, tmp_path / "u") == []


@pytest.mark.parametrize("group,name,layout", DCP_SOURCES[:1])
def test_deepspeed_resume_of_universal_matches_fsdp2(tmp_path, group, name, layout):
    """The DCP sample resumed in FSDP2 (2 ranks) and its universal conversion resumed in DeepSpeed ZeRO-2 at
    DP=2 and DP=1, the same replica and synthetic gradient: the first update is the same, the Adam step and
    the LR continue."""
    from ckpt_tools.resume.workers.convert_resume import spec_from_checkpoint

    src = sample(group, name)
    out = tmp_path / "univ"
    plan = C.plan_convert(src, out, to="deepspeed-universal")
    C.execute(plan)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_from_checkpoint(src, scheduler_class=plan.scheduler_class, bf16=False)))
    # FSDP2 and DeepSpeed at DP=2 in one launch (two runs), DeepSpeed at DP=1 in a launch of its own
    (fs_rec, fs_state), ds2 = _resumes(
        tmp_path, [("fsdp2", src, spec, "fsdp2", "--layout", layout), ("deepspeed", out, spec, "ds2", "--universal")]
    )
    assert [r["optimizer_step"] for r in fs_rec] == [5, 6]
    for dp in (2, 1):
        if dp == 2:
            ds_rec, ds_state = ds2
        else:
            record, state = tmp_path / f"ds{dp}.json", tmp_path / f"ds{dp}.pt"
            args = ["--framework", "deepspeed", "--universal", "--ckpt", str(out), "--spec", str(spec)]
            run_torchrun(WORKER, dp, [*args, "--record", str(record), "--state", str(state)])
            ds_rec, ds_state = json.loads(record.read_text()), torch.load(state, weights_only=True)
        assert [r["step"] for r in ds_rec] == [5, 6]
        assert [r["optimizer_step"] for r in ds_rec] == [5, 6]
        assert ds_rec[0]["lr"] == manifest(group, name)["lr"]["param_groups"]
        for a, b in zip(ds_rec, fs_rec):
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert set(ds_state) == set(fs_state)
        for n in fs_state:
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    ds_state[n][k], fs_state[n][k], rtol=1.3e-6, atol=1e-8, msg=f"DP={dp} {n}.{k}"
                )


def test_deepspeed_resume_of_universal_loss_continues(tmp_path):
    """The real model on the real batches: DeepSpeed at DP=2 and DP=1 (the two micro-batches accumulated)
    resumed from the universal conversion of the FSDP2 sample continues its loss and LR (fp32 run)."""
    from ckpt_tools.resume.workers.convert_resume import spec_from_checkpoint

    src = sample("fsdp", "fsdp2_dcp")
    out = tmp_path / "univ"
    C.execute(C.plan_convert(src, out, to="deepspeed-universal"))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_from_checkpoint(src, bf16=False, max_norm=None)))  # the sample ran unclipped
    history = manifest("fsdp", "fsdp2_dcp")["extra"]["history"]
    for dp in (2, 1):
        record = tmp_path / f"gpt{dp}.json"
        run_torchrun(
            WORKER,
            dp,
            [
                "--framework",
                "deepspeed",
                "--model",
                "tinygpt",
                "--universal",
                "--ckpt",
                str(out),
                "--spec",
                str(spec),
                "--record",
                str(record),
            ],
            log_path=tmp_path / f"gpt{dp}.log",
        )
        rec = json.loads(record.read_text())
        assert [r["optimizer_step"] for r in rec] == [5, 6]
        assert_history_matches(
            [{"step": r["step"], "loss": r["loss"], "lr": r["lr"]} for r in rec], history[4:6], "float32"
        )


# --- as a torchrun job: tests/test_convert_torchrun.py ----------------------------------------------------


@pytest.mark.parametrize("to", ["dcp", "torch", "deepspeed-universal"])
def test_failed_verification_writes_nothing(tmp_path, monkeypatch, to):
    """A difference found by the logical comparison stops the conversion before the output is put in place."""
    from ckpt_tools.errors import CkptError

    src = sample("fsdp", "fsdp2_dcp") if to == "deepspeed-universal" else sample("deepspeed", "zero2_lambdalr")
    out = tmp_path / ("o.pt" if to == "torch" else "o")
    plan = C.plan_convert(src, out, to=to)
    monkeypatch.setattr(C, "verify_logical", lambda plan, root: ["model wte.weight: changed"])
    with pytest.raises(CkptError, match="differs from the source"):
        C.execute(plan)
    assert list(tmp_path.iterdir()) == []


def test_diff_with_n_kv_heads_compares_a_torchtitan_conversion_whole(tmp_path):
    """`ckpt diff` of torchtitan's own save against its universal conversion: without --n-kv-heads the fused wqkv's
    state and its split wq/wk/wv state differ by name (exit 1, with a note naming the option); with it, the two are
    equal by logical parameter, bit for bit (exit 0); --files with it is refused."""
    src = sample("dcp", "torchtitan_real") / "step-3"
    out = tmp_path / "u"
    assert run_cli("convert", src, out, "--to", "deepspeed-universal", "--n-kv-heads", "4").returncode == 0
    r = run_cli("diff", src, out)
    assert r.returncode == 1 and "--n-kv-heads N compares it split" in r.stdout, r.stdout
    r = run_cli("diff", src, out, "--n-kv-heads", "4", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["same"]
    r = run_cli("diff", src, out, "--n-kv-heads", "4", "--files")
    assert r.returncode == 2 and "--logical" in r.stderr
