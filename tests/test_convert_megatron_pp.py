"""`ckpt convert RUN OUT --to megatron --ckpt-format torch --pp N`: a Megatron-LM torch_dist run written as legacy
rank files at another pipeline-parallel size. The references are Megatron's own saves of the same runs: the PP 2
legacy save (`megatron_pp2_legacy`, the run `megatron_pp2_torch_dist` saved the other way) holds every tensor the
PP 1 output must hold, stage by stage; the TP 2 legacy save holds the shards the TP 2 x PP 2 output cuts into
stages. Where a Megatron-LM checkout is named (MEGATRON_LM_DIR), Megatron loads the PP 1 output and continues the
run, and its own conversion at PP 1 writes the same rank file."""

from __future__ import annotations

import importlib.util

import pytest

from ckpt_tools.read import pickle_reader as pr

from conftest import run_cli, sample
from test_convert_to_megatron import (
    ITER,
    MEGATRON,
    _ckpt_resume,
    _dcp,
    _global,
    _inert,
    _rank_files,
    _to_legacy,
    same_as_megatrons_own_legacy_conversion,
    same_rank_files,
)


def _layer(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[2]) if key.startswith("decoder.layers.") else None


def _renumbered(key: str, shift: int) -> str:
    parts = key.split(".")
    return ".".join(parts[:2] + [str(int(parts[2]) + shift)] + parts[3:])


def test_pp2_to_pp1_joins_the_stages_of_megatrons_own_pp2_save(tmp_path):
    """PP 2 -> 1: one rank file whose model is stage 0's embedding and layers, then stage 1's layers numbered
    on after stage 0's, its final norm and extra states, each tensor bit-equal to Megatron's PP 2 legacy save of the
    same run; no tied output-layer copy (at PP 1 Megatron shares the word embeddings); the optimizer holds every
    parameter once, with its Adam state and fp32 master equal to the stage file's; args say PP 1, world size 1."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "pp1"
    doc = _to_legacy("megatron_pp2_torch_dist", out, "--pp", "1")
    assert doc["verified"] is True and (doc["tp"], doc["pp"]) == (1, 1)
    assert any(x.startswith("RNG at another TP x PP") for x in doc["not_moved"])
    assert _rank_files(out) == ["iter_0000010/mp_rank_00/model_optim_rng.pt", "latest_checkpointed_iteration.txt"]
    a = pr.load(out / ITER / "mp_rank_00/model_optim_rng.pt").obj
    ref = sample("megatron_lm", "megatron_pp2_legacy") / ITER
    s0, s1 = (pr.load(ref / f"mp_rank_00_00{p}/model_optim_rng.pt").obj for p in (0, 1))
    per = 1 + max(_layer(k) for k in s0["model"] if _layer(k) is not None)
    want = [(k, s0, k) for k in s0["model"]]
    want += [
        (_renumbered(k, per) if _layer(k) is not None else k, s1, k) for k in s1["model"] if k != "output_layer.weight"
    ]  # the last stage's copy of the tied word embeddings
    assert list(a["model"]) == [k for k, _, _ in want]
    for k, stage, src in want:
        v, w = a["model"][k], stage["model"][src]
        assert (v is None and w is None) or torch.equal(v.read_torch(), w.read_torch()), k
    args = a["args"].state
    assert (args["pipeline_model_parallel_size"], args["tensor_model_parallel_size"], args["world_size"]) == (1, 1, 1)
    # the optimizer: stage 0's parameters, then stage 1's (but its tied copy), per param group
    names = [k for k, v in a["model"].items() if v is not None]
    state = a["optimizer"]["optimizer"]["state"]
    assert len(state) == len(names) == sum(len(g["params"]) for g in a["optimizer"]["optimizer"]["param_groups"])

    def states(f: dict) -> list:
        """(exp_avg, exp_avg_sq, fp32 master) of each parameter of a rank file, in its param groups' order."""
        opt = f["optimizer"]
        out = []
        for g, masters in zip(opt["optimizer"]["param_groups"], opt["fp32_from_fp16_params"]):
            out += [
                (opt["optimizer"]["state"][i]["exp_avg"], opt["optimizer"]["state"][i]["exp_avg_sq"], m)
                for i, m in zip(g["params"], masters)
            ]
        return out

    mine = states(a)
    theirs = states(s0) + states(s1)
    assert len(theirs) == len(mine) + 1  # stage 1's tied copy is the one parameter more
    for m in mine:
        match = [
            t
            for t in theirs
            if all(x.shape == y.shape and torch.equal(x.read_torch(), y.read_torch()) for x, y in zip(m, t))
        ]
        assert match, "an optimizer entry with no equal entry in Megatron's stage files"
    assert _inert(a["opt_param_scheduler"]) == _inert(s0["opt_param_scheduler"])


def test_pp1_to_pp2_cuts_megatrons_tp2_save_into_stages_and_round_trips(tmp_path):
    """TP 2 x PP 1 -> TP 2 x PP 2: four rank files mp_rank_TT_PPP; stage 0 holds the embedding and layer 0, stage 1
    layer 1 (numbered 0), the final norm and the tied output layer, which is the word embeddings' TP shard with
    its Adam state; every tensor bit-equal to Megatron's TP 2 legacy save. Converted back to torch_dist, the output
    holds every tensor of the source torch_dist run bit for bit."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "pp2"
    doc = _to_legacy("megatron_tp2_torch_dist", out, "--pp", "2")
    assert doc["verified"] is True and (doc["tp"], doc["pp"]) == (2, 2)
    assert sorted(p.name for p in (out / ITER).iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    ref = sample("megatron_lm", "megatron_tp2_legacy") / ITER
    for t in (0, 1):
        whole = pr.load(ref / f"mp_rank_0{t}/model_optim_rng.pt").obj["model"]
        s0, s1 = (pr.load(out / ITER / f"mp_rank_0{t}_00{p}/model_optim_rng.pt").obj for p in (0, 1))
        assert s1["args"].state["pipeline_model_parallel_size"] == 2 and s1["args"].state["world_size"] == 4
        assert not any(_layer(k) not in (None, 0) for k in [*s0["model"], *s1["model"]])
        for k, v in s0["model"].items():
            assert (v is None and whole[k] is None) or torch.equal(v.read_torch(), whole[k].read_torch()), k
        for k, v in s1["model"].items():
            src = _renumbered(k, 1) if _layer(k) is not None else k
            if k == "output_layer.weight":
                src = "embedding.word_embeddings.weight"
            assert (v is None and whole[src] is None) or torch.equal(v.read_torch(), whole[src].read_torch()), k
        assert "output_layer.weight" in s1["model"] and "embedding.word_embeddings.weight" in s0["model"]
    # back to torch_dist: the source run's tensors, all of them
    back = tmp_path / "back"
    proc = run_cli("convert", out, back, "--to", "megatron", "--json")
    assert proc.returncode == 0, proc.stderr
    (_, kb), (_, ks) = _dcp(back), _dcp(sample("megatron_lm", "megatron_tp2_torch_dist"))
    tensors = sorted(k for k, v in ks.items() if v != "bytes")
    assert sorted(k for k, v in kb.items() if v != "bytes") == tensors and len(tensors) > 40
    src = sample("megatron_lm", "megatron_tp2_torch_dist")
    unequal = [
        k for k in tensors if kb[k] != ks[k] or not torch.equal(_global(back, k, kb[k][0]), _global(src, k, ks[k][0]))
    ]
    assert unequal == []


@pytest.mark.parametrize(
    "run,size",
    [
        ("megatron_tp2", ("--tp", "1")),
        ("megatron_pp2", ("--pp", "1")),
        ("megatron_tp2_llama", ("--tp", "1")),
        ("megatron_pp2_vpp2", ("--tp", "2")),
        ("megatron_tp2", ("--tp", "1", "--pp", "2")),
    ],
)
def test_legacy_to_legacy_at_another_size_in_one_step(tmp_path, run, size):
    """Legacy rank files at another TP / PP straight from legacy rank files (no torch_dist in between): the same
    rank folders and files, bit for bit, as writing the torch_dist save of the same run at that size (the route
    the tests above hold against Megatron's own saves and resumes), the args but for the two runs' own save folders;
    verified by the logical diff. The plan says where it read from."""
    pytest.importorskip("torch")
    ours, via_dist = tmp_path / "ours", tmp_path / "via_dist"
    doc = _to_legacy(f"{run}_legacy", ours, *size)
    assert doc["verified"] is True and any("read from the legacy rank files" in n for n in doc["notes"])
    _to_legacy(f"{run}_torch_dist", via_dist, *size)
    same_rank_files(ours, via_dist)


def test_pp_refusals_are_one_line_and_write_nothing(tmp_path):
    """A PP size that does not divide the layers, another PP for a virtual-pipeline run, --pp for the torch_dist
    target: exit 2, one line, nothing written."""
    out = tmp_path / "out"
    cases = [
        ("megatron_pp2_torch_dist", ("--ckpt-format", "torch", "--pp", "3"), "--pp 3 does not divide num_layers=2"),
        ("megatron_pp2_vpp2_torch_dist", ("--ckpt-format", "torch", "--pp", "1"), "virtual pipeline (VPP 2)"),
        ("megatron_pp2_legacy", ("--pp", "1"), "--pp applies to --to megatron --ckpt-format torch"),
    ]
    for name, extra, words in cases:
        proc = run_cli("convert", sample("megatron_lm", name), out, "--to", "megatron", *extra)
        assert proc.returncode == 2 and words in proc.stderr, (name, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not list(tmp_path.iterdir())


@pytest.mark.skipif(
    not MEGATRON or importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core 0.16.1 and MEGATRON_LM_DIR (a Megatron-LM core_v0.16.1 checkout)",
)
def test_megatron_resumes_the_pp1_conversion_and_writes_the_same_rank_file(tmp_path):
    """The PP 2 torch_dist sample written as one PP 1 rank file, resumed by Megatron-LM's own pretrain (`ckpt
    resume`, one gloo process): every check passes, the closed-form AdamW check included, iteration and Adam step
    continue from 10, and LRs and losses equal bit for bit those of resuming the torch_dist sample at --pp 1
    (Megatron reshards it at load). Megatron's own conversion of the sample at PP 1 (`--ckpt-convert-format torch`)
    holds the same model, Adam state, fp32 master, param groups and scheduler."""
    pytest.importorskip("torch")
    dist = sample("megatron_lm", "megatron_pp2_torch_dist")
    pp1 = tmp_path / "pp1"
    _to_legacy("megatron_pp2_torch_dist", pp1, "--pp", "1")
    runs = {"pp1": _ckpt_resume(pp1, "--nproc", "1"), "dist_pp1": _ckpt_resume(dist, "--pp", "1", "--nproc", "1")}
    for key, res in runs.items():
        checks = {c["name"]: c["status"] for c in res["checks"]}
        assert all(s in ("pass", "n/a") for s in checks.values()), (key, checks)
        assert [r["step"] for r in res["records"]] == [r["optimizer_step"] for r in res["records"]] == [11, 12]
    assert {c["name"]: c["status"] for c in runs["pp1"]["checks"]}["optimizer state"] == "pass"
    assert [(r["lr"], r["loss"]) for r in runs["pp1"]["records"]] == [
        (r["lr"], r["loss"]) for r in runs["dist_pp1"]["records"]
    ]
    same_as_megatrons_own_legacy_conversion(dist, pp1, tmp_path / "megatron_ref", "--pp", "1")


def test_a_source_without_rng_is_said_to_have_none(tmp_path):
    """A torch_dist run that saved no RNG state (the pipeline's conversion into Megatron: args.no_save_rng): the plan
    to legacy rank files lists the RNG as not moved, with the relaunch flag, instead of "as saved"."""
    import json

    dist = tmp_path / "dist"
    proc = run_cli("convert", sample("megatron", "gpt_tp2_pp2"), dist, "--to", "megatron")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(
        "convert", dist, tmp_path / "leg", "--to", "megatron", "--ckpt-format", "torch", "--dry-run", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [x for x in doc["not_moved"] if x.startswith("RNG")] == [
        "RNG: the source saved none (no rng_state items): the rank files hold no rng_state; relaunch with --no-load-rng"
    ]
    assert not [x for x in doc["notes"] if x.startswith("RNG")] and not (tmp_path / "leg").exists()
