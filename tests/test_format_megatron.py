"""The Megatron-DeepSpeed pipeline reader (TP=2 x PP=2, bf16 ZeRO-1) against the real samples, their
manifests (written from the live engine), torch.load of the layer files, and DeepSpeed's own
`ds_to_universal` conversion."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.read.tp_layout import TPLayout, merge_shards, rule_from_data
from ckpt_tools.read.tree import TensorNode

from conftest import run_cli, manifest, sample

GROUP = "megatron"
NAMES = ["gpt_tp2_pp2", "gpt_tp2_pp2_noinfo", "gpt_tp2_pp2_drifted"]
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def ds_name(manifest_name: str) -> str:
    """'02.input_layernorm.weight' (manifest: the layer file's LL) -> '2.input_layernorm.weight' (DeepSpeed)."""
    layer, local = manifest_name.split(".", 1)
    return f"{int(layer)}.{local}"


def layer_file(name: str, layer: int, tp_rank: int) -> Path:
    m = manifest(GROUP, name)
    return sample(GROUP, name) / m["extra"]["tag"] / f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def expected_merge(m: dict, manifest_name: str) -> str:
    if manifest_name in m["extra"]["tp_replicated"]:
        return "replicated"
    return f"cat:{m['extra']['split'][manifest_name]['dim']}"


@pytest.fixture(scope="module")
def opened():
    return {name: ckpt_tools.open_checkpoint(sample(GROUP, name)) for name in NAMES}


# --- header --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_header_matches_the_run(opened, name):
    ck, m = opened[name], manifest(GROUP, name)
    assert ck.format == m["format"] == "deepspeed_pipeline"
    topo = m["topology"]
    # mp_world_size is 4 (pp x tp) in these files; the reader must not report it as tp
    assert (
        (ck.topology.dp, ck.topology.tp, ck.topology.pp, ck.topology.zero_stage)
        == (topo["dp"], topo["tp"], topo["pp"], topo["zero_stage"])
        == (1, 2, 2, 1)
    )
    assert ck.counters.__dict__ == m["counters"]
    assert list(ck.lr.param_groups) == pytest.approx(m["lr"]["param_groups"])
    # DeepSpeed's WarmupLR saves only last_batch_iteration: the last LR is computed from the saved ds_config's
    # scheduler at that position, and equals what the live scheduler reported
    assert ck.lr.base_lrs is None and list(ck.lr.last_lr) == pytest.approx(m["lr"]["last_lr"], rel=1e-12)
    assert (
        (ck.parameter_count, ck.parameter_tensors)
        == (m["parameters"]["count"], m["parameters"]["tensors"])
        == (15456, 53)
    )
    # every layer with parameters (00 is a function: no file) on the stage the run put it
    want = {f"{lay:02d}": int(s) for s, layers in m["extra"]["stage_layers"].items() for lay in layers if lay}
    assert ck.details["layer_stages"] == want


@pytest.mark.parametrize("name", NAMES)
def test_every_logical_tensor_has_the_full_shape_and_the_right_merge(opened, name):
    ck, m = opened[name], manifest(GROUP, name)
    shapes = {ds_name(k): tuple(v) for k, v in m["extra"]["parameter_shapes"].items()}
    assert set(ck.model.children) == set(shapes)
    state = ck.get("optimizer.state").children
    assert set(state) == set(shapes)
    for mname in m["extra"]["parameter_shapes"]:
        n = ds_name(mname)
        node = ck.model.children[n]
        assert node.shape == shapes[n], n
        assert node.merge == expected_merge(m, mname), n
        assert len(node.shards) == 2 and [s.pieces[0].rank["tp"] for s in node.shards] == [0, 1]
        for key in STATES:
            assert state[n].children[key].shape == shapes[n], (n, key)
            assert state[n].children[key].merge == node.merge
    assert sum(math.prod(s) for s in shapes.values()) == ck.parameter_count


# --- tensors against torch.load of the layer files ----------------------------------------------------


@pytest.mark.parametrize(
    "param, layer, local, dim",
    [
        ("2.self_attention.dense.weight", 2, "self_attention.dense.weight", 1),  # row-parallel
        ("5.mlp.dense_4h_to_h.weight", 5, "mlp.dense_4h_to_h.weight", 1),
        ("1.word_embeddings.weight", 1, "word_embeddings.weight", 0),  # vocab-parallel
        ("3.self_attention.query_key_value.bias", 3, "self_attention.query_key_value.bias", 0),
        ("7.lm_head.weight", 7, "lm_head.weight", 0),
    ],
)
def test_split_weight_is_the_cat_of_the_tp_ranks_files(opened, param, layer, local, dim):
    ck = opened["gpt_tp2_pp2"]
    parts = [torch.load(layer_file("gpt_tp2_pp2", layer, t), weights_only=False)[local] for t in range(2)]
    assert not torch.equal(parts[0], parts[1])
    got = ck.get(f"model.{param}").read_torch()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.cat(parts, dim=dim))


def test_replicated_is_rank0_and_rank1_is_bit_identical(opened):
    ck, m = opened["gpt_tp2_pp2"], manifest(GROUP, "gpt_tp2_pp2")
    for mname in m["extra"]["tp_replicated"]:
        layer, local = mname.split(".", 1)
        files = [torch.load(layer_file("gpt_tp2_pp2", int(layer), t), weights_only=False)[local] for t in range(2)]
        node = ck.model.children[ds_name(mname)]
        assert torch.equal(node.read_torch(), files[0]), mname
        assert torch.equal(node.shards[1].read_torch(), files[0]), mname
    # the final norm layer's bare names
    assert ck.model.children["6.weight"].merge == ck.model.children["6.bias"].merge == "replicated"


def test_drifted_replicas_show_in_the_shards_exactly_where_the_run_measured_drift(opened):
    """The manifest's `drifted` was measured on the live engine (max |tp0 - tp1| per state)."""
    ck, m = opened["gpt_tp2_pp2_drifted"], manifest(GROUP, "gpt_tp2_pp2_drifted")
    drifted = m["extra"]["drifted"]
    assert set(m["extra"]["perturbed"]) <= set(drifted)
    for mname in m["extra"]["tp_replicated"]:
        n = ds_name(mname)
        want = drifted.get(mname, {})
        node = ck.model.children[n]
        a, b = (s.read_torch().float() for s in node.shards)
        assert float((a - b).abs().max()) == pytest.approx(want.get("bf16", 0.0), abs=0), (mname, "bf16")
        for key in STATES:
            a, b = (s.read_torch() for s in ck.get(f"optimizer.state.{n}.{key}").shards)
            assert float((a - b).abs().max()) == pytest.approx(want.get(key, 0.0), rel=1e-6, abs=0), (mname, key)


# --- the key test: optimizer state against DeepSpeed's own universal conversion ------------------------


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    """DeepSpeed's `ds_to_universal` on the sample (strict: it rejects unused patterns), as its own process."""
    m = manifest(GROUP, "gpt_tp2_pp2")
    out = tmp_path_factory.mktemp("ucp") / m["extra"]["tag"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(sample(GROUP, "gpt_tp2_pp2") / m["extra"]["tag"]),
            "--output_folder",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out / "zero"


def test_optimizer_state_equals_deepspeed_ds_to_universal(opened, universal):
    ck = opened["gpt_tp2_pp2"]
    params = sorted(p.name for p in universal.iterdir() if p.is_dir())
    assert set(params) == set(ck.model.children) and len(params) == 53
    for name in params:
        node = ck.model.children[name]
        for key in STATES:
            ref = torch.load(universal / name / f"{key}.pt", weights_only=False)
            ours = ck.get(f"optimizer.state.{name}.{key}")
            assert isinstance(ours, TensorNode) and ours.shape == tuple(ref["param"].shape), (name, key)
            assert torch.equal(ours.read_torch(), ref["param"]), (name, key)
            if "cat_dim" in ref:  # DeepSpeed wrote a cat rule: ours must be the same one
                assert node.merge == f"cat:{ref['cat_dim']}", name
            else:
                assert node.merge == "replicated", name
        step = torch.load(universal / name / "step.pt", weights_only=False)
        assert ck.get(f"optimizer.state.{name}.step").value == int(step) == 4


# --- layout sources -----------------------------------------------------------------------------------


def test_layout_source_is_reported_and_both_sources_agree(opened):
    info, noinfo = opened["gpt_tp2_pp2"], opened["gpt_tp2_pp2_noinfo"]
    assert info.details["tp_layout"] == "universal_checkpoint_info"
    assert noinfo.details["tp_layout"] == "megatron preset"
    assert "universal_checkpoint_info" in info.tree.children and "universal_checkpoint_info" not in noinfo.tree.children
    assert {n: t.merge for n, t in info.model.children.items()} == {
        n: t.merge for n, t in noinfo.model.children.items()
    }


def test_layout_rules_follow_deepspeed_semantics():
    m = manifest(GROUP, "gpt_tp2_pp2")
    layout = TPLayout.from_checkpoint_info(m["extra"]["universal_checkpoint_info"])
    names = [ds_name(k) for k in m["extra"]["parameter_shapes"]]
    for mname in m["extra"]["parameter_shapes"]:
        rule = layout.rule(ds_name(mname))
        assert rule.merge == expected_merge(m, mname) and rule.source == "universal_checkpoint_info"
    assert layout.rule("2.self_attention.dense.weight").pattern == r"\d+.self_attention.dense.weight"
    # no pattern matched: DeepSpeed concatenates on dim 0; vocab patterns only add the vocab size
    assert layout.rule("7.lm_head.weight").merge == "cat:0" and layout.rule("7.lm_head.weight").vocab_size == 64
    assert layout.unused_patterns(names) == []  # what a strict ds_to_universal demands
    # re.match, not re.search: the pattern must match at the start of the name
    assert (
        TPLayout.from_checkpoint_info({"tp_replicated_parameter_patterns": ["weight"]}).rule("6.weight").merge
        == "cat:0"
    )
    # the preset knows nothing of unknown names rather than guessing
    assert TPLayout.megatron_preset().rule("2.rotary.inv_freq").merge is None


def test_user_patterns_override_and_data_decides_only_when_asked(opened):
    ck = opened["gpt_tp2_pp2_noinfo"]
    layout = TPLayout.from_user_patterns([r"input_layernorm\.weight$=cat:0"]).then(TPLayout.megatron_preset())
    r = layout.rule("2.input_layernorm.weight")
    assert (r.merge, r.source) == ("cat:0", "user pattern")
    assert layout.rule("2.input_layernorm.bias").source == "megatron preset"
    with pytest.raises(ValueError, match="unknown merge"):
        TPLayout.from_user_patterns(["x=concat"])
    # from the data: bit-identical replicas -> replicated; split shards -> undecided, never a guessed cat
    assert rule_from_data(ck.model.children["2.input_layernorm.weight"].shards).merge == "replicated"
    assert rule_from_data(ck.model.children["2.self_attention.dense.weight"].shards).merge is None
    shards = ck.model.children["2.self_attention.dense.weight"].shards
    assert torch.equal(
        merge_shards("cat:1", [s.read_torch() for s in shards]),
        ck.model.children["2.self_attention.dense.weight"].read_torch(),
    )


def test_open_with_user_patterns(opened):
    from ckpt_tools.formats import megatron_pipeline

    ck = megatron_pipeline.open(sample(GROUP, "gpt_tp2_pp2_noinfo"), tp_patterns=(r"\.dense\.bias$=cat:0",))
    assert ck.details["tp_layout"] == "user pattern > megatron preset"
    assert ck.model.children["2.self_attention.dense.bias"].merge == "cat:0"
    assert ck.model.children["2.self_attention.dense.bias"].shape == (32,)
    assert ck.parameter_count == 15456 + 4 * 16  # four dense.bias replicas now counted twice


# --- warnings and broken folders ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tp_rng_mismatch_exactly_where_the_run_seeded_per_tp_rank(opened, name):
    ck, m = opened[name], manifest(GROUP, name)
    seeds = m["extra"]["torch_rng_seed_per_rank"]  # global rank = pp_stage * tp + tp_rank
    differs = any(seeds[s * 2] != seeds[s * 2 + 1] for s in range(2))
    assert differs == m["extra"]["torch_rng_state_differs_across_tp"] == (name == "gpt_tp2_pp2_drifted")
    codes = [w.code for w in ck.warnings]
    assert ("tp-rng-mismatch" in codes) == differs
    assert [c for c in codes if c != "tp-rng-mismatch"] == []


def test_missing_layer_file_is_exit_2_naming_it(copy_sample):
    path = copy_sample(GROUP, "gpt_tp2_pp2")
    (path / "global_step4" / "layer_05-model_01-model_states.pt").unlink()
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "layer_05-model_01-model_states.pt is missing" in lines[0], proc.stderr


def test_missing_optimizer_file_is_an_error_naming_it(copy_sample):
    path = copy_sample(GROUP, "gpt_tp2_pp2")
    (path / "global_step4" / "bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt").unlink()
    with pytest.raises(ckpt_tools.MissingFile, match="bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt"):
        ckpt_tools.open_checkpoint(path)


def test_extra_and_stray_files_are_warnings(copy_sample):
    path = copy_sample(GROUP, "gpt_tp2_pp2")
    tag = path / "global_step4"
    shutil.copy(tag / "layer_02-model_01-model_states.pt", tag / "layer_02-model_02-model_states.pt")
    shutil.copy(tag / "layer_02-model_01-model_states.pt", tag / "layer_02-model_01-model_states.pt.orig")
    ck = ckpt_tools.open_checkpoint(path)
    by_code = {w.code: w for w in ck.warnings}
    assert set(by_code) == {"extra-rank-file", "stray-file"}
    assert "layer_02-model_02" in by_code["extra-rank-file"].message
    assert ck.topology.tp == 2 and ck.parameter_count == 15456


def test_tag_folder_and_parent_both_open(opened):
    ck = ckpt_tools.open_checkpoint(sample(GROUP, "gpt_tp2_pp2") / "global_step4")
    assert ck.format == "deepspeed_pipeline" and ck.parameter_count == opened["gpt_tp2_pp2"].parameter_count


def test_info_missing_a_replica_pattern_is_followed_and_flagged(copy_sample):
    """Megatron's info names the position embedding `tied_modules.embed.position_embeddings.weight`, which
    matches nothing in an untied model; DeepSpeed then concatenates the replicas. Reproduce that info."""
    path = copy_sample(GROUP, "gpt_tp2_pp2")
    for f in sorted((path / "global_step4").glob("mp_rank_*_model_states.pt")):
        sd = torch.load(f, weights_only=False)
        pats = sd["universal_checkpoint_info"]["tp_replicated_parameter_patterns"]
        pats[pats.index(r"\d+.position_embeddings.weight")] = r"tied_modules.embed.position_embeddings.weight"
        torch.save(sd, f)
    ck = ckpt_tools.open_checkpoint(path)
    node = ck.model.children["1.position_embeddings.weight"]
    assert (node.merge, node.shape) == ("cat:0", (32, 16))
    assert [w.code for w in ck.warnings] == ["tp-layout-disagrees"]
    assert "1.position_embeddings.weight: cat:0 (info) vs replicated" in ck.warnings[0].message


@pytest.mark.slow
def test_dp2_pipeline_reader_and_to_universal_equal_deepspeed(copy_sample, tmp_path):
    """DP=2: ZeRO-1 splits every fp32 master / Adam state over the two DP ranks' files. On the DP=2 drifted
    sample, repaired with `ckpt sync-tp` (DeepSpeed's converter stops on drifted replicas), the reader's merged
    states and `ckpt to-universal`'s output equal DeepSpeed's `ds_to_universal`, tensor for tensor."""
    name = "gpt_tp2_pp2_dp2_drifted"
    ck_path = copy_sample(GROUP, name)
    assert run_cli("sync-tp", ck_path, "--yes").returncode == 0
    tag = manifest(GROUP, name)["extra"]["tag"]
    ref_root = tmp_path / "ds" / tag
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(ck_path / tag),
            "--output_folder",
            str(ref_root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ref = ref_root / "zero"
    ck = ckpt_tools.open_checkpoint(ck_path)
    assert (ck.topology.dp, ck.topology.tp, ck.topology.pp) == (2, 2, 2)
    out = run_cli("to-universal", ck_path, tmp_path / "ours", "--json")
    assert out.returncode == 0, out.stderr
    ours = tmp_path / "ours" / f"{tag}_universal" / "zero"
    params = sorted(p.name for p in ref.iterdir() if p.is_dir())
    assert len(params) == 53
    split_over_dp = 0
    for pname in params:
        for key in STATES:
            want = torch.load(ref / pname / f"{key}.pt", weights_only=False)
            node = ck.get(f"optimizer.state.{pname}.{key}")
            assert torch.equal(node.read_torch(), want["param"]), (pname, key)
            got = torch.load(ours / pname / f"{key}.pt", weights_only=False)
            assert torch.equal(got["param"], want["param"]), (pname, key)
            assert {k: v for k, v in got.items() if k != "param"} == {k: v for k, v in want.items() if k != "param"}
        split_over_dp += any(
            len({p.file for p in s.pieces}) > 1
            for s in (ck.get(f"optimizer.state.{pname}.fp32").shards or [ck.get(f"optimizer.state.{pname}.fp32")])
        )
    assert split_over_dp >= 1  # some parameter really lies in two DP ranks' files
