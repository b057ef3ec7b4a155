"""`ckpt convert SRC OUT --to megatron`: a Megatron-LM legacy run (`--ckpt-format torch`) written as Megatron-LM's
torch_dist. The samples `megatron_*_legacy` and `megatron_*_torch_dist` are ONE run (same recipe, seed and
iteration) saved by Megatron-LM core_v0.16.1 in both formats, so Megatron's own torch_dist save is the exact
reference for what the conversion must write: the same DCP keys, global shapes, dtypes and values, and the same
common.pt. Where a Megatron-LM checkout is named (MEGATRON_LM_DIR), Megatron's own `load_checkpoint` resumes the
output at TP 2 and at TP 1 through `ckpt resume`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools.read import pickle_reader as pr
from ckpt_tools.write.dcp_write import DcpFolder

from conftest import ROOT, run_cli, sample

ITER = "iter_0000010"
PAIRS = [
    ("megatron_tp2_legacy", "megatron_tp2_torch_dist"),
    ("megatron_pp2_legacy", "megatron_pp2_torch_dist"),
    ("megatron_tp2_llama_legacy", "megatron_tp2_llama_torch_dist"),
    ("megatron_pp2_vpp2_legacy", "megatron_pp2_vpp2_torch_dist"),
]
MEGATRON = os.environ.get("MEGATRON_LM_DIR")
#: what differs between the two saves by construction: where each run wrote (its own save / data-cache folders)
RUN_PATHS = {"save", "data_cache_path"}


def _convert(name: str, out: Path) -> dict:
    proc = run_cli("convert", sample("megatron_lm", name), out, "--to", "megatron", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _dcp(root: Path) -> tuple[DcpFolder, dict[str, tuple]]:
    """The folder (read inert) and {key: (global shape, dtype) or "bytes"} of its `.metadata`."""
    folder = DcpFolder(root / ITER)
    out = {}
    for key, meta in folder.sdm.items():
        if pr.is_opaque(meta, "TensorStorageMetadata"):
            props = meta.field("properties").state  # TensorProperties pickles as (dtype, layout, ...)
            out[key] = (tuple(meta.field("size")), str(props[0]))
        else:
            out[key] = "bytes"
    return folder, out


def _global(root: Path, key: str, shape: tuple):
    """The whole global tensor `key` of a DCP folder, assembled from its chunks (torch's own DCP reader)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    dtype = getattr(torch, _dcp(root)[1][key][1].replace("torch.", ""))
    sd = {key: torch.empty(shape, dtype=dtype)}
    load(sd, storage_reader=FileSystemReader(root / ITER))  # no process group: one process reads it all
    return sd[key]


def _values(obj):
    """An inert tree as comparable values: a tensor record as (dtype, shape, its bytes), not its storage key."""
    if isinstance(obj, pr.TensorRef):
        return ("tensor", obj.dtype, tuple(obj.shape), obj.read_torch().contiguous().numpy().tobytes())
    if isinstance(obj, dict):
        return {k: _values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_values(v) for v in obj)
    return repr(obj)


def _common(root: Path) -> dict:
    obj = pr.load(root / ITER / "common.pt").obj
    return {**obj, "args": dict(obj["args"].state)}


@pytest.mark.parametrize("legacy,dist", PAIRS)
def test_the_conversion_writes_what_megatrons_own_torch_dist_save_of_the_run_holds(tmp_path, legacy, dist):
    """Key for key, global shape and dtype (the layer axis, the fused layer-norm names, the SwiGLU fc1, the optimizer
    keys, the layers' extra states and one RNG object per TP x PP rank), every tensor bit for bit (the two saves are
    the same run at the same iteration: Megatron's torch_dist save holds exactly the legacy rank files' values,
    merged), every bytes item equal, and common.pt with the same iteration, args (but the two run folders),
    optimizer param groups and common Adam step, scheduler and content metadata."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    doc = _convert(legacy, out)
    assert doc["verified"] is True and doc["to"] == "megatron"
    ref = sample("megatron_lm", dist)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000010", "latest_checkpointed_iteration.txt"]
    assert json.loads((out / ITER / "metadata.json").read_text()) == json.loads(
        (ref / ITER / "metadata.json").read_text()
    )
    (fa, ka), (fb, kb) = _dcp(out), _dcp(ref)
    assert ka == kb  # the same keys, global shapes and dtypes
    tensors = [k for k, v in kb.items() if v != "bytes"]
    assert any(k.startswith("optimizer.state.fp32_param.") for k in tensors)
    unequal = [k for k in tensors if not torch.equal(_global(out, k, ka[k][0]), _global(ref, k, kb[k][0]))]
    assert unequal == [], unequal
    for key in (k for k, v in kb.items() if v == "bytes"):  # extra states [None]; each rank's RNG state
        assert _values(fa.value(key)) == _values(fb.value(key)), key
    ca, cb = _common(out), _common(ref)
    assert list(ca) == list(cb)
    assert {
        k for k in set(ca["args"]) | set(cb["args"]) if repr(ca["args"].get(k)) != repr(cb["args"].get(k))
    } == RUN_PATHS
    for k in cb:
        if k not in ("args", "optimizer"):
            assert repr(ca[k]) == repr(cb[k]), k
    oa, ob = ca["optimizer"]["optimizer"], cb["optimizer"]["optimizer"]
    assert oa["param_groups"] == ob["param_groups"] and len(ob["param_groups"]) == 2
    assert oa["state"]["common_step"].read_torch().item() == ob["state"]["common_step"].read_torch().item() == 10


def test_the_distributed_optimizer_is_written_as_megatrons_own_dp_reshardable_save(tmp_path):
    """A distributed-optimizer legacy run (DP 2: distrib_optim.pt's coalesced fp32 master / exp_avg / exp_avg_sq
    buffers) becomes what Megatron's own torch_dist save of the same run holds (`megatron_dp2_distopt_torch_dist`,
    dp_reshardable): the same keys, global shapes and dtypes, each bucket tensor bit for bit and cut into the same
    chunks (one per parameter range and DP share: how a reader finds the parameters in the bucket again), the
    per_bucket_numel / per_bucket_numel_unpadded objects, the inner optimizer's param groups (with the step), the
    RNG and extra states, and common.pt (optimizer sharding type, content metadata, scheduler, counters; args but
    for the run folders). ckpt reads the output's buffers mapped to parameters, and the logical diff against the
    source is clean (convert's own check)."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    doc = _convert("megatron_dp2_distopt_legacy", out)
    assert doc["verified"] is True
    ref = sample("megatron_lm", "megatron_dp2_distopt_torch_dist")
    (fa, ka), (fb, kb) = _dcp(out), _dcp(ref)
    assert ka == kb
    buckets = [k for k in kb if ".bucket_idx_" in k]
    assert len(buckets) == 3 and not any(k.startswith("optimizer.state.") for k in kb)
    unequal = [
        k
        for k, v in kb.items()
        if v != "bytes" and not torch.equal(_global(out, k, ka[k][0]), _global(ref, k, kb[k][0]))
    ]
    assert unequal == [], unequal

    def chunks(folder, key):
        return sorted((tuple(c.field("offsets")), tuple(c.field("sizes"))) for c in folder.sdm[key].field("chunks"))

    assert all(chunks(fa, k) == chunks(fb, k) for k in buckets) and len(chunks(fb, buckets[0])) > 20
    for key in (k for k, v in kb.items() if v == "bytes"):  # per_bucket_numel(_unpadded), param groups, RNG, ...
        assert _values(fa.value(key)) == _values(fb.value(key)), key
    ca, cb = _common(out), _common(ref)
    assert list(ca) == list(cb)
    assert {
        k for k in set(ca["args"]) | set(cb["args"]) if repr(ca["args"].get(k)) != repr(cb["args"].get(k))
    } == RUN_PATHS
    assert all(repr(ca[k]) == repr(cb[k]) for k in cb if k != "args")
    doc = json.loads(run_cli("inspect", out, "--json").stdout)
    assert doc["details"]["optimizer"].startswith("distributed (flat buckets, mapped to parameters")


def _megatron_save(name: str, out: Path) -> Path:
    """Megatron-LM's own pretrain + save_checkpoint of the recipe variant `name` (the sample maker, 4 gloo processes:
    TP 2 x DP 2), into out/name."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "4",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            "ckpt_tools.samples.workers.megatron_lm",
            "--sample",
            name,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / name


@pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout)",
)
@pytest.mark.parametrize(
    "run,sizes,buckets", [("megatron_tp2_dp2_distopt", (2, 1), 2), ("megatron_pp2_dp2_distopt", (1, 2), 4)]
)
def test_the_distributed_optimizer_at_tp2_or_pp2_both_ways_against_megatrons_own_saves(tmp_path, run, sizes, buckets):
    """TP 2 x DP 2 and PP 2 x DP 2 with the distributed optimizer (one run saved both ways by Megatron-LM itself,
    not bundled): each model-parallel rank's buckets are their own domain (dp_group_idx_0, _1); at PP 2 the tied
    embedding's copy on each stage is a bucket of its own (Megatron's shared-embedding bucket: 2 buckets per stage,
    which the legacy distrib_optim.pt joins without marking). ckpt maps both saves' buffers to parameters, so the
    two saves are logically the same (84 tensors). legacy -> torch_dist writes Megatron's keys, chunks, objects and
    common.pt, and its buckets equal Megatron's on every parameter's range (the logical diff; Megatron fills the
    padding between parameters with torch.empty, so those elements are whatever memory held); torch_dist -> legacy
    writes the same rank folders, each rank file equal to Megatron's but for the args' run folders, and
    distrib_optim.pt with the same keys, dtype keys and lengths."""
    import torch

    legacy = _megatron_save(f"{run}_legacy", tmp_path / "saves")
    dist = _megatron_save(f"{run}_torch_dist", tmp_path / "saves")
    for path in (legacy, dist):
        doc = json.loads(run_cli("inspect", path, "--json").stdout)
        assert "mapped to parameters" in doc["details"]["optimizer"], (path, doc["details"]["optimizer"])
        assert (doc["topology"]["tp"], doc["topology"]["pp"]) == sizes, path
    proc = run_cli("diff", "--logical", legacy, dist, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["tensors_compared"] == 84, proc.stdout[-2000:]

    out = tmp_path / "out"
    proc = run_cli("convert", legacy, out, "--to", "megatron", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["verified"] is True, proc.stderr
    (fa, ka), (fb, kb) = _dcp(out), _dcp(dist)
    assert ka == kb and {k.split(".")[2] for k in kb if ".bucket_idx_" in k} == {"dp_group_idx_0", "dp_group_idx_1"}
    assert len({k.rsplit(".", 1)[0] for k in kb if ".bucket_idx_" in k}) == buckets

    def chunks(folder, key):
        return sorted((tuple(c.field("offsets")), tuple(c.field("sizes"))) for c in folder.sdm[key].field("chunks"))

    assert all(chunks(fa, k) == chunks(fb, k) for k in kb if ".bucket_idx_" in k)
    assert all(_values(fa.value(k)) == _values(fb.value(k)) for k, v in kb.items() if v == "bytes")
    assert all(
        torch.equal(_global(out, k, ka[k][0]), _global(dist, k, kb[k][0]))
        for k, v in kb.items()
        if v != "bytes" and not k.startswith("optimizer.")
    )
    ca, cb = _common(out), _common(dist)
    assert list(ca) == list(cb) and all(repr(ca[k]) == repr(cb[k]) for k in cb if k != "args")
    proc = run_cli("diff", "--logical", out, dist)
    assert proc.returncode == 0, proc.stdout[-2000:]

    back = tmp_path / "back"
    proc = run_cli("convert", dist, back, "--to", "megatron", "--ckpt-format", "torch", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["verified"] is True, proc.stderr
    assert _rank_files(back) == _rank_files(legacy)
    for f in (f for f in _rank_files(legacy) if f.endswith(".pt")):
        a, b = pr.load(back / f).obj, pr.load(legacy / f).obj
        if f.endswith("model_optim_rng.pt"):
            assert list(a) == list(b)
            assert all(_inert(a[k]) == _inert(b[k]) for k in b if k != "args"), f
        elif f.endswith("distrib_optim.pt"):
            assert list(a) == list(b) and a["buckets_coalesced"] is True
            for g in (k for k in b if isinstance(k, int)):
                assert list(a[g]) == list(b[g])
                for dkey, entry in b[g].items():
                    assert [(k, getattr(v, "shape", v)) for k, v in a[g][dkey].items()] == [
                        (k, getattr(v, "shape", v)) for k, v in entry.items()
                    ]
    proc = run_cli("diff", "--logical", back, legacy)
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_inspect_and_the_logical_diff_see_the_source(tmp_path):
    """`ckpt inspect` of the output reports the source's iteration, Adam step, parameter count and next LR;
    `ckpt diff --logical` against the legacy source (the layer norms paired with their fused torch_dist names)
    and against Megatron's own torch_dist save reports no difference."""
    out = tmp_path / "out"
    doc = _convert("megatron_tp2_legacy", out)
    assert doc["scheduler"] == "OptimizerParamScheduler" and doc["step"] == 10
    assert any("rng_state" in n for n in doc["notes"]) and not any(
        "OptimizerParamScheduler" in x for x in doc["not_moved"]
    )
    views = {}
    for p in (sample("megatron_lm", "megatron_tp2_legacy"), out):
        proc = run_cli("inspect", p, "--json")
        assert proc.returncode == 0, proc.stderr
        views[p] = json.loads(proc.stdout)
    a, b = views.values()
    assert b["format"] == "megatron_torch_dist"
    for k in ("counters", "parameters", "lr"):
        assert a[k] == b[k], k
    for other in (sample("megatron_lm", "megatron_tp2_legacy"), sample("megatron_lm", "megatron_tp2_torch_dist")):
        diff = run_cli("diff", "--logical", other, out)
        assert diff.returncode == 0 and "same" in diff.stdout, diff.stdout


def test_dry_run_writes_nothing_and_sources_it_cannot_write_are_refused_in_one_line(tmp_path):
    """--dry-run shows the plan and writes nothing; a non-Megatron source (DeepSpeed, DCP) and a torch_dist source
    are refused with one line naming what is missing, exit 2, nothing written."""
    out = tmp_path / "out"
    proc = run_cli(
        "convert", sample("megatron_lm", "megatron_tp2_legacy"), out, "--to", "megatron", "--dry-run", "--json"
    )
    assert proc.returncode == 0 and json.loads(proc.stdout)["to"] == "megatron" and not out.exists()
    dcp_sample, ds_sample = sample("dcp", "dcp_recipe_fsdp2"), sample("deepspeed", "zero2_bf16")
    cases = [
        (sample("megatron_lm", "megatron_tp2_torch_dist"), "already"),
        (dcp_sample, "needs a Megatron-LM legacy checkpoint"),
        (ds_sample, "needs a Megatron-LM legacy checkpoint"),
    ]
    for src, words in cases:
        proc = run_cli("convert", src, out, "--to", "megatron")
        assert proc.returncode == 2 and words in proc.stderr, (src, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists() and not [p for p in tmp_path.iterdir()], list(tmp_path.iterdir())


def _ckpt_resume(path: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the workers import this checkout's ckpt_tools
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_cli.main", "resume", str(path), "-n", "2", "--device", "cpu", "--json", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout: its "
    "training code is not on the package registries)",
)
def test_megatron_resumes_the_conversion_at_tp2_and_tp1_as_it_resumes_the_original(tmp_path):
    """`ckpt resume` runs Megatron-LM's own pretrain on the output (2 gloo ranks on the CPU, no extra flag: the
    RNG state is in it and Megatron ignores it at another TP): at TP 2 and at TP 1 every check passes, the
    iteration and Adam step continue from 10, and the LRs and losses are those of resuming the ORIGINAL legacy
    checkpoint at TP 2 — bit for bit at TP 2 (the same state in the same layout), within rel 1e-3 at TP 1 (bf16
    matmuls split over 2 ranks round apart from 1 rank; measured 1.1e-4 and 8.5e-5), and at TP 1 bit for bit those
    of resuming Megatron's own torch_dist save of the run at TP 1."""
    out = tmp_path / "out"
    _convert("megatron_tp2_legacy", out)
    runs = {
        "legacy_tp2": _ckpt_resume(sample("megatron_lm", "megatron_tp2_legacy")),
        "tp2": _ckpt_resume(out),
        "tp1": _ckpt_resume(out, "--tp", "1", "--nproc", "1"),
        "dist_tp1": _ckpt_resume(sample("megatron_lm", "megatron_tp2_torch_dist"), "--tp", "1", "--nproc", "1"),
    }
    for key, res in runs.items():
        checks = {c["name"]: c["status"] for c in res["checks"]}
        assert all(s in ("pass", "n/a") for s in checks.values()), (key, checks)
        assert {"global step", "optimizer step", "learning rate", "run rebuilt", "scheduler state"} <= {
            n for n, s in checks.items() if s == "pass"
        }, (key, checks)
        assert [r["step"] for r in res["records"]] == [r["optimizer_step"] for r in res["records"]] == [11, 12]
    ref = runs["legacy_tp2"]["records"]
    assert [r["lr"] for r in runs["tp2"]["records"]] == [r["lr"] for r in ref]
    assert [r["loss"] for r in runs["tp2"]["records"]] == [r["loss"] for r in ref]
    assert [r["lr"] for r in runs["tp1"]["records"]] == [r["lr"] for r in ref]
    assert [r["loss"] for r in runs["tp1"]["records"]] == pytest.approx([r["loss"] for r in ref], rel=1e-3)
    # and at TP 1 bit for bit what Megatron makes of its own torch_dist save of the run
    assert [(r["lr"], r["loss"]) for r in runs["tp1"]["records"]] == [
        (r["lr"], r["loss"]) for r in runs["dist_tp1"]["records"]
    ]


# --- torch_dist -> legacy (`--to megatron --ckpt-format torch [--tp N]`) ------------------------------------------

#: the args a conversion into the legacy format changes, as Megatron's own legacy save of the run records them
LEGACY_ARGS = {"ckpt_format": "torch", "use_dist_ckpt": False}


def _to_legacy(name: str, out: Path, *extra: str) -> dict:
    proc = run_cli(
        "convert", sample("megatron_lm", name), out, "--to", "megatron", "--ckpt-format", "torch", "--json", *extra
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _rank_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def same_rank_files(ours: Path, ref: Path) -> None:
    """The same files; every .pt file the same top-level keys in the same order and the same values (`_inert`), the
    args but for the two runs' own folders (RUN_PATHS); any other file byte for byte."""
    assert _rank_files(ours) == _rank_files(ref)
    for f in _rank_files(ref):
        if not f.endswith(".pt"):
            assert (ours / f).read_bytes() == (ref / f).read_bytes(), f
            continue
        a, b = pr.load(ours / f).obj, pr.load(ref / f).obj
        assert list(a) == list(b), f
        for k in b:
            if k == "args":
                sa, sb = a[k].state, b[k].state
                assert list(sa) == list(sb) and {x for x in sb if repr(sa[x]) != repr(sb[x])} == RUN_PATHS, f
            else:
                assert _inert(a[k]) == _inert(b[k]), (f, k)


def _inert(obj):
    """An inert tree as comparable values, keeping what a loader sees: dict types and key order, tensor dtype,
    shape and bytes, Namespace fields."""
    if isinstance(obj, pr.TensorRef):
        t = obj.read_torch().contiguous().reshape(-1)
        import torch

        return ("tensor", obj.dtype, tuple(obj.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    if isinstance(obj, dict):
        return (type(obj).__name__, [(k, _inert(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_inert(v) for v in obj])
    if pr.is_opaque(obj):
        return (type(obj).__name__, _inert(obj.state) if isinstance(obj.state, dict) else repr(obj.state))
    return repr(obj)


@pytest.mark.parametrize("legacy,dist", PAIRS)
def test_legacy_output_is_megatrons_own_legacy_save_of_the_run(tmp_path, legacy, dist):
    """torch_dist -> legacy at the saved TP / PP: the same rank folders and files as Megatron's own legacy save of
    the same run (TP 2, PP 2, PP 2 x VPP 2 with model0/model1, the Llama-style SwiGLU / GQA / untied run), and in
    every rank file the same top-level keys in the same order, every model tensor (local TP shards, the stage's
    layers numbered from 0, the layer norms under their own names, the tied output-layer copy on the last stage,
    the None extra states) bit for bit, the optimizer's state ids, key order and Adam tensors, its param groups
    (hyper-parameters and member ids), fp32_from_fp16_params, the scheduler, the RNG state, the counters; the args
    equal but for the two runs' own save folders (`save`, `data_cache_path`) — ckpt_format / use_dist_ckpt are
    what Megatron's legacy save records (torch, False), as is each file's rank."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    doc = _to_legacy(dist, out)
    assert doc["verified"] is True and doc["ckpt_format"] == "torch" and doc["tp"] == 2 - ("pp2" in dist)
    ref = sample("megatron_lm", legacy)
    assert _rank_files(out) == _rank_files(ref)
    files = [f for f in _rank_files(ref) if f.endswith(".pt")]
    assert len(files) == 2
    for f in files:
        a, b = pr.load(out / f).obj, pr.load(ref / f).obj
        assert list(a) == list(b), f
        for k in b:
            if k == "args":
                sa, sb = a[k].state, b[k].state
                assert type(a[k]) is type(b[k]) and list(sa) == list(sb)
                assert {x for x in sb if repr(sa[x]) != repr(sb[x])} == RUN_PATHS, f
                assert {x: sa[x] for x in LEGACY_ARGS} == LEGACY_ARGS
            else:
                assert _inert(a[k]) == _inert(b[k]), (f, k)
        opt = a["optimizer"]["optimizer"]
        assert list(opt["state"]) == list(range(sum(len(g["params"]) for g in opt["param_groups"])))
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "10"


def test_the_distributed_optimizer_goes_back_as_megatrons_own_legacy_save(tmp_path):
    """The dp_reshardable torch_dist save of a distributed-optimizer run (`megatron_dp2_distopt_torch_dist`) written
    as legacy rank files equals Megatron's own legacy save of the same run (`megatron_dp2_distopt_legacy`) file for
    file: model_optim_rng.pt (the model in Megatron's module order, the inner optimizer's param groups with the step,
    scheduler, RNG, counters; args but for the run folders) and distrib_optim.pt (buckets_coalesced, each buffer's
    fp32 master / exp_avg / exp_avg_sq bit for bit under its (param, main) dtype key, numel_unpadded). ckpt reads
    the output's buffers mapped to parameters; convert's own logical check passed."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    doc = _to_legacy("megatron_dp2_distopt_torch_dist", out)
    assert doc["verified"] is True
    ref = sample("megatron_lm", "megatron_dp2_distopt_legacy")
    assert "iter_0000010/mp_rank_00/distrib_optim.pt" in _rank_files(ref)
    same_rank_files(out, ref)
    proc = run_cli("inspect", out, "--json")
    assert "buckets mapped to parameters" in json.loads(proc.stdout)["details"]["optimizer"]


def test_legacy_at_another_tp_splits_by_megatrons_rules(tmp_path):
    """--tp 1 from the TP 2 torch_dist sample: one rank file whose tensors are the TP 2 legacy save's shards
    merged by Megatron's rules (QKV / fc1 / vocabulary dim 0, row-parallel dim 1, replicas once), with the saved
    optimizer ids, groups and scheduler; the args say TP 1 / world size 1; the RNG is TP rank 0's (listed as not
    moved). And the Llama-style run (GQA with 2 query groups, SwiGLU fc1 [gate; up]) at TP 1 and the PP 2 x VPP 2
    run at TP 2 verify against their sources (the logical diff merges the written shards back)."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "tp1"
    doc = _to_legacy("megatron_tp2_torch_dist", out, "--tp", "1")
    assert doc["verified"] is True and doc["tp"] == 1
    assert any(x.startswith("RNG at another TP") for x in doc["not_moved"])
    assert _rank_files(out) == ["iter_0000010/mp_rank_00/model_optim_rng.pt", "latest_checkpointed_iteration.txt"]
    a = pr.load(out / "iter_0000010/mp_rank_00/model_optim_rng.pt").obj
    ref = sample("megatron_lm", "megatron_tp2_legacy") / ITER
    b0, b1 = (pr.load(ref / f"mp_rank_0{t}/model_optim_rng.pt").obj for t in (0, 1))
    args = a["args"].state
    assert (args["tensor_model_parallel_size"], args["world_size"], args["ckpt_format"]) == (1, 1, "torch")
    merge = {
        "linear_qkv.weight": 0,
        "linear_qkv.bias": 0,
        "linear_fc1.weight": 0,
        "linear_fc1.bias": 0,
        "word_embeddings.weight": 0,
        "linear_proj.weight": 1,
        "linear_fc2.weight": 1,
    }
    assert list(a["model"]) == list(b0["model"])
    for k, v in a["model"].items():
        if v is None:
            assert b0["model"][k] is None
            continue
        dim = next((d for s, d in merge.items() if k.endswith(s)), None)
        s0, s1 = b0["model"][k].read_torch(), b1["model"][k].read_torch()
        want = s0 if dim is None else torch.cat([s0, s1], dim)
        assert torch.equal(v.read_torch(), want), k
    oa, ob = a["optimizer"], b0["optimizer"]
    assert [g["params"] for g in oa["optimizer"]["param_groups"]] == [
        g["params"] for g in ob["optimizer"]["param_groups"]
    ]
    assert [{k: v for k, v in g.items() if k != "params"} for g in oa["optimizer"]["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in ob["optimizer"]["param_groups"]
    ]
    qkv = list(a["model"]).index("decoder.layers.0.self_attention.linear_qkv.weight")
    params = [k for k, v in a["model"].items() if v is not None]
    i = [n for g in ob["optimizer"]["param_groups"] for n in g["params"]][0]  # the word embeddings: id 0
    assert params[0] == "embedding.word_embeddings.weight" and qkv > 0
    got = oa["optimizer"]["state"][i]["exp_avg"].read_torch()
    assert torch.equal(
        got,
        torch.cat(
            [
                b0["optimizer"]["optimizer"]["state"][i]["exp_avg"].read_torch(),
                b1["optimizer"]["optimizer"]["state"][i]["exp_avg"].read_torch(),
            ]
        ),
    )
    assert torch.equal(
        oa["fp32_from_fp16_params"][0][0].read_torch(),
        torch.cat(
            [
                b0["optimizer"]["fp32_from_fp16_params"][0][0].read_torch(),
                b1["optimizer"]["fp32_from_fp16_params"][0][0].read_torch(),
            ]
        ),
    )
    assert _inert(a["rng_state"]) == _inert(b0["rng_state"])
    assert _inert(a["opt_param_scheduler"]) == _inert(b0["opt_param_scheduler"])
    for name, extra in (("megatron_tp2_llama_torch_dist", "1"), ("megatron_pp2_vpp2_torch_dist", "2")):
        doc = _to_legacy(name, tmp_path / name, "--tp", extra)
        assert doc["verified"] is True and doc["tp"] == int(extra)
    llama = pr.load(tmp_path / "megatron_tp2_llama_torch_dist" / ITER / "mp_rank_00/model_optim_rng.pt").obj
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    l0, l1 = (
        pr.load(sample("megatron_lm", "megatron_tp2_llama_legacy") / ITER / f"mp_rank_0{t}/model_optim_rng.pt")
        .obj["model"][fc1]
        .read_torch()
        for t in (0, 1)
    )
    g0, u0 = l0.chunk(2)
    g1, u1 = l1.chunk(2)  # each TP rank holds its slice of the gate, then its slice of the up projection
    assert torch.equal(llama["model"][fc1].read_torch(), torch.cat([g0, g1, u0, u1]))
    vpp = tmp_path / "megatron_pp2_vpp2_torch_dist" / ITER
    assert sorted(p.name for p in vpp.iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    assert {k for k in pr.load(vpp / "mp_rank_01_001/model_optim_rng.pt").obj if k.startswith("model")} == {
        "model0",
        "model1",
    }


def test_legacy_refusals_are_one_line_and_write_nothing(tmp_path):
    """A legacy source (already the target), the distributed optimizer, a non-Megatron source and TP sizes that do
    not divide the heads / FFN / vocabulary or change the vocabulary padding are refused in one line, exit 2,
    nothing written; --dry-run shows the plan and writes nothing."""
    out = tmp_path / "out"
    proc = run_cli(
        "convert",
        sample("megatron_lm", "megatron_tp2_torch_dist"),
        out,
        "--to",
        "megatron",
        "--ckpt-format",
        "torch",
        "--tp",
        "1",
        "--dry-run",
        "--json",
    )
    assert proc.returncode == 0 and not out.exists()
    doc = json.loads(proc.stdout)
    assert (doc["ckpt_format"], doc["tp"]) == ("torch", 1) and doc["optimizer_state"] == [
        "exp_avg",
        "exp_avg_sq",
        "step",
    ]
    cases = [
        ("megatron_tp2_legacy", (), "already in Megatron-LM's legacy format"),
        ("megatron_dp2_distopt_torch_dist", ("--tp", "2"), "distributed-optimizer run at TP 1 x PP 1 (to TP 2"),
        ("megatron_tp2_torch_dist", ("--tp", "3"), "--tp 3 does not divide num_attention_heads=4"),
        ("megatron_tp2_torch_dist", ("--tp", "4"), "pads the vocabulary (127) to 256 rows"),
    ]
    for name, extra, words in cases:
        proc = run_cli(
            "convert", sample("megatron_lm", name), out, "--to", "megatron", "--ckpt-format", "torch", *extra
        )
        assert proc.returncode == 2 and words in proc.stderr, (name, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists() and not list(tmp_path.iterdir())
    proc = run_cli("convert", sample("deepspeed", "zero2_bf16"), out, "--to", "megatron", "--ckpt-format", "torch")
    assert proc.returncode == 2 and "needs a Megatron-LM checkpoint (torch_dist, or legacy" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout)",
)
def test_megatron_resumes_the_legacy_conversion_at_tp1_and_tp2(tmp_path):
    """The TP 2 torch_dist sample written as legacy rank files at TP 1 and at TP 2, resumed by Megatron-LM's own
    pretrain (`ckpt resume`, gloo on the CPU, no extra flag): every check passes — at TP 1 too the closed-form
    AdamW check of every update from the state the rank file saved (it runs for legacy checkpoints at their saved
    TP / PP) —, the iteration and Adam step continue from 10, and the LRs and losses equal bit for bit (tolerance
    0) those of resuming the torch_dist sample at TP 1 (Megatron reshards it at load) and of resuming the original
    legacy save at TP 2. And Megatron's own legacy conversion of the sample at TP 1 (`--ckpt-convert-format
    torch`) holds the same model, Adam state, fp32 master, param groups and scheduler as ckpt's --tp 1 output
    (its RNG is the fresh seeding Megatron falls back to at another TP)."""
    pytest.importorskip("torch")
    dist = sample("megatron_lm", "megatron_tp2_torch_dist")
    tp1, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    _to_legacy("megatron_tp2_torch_dist", tp1, "--tp", "1")
    _to_legacy("megatron_tp2_torch_dist", tp2)
    runs = {
        "tp1": _ckpt_resume(tp1, "--nproc", "1"),
        "dist_tp1": _ckpt_resume(dist, "--tp", "1", "--nproc", "1"),
        "tp2": _ckpt_resume(tp2),
        "legacy_tp2": _ckpt_resume(sample("megatron_lm", "megatron_tp2_legacy")),
    }
    for key, res in runs.items():
        checks = {c["name"]: c["status"] for c in res["checks"]}
        assert all(s in ("pass", "n/a") for s in checks.values()), (key, checks)
        assert [r["step"] for r in res["records"]] == [r["optimizer_step"] for r in res["records"]] == [11, 12]
    for key in ("tp1", "tp2", "legacy_tp2"):  # legacy at its saved TP / PP: the closed form runs
        assert {c["name"]: c["status"] for c in runs[key]["checks"]}["optimizer state"] == "pass", key
    assert [(r["lr"], r["loss"]) for r in runs["tp1"]["records"]] == [
        (r["lr"], r["loss"]) for r in runs["dist_tp1"]["records"]
    ]
    assert [(r["lr"], r["loss"]) for r in runs["tp2"]["records"]] == [
        (r["lr"], r["loss"]) for r in runs["legacy_tp2"]["records"]
    ]
    # Megatron's own conversion at TP 1, launched through ckpt resume (it exits after saving: no step runs)
    same_as_megatrons_own_legacy_conversion(dist, tp1, tmp_path / "megatron_ref", "--tp", "1")


def same_as_megatrons_own_legacy_conversion(dist: Path, ours: Path, ref: Path, *parallel: str) -> None:
    """Megatron's own `--ckpt-convert-format torch` of the torch_dist run `dist` at `parallel` (one process, launched
    through ckpt resume: it exits after saving) writes the rank file `ours` holds: the same keys, model, param
    groups, Adam state, fp32 master and scheduler."""
    import torch

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ckpt_cli.main",
            "resume",
            str(dist),
            "-n",
            "1",
            "--device",
            "cpu",
            *parallel,
            "--nproc",
            "1",
            "--json",
            "--megatron-args",
            f"--ckpt-convert-format torch --ckpt-convert-save {ref}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    mine = pr.load(ours / ITER / "mp_rank_00/model_optim_rng.pt").obj
    theirs = pr.load(ref / "torch" / ITER / "mp_rank_00/model_optim_rng.pt").obj
    assert list(mine) == list(theirs)
    assert _inert(mine["model"]) == _inert(theirs["model"])
    om, ot = mine["optimizer"], theirs["optimizer"]
    assert om["optimizer"]["param_groups"] == ot["optimizer"]["param_groups"]
    assert list(om["optimizer"]["state"]) == list(ot["optimizer"]["state"])
    for i, s in ot["optimizer"]["state"].items():  # Megatron's resharding load builds each entry in another order
        assert sorted(om["optimizer"]["state"][i]) == sorted(s)
        assert all(torch.equal(om["optimizer"]["state"][i][k].read_torch(), v.read_torch()) for k, v in s.items())
    assert _inert(om["fp32_from_fp16_params"]) == _inert(ot["fp32_from_fp16_params"])
    assert _inert(mine["opt_param_scheduler"]) == _inert(theirs["opt_param_scheduler"])
