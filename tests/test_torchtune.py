"""torchtune output folders written by torchtune 0.6.1's own recipes (`full_finetune_single_device`,
`lora_finetune_single_device`; `ckpt_tools.samples.workers.torchtune_run`): read as one checkpoint (epoch_N weights +
recipe_state), optimizer ids named, the step derived, set-lr telling that `initial_lr` drives the LR, proven by
resuming in the real recipe when torchtune is installed (it is not a dependency of ckpt: those tests skip).
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from conftest import manifest, run_cli, sample

NEEDS_TORCHTUNE = pytest.mark.skipif(
    importlib.util.find_spec("torchtune") is None,
    reason="the real torchtune is not installed (torchtune==0.6.1 and torchao==0.11.0, --no-deps: see "
    "ckpt_tools/samples/workers/torchtune_run.py)",
)


def _inspect(path):
    proc = run_cli("inspect", path, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_full_finetune_output_folder_is_one_checkpoint():
    """The output folder: epoch_0's weights with recipe_state (the final epoch_1 listed as a model-only save);
    the live model's count, the step (epochs_run x max_steps_per_epoch, equal to Adam's step), the LR; every
    optimizer id named by its parameter (torchtune's order mapped to the Hugging Face names it saved)."""
    m = manifest("torchtune", "torchtune_full")
    doc = _inspect(sample("torchtune", "torchtune_full"))
    assert doc["format"] == "torchtune"
    assert (doc["parameters"]["count"], doc["parameters"]["tensors"]) == (
        m["parameters"]["count"],
        m["parameters"]["tensors"],
    )
    assert doc["counters"]["global_step"] == m["counters"]["global_step"] == 3
    assert doc["counters"]["optimizer_step"] == m["counters"]["optimizer_step"]
    assert doc["lr"]["param_groups"] == pytest.approx(m["lr"]["param_groups"], rel=1e-12)
    assert doc["details"]["opened"] == m["extra"]["intermediate_save"]
    assert doc["details"]["model_only_saves"] == [m["extra"]["final_save"]]
    assert {w["code"] for w in doc["warnings"]} == set()
    from ckpt_tools import open_checkpoint

    opt = open_checkpoint(sample("torchtune", "torchtune_full")).tree.children["optimizer"]
    names = [m["extra"]["hf_names"][n] for n in m["extra"]["optimizer_param_names"]]  # id order, live
    group = opt.children["param_groups"].children["0"].children
    assert list(group["param_names"].value) == names
    assert sorted(opt.children["state"].children) == sorted(names)


def test_lora_output_folder_reads_the_adapter_and_names_its_optimizer_state(tmp_path):
    """LoRA: the adapter (PEFT names) with its torchtune-named copy adapter_model.pt, the optimizer's trainable ids
    named (the live recipe's trainable parameters, in their order), the frozen base's stateless ids said; the final
    epoch_1 is another save, not an unread part; set-lr works without --allow-unread."""
    from ckpt_tools import open_checkpoint
    from ckpt_tools.formats.torchtune import peft_name

    m = manifest("torchtune", "torchtune_lora")
    doc = _inspect(sample("torchtune", "torchtune_lora"))
    assert doc["format"] == "torchtune" and "adapter" in doc["details"]
    assert doc["parameters"]["tensors"] == 8 == len(m["extra"]["trainable_parameter_names"])
    assert doc["counters"]["global_step"] == m["counters"]["global_step"]
    assert {w["code"] for w in doc["warnings"]} == {"optimizer-state-missing"}  # the frozen base: no state
    state = open_checkpoint(sample("torchtune", "torchtune_lora")).tree.children["optimizer"].children["state"]
    assert list(state.children) == [peft_name(n) for n in m["extra"]["trainable_parameter_names"]]
    ck = tmp_path / "run"
    shutil.copytree(sample("torchtune", "torchtune_lora"), ck)
    r = run_cli("set-lr", ck, "--scale", "0.5", "--yes")
    assert r.returncode == 0, r.stderr


def test_set_lr_plan_says_initial_lr_drives_it(tmp_path):
    ck = tmp_path / "run"
    shutil.copytree(sample("torchtune", "torchtune_full"), ck)
    doc = json.loads(run_cli("set-lr", ck, "--scale", "0.5", "--dry-run", "--json").stdout)
    plan = doc["plan"]
    assert plan["scheduler_kind"] == "rebuilt" and "initial_lr" in plan["lr_driven_by"]
    notes = {c["field"].rsplit(".", 1)[-1]: c["note"] for f in plan["files"] for c in f["changes"]}
    assert notes["initial_lr"].startswith("DRIVES") and not notes["lr"].startswith("DRIVES")
    assert [f["path"] for f in plan["files"]] == ["recipe_state/recipe_state.pt"]


def test_export_is_the_epoch_weights(tmp_path):
    from safetensors.torch import load_file

    src = sample("torchtune", "torchtune_full")
    r = run_cli("export", src, tmp_path / "m.safetensors")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "m.safetensors")
    ref = load_file(next((src / "epoch_0").glob("*.safetensors")))
    assert set(got) == set(ref) and all(got[k].equal(ref[k]) for k in ref)


@pytest.mark.slow
@NEEDS_TORCHTUNE
@pytest.mark.parametrize("name", ["torchtune_full", "torchtune_lora"])
def test_set_lr_halves_every_resumed_step_in_the_real_recipe(tmp_path, name):
    """Untouched copy and `set-lr --scale 0.5` copy, each resumed by torchtune's own recipe from epoch_0 +
    recipe_state (`torchtune_run --check`): every resumed step of the edited copy runs at exactly half the LR;
    the Adam step continues from the saved 3; the untouched resume equals the uninterrupted run."""
    from ckpt_tools.samples import run_torchrun

    m = manifest("torchtune", name)
    recs = {}
    for tag in ("untouched", "edited"):
        ck = tmp_path / tag / name
        shutil.copytree(sample("torchtune", name), ck)
        shutil.copy(sample("torchtune", f"{name}.manifest.json"), ck.parent)  # the run's recorded history
        if tag == "edited":
            r = run_cli("set-lr", ck, "--scale", "0.5", "--yes")
            assert r.returncode == 0, r.stderr
        out = tmp_path / f"{tag}.json"
        run_torchrun(
            "ckpt_tools.samples.workers.torchtune_run",
            1,
            ["--sample", name, "--check", str(ck), "--record", str(out)],
            log_path=tmp_path / f"{tag}.log",
            timeout=300,
        )
        recs[tag] = json.loads(out.read_text())["records"]
    history = {h["step"]: h for h in m["extra"]["history"]}
    assert [r["step"] for r in recs["untouched"]] == [4, 5, 6]
    for u, e in zip(recs["untouched"], recs["edited"]):
        assert u["lr"] == history[u["step"]]["lr"] and u["loss"] == pytest.approx(history[u["step"]]["loss"], rel=1e-6)
        assert e["step"] == u["step"] and e["optimizer_step"] == u["optimizer_step"] == u["step"]
        assert e["lr"] == pytest.approx([x / 2 for x in u["lr"]], rel=1e-12), (u, e)


def _hf_logits(folder, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_export_hf_loads_in_transformers(tmp_path):
    """`export --hf` of the output folder: config.json from the epoch folder the recipe state goes with, the
    weights it saved; transformers loads it with no missing key and gives the logits of that epoch folder."""
    import torch

    src = sample("torchtune", "torchtune_full")
    r = run_cli("export", src, tmp_path / "hf", "--hf")
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }
    tokens = torch.arange(0, 24).reshape(2, 12) % 100
    assert torch.equal(_hf_logits(tmp_path / "hf", tokens), _hf_logits(src / "epoch_0", tokens))


@NEEDS_TORCHTUNE
def test_export_hf_logits_equal_torchtunes_own_model(tmp_path):
    """The exported folder in transformers vs torchtune's own llama3 (the recipe's builder and arguments) loaded
    by torchtune's own HF -> torchtune conversion of the same save: the same logits (fp32, atol 1e-5). torchtune
    is imported by name (an optional package, not a [dev] dependency)."""
    import torch
    from safetensors.torch import load_file

    convert_weights = importlib.import_module("torchtune.models.convert_weights")
    llama3 = importlib.import_module("torchtune.models.llama3").llama3

    m = manifest("torchtune", "torchtune_full")
    cfg = {k: v for k, v in m["extra"]["config"]["model"].items() if k != "_component_"}
    src = sample("torchtune", "torchtune_full")
    assert run_cli("export", src, tmp_path / "hf", "--hf").returncode == 0
    tune = llama3(**cfg)
    sd = convert_weights.hf_to_tune(
        load_file(tmp_path / "hf" / "model.safetensors"),
        num_heads=cfg["num_heads"],
        num_kv_heads=cfg["num_kv_heads"],
        dim=cfg["embed_dim"],
    )
    tune.load_state_dict(sd)
    tokens = torch.arange(0, 24).reshape(2, 12) % 100
    with torch.no_grad():
        ref = tune.eval()(tokens)
    got = _hf_logits(tmp_path / "hf", tokens)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()


def test_convert_to_universal_says_the_schedule_is_not_in_the_checkpoint(tmp_path):
    """Weights, Adam state and the step move and are verified against the whole source; the schedule torchtune
    rebuilds from its config is listed as not moved (no resume in DeepSpeed proves this conversion yet)."""
    r = run_cli(
        "convert", sample("torchtune", "torchtune_full"), tmp_path / "u", "--to", "deepspeed-universal", "--json"
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verified"] and doc["step"] == 3
    assert any(x.startswith("scheduler: not saved") for x in doc["not_moved"]), doc["not_moved"]


@pytest.mark.parametrize(
    "name,weights",
    [
        ("torchtune_full", "checkpointer.checkpoint_files=[epoch_0/model-"),
        ("torchtune_lora", "checkpointer.adapter_checkpoint=epoch_0/adapter_model.pt"),
    ],
)
def test_resume_names_the_recipe_relaunch(name, weights):
    """torchtune rebuilds the model, the schedule and the data from its recipe config, which ckpt cannot replay:
    `ckpt resume` exits 2 in one line with the overrides torchtune 0.6.1 resumes this folder with (the ones the
    real-recipe resume in test_set_lr_halves_every_resumed_step_in_the_real_recipe uses)."""
    src = sample("torchtune", name)
    r = run_cli("resume", src, "--steps", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for part in (
        "tune run RECIPE --config",
        "torchtune_config.yaml",
        "resume_from_checkpoint=True",
        weights,
        "checkpointer.recipe_checkpoint=recipe_state/recipe_state.pt",
        f"output_dir={src}",
    ):
        assert part in r.stderr, (part, r.stderr)
