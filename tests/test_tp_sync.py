"""check-tp-sync / sync-tp on the real TP=2 x PP=2 pipeline samples: the drift the training run measured
is found exactly, repaired in all four representations through the transactional write path, and the
repaired checkpoint loads and trains in the real DeepSpeed PipelineEngine."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.write import io
from ckpt_tools.ops import tp_sync as ops

from conftest import ROOT, fail_at, manifest, run_cli, sample

GROUP = "megatron"
DRIFTED = "gpt_tp2_pp2_drifted"
DRIFTED_DP2 = "gpt_tp2_pp2_dp2_drifted"  # the same drift at DP=2: ZeRO-1 splits each state over two files
BOTH_DRIFTED = pytest.mark.parametrize("drifted", [DRIFTED, DRIFTED_DP2])
REPS = ("bf16", "fp32", "exp_avg", "exp_avg_sq")
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def ds_name(manifest_name: str) -> str:
    layer, local = manifest_name.split(".", 1)
    return f"{int(layer)}.{local}"


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# --- a direct comparison: torch.load of the files, un-flattened by hand -------------------------------------


class Direct:
    """Every representation of a pipeline parameter per TP rank, straight from torch.load of the files; at
    DP > 1 the ZeRO-1 fragments of the DP ranks' files are concatenated in DP order (what ds_to_universal
    does)."""

    def __init__(self, ckpt: Path, name: str = DRIFTED):
        m = manifest(GROUP, name)
        self.dp = m["topology"]["dp"]
        self.tag = ckpt / m["extra"]["tag"]
        self.stage_of = {lay: int(s) for s, layers in m["extra"]["stage_layers"].items() for lay in layers}
        self._cache: dict[Path, dict] = {}

    def _load(self, p: Path) -> dict:
        if p not in self._cache:
            self._cache[p] = torch.load(p, weights_only=False, map_location="cpu")
        return self._cache[p]

    def get(self, name: str, rep: str, tp_rank: int) -> torch.Tensor:
        layer, local = name.split(".", 1)
        if rep == "bf16":
            return self._load(self.tag / f"layer_{int(layer):02d}-model_{tp_rank:02d}-model_states.pt")[local]
        mp = self.stage_of[int(layer)] * 2 + tp_rank
        pieces = []
        for dp_rank in range(self.dp):
            osd = self._load(self.tag / f"bf16_zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_optim_states.pt")[
                "optimizer_state_dict"
            ]
            for g, mapping in enumerate(osd["param_slice_mappings"]):
                if name in mapping:
                    frag = mapping[name]
                    flat = (
                        osd["single_partition_of_fp32_groups"][g]
                        if rep == "fp32"
                        else osd["base_optimizer_state"]["state"][g][rep]
                    )
                    pieces.append(flat.narrow(0, frag.start, frag.numel))
        if not pieces:
            raise KeyError(name)
        return torch.cat(pieces)

    def max_abs(self, name: str, rep: str) -> float:
        a, b = (self.get(name, rep, t).detach().double().flatten() for t in (0, 1))
        return float((a - b).abs().max())


# --- check ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, source", [("gpt_tp2_pp2", "universal_checkpoint_info"), ("gpt_tp2_pp2_noinfo", "megatron preset")]
)
def test_in_sync_sample_is_100_percent_bit_exact(name, source):
    m = manifest(GROUP, name)
    report = ops.check_tp_sync(ops.open_for_tp_sync(sample(GROUP, name)))
    assert report.ok and report.percent_in_sync == 100.0 and report.layout_source == source
    assert {p.name for p in report.params} == {ds_name(n) for n in m["extra"]["tp_replicated"]}
    assert report.representations == REPS
    for p in report.params:
        assert p.bit_exact and [d.representation for d in p.diffs] == list(REPS), p.name
        assert all(d.max_abs_diff == 0.0 and d.max_rel_diff == 0.0 for d in p.diffs)
    assert all(f.in_sync == f.total for f in report.families)
    assert not report.warnings
    proc = run_cli("check-tp-sync", str(sample(GROUP, name)))
    assert proc.returncode == 0, proc.stderr
    assert "all 27 replicated parameters in sync (100%)" in proc.stdout


@BOTH_DRIFTED
def test_drifted_sample_reports_exactly_the_measured_drift(drifted):
    m = manifest(GROUP, drifted)
    ck = sample(GROUP, drifted)
    report = ops.check_tp_sync(ops.open_for_tp_sync(ck))
    assert not report.ok and report.layout_source == "universal_checkpoint_info"
    found = {(p.name, d.representation) for p in report.params for d in p.diffs if not d.bit_exact}
    want = {(ds_name(n), rep) for n, reps in m["extra"]["drifted"].items() for rep, v in reps.items() if v}
    assert found == want
    # the two layer norms the bug hit directly drift only in fp32 master / Adam moments, not in bf16
    for n in ("2.post_attention_layernorm.weight", "5.post_attention_layernorm.weight"):
        p = next(q for q in report.params if q.name == n)
        assert p.diff("bf16").bit_exact and not p.diff("fp32").bit_exact
    direct = Direct(ck, drifted)
    for p in report.params:
        for d in p.diffs:
            assert d.max_abs_diff == direct.max_abs(p.name, d.representation), (p.name, d.representation)
            live = m["extra"]["drifted"].get(f"{int(p.name.split('.')[0]):02d}.{p.name.split('.', 1)[1]}", {})
            assert d.max_abs_diff == pytest.approx(live.get(d.representation, 0.0), rel=1e-6, abs=0)
    lines = {f.family: f.line() for f in report.families}
    assert lines["post_attention_layernorm.weight"] == "post_attention_layernorm.weight: 1/4 layers in sync (25%)"
    assert lines["self_attention.dense.bias"] == "self_attention.dense.bias: 2/4 layers in sync (50%)"
    assert lines["input_layernorm.weight"] == "input_layernorm.weight: 4/4 layers in sync (100%)"
    assert [w.code for w in report.warnings] == ["tp-rng-mismatch"]

    proc = run_cli("check-tp-sync", str(ck), "--json", "--atol", "0", "--rtol", "0")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and len([p for p in doc["params"] if not p["in_sync"]]) == 7
    assert doc["warnings"][0]["code"] == "tp-rng-mismatch"


def test_tolerance_and_patterns():
    ck = ops.open_for_tp_sync(sample(GROUP, DRIFTED))
    loose = ops.check_tp_sync(ck, atol=0.01)  # the largest drift is 0.0077 (exp_avg of 3.self_attention.dense.bias)
    assert loose.ok and not all(p.bit_exact for p in loose.params)
    tight = ops.check_tp_sync(ck, atol=1e-4)
    assert {p.name for p in tight.out_of_sync} == {
        "2.post_attention_layernorm.weight",
        "3.self_attention.dense.bias",
        "5.post_attention_layernorm.weight",
    }
    # --pattern declares more replicas: a column-parallel bias really differs per rank and is reported
    clean = sample(GROUP, "gpt_tp2_pp2")
    report = ops.check_tp_sync(ops.open_for_tp_sync(clean, ["query_key_value.bias"]), patterns=["query_key_value.bias"])
    bad = {p.name: p for p in report.out_of_sync}
    assert set(bad) == {f"{i}.self_attention.query_key_value.bias" for i in range(2, 6)}
    assert all(p.rule_source == "user pattern" for p in bad.values())
    assert report.layout_source.startswith("user pattern")
    proc = run_cli("check-tp-sync", str(clean), "--pattern", "query_key_value.bias")
    assert proc.returncode == 1 and "query_key_value.bias: 0/4 layers in sync (0%)" in proc.stdout


class _Arr:
    """A shard given as a numpy array (what `shard_values` reads from anything with read_numpy)."""

    def __init__(self, values, dtype="float32"):
        import numpy as np

        self.a = np.asarray(values, dtype=dtype)
        self.shape, self.dtype = self.a.shape, dtype

    def read_numpy(self):
        return self.a


def test_shard_values_equal_torch_on_real_bf16_and_fp32_shards():
    """The numpy read (bf16 widened from its bit patterns) gives torch's values, bit patterns included."""
    import numpy as np

    ck = ckpt_tools.open_checkpoint(sample(GROUP, DRIFTED))
    node = ck.model.children["3.post_attention_layernorm.weight"]
    fp32 = ck.optimizer.children["state"].children["3.post_attention_layernorm.weight"].children["fp32"]
    for n in (node, fp32):
        for shard in n.shards:
            values, bits, dtype = ops.shard_values(shard)
            t = shard.read_torch()
            assert dtype == str(t.dtype).replace("torch.", "")
            assert np.array_equal(values, t.double().reshape(-1).numpy())
            assert bits.tobytes() == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_compare_shards_semantics():
    a = _Arr([1.0, 0.0, -2.0])
    b = _Arr([1.5, 0.0, -2.0])
    d = ops.compare_shards([a, b], "fp32", 0.0, 0.0)
    assert (d.max_abs_diff, d.max_rel_diff, d.bit_exact, d.in_tolerance, d.ranks_differing) == (
        0.5,
        0.5 / 1.5,
        False,
        False,
        (1,),
    )
    assert ops.compare_shards([a, b], "fp32", 0.5, 0.0).in_tolerance
    assert ops.compare_shards([a, b], "fp32", 0.0, 0.5).in_tolerance  # 0.5 <= 0.5 * |1.0|
    z = ops.compare_shards([_Arr([0.0]), _Arr([-0.0])], "fp32", 0.0, 0.0)
    assert z.in_tolerance and not z.bit_exact  # equal values, different bits: not bit-exact


# --- sync ---------------------------------------------------------------------------------------------------------


def test_dry_run_writes_nothing_and_shows_the_plan(copy_sample):
    ck = copy_sample(GROUP, DRIFTED)
    before = snapshot(ck.parent)
    proc = run_cli("sync-tp", str(ck), "--method", "average", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert snapshot(ck.parent) == before  # nothing written, not even a backups folder
    out = proc.stdout
    assert "dry run: nothing written" in out and "8 files to patch" in out
    for name in ("1.position_embeddings.weight", "3.self_attention.dense.bias", "5.post_attention_layernorm.weight"):
        assert name in out
    assert "bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt" in out and "layer_03-model_01-model_states.pt" in out
    proc = run_cli("sync-tp", str(ck), "--dry-run", "--json")
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] and len(doc["plan"]["files"]) == 8 and snapshot(ck.parent) == before


@pytest.fixture(params=[DRIFTED, DRIFTED_DP2])
def synced(request, copy_sample):
    """A drifted sample (DP=1 and DP=2) copied, then `ckpt sync-tp --yes` (the average)."""
    ck = copy_sample(GROUP, request.param)
    orig = snapshot(ck)
    proc = run_cli("sync-tp", str(ck), "--yes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "100% of 27 replicated parameters in sync" in proc.stdout
    return ck, orig, request.param


def test_sync_average_makes_all_four_representations_identical(synced):
    ck, orig, drifted = synced
    # no file added to or removed from the checkpoint folder; backups live beside it
    assert set(snapshot(ck)) == set(orig)
    changed = {f for f, h in snapshot(ck).items() if orig[f] != h}
    # exactly the layer files of the drifted tensors (bf16) and the optimizer files holding a ZeRO-1 piece of
    # one (at DP=2 a drifted state may lie in one DP rank's partition or be split over both)
    drift_names = {ds_name(n) for n in manifest(GROUP, drifted)["extra"]["drifted"]}
    holders = set()
    for f in sorted(ck.glob("global_step4/*optim_states.pt")):
        osd = torch.load(f, weights_only=False, map_location="cpu")["optimizer_state_dict"]
        if any(drift_names & set(m) for m in osd["param_slice_mappings"]):
            holders.add(f"global_step4/{f.name}")
    layers = {
        f"global_step4/layer_{int(n.split('.')[0]):02d}-model_{t:02d}-model_states.pt"
        for n in drift_names
        for t in (0, 1)
    }
    # (a layer file whose averaged replica rounds to the bf16 it already held keeps its bytes)
    assert holders <= changed <= holders | layers and changed & layers
    assert len(holders) == (4 if drifted == DRIFTED else 6)
    if drifted == DRIFTED:
        assert len(changed) == 8
    tx = io.transactions(ck)
    assert [t.status for t in tx] == ["done"] and not tx[0].dir.is_relative_to(ck)
    # changed in place: only the patched ranges (tensor bytes, CRC-32 fields) were written, and the journal
    # outside the checkpoint holds their original bytes — the current file + the undo record is the original
    assert sorted(tx[0].in_place) == sorted(changed) and not list((tx[0].dir / "files").rglob("*.pt"))
    assert tx[0].written < sum((ck / rel).stat().st_size for rel in changed) / 10
    journal = json.loads((tx[0].dir / io.JOURNAL).read_text())
    for e in journal["files"]:
        data = bytearray((ck / e["path"]).read_bytes()[: e["size"]])
        undo = (tx[0].dir / e["undo"]).read_bytes()
        for off, n, pos, _crc in e["ranges"]:
            data[off : off + n] = undo[pos : pos + n]
        assert hashlib.sha256(bytes(data)).hexdigest() == orig[e["path"]]

    report = ops.check_tp_sync(ops.open_for_tp_sync(ck))
    assert report.ok and all(p.bit_exact for p in report.params) and report.representations == REPS
    assert [w.code for w in report.warnings] == ["tp-rng-mismatch"]  # reported, never changed
    assert run_cli("check-tp-sync", str(ck)).returncode == 0

    before, after = Direct(sample(GROUP, drifted), drifted), Direct(ck, drifted)
    m = manifest(GROUP, drifted)
    for mname in m["extra"]["drifted"]:
        n = ds_name(mname)
        for rep in STATES:
            want = ((before.get(n, rep, 0).double() + before.get(n, rep, 1).double()) / 2).float()
            for t in (0, 1):
                assert torch.equal(after.get(n, rep, t), want), (n, rep, t)
        master = after.get(n, "fp32", 0)
        for t in (0, 1):
            assert torch.equal(after.get(n, "bf16", t).flatten(), master.to(torch.bfloat16)), (n, t)
    for mname in m["extra"]["tp_replicated"]:  # replicas that were in sync are untouched
        if mname not in m["extra"]["drifted"]:
            n = ds_name(mname)
            for rep in REPS:
                assert torch.equal(after.get(n, rep, 1), before.get(n, rep, 1)), (n, rep)
    # split tensors are untouched
    assert torch.equal(
        after.get("2.self_attention.query_key_value.weight", "fp32", 1),
        before.get("2.self_attention.query_key_value.weight", "fp32", 1),
    )

    # and undo brings the drifted bytes back
    io.restore(ck)
    assert snapshot(ck) == orig


def test_synced_checkpoint_loads_in_deepspeed_and_trains(synced):
    """The real PipelineEngine at TP=2 x PP=2 (x DP=2: 8 processes) loads the repaired files; on the live
    engine the replicas agree in bf16, fp32 master and both moments, and a training step gives a finite
    loss. The untouched drifted sample, loaded the same way, shows the drift: the measurement can fail."""
    ck, _, drifted = synced
    nproc = 4 * manifest(GROUP, drifted)["topology"]["dp"]

    # the repaired copy and the untouched drifted sample in one launch (8 processes start once, not twice)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "tests" / "ds_pipeline_step.py")
    args = ["--standalone", "--nproc_per_node", str(nproc), script, str(ck), str(sample(GROUP, drifted))]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DS_PIPELINE_STEP ")]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    got, control = (json.loads(ln.split(" ", 1)[1]) for ln in lines)
    assert got["path"] == str(ck) and control["path"] == str(sample(GROUP, drifted))
    assert got["drift"] == {} and got["finite"] and got["global_steps_loaded"] == 4 and got["global_steps_after"] == 5
    want = manifest(GROUP, drifted)["extra"]["drifted"]
    assert set(control["drift"]) == set(want)
    for name, reps in want.items():  # the live engine after a load sees what the saving engine measured
        assert control["drift"][name] == pytest.approx(reps, rel=1e-6, abs=0), name


def test_sync_from_rank(copy_sample):
    ck = copy_sample(GROUP, DRIFTED)
    proc = run_cli("sync-tp", str(ck), "--from-rank", "1", "--yes", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["after"]["ok"] and doc["plan"]["command"] == "sync-tp --method rank0"
    before, after = Direct(sample(GROUP, DRIFTED)), Direct(ck)
    for mname in manifest(GROUP, DRIFTED)["extra"]["drifted"]:
        n = ds_name(mname)
        for rep in STATES:
            assert torch.equal(after.get(n, rep, 0), before.get(n, rep, 1)), (n, rep)
        assert torch.equal(after.get(n, "bf16", 0).flatten(), before.get(n, "fp32", 1).to(torch.bfloat16))
    assert run_cli("sync-tp", str(ck), "--method", "average", "--from-rank", "0").returncode == 2


@pytest.mark.parametrize("fail_stage, nth", [("produce", 4), ("replace", 5), ("verify", 1)])
def test_failure_mid_write_leaves_the_checkpoint_byte_identical(copy_sample, fail_stage, nth):
    ck = copy_sample(GROUP, DRIFTED)
    before = snapshot(ck)
    plan, _ = ops.plan_sync_tp(ops.open_for_tp_sync(ck))
    assert len(plan.writes) == 8
    with pytest.raises(io.WriteFailed, match="injected failure"):
        io.execute(plan, on_stage=fail_at(fail_stage, nth))
    assert snapshot(ck) == before
    assert [t.status for t in io.transactions(ck)] == ["rolled-back"]


def test_verification_failure_rolls_back(copy_sample):
    ck = copy_sample(GROUP, DRIFTED)
    before = snapshot(ck)
    plan, _ = ops.plan_sync_tp(ops.open_for_tp_sync(ck))
    # a plan that "forgets" the module weights: the re-check after writing finds bf16 still drifted
    partial = io.WritePlan(
        plan.root, plan.command, tuple(w for w in plan.writes if "optim_states" in w.path), plan.notes, plan.verify
    )
    with pytest.raises(io.WriteFailed, match="still differs"):
        io.execute(partial)
    assert snapshot(ck) == before


def test_nothing_to_repair_on_an_in_sync_checkpoint_is_an_error(copy_sample):
    ck = copy_sample(GROUP, "gpt_tp2_pp2")
    before = snapshot(ck.parent)
    proc = run_cli("sync-tp", str(ck), "--yes")
    assert proc.returncode == 2 and "nothing to repair" in proc.stderr and proc.stdout == ""
    assert snapshot(ck.parent) == before


def test_data_fallback_tells_drifted_replicas_from_split_shards():
    """Names no pattern decides: bit-identical or close equal-shaped shards are replicas, independently
    initialised ones (a split weight) stay undecided."""

    def Shard(t):  # noqa: N802
        return _Arr(t.numpy())

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, generator=g)
    assert ops._rule_from_close_data([Shard(w), Shard(w.clone())]).merge == "replicated"
    drifted = ops._rule_from_close_data([Shard(w), Shard(w + 1e-4)])
    assert drifted.merge == "replicated" and drifted.source == "data"
    assert ops._rule_from_close_data([Shard(w), Shard(torch.randn(64, generator=g))]).merge is None
    assert ops._rule_from_close_data([Shard(w), Shard(torch.randn(32, generator=g))]).merge is None


@pytest.mark.parametrize("drifted", [DRIFTED, DRIFTED_DP2])
def test_pure_python_and_numpy_comparisons_agree(drifted, monkeypatch):
    """Drifted shards small enough are compared in pure Python (no numpy import on the check path); the
    numpy path gives the same numbers on the real drifted samples, every representation, with and without
    a tolerance."""
    ck = ckpt_tools.open_checkpoint(sample(GROUP, drifted))
    for atol, rtol in ((0.0, 0.0), (1e-6, 1e-3)):
        monkeypatch.setattr(ops, "PY_COMPARE_MAX", 1 << 30)
        py = ops.check_tp_sync(ck, atol, rtol).to_json()
        monkeypatch.setattr(ops, "PY_COMPARE_MAX", -1)
        np_ = ops.check_tp_sync(ck, atol, rtol).to_json()
        assert py == np_
        assert not py["ok"] and any(d["max_abs_diff"] > 0 for p in py["params"] for d in p["diffs"])


def test_check_path_imports_neither_numpy_nor_torch_when_replicas_are_small():
    """check-tp-sync on the drifted sample (its drifted replicas are layer norms) runs without importing numpy,
    torch or deepspeed: bit-identical shards are compared as bytes, small drifted ones in pure Python."""
    code = (
        "import sys; from ckpt_cli.main import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('IMPORTED', sorted(m for m in ('numpy', 'torch', 'deepspeed') if m in sys.modules), rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "check-tp-sync", str(sample(GROUP, DRIFTED)), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.stdout.strip().splitlines()[-1] == "IMPORTED [] 1", proc.stderr[-2000:]
