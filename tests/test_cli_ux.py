"""The command line as a person meets it (issue 13): a wrong path gets the right one back, option mistakes are
one-line errors, output fits a terminal and reads short, unknowns are null, and the core install runs
without torch or deepspeed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLES, run_cli, run_on_terminal, sample


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single `ckpt: error:` line of an exit-2 run (progress-bar redraws aside), and no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in re.split(r"[\r\n]+", proc.stderr) if ln.strip() and "|" not in ln]
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), lines
    return lines[0]


def run_tty(*args, columns: int = 80) -> str:
    """`ckpt ARGS` with stdout on a terminal `columns` wide (a pseudo-terminal), as a person runs it; the
    text it printed (no colour: NO_COLOR)."""
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    code, out, err = run_on_terminal(*args, columns=columns, env=env, timeout=120)
    assert code == 0, err
    return out.replace("\r\n", "\n")


# --- pointing at the wrong path ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group,name,part",
    [
        ("deepspeed", "zero2_bf16", "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("dcp", "torchtitan_real/step-3", "__0_0.distcp"),
        ("safetensors", "sharded", "model-00001-of-00002.safetensors"),
    ],
)
def test_a_file_inside_a_checkpoint_names_the_folder_to_open(group, name, part):
    folder = sample(group, name)
    proc = run_cli("inspect", folder / part, "-q")
    assert proc.returncode == 0, proc.stderr
    assert "part-of-checkpoint" in proc.stdout and f"ckpt inspect {folder}" in proc.stdout
    doc = json.loads(run_cli("inspect", folder / part, "--json").stdout)
    assert doc["path"] == str(folder / part)  # the file's own view ...
    hint = [w for w in doc["warnings"] if w["code"] == "part-of-checkpoint"]
    assert [w["path"] for w in hint] == [str(folder)]  # ... and the folder that opens the whole checkpoint
    whole = json.loads(run_cli("inspect", hint[0]["path"], "--json").stdout)
    assert any(f["path"].endswith(part) for f in whole["files"])


def test_a_standalone_file_gets_no_part_of_hint():
    for p in (
        sample("torch", "plain.pt"),
        sample("safetensors", "model.safetensors"),
        sample("lightning", "onecycle.ckpt"),
    ):
        doc = json.loads(run_cli("inspect", p, "--json").stdout)
        assert "part-of-checkpoint" not in [w["code"] for w in doc["warnings"]], p


def test_a_folder_of_checkpoints_lists_them_newest_first(copy_sample, tmp_path):
    """`ckpt inspect` of the folder a run saves its checkpoints in: exit 2 (it is not one checkpoint, so a
    script asking for its counters must not get a listing instead), the list on stdout (format, step, size,
    newest first) and one error line naming the newest to open."""
    old, new = copy_sample("deepspeed", "zero2_bf16"), copy_sample("deepspeed", "zero2_lambdalr")
    for ck, when in ((old, 1_700_000_000), (new, 1_800_000_000)):
        for p in [ck, *ck.rglob("*")]:
            os.utime(p, (when, when))
    runs = old.parent
    proc = run_cli("inspect", runs)
    err = one_error_line(proc)
    assert str(runs) in err and f"ckpt inspect {new}" in err
    listing = proc.stdout.splitlines()
    assert listing[0] == f"{runs}: 2 checkpoints, newest first"
    assert listing[1].split()[:4] == ["zero2_lambdalr", "deepspeed_zero", "step", "4"]
    assert listing[2].split()[:4] == ["zero2_bf16", "deepspeed_zero", "step", "4"]
    proc = run_cli("inspect", runs, "--json")
    one_error_line(proc)
    rows = json.loads(proc.stdout)["checkpoints"]
    assert [Path(r["path"]).name for r in rows] == ["zero2_lambdalr", "zero2_bf16"]
    assert [r["bytes"] for r in rows] == [sum(f.stat().st_size for f in ck.rglob("*.pt")) for ck in (new, old)]
    assert all(r["format"] == "deepspeed_zero" and r["step"] == 4 and r["error"] is None for r in rows)


def test_the_samples_parent_and_an_hf_output_dir():
    proc = run_cli("inspect", SAMPLES / "deepspeed")
    one_error_line(proc)
    names = {ln.split()[0] for ln in proc.stdout.splitlines()[1:]}
    assert names == {p.name for p in (SAMPLES / "deepspeed").iterdir() if p.is_dir()}
    # an HF Trainer output_dir stays what it was: its newest checkpoint-N, opened
    doc = json.loads(run_cli("inspect", sample("hf_trainer", "hf_trainer_ddp"), "--json").stdout)
    assert doc["format"] == "hf_trainer" and doc["counters"]["global_step"] == 4


def test_a_file_of_a_checkpoint_that_no_format_reads_names_the_checkpoint():
    err = one_error_line(run_cli("inspect", sample("deepspeed", "zero2_bf16") / "latest"))
    assert f"ckpt inspect {sample('deepspeed', 'zero2_bf16')}" in err


def test_rank_beyond_the_topology_is_a_one_line_error():
    z2 = sample("deepspeed", "zero2_bf16")
    err = one_error_line(run_cli("inspect", z2, "--rank", "5"))
    assert "--rank 5" in err and "dp=2" in err and str(z2) in err
    assert "tp=1" in one_error_line(run_cli("inspect", z2, "--rank", "tp=1"))
    assert run_cli("inspect", z2, "--rank", "1", "-q").returncode == 0


def test_negative_depth_is_a_one_line_error():
    assert "--depth -1" in one_error_line(run_cli("inspect", sample("deepspeed", "zero2_bf16"), "--depth", "-1"))


def test_shard_size_without_a_unit_is_a_one_line_error(tmp_path):
    z2 = sample("deepspeed", "zero2_bf16")
    args = ("export", z2, tmp_path / "w.safetensors", "--dry-run", "--max-shard-size")
    err = one_error_line(run_cli(*args, "5"))  # was: 5 bytes, 29 one-tensor files
    assert "--max-shard-size 5" in err and "5GB" in err
    assert run_cli(*args, "5GB").returncode == 0


def test_export_into_a_missing_folder_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no" / "such" / "folder"
    err = one_error_line(run_cli("export", sample("deepspeed", "zero2_bf16"), missing / "w.safetensors"))
    assert str(missing) in err and "mkdir" in err
    assert not (tmp_path / "no").exists()


def test_to_universal_into_its_own_source_is_a_one_line_error(copy_sample):
    src = copy_sample("deepspeed", "zero2_lambdalr")
    for out in (src / "inside", src / "global_step4" / "u", src):
        assert "inside the checkpoint" in one_error_line(run_cli("to-universal", src, out))
    assert sorted(p.name for p in src.iterdir()) == ["global_step4", "latest"]
    assert sorted(p.name for p in (src / "global_step4").iterdir()) == sorted(
        p.name for p in (sample("deepspeed", "zero2_lambdalr") / "global_step4").iterdir()
    )


def test_an_unknown_sample_name_is_a_one_line_error(tmp_path):
    err = one_error_line(run_cli("samples", "make", tmp_path / "s", "--only", "nosuch"))
    assert "nosuch" in err and "ckpt samples list" in err
    assert not (tmp_path / "s").exists()


# --- output people read ------------------------------------------------------------------------------------


def test_resume_bar_counts_only_steps_and_keeps_deepspeed_logs_out(tmp_path):
    """The bar's clock starts when the engine has loaded (conversion and start-up are not step time), and the
    line DeepSpeed logs while converting prints above the bar, not inside one of its redraws."""
    ref = tmp_path / "records.json"
    proc = run_cli(
        "resume",
        sample("deepspeed", "zero2_bf16"),
        "--steps",
        "2",
        "--universal",
        "--record-reference",
        ref,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed on 2 cpu processes" in proc.stdout
    step_s = max(r["seconds"] for r in json.loads(ref.read_text())["records"])
    redraws = re.split(r"[\r\n]", proc.stderr)
    final = [r for r in redraws if re.search(r"\b2/2 \[", r)][-1]
    m = re.search(r"([\d.]+)(s/step|step/s)", final)
    bar_s = float(m[1]) if m[2] == "s/step" else 1 / float(m[1])
    assert bar_s <= 3 * step_s + 1.0, (final, step_s)  # before: ~7 s/step, the engine's start-up
    logs = [r for r in redraws if re.search(r"\] \[(WARNING|INFO)\] \[", r)]
    assert logs, "expected DeepSpeed's accelerator line in this run"
    assert not [r for r in logs if "step/s" in r or "%|" in r], logs


def test_rng_states_are_summarised_unless_full():
    path = sample("accelerate", "accelerate_ddp")
    short, full = run_cli("inspect", path).stdout, run_cli("inspect", path, "--full").stdout
    assert len(short.splitlines()) < 250  # was 1,386: one line per RNG integer
    assert "int [625] = [2147483648, 2321821501, 3718478819, … 622 more]" in short
    values = re.search(r"int \[625\] = \[([^\]]*)\]", full)[1].split(", ")
    assert len(values) == 625 and all(v.isdigit() for v in values)
    doc = json.loads(run_cli("inspect", path, "--json", "--grep", "random_state").stdout)
    state = doc["tree"]["rng"]["random_states_0"]["random_state"]
    assert state["0"] == 3 and len(state["1"]) == 625 and all(isinstance(x, int) for x in state["1"])


@pytest.mark.parametrize(
    "group,name",
    [
        ("accelerate", "accelerate_ddp"),
        ("deepspeed", "zero2_lambdalr"),
        ("hf_trainer", "hf_trainer_zero2"),
        ("megatron", "gpt_tp2_pp2"),
    ],
)
def test_inspect_fits_an_80_column_terminal_without_breaking_words(group, name):
    path = sample(group, name).relative_to(ROOT)
    tty = run_tty("inspect", path)
    lines = tty.splitlines()
    assert max(len(ln) for ln in lines) <= 80, [ln for ln in lines if len(ln) > 80][:3]
    # the same words as the unwrapped output a pipe gets: nothing broken inside a word, nothing lost
    box = re.compile(r"^[│├└─]+$")
    words = lambda text: [w for w in text.split() if not box.match(w)]  # noqa: E731
    assert words(tty) == words(run_cli("inspect", path).stdout)


def test_help_fits_80_columns_and_names_arguments_plainly():
    from ckpt_cli.main import app

    commands = [[c.name] for c in app.registered_commands] + [["samples", "make"], ["samples", "list"]]
    for argv in [[], *commands]:
        text = run_tty(*argv, "-h")
        assert max(len(ln) for ln in text.splitlines()) <= 80, argv
        assert not re.search(r"\{[a-z_]+\}|<(str|int|float|path|bool|list\[[^>]*\])>", text), (argv, text)
    # (the program name is `ckpt` from the console script, `-c` in these `python -c` runs)
    assert re.search(r"^Usage: \S+ inspect \[OPTIONS\] PATH\n", run_tty("inspect", "--help"))
    assert re.search(r"^Usage: \S+ to-universal \[OPTIONS\] PATH OUT\n", run_tty("to-universal", "--help"))
    listing = run_tty("--help")
    set_step = next(ln for ln in listing.splitlines() if ln.strip().startswith("set-step"))
    assert "(e.g. repair" in set_step and not set_step.rstrip().endswith("(e.g.")


def test_version_and_short_help():
    from ckpt_tools import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout == f"ckpt {__version__}\n"
    for argv in (["-h"], ["inspect", "-h"], ["samples", "make", "-h"]):
        proc = run_cli(*argv)
        assert proc.returncode == 0 and proc.stdout.startswith("Usage: "), argv


def test_counts_read_in_the_singular():
    out = run_cli("inspect", sample("torch", "plain.pt"), "-q").stdout
    assert re.search(r"^files +1 file \(1 read\), ", out, re.M) and "1 files" not in out


def test_numbers_in_plan_notes_print_short(copy_sample):
    ck = copy_sample("deepspeed", "zero2_warmuplr")
    out = run_cli("set-lr", ck, "--scale", "0.05", "--dry-run").stdout
    assert "0.00015000000000000001" not in out and "1.5000000000000002e-05" not in out
    assert '"warmup_max_lr": 0.00015' in out and '"warmup_min_lr": 1.5e-05' in out


def test_unknown_is_null_in_json_for_every_sample():
    paths = [p for p in sorted(SAMPLES.glob("*/*")) if not p.name.endswith(".manifest.json")]
    assert len(paths) >= 20
    for p in paths:
        full = (
            json.loads(p.with_name(p.name + ".manifest.json").read_text())["extra"].get("full_save")
            if p.with_name(p.name + ".manifest.json").is_file()
            else None
        )
        p = p / full if full else p  # a run folder of several saves (torchtitan's step-N): the full one
        doc = json.loads(run_cli("inspect", p, "--json", "-q").stdout)
        assert (
            {"dp", "tp", "pp", "zero_stage"} <= set(doc["topology"]) <= {"dp", "tp", "pp", "zero_stage", "ep", "vpp"}
        ), p
        assert all(
            v is None or (isinstance(v, int) and v >= 1) for k, v in doc["topology"].items() if k != "zero_stage"
        ), p
        for k in ("param_groups", "base_lrs", "last_lr"):
            assert doc["lr"][k] is None or (isinstance(doc["lr"][k], list) and doc["lr"][k]), (p, k)
    for p in (sample("safetensors", "model.safetensors"), sample("safetensors", "sharded")):
        assert json.loads(run_cli("inspect", p, "--json").stdout)["lr"]["param_groups"] is None


# --- a light install ---------------------------------------------------------------------------------------


def test_core_dependencies_are_light_and_extras_name_the_heavy_ones():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~\[; ]", req, 1)[0].lower()  # noqa: E731
    core = {name(r) for r in project["dependencies"]}
    assert not core & {"torch", "deepspeed", "accelerate", "transformers", "lightning"}, core
    extras = {k: {name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    assert {"torch", "deepspeed"} <= extras["convert"]
    assert {"torch", "deepspeed"} <= extras["train"] <= extras["all"]
    # [dev] holds every third-party package a test file imports
    imported = set()
    for f in (ROOT / "tests").rglob("*.py"):
        imported |= set(re.findall(r"^\s*(?:import|from) ([a-z_][a-z0-9_]*)", f.read_text(), re.M))
    third_party = imported - set(sys.stdlib_module_names) - {"ckpt_tools", "ckpt_cli", "conftest", "hostile", "bench"}
    third_party = {m for m in third_party if not (ROOT / "tests" / f"{m}.py").exists()}
    assert third_party <= extras["dev"] | core, third_party - extras["dev"] - core


#: runs `ckpt` with torch and deepspeed made unimportable, as in an install without the extras
NO_HEAVY = (
    "import sys; sys.modules['torch'] = None; sys.modules['deepspeed'] = None\nfrom ckpt_cli.main import main; main()"
)


def ckpt_without_heavy(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_HEAVY, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_core_commands_run_without_torch_and_the_rest_name_their_extra(copy_sample, tmp_path):
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    proc = ckpt_without_heavy("inspect", ck)
    assert proc.returncode == 0 and "deepspeed_zero" in proc.stdout, proc.stderr
    proc = ckpt_without_heavy("set-lr", ck, "--scale", "0.5", "--dry-run")
    assert proc.returncode == 0 and "dry run: nothing written" in proc.stdout, proc.stderr
    proc = ckpt_without_heavy("diff", sample("deepspeed", "zero2_lambdalr"), ck)
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr
    # check-tp-sync's report compares raw bf16/fp32 bytes with numpy: the drifted sample is found, exit 1
    proc = ckpt_without_heavy("check-tp-sync", sample("megatron", "gpt_tp2_pp2_drifted"))
    assert proc.returncode == 1 and "7 of 27 replicated parameters out of sync" in proc.stdout, proc.stderr
    # --stats reads tensor data in chunks with numpy (bf16 widened from its bit patterns): no torch either
    proc = ckpt_without_heavy("inspect", "--stats", "--json", ck)
    assert proc.returncode == 0 and json.loads(proc.stdout)["stats"], proc.stderr
    cases = [
        (("to-universal", ck, tmp_path / "u"), "needs torch: pip install 'ckpt-tools[convert]'"),
        (("export", ck, tmp_path / "w.safetensors"), "needs torch: pip install 'ckpt-tools[convert]'"),
        (("resume", ck, "--steps", "1"), "needs torch: pip install 'ckpt-tools[train]'"),
    ]
    for argv, want in cases:
        assert want in one_error_line(ckpt_without_heavy(*argv)), argv


def test_missing_model_states_names_the_file(copy_sample):
    p = copy_sample("deepspeed", "zero2_bf16")
    (p / "global_step4" / "mp_rank_00_model_states.pt").unlink()
    for target in (p, p / "global_step4"):
        proc = run_cli("inspect", target)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr
        assert "mp_rank_00_model_states.pt is missing" in lines[0] and str(p / "global_step4") in lines[0]
