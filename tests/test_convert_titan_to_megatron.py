"""`ckpt convert SRC OUT --to megatron --hf-config CONFIG.json` from torchtitan (the way in, issue 23): the real
torchtitan 0.3.0 Trainer's save `dcp/torchtitan_real/step-3` (llama3, dim 64, 4 heads, fused wqkv, FSDP2 over 2
ranks, AdamW with two param groups: norms at lr 4e-4 without decay, the rest at 8e-4 with decay 0.1) written as a
Megatron-LM core_v0.16.1 torch_dist run folder.

The expected tensors are computed here from the source, with the layout rules written out in this file (not the
converter's): Megatron-core's linear_qkv holds, per query group, its query heads, then its key and value heads;
its rotary embedding rotates halves where torchtitan's rotates interleaved pairs, so each q / k head's rows are
permuted; SwiGLU's linear_fc1 is [w1; w3]. `export --hf` of the output must equal `export --hf` of the source
(that export is held against torchtitan's own Hugging Face converter and forward in test_export_formats). Where a
Megatron-LM checkout is named (MEGATRON_LM_DIR), Megatron's own load_checkpoint resumes the output through `ckpt
resume` and Megatron's own forward of it gives torchtitan's logits."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_tools

from ckpt_tools.samples import free_port, worker_env
from ckpt_tools.view import logical as L

from conftest import ROOT, assert_hf_logits_equal, manifest, run_cli, sample
from test_convert_to_megatron import _ckpt_resume  # `ckpt resume -n 2 --device cpu --json` on this checkout
from test_export_formats import _titan_hf_config  # the sample model's LlamaConfig, written by transformers

SRC = ("dcp", "torchtitan_real")
MEGATRON = os.environ.get("MEGATRON_LM_DIR")
HEADS, HEAD_DIM = 4, 16  # the sample's llama3: no GQA, so each query group is one head
TOKENS = [[1, 5, 9, 13, 20, 33, 40, 2, 7, 11, 50, 63], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def _src() -> Path:
    return sample(*SRC) / "step-3"


def _convert(out: Path, cfg: Path | None, *extra: str, src: Path | None = None) -> subprocess.CompletedProcess:
    flags = ["--hf-config", cfg] if cfg is not None else []
    return run_cli("convert", src or _src(), out, "--to", "megatron", "--json", *flags, *extra)


def _halves(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows from interleaved pairs (x0, y0, x1, y1, ...) to halves (x0, x1, ..., y0, y1, ...)."""
    per = rows.shape[0] // heads
    idx = [h * per + (2 * j if j < per // 2 else 2 * (j - per // 2) + 1) for h in range(heads) for j in range(per)]
    return rows[idx]


def _megatron_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per query group (one head each here): its q head, its k head, its v head, q / k rotate-half."""
    q, k = _halves(q, HEADS), _halves(k, HEADS)
    return torch.cat([t[h * HEAD_DIM : (h + 1) * HEAD_DIM] for h in range(HEADS) for t in (q, k, v)])


def _titan_fused_split(fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """torchtitan's FusedQKVLinear rows (its optimizer state): per KV group its q heads, k head, v head."""
    blocks = [fused[h * 3 * HEAD_DIM : (h + 1) * 3 * HEAD_DIM] for h in range(HEADS)]
    return tuple(torch.cat([b[i * HEAD_DIM : (i + 1) * HEAD_DIM] for b in blocks]) for i in range(3))


def test_torchtitan_to_megatron_needs_its_config_then_carries_every_tensor(tmp_path):
    """Without --hf-config: exit 2 naming it, nothing written. With it: verified; the fp32 master, the bf16
    module copy and both Adam moments of every Megatron tensor equal the source's rearranged by the rules above;
    common.pt holds the args the config describes, each param group's own LR as max_lr = min_lr, the step 3; the
    logical diff pairs 45 tensors bit for bit and reports only Megatron's added param-group fields; `export --hf`
    of the output equals `export --hf` of the source, tensor for tensor."""
    cfg = _titan_hf_config(tmp_path / "cfg")
    r = _convert(tmp_path / "none", None)
    assert r.returncode == 2 and "--hf-config" in r.stderr and not (tmp_path / "none").exists(), r.stderr
    out = tmp_path / "out"
    r = _convert(out, cfg, "--seq-length", "32")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["verified"] is True and res["params"] == 15 and res["step"] == 3

    src = {t.name: t.read() for t in L.model_tensors(_src())}
    states = {n: {k: t.read() for k, t in s.items() if k != "step"} for n, s in L.optimizer_states(_src()).items()}
    master = {t.name: t.read() for t in L.model_tensors(out, weights="fp32")}
    module = {t.name: t for t in L.model_tensors(out, weights="module")}
    got = {
        n: {k: t.read() for k, t in s.items() if k not in ("step", "fp32")}  # fp32: the master, above
        for n, s in L.optimizer_states(out).items()
    }
    for i in range(2):
        a, m, f = f"layers.{i}.attention", f"decoder.layers.{i}", f"layers.{i}.feed_forward"
        want = {  # Megatron name: (fp32 weight, {state: tensor})
            f"{m}.self_attention.linear_qkv.weight": (
                _megatron_qkv(*(src[f"{a}.qkv_linear.w{x}.weight"] for x in "qkv")),
                {
                    s: _megatron_qkv(*_titan_fused_split(states[f"{a}.qkv_linear.wqkv.weight"][s]))
                    for s in ("exp_avg", "exp_avg_sq")
                },
            ),
            f"{m}.mlp.linear_fc1.weight": (
                torch.cat([src[f"{f}.w1.weight"], src[f"{f}.w3.weight"]]),
                {
                    s: torch.cat([states[f"{f}.w1.weight"][s], states[f"{f}.w3.weight"][s]])
                    for s in ("exp_avg", "exp_avg_sq")
                },
            ),
            f"{m}.mlp.linear_fc2.weight": (src[f"{f}.w2.weight"], states[f"{f}.w2.weight"]),
            f"{m}.self_attention.linear_proj.weight": (src[f"{a}.wo.weight"], states[f"{a}.wo.weight"]),
            f"{m}.self_attention.linear_qkv.layer_norm_weight": (
                src[f"layers.{i}.attention_norm.weight"],
                states[f"layers.{i}.attention_norm.weight"],
            ),
            f"{m}.mlp.linear_fc1.layer_norm_weight": (
                src[f"layers.{i}.ffn_norm.weight"],
                states[f"layers.{i}.ffn_norm.weight"],
            ),
        }
        for name, (weight, st) in want.items():
            key = next(k for k in master if L.name_key(k) == L.name_key(name))
            assert master[key].equal(weight), name
            assert module[key].dtype == "bfloat16" and module[key].read().equal(weight.to(torch.bfloat16)), name
            assert set(got[key]) == {"exp_avg", "exp_avg_sq"} and all(got[key][s].equal(st[s]) for s in st), name
    for titan, core in (
        ("tok_embeddings.weight", "embedding.word_embeddings.weight"),
        ("norm.weight", "decoder.final_layernorm.weight"),
        ("lm_head.weight", "output_layer.weight"),
    ):
        assert master[core].equal(src[titan]) and all(got[core][s].equal(states[titan][s]) for s in states[titan])

    common = torch.load(next(out.glob("iter_*/common.pt")), weights_only=False)
    a = vars(common["args"])
    assert {
        k: a[k]
        for k in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "normalization",
            "swiglu",
            "position_embedding_type",
            "rotary_base",
            "use_rope_scaling",
            "rope_scaling_factor",
            "layernorm_epsilon",
            "seq_length",
            "add_bias_linear",
            "untie_embeddings_and_output_weights",
            "padded_vocab_size",
            "iteration",
            "bf16",
        )
    } == {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "kv_channels": 16,
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "rotary_base": 500000,
        "use_rope_scaling": True,
        "rope_scaling_factor": 8.0,
        "layernorm_epsilon": 1e-5,
        "seq_length": 32,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True,
        "padded_vocab_size": 64,
        "iteration": 3,
        "bf16": True,
    }
    groups = common["optimizer"]["optimizer"]["param_groups"]
    history = {h["step"]: h for h in manifest(*SRC)["extra"]["history"]}
    norms_lr, rest_lr = history[3]["lr_after"]  # the LRs torchtitan's step 4 uses (group order: norms, rest)
    assert [(g["wd_mult"], g["weight_decay"], g["max_lr"], g["min_lr"], g["lr"]) for g in groups] == [
        (1.0, 0.1, rest_lr, rest_lr, rest_lr),
        (0.0, 0.0, norms_lr, norms_lr, norms_lr),
    ]
    assert float(common["optimizer"]["optimizer"]["state"]["common_step"]) == 3.0
    assert common["opt_param_scheduler"]["lr_decay_style"] == "constant"

    d = run_cli("diff", "--logical", _src(), out, "--json")
    rep = json.loads(d.stdout)
    assert d.returncode == 1 and rep["tensors_compared"] == 45, d.stdout[-2000:]
    assert {(x["file"], x["field"], x["kind"]) for x in rep["differences"]} == {
        ("param_groups", f"{i}.{k}", "added")
        for i in (0, 1)
        for k in ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr")
    }

    assert run_cli("export", out, tmp_path / "hf_out", "--hf").returncode == 0
    assert run_cli("export", _src(), tmp_path / "hf_src", "--hf", "--hf-config", cfg).returncode == 0
    from safetensors.torch import load_file

    x, y = load_file(tmp_path / "hf_out" / "model.safetensors"), load_file(tmp_path / "hf_src" / "model.safetensors")
    assert set(x) == set(y) and len(y) == 21 and all(x[k].equal(y[k]) for k in y)


def test_torchtitan_to_megatron_refuses_what_it_cannot_carry(tmp_path):
    """Exit 2 with one line naming it, nothing written: the model-only final save (no Adam state), a config whose
    head count the shapes contradict, a RoPE scaling Megatron-core does not have, the legacy format (written from a
    torch_dist run), and --hf-config on a source that is not torchtitan's."""
    cfg = _titan_hf_config(tmp_path / "cfg")
    heads8 = _titan_hf_config(tmp_path / "heads8")
    heads8.write_text(heads8.read_text().replace('"num_attention_heads": 4', '"num_attention_heads": 8'))
    yarn = _titan_hf_config(tmp_path / "yarn")
    yarn.write_text(yarn.read_text().replace('"llama3"', '"yarn"'))
    no_head_dim = _titan_hf_config(tmp_path / "no_head_dim")  # then 2, 4, 8 or 16 heads would all fit the shapes
    no_head_dim.write_text(no_head_dim.read_text().replace('"head_dim": 16,', ""))
    no_factor = _titan_hf_config(tmp_path / "no_factor")
    no_factor.write_text(no_factor.read_text().replace('"factor": 8.0', '"factor": null'))
    cases = [
        (_convert(tmp_path / "o1", cfg, src=sample(*SRC) / "step-5"), "model-only"),
        (_convert(tmp_path / "o2", heads8), "wq.weight"),
        (_convert(tmp_path / "o3", yarn), "rope_scaling"),
        (_convert(tmp_path / "o4", cfg, "--ckpt-format", "torch"), "torch_dist"),
        (_convert(tmp_path / "o5", cfg, src=sample("megatron", "gpt_tp2_pp2")), "--hf-config"),
        (_convert(tmp_path / "o6", no_head_dim), "head_dim"),
        (_convert(tmp_path / "o7", no_factor), "rope_scaling"),
    ]
    for r, word in cases:
        lines = [x for x in r.stderr.splitlines() if x.startswith("ckpt: error:")]
        assert r.returncode == 2 and len(lines) == 1 and word in lines[0], r.stderr[-1500:]
    r = _convert(tmp_path / "o8", cfg, "--n-kv-heads", "4")  # the KV heads come from the config
    assert r.returncode == 2 and "--n-kv-heads" in r.stderr, r.stderr[-1500:]
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 9))
    r = _convert(tmp_path / "dry", cfg, "--dry-run")
    assert r.returncode == 0 and not (tmp_path / "dry").exists()


#: the sample's torchtitan schedule (its manifest's config), in torchtitan's own field names
SCHEDULE = "warmup_steps=2,decay_ratio=0.6,decay_type=linear,min_lr_factor=0,training_steps=5"


def test_torchtitan_schedule_is_carried_as_megatrons_wsd(tmp_path):
    """--lr-scheduler with the run's torchtitan settings: the factors ckpt computes from them reproduce the LR the
    real run used at every one of its 5 steps (its manifest); the output holds Megatron's WSD schedule, whose own
    formula (`schedules.megatron`, held against Megatron's resumes) gives, for the two steps after the save, the LRs
    torchtitan's run used there, group for group; `ckpt inspect` reads the output's next LRs. Settings that do not
    reproduce the saved LRs (cosine decay; 6 steps) are refused, nothing written."""
    from ckpt_tools.view import torchtitan as megatron_in
    from ckpt_tools.schedules.megatron import expected_lrs

    m = manifest(*SRC)["extra"]
    assert m["config"]["warmup_steps"] == 2 and m["config"]["decay_ratio"] == 0.6
    s = megatron_in.parse_titan_schedule(SCHEDULE, None)
    assert [
        [base * megatron_in.titan_factor(s, h["step"] - 1) for base in m["config"]["lr"]] for h in m["history"]
    ] == [h["lr"] for h in m["history"]]
    cfg, out = _titan_hf_config(tmp_path / "cfg"), tmp_path / "out"
    r = _convert(out, cfg, "--seq-length", "32", "--lr-scheduler", SCHEDULE)
    assert r.returncode == 0 and json.loads(r.stdout)["verified"] is True, r.stderr
    common = torch.load(next(out.glob("iter_*/common.pt")), weights_only=False)
    a, groups = vars(common["args"]), common["optimizer"]["optimizer"]["param_groups"]
    assert {
        k: a[k]
        for k in (
            "lr_decay_style",
            "lr_decay_iters",
            "lr_wsd_decay_iters",
            "lr_wsd_decay_style",
            "lr_warmup_iters",
            "train_iters",
        )
    } == {
        "lr_decay_style": "WSD",
        "lr_decay_iters": 5,
        "lr_wsd_decay_iters": 3,
        "lr_wsd_decay_style": "linear",
        "lr_warmup_iters": 1,
        "train_iters": 5,
    }
    assert [(g["max_lr"], g["min_lr"]) for g in groups] == [(8e-4, 0.0), (4e-4, 0.0)]
    rows, _ = expected_lrs(common["opt_param_scheduler"], groups, a, 2)
    later = [h["lr"] for h in m["history"] if h["step"] > 3]  # group order: norms, rest
    assert rows == [[rest, norms] for norms, rest in later]
    r = run_cli("inspect", out, "--json")
    assert r.returncode == 0, r.stderr
    for bad in (SCHEDULE.replace("linear", "cosine"), SCHEDULE.replace("=5", "=6")):
        r = _convert(tmp_path / "bad", cfg, "--lr-scheduler", bad)
        assert r.returncode == 2 and "not the schedule this run trained with" in r.stderr, r.stderr[-800:]
        assert not (tmp_path / "bad").exists()


NEEDS_MEGATRON = pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout)",
)


@NEEDS_MEGATRON
def test_megatron_resumes_the_torchtitan_conversion(tmp_path):
    """`ckpt resume` runs Megatron-LM's own pretrain on the output (the model rebuilt from the written args, no
    extra flag): every check passes, the iteration and Adam step continue from 3, and each param group's LR is the
    one torchtitan's own next step uses (its manifest) — at DP 2, and resharded at TP 2; converted with the run's
    --lr-scheduler, the LRs of both resumed steps are torchtitan's own for steps 4 and 5. Written again as legacy
    rank files, the closed-form AdamW check of every update from the carried fp32 master, exp_avg, exp_avg_sq, step
    and LR passes, with the torch_dist resume's LRs and losses bit for bit."""
    out, leg = tmp_path / "out", tmp_path / "legacy"
    assert _convert(out, _titan_hf_config(tmp_path / "cfg"), "--seq-length", "32").returncode == 0
    assert run_cli("convert", out, leg, "--to", "megatron", "--ckpt-format", "torch").returncode == 0
    norms_lr, rest_lr = {h["step"]: h for h in manifest(*SRC)["extra"]["history"]}[3]["lr_after"]
    wsd = tmp_path / "wsd"
    assert (
        _convert(wsd, _titan_hf_config(tmp_path / "cfg2"), "--seq-length", "32", "--lr-scheduler", SCHEDULE).returncode
        == 0
    )
    runs = {
        "dp2": _ckpt_resume(out),
        "tp2": _ckpt_resume(out, "--tp", "2"),
        "legacy": _ckpt_resume(leg),
        "wsd": _ckpt_resume(wsd),
    }
    for key, res in runs.items():
        checks = {c["name"]: c["status"] for c in res["checks"]}
        assert all(s in ("pass", "n/a") for s in checks.values()), (key, checks)
        assert {"global step", "optimizer step", "learning rate", "run rebuilt", "scheduler state"} <= {
            n for n, s in checks.items() if s == "pass"
        }, (key, checks)
        assert [r["step"] for r in res["records"]] == [r["optimizer_step"] for r in res["records"]] == [4, 5]
        if key == "wsd":  # torchtitan's own LRs of steps 4 and 5 (group order there: norms, rest)
            later = [h["lr"] for h in manifest(*SRC)["extra"]["history"] if h["step"] > 3]
            assert [r["lr"] for r in res["records"]] == [[rest, norms] for norms, rest in later]
        else:
            assert [r["lr"] for r in res["records"]] == [[rest_lr, norms_lr]] * 2, key
    assert {c["name"]: c["status"] for c in runs["legacy"]["checks"]}["optimizer state"] == "pass"
    assert [(r["lr"], r["loss"]) for r in runs["legacy"]["records"]] == [
        (r["lr"], r["loss"]) for r in runs["dp2"]["records"]
    ]
    assert [r["loss"] for r in runs["tp2"]["records"]] == pytest.approx(
        [r["loss"] for r in runs["dp2"]["records"]], rel=1e-3
    )


@NEEDS_MEGATRON
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="the real torchtitan is not installed")
def test_megatrons_forward_of_the_conversion_gives_torchtitans_logits(tmp_path):
    """Megatron's own forward of the output (initialize_megatron + load_checkpoint, the model from the written args,
    fp32 compute on the bf16 weights the model holds, llama3 RoPE scaling included) equals transformers' Llama on
    the same bf16 weights (`export --hf --source module`) to float32 rounding; transformers' Llama on the fp32
    master (`export --hf`) equals torchtitan's own forward of the source to float32 rounding; so Megatron's forward
    and torchtitan's differ only by the bf16 rounding of the weights (measured: max |diff| 0.008 on logits of
    magnitude up to 3.2)."""
    out = tmp_path / "out"
    assert _convert(out, _titan_hf_config(tmp_path / "cfg"), "--seq-length", "32").returncode == 0
    m, t = _megatron_and_titan_logits(out, _src(), tmp_path)
    assert not torch.equal(m, t)  # the bf16 module weights: Megatron's forward is not torchtitan's, bit for bit


def test_grouped_query_attention_fuses_as_megatrons_own_split_undoes():
    """With grouped-query attention (8 heads in 2 KV groups; the sample has none), the linear_qkv the view builds out
    of torchtitan's wq / wk / wv — and out of its fused wqkv optimizer rows — splits back, under the rules `export
    --hf` applies to a Megatron Llama (held against Megatron's own forward of the GQA sample in
    test_format_megatron_lm), into torchtitan's q / k rotated to halves per head (the permutation torchtitan's own
    Hugging Face converter applies, tested in test_export_formats) and v as saved."""
    from ckpt_tools.ops import hf_map
    from ckpt_tools.read import qkv
    from ckpt_tools.read.tp_layout import merge_shards

    heads, groups, hd, hidden = 8, 2, 4, 32
    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(n * hd, hidden, generator=g) for n in (heads, groups, groups))
    rule = qkv.megatron_rule(heads, groups)
    fused = merge_shards(rule, [wq, wk, wv])
    titan_rows = qkv.fuse(wq, wk, wv, groups)  # torchtitan's FusedQKVLinear rows (its optimizer state's order)
    assert merge_shards(rule, [titan_rows]).equal(fused)
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "intermediate_size": 8,
    }
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    split = {
        hf.rsplit(".", 2)[-2]: fn(fused) for hf, fn, _ in hf_map.megatron_to_hf({name: fused.shape}, config, "x")[name]
    }
    assert split["q_proj"].equal(hf_map.rope_permute(heads)(wq))
    assert split["k_proj"].equal(hf_map.rope_permute(groups)(wk))
    assert split["v_proj"].equal(wv)


@NEEDS_MEGATRON
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="the real torchtitan is not installed")
def test_a_grouped_query_torchtitan_run_moves_onto_megatron(tmp_path):
    """The real torchtitan Trainer makes the grouped-query variant here (4 heads in 2 KV groups, fused wqkv whose
    Adam rows torchtitan groups per KV head; not bundled): converted with its config, verified; Megatron's own
    forward of the output equals transformers' Llama on the same bf16 weights to float32 rounding, transformers'
    Llama on the fp32 master equals torchtitan's own forward; and Megatron resumes it with every check passing and
    each group's LR the one torchtitan's next step uses."""
    from ckpt_tools.samples import run_torchrun

    run_torchrun(
        "ckpt_tools.samples.workers.torchtitan_run",
        2,  # raises with the log's tail if it fails
        ["--sample", "torchtitan_gqa", "--out", str(tmp_path / "made")],
        timeout=600,
    )
    src = tmp_path / "made" / "torchtitan_gqa" / "step-3"
    cfg = _titan_hf_config(tmp_path / "cfg")
    cfg.write_text(cfg.read_text().replace('"num_key_value_heads": 4', '"num_key_value_heads": 2'))
    out = tmp_path / "out"
    r = _convert(out, cfg, "--seq-length", "32", src=src)
    assert r.returncode == 0 and json.loads(r.stdout)["verified"] is True, r.stderr
    a = vars(torch.load(next(out.glob("iter_*/common.pt")), weights_only=False)["args"])
    assert (a["num_attention_heads"], a["num_query_groups"], a["group_query_attention"]) == (4, 2, True)
    _megatron_and_titan_logits(out, src, tmp_path, kv_heads=2)
    made = json.loads((tmp_path / "made" / "torchtitan_gqa.manifest.json").read_text())
    norms_lr, rest_lr = {h["step"]: h for h in made["extra"]["history"]}[3]["lr_after"]
    res = _ckpt_resume(out)
    checks = {c["name"]: c["status"] for c in res["checks"]}
    assert all(s in ("pass", "n/a") for s in checks.values()), checks
    assert [r["lr"] for r in res["records"]] == [[rest_lr, norms_lr]] * 2


def _megatron_and_titan_logits(out: Path, src: Path, tmp_path: Path, kv_heads: int | None = None):
    """(Megatron's own forward of the converted `out`, torchtitan's own forward of `src`) on TOKENS, after checking
    each against transformers' Llama: Megatron's on the same bf16 weights (`export --hf --source module`) to float32
    rounding, torchtitan's on the fp32 master (`export --hf`) to float32 rounding; the two within the bf16 rounding
    of the weights (atol 0.03; measured 0.008 on logits up to 3.2)."""
    meg, titan = tmp_path / "megatron_logits.pt", tmp_path / "titan_logits.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "ckpt_tools.samples.workers.megatron_lm",
        "--forward",
        str(out),
        "--tokens",
        json.dumps(TOKENS),
        "--logits",
        str(meg),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ckpt_tools.samples.workers.torchtitan_run import logits_main; logits_main()",
            str(src),
            str(titan),
            json.dumps(TOKENS),
            *([str(kv_heads)] if kv_heads else []),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_cli("export", out, tmp_path / "hf_module", "--hf", "--source", "module").returncode == 0
    assert run_cli("export", out, tmp_path / "hf", "--hf").returncode == 0
    m, t = torch.load(meg, weights_only=True), torch.load(titan, weights_only=True)
    assert_hf_logits_equal(tmp_path / "hf_module", TOKENS, m, (2, 12, 64))
    assert_hf_logits_equal(tmp_path / "hf", TOKENS, t, (2, 12, 64))
    assert torch.allclose(m, t, atol=0.03, rtol=0), float((m - t).abs().max())
    return m, t


@NEEDS_MEGATRON
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="the real torchtitan is not installed")
def test_a_stock_single_group_torchtitan_run_moves_onto_megatron_with_drop_norm_decay(tmp_path):
    """torchtitan's own llama3 configs train with its stock `default_adamw`: one AdamW param group, weight decay 0.1
    on every parameter, the RMSNorm weights included, which Megatron-core never decays (wd_mult 0 for 1-D tensors).
    The real Trainer makes such a run here (not bundled). Converted as it is: exit 2 naming --drop-norm-decay,
    nothing written. With it: verified against the source read with that one change; the plan lists the weight
    decay dropped from the 5 norm weights; the output holds Megatron-core's two groups (10 weights at 0.1, the 5 norms
    at 0). Megatron resumes the legacy rank files of it with every check passing, the closed-form AdamW check of
    every update from the carried state included, and the LRs of steps 4 and 5 are torchtitan's own (--lr-scheduler).
    On a run whose norms do not decay (the bundled sample) the flag has nothing to change: exit 2."""
    import ckpt_tools
    from ckpt_tools.samples import run_torchrun
    from ckpt_tools.view import logical as L

    run_torchrun(
        "ckpt_tools.samples.workers.torchtitan_run",
        2,  # raises with the log's tail if it fails
        ["--sample", "torchtitan_onegroup", "--out", str(tmp_path / "made")],
        timeout=600,
    )
    src = tmp_path / "made" / "torchtitan_onegroup" / "step-3"
    made = json.loads((tmp_path / "made" / "torchtitan_onegroup.manifest.json").read_text())
    assert made["extra"]["config"]["weight_decay"] == [0.1] and made["extra"]["config"]["lr"] == [8e-4]
    cfg = _titan_hf_config(tmp_path / "cfg")
    r = _convert(tmp_path / "refused", cfg, "--seq-length", "32", src=src)
    assert r.returncode == 2 and "--drop-norm-decay" in r.stderr and not (tmp_path / "refused").exists(), r.stderr
    out = tmp_path / "out"
    r = _convert(out, cfg, "--seq-length", "32", "--lr-scheduler", SCHEDULE, "--drop-norm-decay", src=src)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verified"] is True
    assert any(x.startswith("weight decay 0.1 on 5 norm weights") for x in doc["not_moved"]), doc["not_moved"]
    groups = L.param_groups(out)
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [(0.1, 10), (0.0, 5)]
    assert all(len(ckpt_tools.open_checkpoint(out).get(f"model.{n}").shape) == 1 for n in groups[1]["params"])
    leg = tmp_path / "legacy"
    assert run_cli("convert", out, leg, "--to", "megatron", "--ckpt-format", "torch").returncode == 0
    res = _ckpt_resume(leg)
    checks = {c["name"]: c["status"] for c in res["checks"]}
    assert all(s in ("pass", "n/a") for s in checks.values()), checks
    assert checks["optimizer state"] == checks["learning rate"] == checks["run rebuilt"] == "pass", checks
    later = [h["lr"] for h in made["extra"]["history"] if h["step"] > 3]
    assert [r["lr"] for r in res["records"]] == [[lr, lr] for (lr,) in later]
    r = _convert(tmp_path / "nothing", cfg, "--drop-norm-decay")
    assert r.returncode == 2 and "nothing to drop" in r.stderr and not (tmp_path / "nothing").exists(), r.stderr


@NEEDS_MEGATRON
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="the real torchtitan is not installed")
def test_a_torchtitan_run_with_separate_wq_wk_wv_moves_onto_megatron(tmp_path):
    """torchtitan's llama3 with `fuse_qkv=False` (made here by the real Trainer, not bundled): wq / wk / wv are
    parameters of their own, each with its own Adam state (the fused sample keeps one wqkv state). Converted with
    --lr-scheduler: verified, each linear_qkv built from the three weights and from the three states; Megatron's own
    forward of the output equals transformers' Llama on the same bf16 weights, transformers' Llama on the fp32 master
    equals torchtitan's own forward (both to float32 rounding); Megatron resumes the legacy rank files of it with
    every check passing (the closed-form AdamW check of every update from the carried state included) at
    torchtitan's own LRs for steps 4 and 5."""
    from ckpt_tools.samples import run_torchrun

    run_torchrun(
        "ckpt_tools.samples.workers.torchtitan_run",
        2,  # raises with the log's tail if it fails
        ["--sample", "torchtitan_split", "--out", str(tmp_path / "made")],
        timeout=600,
    )
    src = tmp_path / "made" / "torchtitan_split" / "step-3"
    made = json.loads((tmp_path / "made" / "torchtitan_split.manifest.json").read_text())
    assert made["extra"]["config"]["model"]["fuse_qkv"] is False
    opt = [k for k in ckpt_tools.open_checkpoint(src).get("optimizer.state").children if ".attention." in k]
    assert sorted(k.rsplit(".", 2)[-2] for k in opt) == sorted(["wq", "wk", "wv", "wo"] * 2), opt
    cfg = _titan_hf_config(tmp_path / "cfg")
    out = tmp_path / "out"
    r = _convert(out, cfg, "--seq-length", "32", "--lr-scheduler", SCHEDULE, src=src)
    assert r.returncode == 0 and json.loads(r.stdout)["verified"] is True, r.stderr
    _megatron_and_titan_logits(out, src, tmp_path)
    leg = tmp_path / "legacy"
    assert run_cli("convert", out, leg, "--to", "megatron", "--ckpt-format", "torch").returncode == 0
    res = _ckpt_resume(leg)
    checks = {c["name"]: c["status"] for c in res["checks"]}
    assert all(s in ("pass", "n/a") for s in checks.values()), checks
    assert checks["optimizer state"] == checks["learning rate"] == "pass", checks
    later = [h["lr"] for h in made["extra"]["history"] if h["step"] > 3]
    assert [r["lr"] for r in res["records"]] == [[rest, norms] for norms, rest in later]
