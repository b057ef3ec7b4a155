"""`ckpt inspect` as a user runs it: the JSON contract, --grep with values, warnings, exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, manifest, run_cli, sample


def ckpt(*args, check=True):
    proc = run_cli(*args)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr}")
    return proc


def test_json_contract_on_zero2():
    m = manifest("deepspeed", "zero2_bf16")
    doc = json.loads(ckpt("inspect", sample("deepspeed", "zero2_bf16"), "--json").stdout)
    assert set(doc) >= {"format", "path", "topology", "parameters", "counters", "lr", "warnings", "tree"}
    assert doc["format"] == "deepspeed_zero"
    assert doc["topology"] == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2}
    assert doc["parameters"] == {"count": m["parameters"]["count"], "tensors": m["parameters"]["tensors"]}
    assert doc["counters"] == m["counters"]
    assert doc["lr"]["param_groups"] == pytest.approx(m["lr"]["param_groups"])
    assert doc["lr"]["base_lrs"] is None and doc["lr"]["last_lr"] is None
    # optimizer state per parameter name, un-flattened from the ZeRO partitions
    entry = doc["tree"]["optimizer"]["state"]["blocks.0.mlp_proj.weight"]
    assert entry["exp_avg"]["shape"] == [32, 128] and entry["fp32"]["dtype"] == "float32"
    assert entry["step"] == m["counters"]["optimizer_step"]


def test_grep_shows_step_values():
    out = ckpt("inspect", sample("deepspeed", "zero2_lambdalr"), "--grep", "step|epoch").stdout
    assert "global_steps: 4" in out
    assert "_step_count: 5" in out and "last_epoch: 4" in out
    assert "exp_avg" not in out


def test_grep_json_scheduler_values():
    doc = json.loads(ckpt("inspect", sample("deepspeed", "zero2_lambdalr"), "--grep", "^scheduler", "--json").stdout)
    m = manifest("deepspeed", "zero2_lambdalr")
    assert doc["tree"]["scheduler"]["base_lrs"] == pytest.approx(m["lr"]["base_lrs"])
    assert doc["tree"]["scheduler"]["_last_lr"] == pytest.approx(m["lr"]["last_lr"])
    assert list(doc["tree"]) == ["scheduler"]


def test_rank_filter_shows_pieces_of_that_rank():
    doc = json.loads(
        ckpt(
            "inspect",
            sample("deepspeed", "zero2_bf16"),
            "--rank",
            "1",
            "--grep",
            r"optimizer\.state\.blocks\.0\.mlp_proj\.weight\.fp32",
            "--json",
        ).stdout
    )
    t = doc["tree"]["optimizer"]["state"]["blocks.0.mlp_proj.weight"]["fp32"]
    assert [p["rank"]["dp"] for p in t["pieces"]] == [1]
    # the piece on rank 1 starts where rank 0's piece ends inside the parameter
    assert t["pieces"][0]["dst_offset"] > 0 and t["pieces"][0]["offset"] == 0


def test_stats_reads_values(tmp_path):
    doc = json.loads(ckpt("inspect", sample("torch", "plain.pt"), "--stats", "--grep", "ln_f.weight", "--json").stdout)
    import torch

    sd = torch.load(sample("torch", "plain.pt"), weights_only=False)["model"]
    row = next(s for s in doc["stats"] if s["path"] == "model.ln_f.weight")
    assert row["max"] == pytest.approx(float(sd["ln_f.weight"].max()))
    assert row["mean"] == pytest.approx(float(sd["ln_f.weight"].double().mean()))
    assert row["nan"] == 0


def test_stats_flags_nan(tmp_path):
    import torch

    f = tmp_path / "nan.pt"
    torch.save({"model": {"w": torch.tensor([1.0, float("nan"), float("inf")])}}, f)
    doc = json.loads(ckpt("inspect", f, "--stats", "--json").stdout)
    assert any(w["code"] == "non-finite" for w in doc["warnings"])


def test_stray_files_are_warned(copy_sample):
    p = copy_sample("accelerate", "accelerate_ddp")
    shutil.copy(p / "custom_checkpoint_0.pkl", p / "custom_checkpoint_0.pkl.orig")
    shutil.copy(p / "optimizer.bin", p / "optimizer.bin.bak")
    doc = json.loads(ckpt("inspect", p, "--json").stdout)
    stray = sorted(w["path"] for w in doc["warnings"] if w["code"] == "stray-file")
    assert stray == ["custom_checkpoint_0.pkl.orig", "optimizer.bin.bak"]


def test_missing_dp_rank_file_exits_2(copy_sample):
    p = copy_sample("deepspeed", "zero2_bf16")
    victim = p / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    proc = ckpt("inspect", p, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and victim.name in lines[0] and "Traceback" not in proc.stderr


def test_extra_rank_file_is_a_warning(copy_sample):
    p = copy_sample("deepspeed", "zero2_bf16")
    tag = p / "global_step4"
    shutil.copy(
        tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    )
    doc = json.loads(ckpt("inspect", p, "--json").stdout)
    assert [w["code"] for w in doc["warnings"]] == ["extra-rank-file"]


def test_latest_naming_a_missing_tag_exits_2(copy_sample):
    p = copy_sample("deepspeed", "zero2_bf16")
    (p / "latest").write_text("global_step999")
    proc = ckpt("inspect", p, check=False)
    assert proc.returncode == 2 and "global_step999" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_truncated_file_exits_2(copy_sample):
    p = copy_sample("deepspeed", "zero2_bf16")
    f = p / "global_step4" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:5000])
    proc = ckpt("inspect", p, check=False)
    assert proc.returncode == 2 and f.name in proc.stderr and "Traceback" not in proc.stderr


def test_not_a_checkpoint_exits_2(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    for target in (tmp_path, tmp_path / "notes.txt", tmp_path / "nope"):
        proc = ckpt("inspect", target, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_step_counter_disagreement_is_warned(tmp_path):
    import torch

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"][1]["step"] = torch.tensor(0.0)  # the "Adam step reset on resume" story, for one param
    torch.save({"model": model.state_dict(), "optimizer": sd, "step": 1}, tmp_path / "c.pt")
    doc = json.loads(ckpt("inspect", tmp_path / "c.pt", "--json").stdout)
    assert "step-mismatch" in [w["code"] for w in doc["warnings"]]


def test_inspect_executes_nothing_from_a_hostile_pickle(copy_sample, tmp_path):
    """A DeepSpeed model-states file with an os.system payload: inspect shows it by name, runs nothing."""
    import torch

    p = copy_sample("deepspeed", "zero2_bf16")
    f = p / "global_step4" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    sd["client_payload"] = Payload()
    torch.save(sd, f)
    doc = json.loads(ckpt("inspect", p, "--json").stdout)
    assert not marker.exists()
    unknown = [w for w in doc["warnings"] if w["code"] == "unknown-global"]
    assert unknown and "system" in unknown[0]["message"]
    assert doc["parameters"]["count"] == manifest("deepspeed", "zero2_bf16")["parameters"]["count"]


def test_inspect_does_not_import_torch_or_deepspeed():
    code = (
        "import sys; from ckpt_cli.main import main\n"
        "try:\n main(['inspect', sys.argv[1], '--json'])\nexcept SystemExit:\n pass\n"
        "bad = [m for m in ('torch', 'deepspeed', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    for p in (
        sample("deepspeed", "zero2_bf16"),
        sample("deepspeed", "zero3_bf16"),
        sample("torch", "plain.pt"),
        sample("accelerate", "accelerate_ddp"),
        sample("safetensors", "sharded"),
        sample("fsdp", "fsdp2_dcp"),
        sample("fsdp", "fsdp1_sharded"),
        sample("megatron", "gpt_tp2_pp2"),
        sample("universal", "zero2_bf16_universal"),
    ):
        subprocess.run([sys.executable, "-c", code, str(p)], check=True, capture_output=True)


def _run_both(cli_main, argv, capsys):
    """(fast path output, typer output, typer's return code) of one command line."""
    assert cli_main._fast_parse(argv) is not None, argv
    try:
        cli_main.main(argv)
    except SystemExit:
        pass
    fast = capsys.readouterr().out
    rc = cli_main.app(args=argv, standalone_mode=False)
    return fast, capsys.readouterr().out, rc


def test_fast_argument_path_matches_typer(capsys):
    """Every command parses plain invocations without typer's pydantic layer for speed (argparse built from the
    same typer declarations); the results must not differ, and anything unusual goes to typer."""
    from ckpt_cli import main as cli_main

    p = str(sample("deepspeed", "zero2_lambdalr"))
    drifted = str(sample("megatron", "gpt_tp2_pp2_drifted"))
    for argv in (
        ["inspect", p, "--json"],
        ["inspect", p, "--json", "--grep", "step|lr", "-d", "3"],
        ["inspect", p, "--json", "--rank", "dp=1", "-q"],
        ["check-tp-sync", drifted, "--json"],
        [
            "check-tp-sync",
            drifted,
            "--json",
            "--atol",
            "1e-3",
            "--rtol",
            "0.5",
            "--pattern",
            "input_layernorm",
            "--pattern",
            "dense.bias",
        ],
        ["diff", p, str(sample("deepspeed", "zero2_bf16")), "--json"],
        ["set-lr", p, "--scale", "0.5", "--dry-run", "--json"],
    ):
        fast, slow, _ = _run_both(cli_main, argv, capsys)
        assert json.loads(fast) == json.loads(slow), argv
    assert cli_main._fast_parse(["inspect", p, "--help"]) is None
    assert cli_main._fast_parse(["inspect", p, "--bogus"]) is None
    assert cli_main._fast_parse(["inspect"]) is None
    assert cli_main._fast_parse(["check-tp-sync", drifted, "--atol", "-1"]) is None  # typer says what min is
    assert cli_main._fast_parse(["check-tp-sync", drifted, "--atol", "x"]) is None
    assert cli_main._fast_parse(["--version"]) is None


def test_reader_closing_the_pipe_is_quiet(tmp_path):
    """`ckpt inspect X | head -1` once the reader has gone: the process ends quietly (no BrokenPipeError
    traceback) with the status a SIGPIPE'd C tool has (141). The pipe's read end is closed before ckpt
    starts, so the broken pipe is certain (a real reader's timing is not)."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "from ckpt_cli.main import main; main()",
                "inspect",
                str(sample("deepspeed", "zero2_bf16")),
            ],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_depth_cuts_the_tree_and_says_how_much_is_below():
    """`--depth 1`: the top-level sections only, each saying how many entries it hides; `--depth 2` shows one
    level more. (The whole Accelerate tree is over 100 lines; its RNG states' 625 numbers take one line each
    state since they are summarised: tests/test_cli_ux.py.)"""
    path = sample("accelerate", "accelerate_ddp")
    full = run_cli("inspect", path)
    one = run_cli("inspect", path, "--depth", "1")
    two = run_cli("inspect", path, "-d", "2")
    assert full.returncode == one.returncode == two.returncode == 0
    tree1 = one.stdout.split("\ntree\n", 1)[1].splitlines()
    assert tree1 == [
        "├── model  …: 29 entries below --depth 1",
        "├── optimizer  …: 2 entries below --depth 1",
        "├── scheduler  …: 7 entries below --depth 1",
        "├── rng  …: 2 entries below --depth 1",
        "└── client_state  …: 1 entry below --depth 1",
    ]
    assert len(one.stdout.splitlines()) < len(two.stdout.splitlines()) < 100 < len(full.stdout.splitlines())
    assert "blocks.0.ln_1.weight" in two.stdout and "state  …: 29 entries below --depth 2" in two.stdout
    doc = json.loads(run_cli("inspect", path, "--depth", "1", "--json").stdout)
    assert doc["tree"]["model"] == {"…": "29 entries below --depth 1"}


def test_numbered_layers_read_as_one_line_and_full_lists_them():
    """A pipeline checkpoint's layers 2..5 (the same shapes and TP rules) read as one line each per parameter,
    `{2..5}.input_layernorm.weight: ...  ×4`; `--full` lists every layer; --json always lists every tensor."""
    path = sample("megatron", "gpt_tp2_pp2_drifted")
    short = ckpt("inspect", path).stdout
    assert "├── {2..5}.input_layernorm.weight: bfloat16 [16] (2 TP shards, replicated)  ×4" in short
    assert "3.input_layernorm.weight" not in short
    full = ckpt("inspect", path, "--full").stdout
    for layer in range(2, 6):
        assert f"── {layer}.input_layernorm.weight: bfloat16 [16]" in full
    assert "{2..5}" not in full and len(full.splitlines()) > len(short.splitlines())
    doc = json.loads(ckpt("inspect", path, "--json").stdout)
    assert {f"{k}.input_layernorm.weight" for k in range(2, 6)} <= set(doc["tree"]["model"])


def test_collapse_keeps_odd_layers_and_order():
    """Layers that read differently stay their own line (an odd layer stands out); fewer than three alike and
    patterns whose numbers do not form a full grid are not collapsed; order is first appearance."""
    from ckpt_cli.output import collapse_numbered

    names = ["emb", "l.0.w", "l.0.b", "l.1.w", "l.1.b", "l.2.w", "l.2.b", "l.3.w", "l.3.b", "x.0.e.0", "x.1.e.1"]
    texts = ["A", "W", "B", "W", "B", "W2", "B", "W", "B", "E", "E"]
    rows = collapse_numbered(names, texts)
    assert [(label, n) for label, _, n in rows] == [
        ("emb", [0]),
        ("l.{0,1,3}.w", [1, 3, 7]),
        ("l.{0..3}.b", [2, 4, 6, 8]),
        ("l.2.w", [5]),
        ("x.0.e.0", [9]),
        ("x.1.e.1", [10]),
    ]


def test_collapsed_lines_say_what_each_member_says():
    """Numbered siblings collapse only when their lines would read the same: a tensor held in 2 pieces and one in
    3 ("(N pieces)") stay apart (the members are a real ZeRO-2 sample's nodes, their piece tuples varied)."""
    import dataclasses

    import ckpt_tools
    from ckpt_cli import output
    from ckpt_tools.read.tree import GroupNode

    ck = ckpt_tools.open_checkpoint(sample("deepspeed", "zero2_bf16"))
    node = ck.optimizer.children["state"].children["wte.weight"].children["fp32"]
    piece = node.pieces[0]
    kids = {f"l.{i}.w": dataclasses.replace(node, pieces=(piece,) * n) for i, n in enumerate((2, 2, 2, 3, 3, 3))}
    text = "\n".join(output.tree_lines(GroupNode(kids), "t"))
    assert "l.{0..2}.w: float32 [64×32] (2 pieces)  ×3" in text, text
    assert "l.{3..5}.w: float32 [64×32] (3 pieces)  ×3" in text, text
    assert output._fmt_runs({str(i): i % 2 for i in range(12)}) == "0,2,4,6,8,10 → 0, 1,3,5,7,9,11 → 1"
