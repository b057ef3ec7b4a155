"""`ckpt convert SRC OUT --to megatron` from a Megatron-DeepSpeed pipeline checkpoint (the way in, issue 23): the
sample `megatron/gpt_tp2_pp2` (DeepSpeed's own PipelineModule save of GPTModelPipe, TP 2 x PP 2, bf16 + ZeRO-1,
WarmupLR) written as a Megatron-LM core_v0.16.1 torch_dist run folder.

What Megatron's own torch_dist save of such a GPT holds is read from the Megatron-LM samples (`megatron_lm/
megatron_tp2_torch_dist`: LayerNorm, GeLU, learned positions; `megatron_tp2_llama_torch_dist`: an untied output
layer): the key pattern, the dtypes and the shape rules, checked on those samples first and then on the output.
The values are compared tensor for tensor with the source read through `ckpt_tools.view.logical`, under a name table
written here (not the converter's), and the QKV rows with the per-TP-rank layer files, head by head. Where a
Megatron-LM checkout is named (MEGATRON_LM_DIR), Megatron's own `load_checkpoint` resumes the output through
`ckpt resume`."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools.view import logical as L
from ckpt_tools.read import pickle_reader as pr
from ckpt_tools.write.dcp_write import DcpFolder

from conftest import manifest, run_cli, sample
from test_convert_to_megatron import _ckpt_resume  # `ckpt resume -n 2 --device cpu --json` on this checkout

SRC = ("megatron", "gpt_tp2_pp2")
ITER = "iter_0000004"  # the sample's global step
MEGATRON = os.environ.get("MEGATRON_LM_DIR")
#: Megatron-DeepSpeed's local names -> Megatron-core's (the issue's table; the layer norms under the fused names)
LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
OTHER = {
    "1.word_embeddings.weight": "embedding.word_embeddings.weight",
    "1.position_embeddings.weight": "embedding.position_embeddings.weight",
    "6.weight": "decoder.final_layernorm.weight",
    "6.bias": "decoder.final_layernorm.bias",
    "7.lm_head.weight": "output_layer.weight",
}


def _core(name: str) -> tuple[str, int | None]:
    """(the torch_dist key, the layer) of a source name: pipeline specs 2..5 are transformer layers 0..3."""
    if name in OTHER:
        return OTHER[name], None
    spec, local = name.split(".", 1)
    return f"decoder.layers.{LAYER[local]}", int(spec) - 2


def _convert(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("convert", sample(*SRC), out, "--to", "megatron", "--json", *extra)


def _keys(it: Path) -> dict[str, tuple | str]:
    """{key: (global shape, dtype) or "bytes"} of a torch_dist iteration folder's .metadata (read inert)."""
    out = {}
    for key, meta in DcpFolder(it).sdm.items():
        if pr.is_opaque(meta, "TensorStorageMetadata"):
            out[key] = (tuple(meta.field("size")), str(meta.field("properties").state[0]))
        else:
            out[key] = "bytes"
    return out


def _global(it: Path, key: str, shape: tuple, dtype: str):
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    sd = {key: torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")))}
    load(sd, storage_reader=FileSystemReader(it))  # torch's own DCP reader, one process
    return sd[key]


def _pattern(key: str) -> str:
    return re.sub(r"/shard_\d+_\d+$", "/shard_i_L", key)


def _shape_rule(key: str, d: dict) -> tuple:
    """The global shape Megatron-core's torch_dist gives `key` for a GPT (LayerNorm, GeLU, learned positions, one
    head per query group) of these sizes: the layers stacked first, QKV 3 x hidden rows, fc1 ffn rows."""
    h, f, v, s, n = (
        d["hidden_size"],
        d["ffn_hidden_size"],
        d["padded_vocab_size"],
        d["max_position_embeddings"],
        d["num_layers"],
    )
    base = key.split("optimizer.state.", 1)[-1].split(".", 1)[-1] if key.startswith("optimizer.") else key
    rules = {
        "embedding.word_embeddings.weight": (v, h),
        "output_layer.weight": (v, h),
        "embedding.position_embeddings.weight": (s, h),
        "decoder.final_layernorm.weight": (h,),
        "decoder.final_layernorm.bias": (h,),
        "decoder.layers.self_attention.linear_qkv.weight": (n, 3 * h, h),
        "decoder.layers.self_attention.linear_qkv.bias": (n, 3 * h),
        "decoder.layers.self_attention.linear_proj.weight": (n, h, h),
        "decoder.layers.mlp.linear_fc1.weight": (n, f, h),
        "decoder.layers.mlp.linear_fc1.bias": (n, f),
        "decoder.layers.mlp.linear_fc2.weight": (n, h, f),
    }
    if base in rules:
        return rules[base]
    assert base.startswith("decoder.layers.") and base.endswith(("bias", "layer_norm_weight", "layer_norm_bias")), key
    return (n, h)


def _common(it: Path) -> dict:
    return pr.load(it / "common.pt").obj


def test_the_output_holds_megatrons_key_pattern_shapes_dtypes_and_the_sources_values(tmp_path):
    """Key pattern: the output's DCP keys are those of Megatron's own torch_dist save of a LayerNorm / GeLU GPT
    (the TP 2 sample) plus the untied output layer's four keys (as the untied Llama-style sample holds them), minus
    the RNG objects (not carried: `no_save_rng`); the shape rules hold on the Megatron samples (their own sizes)
    and on the output (the source's sizes); dtypes as Megatron saves them (bf16 weights, fp32 optimizer state).
    Values: every module weight (bf16), fp32 master, exp_avg and exp_avg_sq equal, bit for bit, the source's
    tensor read through ckpt's logical view, each layer at its index on the stacked axis; QKV rows: Megatron-core's
    view of each query group (q, k, v of one head) is that head's rows in the TP rank's own layer file."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    proc = _convert(out)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verified"] is True and doc["to"] == "megatron" and doc["ckpt_format"] == "torch_dist"
    m = manifest(*SRC)
    assert doc["step"] == m["counters"]["global_step"] == 4
    it = out / ITER
    assert sorted(p.name for p in out.iterdir()) == [ITER, "latest_checkpointed_iteration.txt"]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "4"
    ref_it = sample("megatron_lm", "megatron_tp2_torch_dist") / "iter_0000010"
    untied_it = sample("megatron_lm", "megatron_tp2_llama_torch_dist") / "iter_0000010"
    assert json.loads((it / "metadata.json").read_text()) == json.loads((ref_it / "metadata.json").read_text())
    ka, kr, ku = _keys(it), _keys(ref_it), _keys(untied_it)
    untied = {k for k in ku if k.endswith("output_layer.weight")}
    assert len(untied) == 4
    want = {_pattern(k) for k in kr if not k.startswith("rng_state/")} | untied
    assert {_pattern(k) for k in ka} == want
    # the extra states: one per layer (shard_i_L) for each of the four linears
    cfg = m["extra"]["model_config"]
    assert sum(1 for k in ka if "_extra_state/" in k) == 4 * cfg["n_layers"]
    sizes_ref = _common(ref_it)["args"].state
    sizes_out = {
        "hidden_size": cfg["hidden"],
        "ffn_hidden_size": cfg["ffn_hidden"],
        "padded_vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["seq_len"],
        "num_layers": cfg["n_layers"],
    }
    for keys, sizes in ((kr, sizes_ref), (ka, sizes_out)):
        for k, v in keys.items():
            if v != "bytes":
                assert v[0] == _shape_rule(k, sizes), (k, v)
    dtype_of = {_pattern(k): v[1] for k, v in {**kr, **ku}.items() if v != "bytes"}
    assert {k: v[1] for k, v in ka.items() if v != "bytes"} == {
        k: dtype_of[_pattern(k)] for k in ka if ka[k] != "bytes"
    }
    assert {v[1] for k, v in ka.items() if v != "bytes" and not k.startswith("optimizer.")} == {"torch.bfloat16"}

    # values, tensor for tensor, against the source's logical view
    src = sample(*SRC)
    fp32 = {t.name: t for t in L.model_tensors(src, weights="fp32")}
    bf16 = {t.name: t for t in L.model_tensors(src, weights="module")}
    states = L.optimizer_states(src)
    assert len(fp32) == m["parameters"]["tensors"] == 53
    whole: dict[str, object] = {}

    def got(key: str):
        if key not in whole:
            whole[key] = _global(it, key, *ka[key])
        return whole[key]

    compared = 0
    for name, t in fp32.items():
        key, layer = _core(name)
        pick = (lambda x: x) if layer is None else (lambda x: x[layer])
        pairs = [
            (key, bf16[name].read()),
            (f"optimizer.state.fp32_param.{key}", t.read()),
            (f"optimizer.state.exp_avg.{key}", states[name]["exp_avg"].read()),
            (f"optimizer.state.exp_avg_sq.{key}", states[name]["exp_avg_sq"].read()),
        ]
        for k, want_t in pairs:
            assert torch.equal(pick(got(k)), want_t), (name, k)
            compared += 1
    assert compared == 4 * 53
    assert {t.dtype for t in bf16.values()} == {"bfloat16"}

    # QKV, head by head, from each TP rank's own layer file (Megatron-DeepSpeed: [local heads][q|k|v][head_dim])
    heads, hd = cfg["n_heads"], cfg["hidden"] // cfg["n_heads"]
    tp = m["topology"]["tp"]
    qkv = got("decoder.layers.self_attention.linear_qkv.weight")
    for layer in range(cfg["n_layers"]):
        group = qkv[layer].view(heads, 3 * hd, cfg["hidden"])  # Megatron-core: [groups][q (1 head) | k | v][hd]
        for r in range(tp):
            f = src / "global_step4" / f"layer_{layer + 2:02d}-model_{r:02d}-model_states.pt"
            local = pr.load(f).obj["self_attention.query_key_value.weight"].read_torch()
            local = local.view(heads // tp, 3 * hd, cfg["hidden"])
            for h in range(heads // tp):
                for part in range(3):  # q, k, v
                    rows = slice(part * hd, (part + 1) * hd)
                    assert torch.equal(group[r * heads // tp + h][rows], local[h][rows]), (layer, r, h, part)


def test_common_pt_carries_the_step_groups_schedule_and_args_megatron_rebuilds_the_run_from(tmp_path):
    """common.pt: the iteration and Adam step of the source, its two param groups in Megatron-core's order
    (decaying weights first, then biases and norms with wd_mult 0) with the source's lr / betas / eps /
    weight_decay and Megatron's own fields (the same field set as Megatron's own save), an OptimizerParamScheduler
    that gives the LR the DeepSpeed run used after the save (its manifest's history), and args for this
    architecture. `ckpt inspect` of the output reports the source's counters and LR."""
    out = tmp_path / "out"
    proc = _convert(out)
    assert proc.returncode == 0, proc.stderr
    m = manifest(*SRC)
    c = _common(out / ITER)
    ref = _common(sample("megatron_lm", "megatron_tp2_torch_dist") / "iter_0000010")
    assert list(c) == list(ref)
    assert c["iteration"] == m["counters"]["global_step"]
    opt = c["optimizer"]["optimizer"]
    assert opt["state"]["common_step"].read_torch().item() == m["counters"]["optimizer_step"]
    groups = opt["param_groups"]
    assert [sorted(g) for g in groups] == [sorted(g) for g in ref["optimizer"]["optimizer"]["param_groups"]]
    src_groups = L.param_groups(sample(*SRC))
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    for g, s in zip(groups, src_groups):
        for k in ("lr", "betas", "eps", "weight_decay"):
            assert g[k] == s[k], k
    assert src_groups[0]["weight_decay"] == m["extra"]["ds_config"]["optimizer"]["params"]["weight_decay"]
    from ckpt_tools.schedules.megatron import expected_lrs

    args = c["args"].state
    rows, _ = expected_lrs(c["opt_param_scheduler"], groups, args, 2)
    assert rows == [h["lr"] for h in m["extra"]["history"] if h["step"] > m["counters"]["global_step"]]
    sizes = m["extra"]["model_config"]
    assert (
        args["num_layers"],
        args["hidden_size"],
        args["ffn_hidden_size"],
        args["num_attention_heads"],
        args["max_position_embeddings"],
        args["padded_vocab_size"],
    ) == (
        sizes["n_layers"],
        sizes["hidden"],
        sizes["ffn_hidden"],
        sizes["n_heads"],
        sizes["seq_len"],
        sizes["vocab_size"],
    )
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (2, 2)
    assert args["untie_embeddings_and_output_weights"] is True and args["normalization"] == "LayerNorm"
    assert args["global_batch_size"] == m["extra"]["ds_config"]["train_batch_size"]
    doc = json.loads(proc.stdout)
    assert any("WarmupLR" in n and "constant" in n for n in doc["notes"])
    assert any(x.startswith("RNG") for x in doc["not_moved"]) and any(
        x.startswith("data position") for x in doc["not_moved"]
    )
    view = run_cli("inspect", out, "--json")
    assert view.returncode == 0, view.stderr
    v = json.loads(view.stdout)
    assert v["format"] == "megatron_torch_dist"
    assert (v["counters"]["global_step"], v["counters"]["optimizer_step"]) == (4, 4)
    assert v["parameters"]["count"] == m["parameters"]["count"]


def test_ckpt_diff_by_hand_pairs_the_pipeline_with_the_conversion(tmp_path):
    """`ckpt diff --logical SRC OUT`, run by a user on the pipeline and its conversion, reads the pipeline under the
    Megatron-core names (said in a note): every tensor of the source is compared (the reader's count, read from the
    sample), and the only differences are the param-group fields Megatron-core keeps beside torch's, added."""
    from ckpt_tools.view.megatron_core import MEGATRON_GROUP_KEYS

    out = tmp_path / "out"
    assert _convert(out).returncode == 0
    proc = run_cli("diff", "--logical", sample(*SRC), out, "--json")
    assert proc.returncode == 1, proc.stderr  # differences found: the added group fields
    doc = json.loads(proc.stdout)
    n = len(L.model_tensors(L.open_any(sample(*SRC)), weights="fp32"))
    assert doc["tensors_compared"] == doc["tensors_read"] > n
    assert any("read under the Megatron-core names" in x for x in doc["notes"])
    groups = len(_common(out / ITER)["optimizer"]["optimizer"]["param_groups"])
    assert sorted((d["file"], d["field"], d["kind"]) for d in doc["differences"]) == sorted(
        ("param_groups", f"{g}.{k}", "added") for g in range(groups) for k in MEGATRON_GROUP_KEYS
    )


def test_dry_run_writes_nothing_and_what_cannot_be_carried_is_refused_in_one_line(tmp_path):
    """--dry-run prints the plan (notes, not moved) and writes nothing; refused with exit 2, one line, nothing
    written: the same pipeline whose TP replicas drifted apart (torch_dist keeps one copy), a DCP checkpoint and a
    plain DeepSpeed ZeRO one (no Megatron architecture), and the pipeline into the legacy format."""
    out = tmp_path / "out"
    proc = _convert(out, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "deepspeed_pipeline" and doc["scheduler"] == "OptimizerParamScheduler"
    assert doc["not_moved"] and not out.exists() and not list(tmp_path.iterdir())
    cases = [
        (sample("megatron", "gpt_tp2_pp2_drifted"), (), "TP-replicated parameters differ across TP ranks"),
        (sample("dcp", "dcp_recipe_fsdp2"), (), "needs a Megatron-LM legacy checkpoint"),
        (sample("deepspeed", "zero2_bf16"), (), "needs a Megatron-LM legacy checkpoint"),
        (sample(*SRC), ("--ckpt-format", "torch"), "needs a Megatron-LM torch_dist checkpoint"),
    ]
    for src, extra, words in cases:
        proc = run_cli("convert", src, out, "--to", "megatron", *extra)
        assert proc.returncode == 2 and words in proc.stderr, (src, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout: its "
    "training code is not on the package registries)",
)
def test_megatron_loads_and_resumes_the_conversion_with_its_optimizer_state(tmp_path):
    """`ckpt resume` runs Megatron-LM's own pretrain on the output (TP 2 x PP 2, 4 gloo processes on the CPU, the
    model rebuilt from the written args, no extra flag): Megatron's load_checkpoint takes the weights, the Adam
    state and the scheduler; every check passes; the iteration and Adam step continue from 4 (5, 6); the LRs are
    the ones the DeepSpeed run itself used for those steps (its manifest). The same output written as legacy rank
    files (`--ckpt-format torch`) resumes with the closed-form AdamW check of every update from the saved fp32
    master, exp_avg, exp_avg_sq, step and LR passing, and the same LRs and losses as the torch_dist resume, bit for
    bit (one state, two layouts; no RNG state is carried, so ckpt relaunches the legacy resume with --no-load-rng
    and says so). And Megatron reshards the output at load: resumed at TP 1 x PP 1 every check passes and the
    losses agree within rel 1e-3. Without that flag Megatron's legacy load prints why and calls sys.exit(): the
    resume then fails with exit 2 and that reason in its one error line (was: a normal end, every check failed)."""
    out, leg = tmp_path / "out", tmp_path / "legacy"
    assert _convert(out).returncode == 0
    proc = run_cli("convert", out, leg, "--to", "megatron", "--ckpt-format", "torch", "--json")
    assert proc.returncode == 0, proc.stderr
    m = manifest(*SRC)
    # the legacy loader asks for each rank file's RNG state unless told not to (torch_dist: args.no_save_rng)
    runs = {
        "torch_dist": _ckpt_resume(out),
        "legacy": _ckpt_resume(leg),
        "tp1_pp1": _ckpt_resume(out, "--tp", "1", "--pp", "1", "--nproc", "1"),
    }
    for key, res in runs.items():
        checks = {c["name"]: c["status"] for c in res["checks"]}
        assert all(s in ("pass", "n/a") for s in checks.values()), (key, checks)
        assert {"global step", "optimizer step", "learning rate", "run rebuilt", "scheduler state"} <= {
            n for n, s in checks.items() if s == "pass"
        }, (key, checks)
        assert [r["step"] for r in res["records"]] == [r["optimizer_step"] for r in res["records"]] == [5, 6]
        assert [r["lr"] for r in res["records"]] == [h["lr"] for h in m["extra"]["history"] if h["step"] > 4]
    assert {c["name"]: c["status"] for c in runs["legacy"]["checks"]}["optimizer state"] == "pass"
    assert [(r["lr"], r["loss"]) for r in runs["legacy"]["records"]] == [
        (r["lr"], r["loss"]) for r in runs["torch_dist"]["records"]
    ]
    assert [n for n in runs["legacy"]["plan"]["notes"] if "--no-load-rng" in n] == [
        "RNG: the rank files hold no rng_state: relaunched with --no-load-rng (Megatron's legacy load exits without "
        "it), so the generators are seeded afresh"
    ]
    # the plan as it was before that flag: Megatron's own exit during its load is an error, with its reason
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; import ckpt_tools.resume.megatron as F; "
            "F._legacy_has_rng = lambda ck: True; from ckpt_cli.main import main; "
            f"sys.argv = ['ckpt', 'resume', {str(leg)!r}, '-n', '2', '--device', 'cpu']; main()",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("ckpt: error:")]
    assert proc.returncode == 2 and "Megatron-LM exited while loading the checkpoint: Unable to load rng state" in line
    # Megatron reshards the torch_dist output at load: at TP 1 x PP 1 the same run, bf16 matmuls summed in another
    # order (the TP 2 -> 1 resume of the Megatron-LM sample differs by ~1e-4 relative)
    assert [r["loss"] for r in runs["tp1_pp1"]["records"]] == pytest.approx(
        [r["loss"] for r in runs["torch_dist"]["records"]], rel=1e-3
    )


@pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout)",
)
def test_megatrons_forward_of_the_conversion_is_the_deepspeed_models_forward(tmp_path):
    """The architecture mapping, end to end: Megatron-LM builds its GPTModel from the written args (TP 1 x PP 1,
    one gloo process, fp32 compute) and loads the converted weights with its own load_checkpoint; the DeepSpeed
    sample's own layers (`ckpt_tools.train.megatron`, TP 1) hold the source's weights read through the logical
    view. On the same tokens their logits agree within abs 1e-5 (both fp32 over the same bf16 weights, the op
    order differs; measured 6e-8) and so do their losses (rel 1e-6; measured equal)."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    assert _convert(out).returncode == 0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            str(Path(__file__).resolve()),
            str(out),
            str(tmp_path / "lg.pt"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "lg.pt")
    mega, ds, tokens = got["megatron"], got["deepspeed"], got["tokens"]
    assert mega.shape == ds.shape == (*tokens.shape, manifest(*SRC)["extra"]["model_config"]["vocab_size"])
    assert (mega - ds).abs().max().item() < 1e-5
    labels = tokens[:, 1:].reshape(-1)
    loss = [torch.nn.functional.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), labels).item() for x in (mega, ds)]
    assert loss[0] == pytest.approx(loss[1], rel=1e-6)
    print(f"max |logits diff| {(mega - ds).abs().max().item():.3g}; loss megatron {loss[0]!r} deepspeed {loss[1]!r}")


def _forward_both(out: Path, dst: Path) -> None:
    """(under torchrun, one process) Megatron's forward of the converted folder `out` and the DeepSpeed model's of
    the source, on the same tokens; saves {megatron, deepspeed, tokens} to `dst`."""
    import torch
    import torch.nn as nn

    from ckpt_tools.train.procgroup import join
    from ckpt_tools.train import megatron as dsm
    from ckpt_tools.samples.workers import megatron_lm as W

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    W.import_megatron()
    join("gloo")
    training = sys.modules["megatron.training.training"]  # imported by import_megatron, from the checkout

    saved = pr.load(out / ITER / "common.pt").obj["args"].state
    _, model_provider, model_type, _, embedding_ranks = W._pretrain_entry()
    argv = [
        *W.relaunch_argv(saved),
        *W.parallel_argv(saved, 1, 1),
        *W.CPU_FLAGS,
        "--distributed-backend",
        "gloo",
        "--load",
        str(out),
        "--exit-on-missing-checkpoint",
        "--no-load-optim",
        "--no-load-rng",
        "--train-iters",
        str(saved["train_iters"]),
        "--eval-iters",
        "0",
    ]
    argv.remove("--bf16")  # fp32 compute over the saved bf16 weights, as the DeepSpeed side below
    sys.argv = [sys.argv[0], *argv]
    training.initialize_megatron(
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, get_embedding_ranks=embedding_ranks
    )
    net = training.setup_model_and_optimizer(model_provider, model_type)[0][0]
    net.eval()
    cfg = dsm.MegatronGPTConfig(**manifest(*SRC)["extra"]["model_config"])
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    s = tokens.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    with torch.no_grad():
        mega = net(tokens, positions, mask).float()
    # the DeepSpeed model's own layers at TP 1 (one rank: its all-reduces are the identity), the source's weights
    tp = dsm.TensorParallel(rank=0, size=1, group=torch.distributed.group.WORLD)
    layers = [
        dsm.EmbeddingPipe(cfg, tp, 0, 1),
        *[dsm.ParallelTransformerLayerPipe(cfg, tp, 0, 2 + i) for i in range(cfg.n_layers)],
        nn.LayerNorm(cfg.hidden, eps=cfg.layernorm_eps),
        dsm.LMHeadPipe(cfg, tp, 0, 2 + cfg.n_layers + 1),
    ]
    weights = {t.name: t.read(torch.float32) for t in L.model_tensors(sample(*SRC), weights="module")}
    for i, layer in enumerate(layers, start=1):
        sd = {k[len(f"{i}.") :]: v for k, v in weights.items() if k.startswith(f"{i}.")}
        layer.load_state_dict(sd, strict=True)
    with torch.no_grad():
        x = (tokens, positions)
        for layer in layers:
            x = layer(x)
    torch.save({"megatron": mega, "deepspeed": x.float(), "tokens": tokens}, dst)


if __name__ == "__main__":  # the forward comparison's worker (torchrun, see the test above)
    _forward_both(Path(sys.argv[1]), Path(sys.argv[2]))
