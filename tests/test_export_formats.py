"""`ckpt export` loses nothing and takes every format in: tied and frozen weights equal to DeepSpeed's zero_to_fp32
(names included), DCP equal to torch's dcp_to_torch_save, FSDP1 equal to the ShardedTensor shards placed by their
own metadata, the pipeline equal to its TP shards merged, Accelerate / HF Trainer equal to their weights files,
and `--hf` output that transformers' from_pretrained loads with the same logits."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools.view import logical as L
from ckpt_tools.ops import export as E

from conftest import assert_hf_logits_equal, run_cli, sample

TIED = {"head.weight": "emb.weight"}
FROZEN = {"pos.weight", "ln.weight"}


def zero_to_fp32(path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(path))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tied_and_frozen_equal_zero_to_fp32(stage, tmp_path):
    src = sample("deepspeed", f"zero{stage}_tied_frozen")
    r = run_cli("export", src, tmp_path / "m.safetensors", "--verify", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kinds"] == {"param": 6, "frozen": 2, "tied": 1} and doc["verified"] == 9
    got, ref = load_file(tmp_path / "m.safetensors"), zero_to_fp32(src)
    assert torch.equal(got["head.weight"], got["emb.weight"])
    if stage == 1:
        # DeepSpeed 0.19 ZeRO-1 records no frozen_param_shapes, so zero_to_fp32 drops the frozen weights; they
        # are in the module state dict, and export carries them from there
        assert set(ref) == set(got) - FROZEN
        ms = torch.load(next(src.glob("*/mp_rank_00_model_states.pt")), map_location="cpu", weights_only=False)
        assert all(same(got[n], ms["module"][n]) for n in FROZEN)
    else:
        assert set(got) == set(ref) and FROZEN | set(TIED) <= set(ref)
    for k in ref:
        assert same(got[k], ref[k].detach()), k


def test_dedupe_tied_exclude_frozen_and_filters(tmp_path):
    src = sample("deepspeed", "zero3_tied_frozen")
    r = run_cli(
        "export",
        src,
        tmp_path / "m.safetensors",
        "--dedupe-tied",
        "--exclude-frozen",
        "--exclude",
        r"^fc2\.",
        "--yes",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    got, ref = load_file(tmp_path / "m.safetensors"), zero_to_fp32(src)
    assert set(got) == set(ref) - set(TIED) - FROZEN - {"fc2.weight", "fc2.bias"}
    assert all(same(got[k], ref[k].detach()) for k in got)
    only = run_cli("export", src, tmp_path / "o.safetensors", "--include", "weight$", "--dry-run", "--json")
    assert only.returncode == 0 and not (tmp_path / "o.safetensors").exists()
    assert json.loads(only.stdout)["tensors"] == sum(k.endswith("weight") for k in ref)
    none = run_cli("export", src, tmp_path / "n.safetensors", "--include", "nothing-matches")
    assert none.returncode == 2 and "ckpt export" in none.stderr and not (tmp_path / "n.safetensors").exists()


def test_output_inside_the_checkpoint_is_refused(copy_sample):
    src = copy_sample("deepspeed", "zero2_tied_frozen")
    before = sorted(p.name for p in src.rglob("*"))
    r = run_cli("export", src, src / "w.safetensors")
    assert r.returncode == 2 and "ckpt export" in r.stderr and "inside the checkpoint" in r.stderr
    assert sorted(p.name for p in src.rglob("*")) == before


def test_hf_trainer_zero2_tied_lm_head_equals_zero_to_fp32(tmp_path):
    folder = sample("hf_trainer", "hf_trainer_zero2") / "checkpoint-4"
    E.execute(E.plan_export(folder, tmp_path / "m.safetensors"))
    got, ref = load_file(tmp_path / "m.safetensors"), zero_to_fp32(folder)
    assert set(got) == set(ref) and "lm_head.weight" in ref
    assert all(same(got[k], ref[k].detach()) for k in ref)


def _causal_lm(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


@pytest.mark.parametrize("name", ["hf_trainer_zero2", "hf_trainer_ddp"])
def test_hf_output_loads_with_from_pretrained(name, tmp_path):
    folder = sample("hf_trainer", name) / "checkpoint-4"
    out = tmp_path / "hf"
    r = run_cli(
        "export",
        sample("hf_trainer", name),
        out,
        "--hf",
        "--source",
        "module",
        "--max-shard-size",
        "40KB",
        "--verify",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(doc["files"]) > 1 and {p.split("/")[-1] for p in doc["files"]} == set(index["weight_map"].values())
    assert all(p.split("/")[-1].startswith("model-0000") for p in doc["files"])
    assert (out / "config.json").read_text() == (folder / "config.json").read_text()
    assert (out / "generation_config.json").is_file() and "lm_head.weight" not in index["weight_map"]
    assert not list(tmp_path.glob(".ckpt-staging-*"))
    model, info = _causal_lm(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    orig, _ = _causal_lm(folder)
    tokens = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, orig(tokens).logits)
    # the default (fp32 master) loads as cleanly
    r = run_cli("export", folder, tmp_path / "hf32", "--hf")
    assert r.returncode == 0, r.stderr
    _, info = _causal_lm(tmp_path / "hf32")
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def _flatten(d, prefix=""):
    for k, v in d.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from _flatten(v, name)
        else:
            yield name, v


@pytest.mark.parametrize(
    "group,name,tensors",
    [("dcp", "torchtitan_real/step-3", 21), ("dcp", "dcp_recipe_fsdp2", 29), ("fsdp", "fsdp2_dcp", 29)],
)
def test_dcp_equals_dcp_to_torch_save(group, name, tensors, tmp_path):
    """torchtitan 0.3.0's full save: its flat model keys, the fused wqkv as the wq/wk/wv it saved (21 tensors for
    17 live parameters)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = sample(group, name)
    E.execute(E.plan_export(src, tmp_path / "m.safetensors"))
    got = load_file(tmp_path / "m.safetensors")
    dcp_to_torch_save(str(src), str(tmp_path / "full.pt"))
    full = dict(_flatten(torch.load(tmp_path / "full.pt", map_location="cpu", weights_only=False)))
    # the model part: the names under the one prefix that holds every exported name
    prefix = next(p for p in ("model.", "app.model.", "") if all(p + k in full for k in got))
    ref = {
        k[len(prefix) :]: v
        for k, v in full.items()
        if k.startswith(prefix)
        and isinstance(v, torch.Tensor)
        and not (prefix == "" and k.split(".")[0] in ("optimizer", "lr_scheduler", "train_state", "dataloader"))
    }
    assert set(got) == set(ref) and len(ref) == tensors
    assert all(same(got[k], ref[k]) for k in ref)


_GATHER = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
model = torch.load(f"{sys.argv[1]}/rank{r}.pt", map_location="cpu", weights_only=False)["model"]
out = {}
for k, st in model.items():
    if hasattr(st, "local_shards"):
        out[k] = (list(st.metadata().size), [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in
        st.local_shards()])
    else:
        out[k] = (list(st.shape), [([0] * st.dim(), st.clone())])
torch.save(out, f"{sys.argv[2]}/gathered{r}.pt")
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp1_sharded_equals_its_shards_placed_by_their_metadata(tmp_path):
    """The ShardedTensors as torch itself unpickles them (in a real 2-rank gloo group: they refuse to load
    anywhere else), each shard placed at its own metadata's offsets."""
    import subprocess
    import sys

    from ckpt_tools.samples import free_port, worker_env

    src = sample("fsdp", "fsdp1_sharded")
    E.execute(E.plan_export(src, tmp_path / "m.safetensors"))
    got = load_file(tmp_path / "m.safetensors")
    (tmp_path / "gather.py").write_text(_GATHER)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(tmp_path / "gather.py"),
            str(src),
            str(tmp_path),
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    full: dict[str, torch.Tensor] = {}
    for r in range(2):
        for k, (size, shards) in torch.load(tmp_path / f"gathered{r}.pt", weights_only=False).items():
            for offsets, t in shards:
                out = full.setdefault(k, torch.zeros(size, dtype=t.dtype))
                out[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    assert set(got) == set(full) and len(full) == 29
    assert all(same(got[k], full[k]) for k in full)


def test_pipeline_equals_its_tp_shards_merged(tmp_path):
    """Every exported tensor of the TP=2 x PP=2 sample is its two TP ranks' layer-file tensors merged the way
    the checkpoint's universal_checkpoint_info says (replicated: identical shards; row-parallel: dim 1)."""
    src = sample("megatron", "gpt_tp2_pp2")
    r = run_cli("export", src, tmp_path / "p.safetensors", "--source", "module", "--verify", "--json")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "p.safetensors")
    assert len(got) == 53 and sum(t.numel() for t in got.values()) == 15456
    tag = next(d for d in src.iterdir() if d.is_dir())
    ms = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    info = ms["universal_checkpoint_info"]
    import re

    for name, t in got.items():
        layer, local = name.split(".", 1)
        shards = [
            torch.load(
                tag / f"layer_{int(layer):02d}-model_{r:02d}-model_states.pt", map_location="cpu", weights_only=False
            )[local]
            for r in range(2)
        ]
        if any(re.match(p, name) for p in info["tp_replicated_parameter_patterns"]):
            assert all(same(t, s) for s in shards), name
        elif any(re.match(p, name) for p in info["parameter_with_row_parallelism_patterns"]):
            assert same(t, torch.cat(shards, 1)), name
        else:
            assert same(t, torch.cat(shards, 0)), name


def test_accelerate_and_hf_ddp_equal_their_weights_files(tmp_path):
    acc = sample("accelerate", "accelerate_ddp")
    E.execute(E.plan_export(acc, tmp_path / "a.safetensors"))
    got, ref = load_file(tmp_path / "a.safetensors"), load_file(acc / "model.safetensors")
    assert set(got) == set(ref) and all(same(got[k], ref[k]) for k in ref)
    folder = sample("hf_trainer", "hf_trainer_ddp") / "checkpoint-4"
    E.execute(E.plan_export(folder, tmp_path / "h.safetensors"))
    got, ref = load_file(tmp_path / "h.safetensors"), load_file(folder / "model.safetensors")
    # save_pretrained leaves the tied lm_head out; export writes it under its name too (the embedding's value)
    assert set(got) == set(ref) | {"lm_head.weight"} and all(same(got[k], ref[k]) for k in ref)
    assert same(got["lm_head.weight"], ref["transformer.wte.weight"])


def test_second_model_of_an_accelerate_checkpoint(tmp_path):
    """`--model 1` exports the second prepared model (model_1.safetensors) as Accelerate saved it; a model the
    checkpoint does not hold is a one-line error, exit 2, nothing written."""
    acc = sample("accelerate", "accelerate_two_models")
    out = tmp_path / "m1.safetensors"
    r = run_cli("export", acc, out, "--model", "1", "--verify")
    assert r.returncode == 0, r.stderr
    got, ref = load_file(out), load_file(acc / "model_1.safetensors")
    assert list(got) and set(got) == set(ref) and all(same(got[k], ref[k]) for k in ref)
    first = load_file(acc / "model.safetensors")
    assert set(got).isdisjoint(first) or any(got[k].shape != first[k].shape for k in set(got) & set(first))
    r = run_cli("export", acc, tmp_path / "m2.safetensors", "--model", "2")
    assert r.returncode == 2 and "--model 2" in r.stderr and "2 models (0, 1)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "m2.safetensors").exists()


def test_logical_optimizer_state_by_name():
    """The logical optimizer view names every parameter's state, whole, with the groups' members."""
    src = sample("deepspeed", "zero3_tied_frozen")
    states, groups = L.optimizer_states(src), L.param_groups(src)
    assert set(states) == {"emb.weight", "fc1.weight", "fc2.weight", "ln.bias", "fc1.bias", "fc2.bias"}
    assert all(set(s) == {"fp32", "exp_avg", "exp_avg_sq"} for s in states.values())
    assert [g["lr"] for g in groups] == [pytest.approx(g["lr"]) for g in groups] and len(groups) == 2
    assert groups[0]["params"] == ["emb.weight", "fc1.weight", "fc2.weight"]
    assert groups[1]["lr"] == pytest.approx(2 * groups[0]["lr"])
    ref = zero_to_fp32(src)
    assert same(states["fc1.bias"]["fp32"].read(), ref["fc1.bias"].detach())
    plain = L.param_groups(sample("torch", "plain.pt"))
    st = L.optimizer_states(sample("torch", "plain.pt"))
    # torch numbers ids group by group: the state of each name has that parameter's shape
    model = {t.name: t for t in L.model_tensors(sample("torch", "plain.pt"))}
    assert all(s["exp_avg"].shape == model[n].shape for n, s in st.items())
    assert sorted(n for g in plain for n in g["params"]) == sorted(model)


def test_universal_export_equals_zero_to_fp32_of_its_source(tmp_path):
    E.execute(E.plan_export(sample("universal", "zero2_bf16_universal"), tmp_path / "u.safetensors"))
    got, ref = load_file(tmp_path / "u.safetensors"), zero_to_fp32(sample("deepspeed", "zero2_bf16"))
    assert set(got) == set(ref) and all(same(got[k], ref[k].detach()) for k in ref)


def test_zero3_tree_lists_the_frozen_parameters_its_header_counts():
    from ckpt_tools import iter_tensors, open_checkpoint

    ck = open_checkpoint(sample("deepspeed", "zero3_tied_frozen"))
    model = dict(iter_tensors(ck.model))
    assert FROZEN <= set(model)
    assert ck.parameter_tensors == len(model) == 8 and ck.parameter_count == sum(t.numel for t in model.values())
    ref = zero_to_fp32(sample("deepspeed", "zero3_tied_frozen"))
    assert all(same(model[n].read_torch(), ref[n]) for n in FROZEN)


def test_plain_dcp_save_of_same_shape_tensors_is_not_taken_for_tied(tmp_path):
    """`dcp.save` without a process group writes every tensor whole, each a blob of its own in one .distcp:
    two same-shape tensors (a LayerNorm's weight and bias) must read back as themselves, not as one tied pair."""
    import torch.distributed.checkpoint as dcp

    sd = {"ln.weight": torch.ones(8), "ln.bias": torch.zeros(8), "w": torch.arange(8.0)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    got = {t.name: t for t in L.model_tensors(tmp_path / "plain")}
    assert {n for n, t in got.items() if t.kind == "tied"} == set()
    for name, ref in sd.items():
        assert same(got[name].read(), ref), name


# --- --hf from torchtitan names ----------------------------------------------------------------------------


def _titan_hf_config(folder):
    """The Hugging Face config of the torchtitan sample's model (its worker's llama3: dim 64, 4 heads, no GQA,
    FFN 96, vocab 64, RoPE theta 5e5 with llama3 scaling, RMSNorm eps 1e-5), written by transformers itself."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        max_position_embeddings=8192,
    ).save_pretrained(folder)
    return folder / "config.json"


def test_torchtitan_hf_export_needs_the_config_and_loads_in_transformers(tmp_path):
    """A torchtitan Llama: --hf without --hf-config exits 2 naming it (the head counts the q/k permutation needs are
    not in the checkpoint); with it, every tensor under its Hugging Face name (q/k permuted, the rest as saved),
    verified, and transformers loads the folder with no missing or unexpected key."""
    from transformers import AutoModelForCausalLM

    src = sample("dcp", "torchtitan_real") / "step-3"
    r = run_cli("export", src, tmp_path / "no", "--hf")
    assert r.returncode == 2 and "--hf-config" in r.stderr and not (tmp_path / "no").exists(), r.stderr
    cfg = _titan_hf_config(tmp_path / "cfg")
    r = run_cli("export", src, tmp_path / "hf", "--hf", "--hf-config", cfg, "--verify")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "hf" / "model.safetensors")
    saved = {t.name: t.read() for t in L.model_tensors(src)}
    assert got["model.layers.1.mlp.down_proj.weight"].equal(saved["layers.1.feed_forward.w2.weight"])
    q = saved["layers.0.attention.qkv_linear.wq.weight"]
    assert got["model.layers.0.self_attn.q_proj.weight"].equal(
        q.view(4, 8, 2, 64).transpose(1, 2).reshape(64, 64)
    )  # per head: (x0, y0, x1, y1 ...) -> (x..., y...)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    bad = _titan_hf_config(tmp_path / "bad")
    bad.write_text(bad.read_text().replace('"num_attention_heads": 4', '"num_attention_heads": 8'))
    r = run_cli("export", src, tmp_path / "hf8", "--hf", "--hf-config", bad)
    assert r.returncode == 2 and "q_proj" not in r.stderr and "wq.weight" in r.stderr, r.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="the real torchtitan is not installed")
def test_torchtitan_hf_export_equals_torchtitans_own_adapter(tmp_path):
    """Tensor for tensor against torchtitan 0.3.0's own `Llama3StateDictAdapter.to_hf` (its HF converter) on the
    weights `dcp_to_torch_save` reads from the same save, with the sample's model config."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpt_tools.samples.workers import torchtitan_run

    src = sample("dcp", "torchtitan_real") / "step-3"
    assert (
        run_cli("export", src, tmp_path / "hf", "--hf", "--hf-config", _titan_hf_config(tmp_path / "cfg")).returncode
        == 0
    )
    dcp_to_torch_save(str(src), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    model = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    config = torchtitan_run.torchtitan_tiny().model_spec.model
    adapter = importlib.import_module("torchtitan.models.llama3").Llama3StateDictAdapter(config, None)
    ref = adapter.to_hf(model)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(ref) and len(ref) == 21
    assert all(got[k].equal(ref[k]) for k in ref), [k for k in ref if not got[k].equal(ref[k])]


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="the real torchtitan is not installed")
def test_torchtitan_hf_export_logits_equal_torchtitans_forward(tmp_path):
    """The exported folder in transformers' LlamaForCausalLM gives the logits torchtitan's own model gives with the
    step's weights (its llama3 with fused wqkv, weights loaded through its merge hook, its own causal mask; run in a
    subprocess with the worker's CPU shims): the q/k permutation, RoPE and the rest of the mapping are right."""
    import subprocess
    import sys

    src = sample("dcp", "torchtitan_real") / "step-3"
    tokens = [[1, 5, 9, 13, 20, 33, 40, 2, 7, 11, 50, 63], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    out = tmp_path / "titan_logits.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ckpt_tools.samples.workers.torchtitan_run import logits_main; logits_main()",
            str(src),
            str(out),
            json.dumps(tokens),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = run_cli("export", src, tmp_path / "hf", "--hf", "--hf-config", _titan_hf_config(tmp_path / "cfg"))
    assert r.returncode == 0, r.stderr
    assert_hf_logits_equal(tmp_path / "hf", tokens, torch.load(out, weights_only=True), (2, 12, 64))
