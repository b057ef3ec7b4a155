"""`ckpt to-universal`: checked against DeepSpeed's own converter, a direct TP merge, and real DeepSpeed loads."""

from __future__ import annotations

import hashlib
import math
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import CkptError
from ckpt_tools.ops import to_universal as U
from ckpt_tools.samples import free_port

from conftest import ROOT, manifest, run_cli, sample

ZERO_SAMPLES = ["zero1_bf16", "zero2_bf16", "zero2_fp32", "zero2_lambdalr", "zero3_bf16"]


def ds_to_universal(tag_dir: Path, out_tag: Path) -> None:
    """DeepSpeed's converter, as users run it (TP=1: --inject_missing_state is right there)."""
    out_tag.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(tag_dir),
            "--output_folder",
            str(out_tag),
            "--inject_missing_state",
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )


def convert(src: Path, out: Path, **kw) -> U.UniversalResult:
    return U.execute(U.plan_to_universal(src, out, **kw), workers=2)


def load(p: Path):
    return torch.load(p, weights_only=False)


def assert_same_as_deepspeed(ours: Path, theirs: Path) -> int:
    """Every file DeepSpeed wrote has a torch.equal counterpart in ours; returns the tensors compared."""
    n = 0
    for pdir in sorted((theirs / "zero").iterdir()):
        if not pdir.is_dir():
            continue
        for f in sorted(pdir.iterdir()):
            x, y = load(ours / "zero" / pdir.name / f.name), load(f)
            if isinstance(y, dict):  # ZeRO-1/2 input: {"param": full tensor, "cat_dim": ...}
                assert x["param"].dtype == y["param"].dtype and torch.equal(x["param"], y["param"]), f
                assert {k: v for k, v in x.items() if k != "param"} == {k: v for k, v in y.items() if k != "param"}
            elif f.name == "step.pt":
                assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)) and type(x) is type(y), f
            else:  # ZeRO-3 input: DeepSpeed writes the bare flat tensor; we write the shaped one in a dict
                assert x["param"].dtype == y.dtype and torch.equal(x["param"].reshape(-1), y.reshape(-1)), f
            n += 1
    ox, oy = load(ours / "zero" / "optimizer_state.pt"), load(theirs / "zero" / "optimizer_state.pt")
    assert ox["param_groups"] == oy["param_groups"]
    return n


@pytest.mark.parametrize("name", ZERO_SAMPLES)
def test_zero_samples_equal_deepspeed_converter(name, tmp_path):
    src = sample("deepspeed", name)
    tag = (src / "latest").read_text().strip()
    ds_to_universal(src / tag, tmp_path / "ds" / f"{tag}_universal")
    res = convert(src, tmp_path / "ours")
    ours = tmp_path / "ours" / f"{tag}_universal"
    assert (tmp_path / "ours" / "latest_universal").read_text() == f"{tag}_universal"
    n = assert_same_as_deepspeed(ours, tmp_path / "ds" / f"{tag}_universal")
    assert n >= 29 * 3 and res.params == 29
    # what each loader needs, whatever the source stage: step.pt, both model-states names, nested step
    m = manifest("deepspeed", name)
    step = load(ours / "zero" / "wte.weight" / "step.pt")
    assert int(step) == m["counters"]["optimizer_step"] == 4
    assert (ours / "mp_rank_00_model_states.pt").is_file()
    assert (ours / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()
    osd = load(ours / "zero" / "optimizer_state.pt")
    assert int(osd["optimizer_state_dict"]["state"][0]["step"]) == 4 and osd["ds_version"]


def test_reference_universal_sample_matches(tmp_path):
    """The committed sample is DeepSpeed's own conversion of zero2_bf16 (no converter run needed)."""
    convert(sample("deepspeed", "zero2_bf16"), tmp_path / "u")
    ref = sample("universal", "zero2_bf16_universal") / "global_step4_universal"
    assert assert_same_as_deepspeed(tmp_path / "u" / "global_step4_universal", ref) == 29 * 4


def test_accelerate_deepspeed_tag(tmp_path):
    res = convert(sample("accelerate", "accelerate_deepspeed"), tmp_path / "u")
    assert res.tag == "pytorch_model_universal" and res.params == 29
    w = load(tmp_path / "u" / "pytorch_model_universal" / "zero" / "wte.weight" / "fp32.pt")
    assert w["param"].dtype == torch.float32 and w["cat_dim"] == 0


# --- tensor parallel -------------------------------------------------------------------------------------


def _layer_tensor(tag: Path, layer: int, tp: int, local: str) -> torch.Tensor:
    return torch.load(tag / f"layer_{layer:02d}-model_{tp:02d}-model_states.pt", weights_only=False)[local]


def _direct_merge(tag: Path, name: str) -> torch.Tensor:
    """The Megatron convention written out by hand (not through tp_layout): column-parallel and vocabulary
    weights cat on dim 0, row-parallel weights on dim 1, everything else replicated."""
    layer, local = name.split(".", 1)
    parts = [_layer_tensor(tag, int(layer), t, local) for t in range(2)]
    if local in ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight"):
        return torch.cat(parts, 1)
    if any(k in local for k in ("query_key_value", "dense_h_to_4h", "word_embeddings", "lm_head")):
        return torch.cat(parts, 0)
    assert torch.equal(parts[0], parts[1]), name
    return parts[0]


def _full_model_shapes() -> dict[str, tuple[int, ...]]:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from ckpt_tools.train.megatron import GPTModelPipe, MegatronGPTConfig

    import deepspeed
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:  # the pipeline module asks the (1-process) group for its rank; torn down again below
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
        deepspeed.init_distributed(dist_backend="gloo")
    try:
        model = GPTModelPipe(MegatronGPTConfig(), PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1), seed=0)
    finally:
        if mine:
            dist.destroy_process_group()
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_pipeline_tp_merge(tmp_path):
    src = sample("megatron", "gpt_tp2_pp2")
    res = convert(src, tmp_path / "u")
    zero = tmp_path / "u" / "global_step4_universal" / "zero"
    tag = src / "global_step4"
    names = sorted(p.name for p in zero.iterdir() if p.is_dir())
    assert res.params == len(names) == 53
    full = _full_model_shapes()  # the TP=1/PP=1 model of ckpt_tools/train/megatron.py
    assert set(full) == set(names)
    for name in names:
        fp32 = load(zero / name / "fp32.pt")
        direct = _direct_merge(tag, name)
        assert tuple(fp32["param"].shape) == tuple(direct.shape), name
        assert tuple(fp32["param"].shape) == full[name], name
        # bf16 training: the module weights are the fp32 master rounded, so the merge must agree exactly
        assert torch.equal(fp32["param"].to(direct.dtype), direct), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert load(zero / name / f"{key}.pt")["param"].shape == fp32["param"].shape
    qkv = load(zero / "2.self_attention.dense.weight" / "fp32.pt")
    assert qkv["cat_dim"] == 1
    assert load(zero / "1.word_embeddings.weight" / "fp32.pt")["vocab_tensor"] is True
    assert "cat_dim" not in load(zero / "2.input_layernorm.weight" / "fp32.pt")


def test_pipeline_noinfo_needs_a_layout(tmp_path):
    src = sample("megatron", "gpt_tp2_pp2_noinfo")
    with pytest.raises(CkptError, match="--tp-layout megatron"):
        U.plan_to_universal(src, tmp_path / "u")
    plan = U.plan_to_universal(src, tmp_path / "u", tp_layout="megatron")
    info = U.plan_to_universal(sample("megatron", "gpt_tp2_pp2"), tmp_path / "v")
    assert [(j.name, j.shape, j.merge) for j in plan.params] == [(j.name, j.shape, j.merge) for j in info.params]
    # a user pattern alone must cover every parameter, else the names are listed
    with pytest.raises(CkptError, match="no TP merge rule"):
        U.plan_to_universal(src, tmp_path / "u", patterns=[r"layernorm=replicated"])
    r = run_cli("to-universal", src, tmp_path / "w", "--dry-run", "--tp-layout", "megatron", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {p["merge"] for p in doc["params"]} == {"replicated", "cat:0", "cat:1"} and not (tmp_path / "w").exists()


def test_drifted_replicas_stop_the_conversion(tmp_path):
    src = sample("megatron", "gpt_tp2_pp2_drifted")
    r = run_cli("to-universal", src, tmp_path / "u")
    assert r.returncode == 2 and "differ across TP ranks" in r.stderr and "--tp-replicated" in r.stderr
    assert not (tmp_path / "u").exists() and not list(tmp_path.glob(".ckpt-staging-*"))
    tag = src / "global_step4"
    for policy in ("average", "rank0"):
        convert(src, tmp_path / policy, tp_replicated=policy)
        got = load(tmp_path / policy / "global_step4_universal" / "zero" / "1.position_embeddings.weight" / "fp32.pt")
        parts = [_layer_tensor(tag, 1, t, "position_embeddings.weight") for t in range(2)]
        assert not torch.equal(parts[0], parts[1])
        want = parts[0] if policy == "rank0" else None
        if want is not None:
            assert torch.equal(got["param"].to(want.dtype), want)
        else:
            assert got["param"].shape == parts[0].shape


# --- the write path ------------------------------------------------------------------------------------------


def test_existing_output_refused_and_stale_staging_cleaned(tmp_path):
    out = tmp_path / "u"
    stale = tmp_path / ".ckpt-staging-u-999999999"
    (stale / "junk").mkdir(parents=True)
    convert(sample("deepspeed", "zero2_bf16"), out)
    assert not stale.exists()
    r = run_cli("to-universal", sample("deepspeed", "zero2_bf16"), out)
    assert r.returncode == 2 and "already exists" in r.stderr


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_distributed_two_ranks_byte_identical(tmp_path):
    src = sample("megatron", "gpt_tp2_pp2")
    one = run_cli("to-universal", src, tmp_path / "one", "--workers", "1", "--json")
    assert one.returncode == 0, one.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "ckpt_cli.main",
            "to-universal",
            str(src),
            str(tmp_path / "two"),
            "--distributed",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _tree_digest(tmp_path / "one"), _tree_digest(tmp_path / "two")
    assert len(a) > 200 and a == b


# --- real DeepSpeed loads ----------------------------------------------------------------------------------


def resume_first_loss(
    load_dir: Path,
    ds_config: dict,
    *,
    model: str,
    orig_dp: int,
    micro: int,
    orig_gas: int,
    tmp: Path,
    tp: int = 1,
    pp: int = 1,
) -> dict:
    """Launch the `ckpt resume` worker (1 process, gloo) on `load_dir` and return its first step record."""
    plan = {
        "device": "cpu",
        "ds_config": ds_config,
        "dp": 1,
        "tp": tp,
        "pp": pp,
        "model": model,
        "lambda_epochs": [],
        "load_dir": str(load_dir),
        "tag": None,
        "load_lr_scheduler_states": True,
        "micro_batch": micro,
        "orig_gas": orig_gas,
        "gas": orig_gas * orig_dp,
        "data": None,
        "steps": 1,
    }
    pf = tmp / f"plan-{abs(hash(str(load_dir) + json.dumps(ds_config)))}.json"
    pf.write_text(json.dumps(plan))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "1",
            "--master_port",
            str(free_port()),
            "-m",
            "ckpt_tools.resume.workers.deepspeed",
            "--plan",
            str(pf),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    recs = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("CKPT_RESUME ")]
    return {e["event"]: e for e in recs}


def _universal_config(base: dict, stage: int, gas: int) -> dict:
    cfg = json.loads(json.dumps(base))
    cfg["checkpoint"] = {"load_universal": True}
    cfg["zero_optimization"] = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    cfg["gradient_accumulation_steps"] = gas
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * gas
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("name,stage", [("zero2_bf16", 2), ("zero2_bf16", 3), ("zero3_bf16", 2)])
def test_deepspeed_loads_output_dp2_to_1_and_across_stages(name, stage, tmp_path):
    """DP 2 -> 1, and ZeRO 2 -> 3 / 3 -> 2, which DeepSpeed's own converter output cannot do. The first step's
    loss must be the uninterrupted run's step-5 loss (same weights, same batch for DP rank 0)."""
    m = manifest("deepspeed", name)
    convert(sample("deepspeed", name), tmp_path / "u")
    ev = resume_first_loss(
        tmp_path / "u",
        _universal_config(m["extra"]["ds_config"], stage, 2),
        model="tiny-gpt",
        orig_dp=2,
        micro=4,
        orig_gas=1,
        tmp=tmp_path,
    )
    assert ev["loaded"]["global_step"] == 4 and ev["loaded"]["optimizer_step"] == 4
    want = m["extra"]["history"][4]
    assert want["step"] == 5
    assert ev["step"]["loss"] == pytest.approx(want["loss"], rel=1e-2)
    # DeepSpeed's ZeRO-3 universal loader assigns ONE step tensor object to every param group
    # (stage3.py: `self.optimizer.state[fp32_param]['step'] = state_step`), and torch's AdamW increments it in
    # place once per group: with our two groups it reads 6 after one step. A loader bug, whatever wrote the files.
    assert ev["step"]["optimizer_step"] == (6 if stage == 3 else 5)


@pytest.mark.slow
def test_deepspeed_loads_pipeline_output_at_tp1_pp1(tmp_path):
    m = manifest("megatron", "gpt_tp2_pp2")
    convert(sample("megatron", "gpt_tp2_pp2"), tmp_path / "u")
    e = m["extra"]
    cfg = json.loads(json.dumps(e["ds_config"]))
    cfg["checkpoint"] = {"load_universal": True}
    ev = resume_first_loss(
        tmp_path / "u",
        cfg,
        model="megatron-gpt",
        orig_dp=1,
        micro=e["micro_batch_per_rank"],
        orig_gas=e["micro_batches_per_step"],
        tmp=tmp_path,
    )
    assert ev["loaded"]["global_step"] == 4
    assert ev["step"]["loss"] == pytest.approx(e["history"][4]["loss"], rel=1e-2)


# --- reading universal folders ------------------------------------------------------------------------------


def test_inspect_universal_of_the_pipeline_sample_by_its_zero_folders(tmp_path):
    """A universal checkpoint of the TP=2 x PP=2 sample: every stage's parameters, whole (53 tensors, the
    TP=1/PP=1 model's 15,456 elements), and the source's topology — for our output and DeepSpeed's alike
    (each copied mp_rank file lists one stage's TP shards; mp_world_size is TP x PP)."""
    src = sample("megatron", "gpt_tp2_pp2")
    convert(src, tmp_path / "ours")
    ds_to_universal(src / "global_step4", tmp_path / "ds" / "global_step4_universal")
    full = _full_model_shapes()
    want = sum(math.prod(s) for s in full.values())
    assert (want, len(full)) == (15456, 53)
    for out in ("ours", "ds"):
        r = run_cli("inspect", tmp_path / out, "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["format"] == "deepspeed_universal"
        assert (doc["topology"]["tp"], doc["topology"]["pp"], doc["topology"]["dp"]) == (2, 2, 1), out
        assert (doc["parameters"]["count"], doc["parameters"]["tensors"]) == (15456, 53), out
    from ckpt_tools import open_checkpoint

    ck = open_checkpoint(tmp_path / "ours")
    assert {n: tuple(t.shape) for n, t in ck.model.children.items()} == full


def test_inspect_universal_counts_a_frozen_parameter(tmp_path):
    """zero1_frozen: `wpe.weight` does not train; its universal folder holds fp32.pt only and it is counted."""
    convert(sample("deepspeed", "zero1_frozen"), tmp_path / "u")
    from ckpt_tools.view import logical
    from ckpt_tools import open_checkpoint

    ck = open_checkpoint(tmp_path / "u")
    m = manifest("deepspeed", "zero1_frozen")
    assert (ck.parameter_count, ck.parameter_tensors) == (m["parameters"]["count"], m["parameters"]["tensors"])
    assert [t.kind for t in logical.model_tensors(ck) if t.name == "wpe.weight"] == ["frozen"]
    assert "wpe.weight" not in {n for g in logical.param_groups(ck) for n in g["params"]}


# --- the command line ----------------------------------------------------------------------------------------


def test_cli_dry_run_yes_json_verify(tmp_path):
    src = sample("deepspeed", "zero2_bf16")
    r = run_cli("to-universal", src, tmp_path / "u", "--dry-run", "--json")
    assert r.returncode == 0 and not (tmp_path / "u").exists()
    doc = json.loads(r.stdout)
    assert doc["optimizer_state"] == ["exp_avg", "exp_avg_sq"] and doc["loads_at_zero_stages"] == [1, 2, 3]
    assert doc["warnings"] == [
        "if loaded at ZeRO-3: DeepSpeed's ZeRO-3 universal loader copies param group 0's "
        "hyper-parameters onto every group: group 1 will train with weight_decay 0.01 "
        "instead of 0",
        "if loaded at ZeRO-3: DeepSpeed's ZeRO-3 universal loader gives all 2 param groups "
        "one shared Adam step tensor: each update advances the step by 2 instead of 1 (bias "
        "correction runs ahead)",
    ]
    r = run_cli("to-universal", src, tmp_path / "u", "--yes", "--json", "--verify")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verified"] is True and doc["params"] == 29 and (tmp_path / "u" / "latest_universal").is_file()
    r = run_cli("to-universal", src, tmp_path / "v", "--verify", "--target-stage", "2")
    said = " ".join(r.stdout.split())
    assert r.returncode == 0 and "verified: equal to the source by logical parameter" in said and "warning" not in said
    assert not list((tmp_path / "v" / "global_step4_universal").glob("zero_pp_rank_*"))
    r = run_cli("to-universal", src, tmp_path / "u", "--yes")
    assert r.returncode == 2 and "ckpt to-universal: output folder already exists" in r.stderr


def test_a_failed_check_writes_nothing(tmp_path):
    plan = U.plan_to_universal(sample("deepspeed", "zero2_bf16"), tmp_path / "u")
    seen = []

    def check(root: Path) -> list[str]:
        seen.append(U.verify_logical(plan, root))  # the real comparison of the staged folder: equal
        return ["model wte.weight: pretend it differs"]

    with pytest.raises(CkptError, match="differs from the source in 1 places"):
        U.execute(plan, check=check)
    assert seen == [[]] and not (tmp_path / "u").exists() and not list(tmp_path.glob(".ckpt-staging-*"))


@pytest.mark.parametrize(
    "group,name",
    [
        ("deepspeed", "zero3_bf16"),
        ("deepspeed", "zero1_frozen"),
        ("accelerate", "accelerate_deepspeed"),
        ("megatron", "gpt_tp2_pp2"),
        ("hf_trainer", "hf_trainer_zero2/checkpoint-4"),
    ],
)
def test_verify_logical_equal_to_the_source(group, name, tmp_path):
    """--verify: every fp32 master, optimizer state, param group and counter of the output equals the source's
    (frozen weights: the source's bf16 module weight, written as fp32 like DeepSpeed does: equal values)."""
    plan = U.plan_to_universal(sample(group, name.split("/")[0]) / "/".join(name.split("/")[1:]), tmp_path / "u")
    U.execute(plan, check=lambda root: U.verify_logical(plan, root))
    from ckpt_tools.ops import diff as D

    from ckpt_tools.view import logical

    rep = D.diff(plan.source, tmp_path / "u")
    src = U._open_source(plan.source, ())[0]
    want = len(logical.model_tensors(src)) + sum(
        len(set(k) - {"fp32", "step"}) for k in logical.optimizer_states(src).values()
    )
    assert rep.mode == "logical" and rep.same and rep.tensors_compared == want >= 29 + 2 * 28
    if name == "zero1_frozen":
        assert rep.notes == ("1 tensor holds the same values in another dtype: wpe.weight (bfloat16 -> float32)",)


def test_verify_finds_a_damaged_or_missing_file(tmp_path):
    """The structural check (`verify_written`) re-reads every written file: a truncated parameter file, a storage member
    of the wrong size and a missing file are each reported by name."""
    import zipfile

    plan = U.plan_to_universal(sample("deepspeed", "zero2_bf16"), tmp_path / "u")
    U.execute(plan)
    root = tmp_path / "u"
    zero = root / plan.out_tag / "zero"
    assert U.verify_written(plan, root) == []
    big = max(plan.params, key=lambda j: math.prod(j.shape))
    f = zero / big.name / "exp_avg.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated: no zip directory left
    (zero / "wpe.weight" / "step.pt").unlink()
    # a storage member that lost bytes: rewrite the zip with data/0 cut short
    g = zero / "ln_f.bias" / "fp32.pt"
    with zipfile.ZipFile(g) as zf:
        items = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(g, "w") as zf:
        for name, data in items:
            zf.writestr(name, data[:-4] if name.endswith("data/0") else data)
    problems = U.verify_written(plan, root)
    assert len(problems) == 3, problems
    assert any(p.startswith(f"{big.name}/exp_avg.pt: unreadable") for p in problems)
    assert "wpe.weight/step.pt: missing" in problems
    assert any(p.startswith("ln_f.bias/fp32.pt: data/0 does not hold") for p in problems)


def test_zero_conversion_imports_neither_torch_nor_deepspeed(tmp_path):
    """ZeRO at TP=1 is the direct path: every tensor copied file to file, step/optimizer_state from the
    optimizer file's records; nothing imports torch or deepspeed (as a process of its own)."""
    code = (
        "import sys; from ckpt_tools.ops import to_universal as U; "
        f"p = U.plan_to_universal({str(sample('deepspeed', 'zero2_bf16'))!r}, {str(tmp_path / 'u')!r}); "
        "r = U.execute(p, workers=2, check=lambda root: U.verify_logical(p, root)); "
        "print(r.files, 'torch' in sys.modules, 'deepspeed' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["120", "False", "False"]
    w = load(tmp_path / "u" / "global_step4_universal" / "zero" / "wte.weight" / "exp_avg.pt")
    assert w["param"].dtype == torch.float32 and w["param"].shape == (64, 32)
