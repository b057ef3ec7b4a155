"""set-lr on a checkpoint written by the real torchtitan 0.3.0 Trainer, proven by resuming it in the real torchtitan
Trainer (FSDP2, 2 gloo ranks; `ckpt_tools.samples.workers.torchtitan_run --check`), against an untouched resume in
the same test.

torchtitan is not a dependency of ckpt (it needs `--no-deps` installs: see the worker's docstring): without it
these tests skip and say so. Measured with torchtitan 0.3.0 on torch 2.13.0+cpu.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from conftest import run_cli, sample

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="the real torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 and the packages "
        "listed in ckpt_tools/samples/workers/torchtitan_run.py)",
    ),
]

STEPS = 2


def _resume(step_folder, tmp_path, tag, trainer_args=()):
    from ckpt_tools.samples import run_torchrun

    record = tmp_path / f"{tag}.json"
    args = ["--sample", "torchtitan_real", "--check", str(step_folder), "--steps", str(STEPS), "--record", str(record)]
    for a in trainer_args:
        args.append(f"--trainer-arg={a}")
    run_torchrun("ckpt_tools.samples.workers.torchtitan_run", 2, args, log_path=tmp_path / f"{tag}.log", timeout=400)
    return json.loads(record.read_text())


def _copy(tmp_path, name):
    src = sample("dcp", "torchtitan_real")
    m = json.loads((src.parent / "torchtitan_real.manifest.json").read_text())
    dst = tmp_path / name / m["extra"]["full_save"]
    shutil.copytree(src / m["extra"]["full_save"], dst)
    # the check mode compares with the uninterrupted run recorded in the manifest beside the run folder
    shutil.copy(src.parent / "torchtitan_real.manifest.json", tmp_path / f"{name}.manifest.json")
    return dst, m


def test_set_lr_with_the_job_config_it_names_halves_every_resumed_step_on_every_rank(tmp_path):
    """Untouched resume vs `set-lr --scale 0.5` resumed with the job-config flags the plan printed: every resumed
    step's LR, in every param group on both ranks, is exactly half; the Adam step and the schedule position
    continue (the untouched resume equals the uninterrupted run). The edited copy resumed WITHOUT the config
    change halves only the first step, which is what the plan says."""
    base, m = _copy(tmp_path, "untouched")
    edited, _ = _copy(tmp_path, "edited")
    plain, _ = _copy(tmp_path, "edited_no_config")

    proc = run_cli("set-lr", str(edited), "--scale", "0.5", "--yes", "--json")
    assert proc.returncode == 0, proc.stderr
    flags = json.loads(proc.stdout)["plan"]["launch_config_change"]["job_config"]
    config_lrs = m["extra"]["config"]["lr"]
    assert flags == {
        f"--optimizer.param-groups.{i}.optimizer-kwargs.lr": pytest.approx(lr / 2) for i, lr in enumerate(config_lrs)
    }
    human = run_cli("set-lr", str(plain), "--scale", "0.5", "--yes")
    assert human.returncode == 0 and "NOT DONE YET" in human.stdout, human.stdout

    untouched = _resume(base, tmp_path, "untouched")
    halved = _resume(edited, tmp_path, "halved", [x for k, v in flags.items() for x in (k, repr(v))])
    edit_only = _resume(plain, tmp_path, "edit_only")

    history = {h["step"]: h for h in m["extra"]["history"]}
    loaded = int(edited.name.split("-")[1])
    assert [r["step"] for r in untouched["records"]] == list(range(loaded + 1, loaded + 1 + STEPS))
    for r in untouched["records"]:  # the untouched resume continues the uninterrupted run
        assert r["lr"] == history[r["step"]]["lr"]
        assert r["scheduler_last_epoch"] == r["step"]
    assert len(halved["ranks"]) == len(untouched["ranks"]) == 2
    for rank_u, rank_h, rank_p in zip(untouched["ranks"], halved["ranks"], edit_only["ranks"]):
        assert [r["step"] for r in rank_h] == [r["step"] for r in rank_u]
        for u, h in zip(rank_u, rank_h):
            assert h["lr"] == pytest.approx([x / 2 for x in u["lr"]], rel=1e-12), (u, h)
        # the checkpoint edit alone: the first resumed update only
        assert rank_p[0]["lr"] == pytest.approx([x / 2 for x in rank_u[0]["lr"]], rel=1e-12)
        assert rank_p[1]["lr"] == pytest.approx(rank_u[1]["lr"], rel=1e-12)


#: a resume whose first update a DeepSpeed run can make too: torchtitan's loader starts afresh (the converted
#: checkpoint has no torchtitan loader state) and computes in fp32 (DeepSpeed runs fp32 here)
FIRST_UPDATE_ARGS = ("--checkpoint.exclude-from-loading", "dataloader", "--training.mixed-precision-param", "float32")


def _first_update_in_torchtitan(step_folder, tmp_path, tag):
    """torchtitan's Trainer resumes `step_folder` for one update: (its record, every parameter and its Adam state
    after the update, by parameter name)."""
    import torch

    from ckpt_tools.samples import run_torchrun

    dump = tmp_path / f"{tag}.pt"
    args = [
        "--sample",
        "torchtitan_real",
        "--check",
        str(step_folder),
        "--steps",
        "1",
        "--record",
        str(tmp_path / f"{tag}.json"),
        "--dump",
        str(dump),
    ] + [f"--trainer-arg={a}" for a in FIRST_UPDATE_ARGS]
    run_torchrun("ckpt_tools.samples.workers.torchtitan_run", 2, args, log_path=tmp_path / f"{tag}.log", timeout=400)
    return json.loads((tmp_path / f"{tag}.json").read_text()), torch.load(dump, weights_only=True)


def _deepspeed(tmp_path, tag, *args):
    """The DeepSpeed worker (`ds_torchtitan`) on 2 ranks: what it recorded after its update."""
    import torch

    from ckpt_tools.samples import run_torchrun

    ref = tmp_path / f"{tag}.pt"
    run_torchrun(
        "ckpt_tools.samples.workers.ds_torchtitan",
        2,
        [*map(str, args), "--record", str(ref)],
        log_path=tmp_path / f"{tag}.log",
        timeout=400,
    )
    return torch.load(ref, weights_only=True)


def _largest_differences(titan: dict, ds: dict) -> dict[str, float]:
    """max |torchtitan - DeepSpeed| of the weights and both Adam moments over all parameters, by name: torchtitan's
    fused wqkv split into DeepSpeed's wq/wk/wv by torchtitan's own save hook (`_split_qkv_on_save`)."""
    split = importlib.import_module("torchtitan.models.common.attention").FusedQKVLinear._split_qkv_on_save
    module = type("M", (), {"head_dim": 16, "heads_per_kv": 1, "r_dim": 3})  # the sample's llama3: 4 heads of 16
    worst: dict[str, float] = {}
    for name, entry in titan.items():
        assert entry["step"] == 4.0, name
        got = {}
        if name.endswith(".wqkv.weight"):
            prefix = name[: -len("wqkv.weight")]
            for k in ("param", "exp_avg", "exp_avg_sq"):
                sd = {prefix + "wqkv.weight": entry[k]}
                split(module, sd, prefix, None)
                for s in ("wq", "wk", "wv"):
                    got.setdefault(f"{prefix}{s}.weight", {})[k] = sd[f"{prefix}{s}.weight"]
        else:
            got[name] = entry
        for n, e in got.items():
            for k in ("param", "exp_avg", "exp_avg_sq"):
                worst[k] = max(worst.get(k, 0.0), float((e[k] - ds[n][k]).abs().max()))
    return worst


def _assert_same_first_update(rec: dict, titan: dict, ds: dict) -> None:
    (first,) = rec["records"]
    assert first["step"] == 4 and first["lr"] == pytest.approx(ds["lr"], rel=1e-12)
    assert first["loss"] == pytest.approx(ds["loss"], rel=1e-6)
    assert all(r[0]["lr"] == pytest.approx(ds["lr"], rel=1e-12) for r in rec["ranks"])
    worst = _largest_differences(titan, ds["params"])
    assert worst["param"] < 1e-6 and worst["exp_avg"] < 1e-7 and worst["exp_avg_sq"] < 1e-8, worst


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_checkpoint_converted_to_torchtitan_resumes_in_torchtitans_trainer(tmp_path):
    """DeepSpeed ZeRO-1 (2 gloo ranks) trains torchtitan's own llama3 with the stock wq/wk/wv (the names torchtitan's
    fused model saves its weights under) on torchtitan's own batches, saves step 3, then makes its fourth update.
    `ckpt convert --to dcp --layout torchtitan --n-kv-heads 4` writes torchtitan's layout with the wq/wk/wv Adam state
    fused into wqkv; the real torchtitan Trainer (FSDP2, 2 ranks, the sample's fused llama3, fp32 compute) resumes
    it and makes its fourth update: the loss, the LR of each group, the fp32 weights and both Adam moments after that
    update equal DeepSpeed's (float32 rounding only), every rank at Adam step 4. The same conversion with a wrong
    --n-kv-heads (2: the rows grouped per 2 heads) loads too but resumes into different moments: the comparison
    sees a wrong row order."""
    ds_dir = tmp_path / "ds"
    ds = _deepspeed(tmp_path, "ds_step4", "--out", ds_dir)

    def resume(n_kv: int):
        out = tmp_path / f"kv{n_kv}" / "step-3"
        r = run_cli(
            "convert",
            ds_dir / "global_step3",
            out,
            "--to",
            "dcp",
            "--layout",
            "torchtitan",
            "--n-kv-heads",
            str(n_kv),
            "--json",
        )
        assert r.returncode == 0, r.stderr
        return _first_update_in_torchtitan(out, tmp_path, f"kv{n_kv}")

    rec, titan = resume(4)
    _assert_same_first_update(rec, titan, ds)
    # the update itself is far above that tolerance (~lr per element)
    saved = importlib.import_module("ckpt_tools.view.logical").model_tensors(ds_dir / "global_step3")
    moved = max(float((ds["params"][t.name]["param"] - t.read()).abs().max()) for t in saved)
    assert moved > 1e-4, moved
    _, wrong = resume(2)
    worst = _largest_differences(wrong, ds["params"])
    assert worst["exp_avg"] > 1e-5 and worst["param"] > 1e-5, worst


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_torchtitan_checkpoint_converted_to_universal_resumes_in_deepspeed(tmp_path):
    """The other direction: torchtitan 0.3.0's own step-3, `ckpt convert --to deepspeed-universal --n-kv-heads 4`
    (the fused wqkv's Adam state split into wq/wk/wv), loaded by DeepSpeed ZeRO-1 (`load_universal`, 2 ranks) into
    the same llama3 with the stock wq/wk/wv: its first update equals the one torchtitan's own Trainer makes when
    it resumes the original step-3 (same batch, fp32): LR, loss, weights and moments, Adam step 4."""
    src = sample("dcp", "torchtitan_real") / "step-3"
    uni = tmp_path / "universal"
    r = run_cli("convert", src, uni, "--to", "deepspeed-universal", "--n-kv-heads", "4")
    assert r.returncode == 0, r.stderr
    ds = _deepspeed(tmp_path, "ds_from_universal", "--load-universal", uni)
    assert ds["adam_steps"] == [4.0]
    original = tmp_path / "original" / "step-3"
    shutil.copytree(src, original)
    rec, titan = _first_update_in_torchtitan(original, tmp_path, "titan")
    _assert_same_first_update(rec, titan, ds)
