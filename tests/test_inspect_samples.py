"""Every committed sample, opened by `ckpt_tools.open_checkpoint`, against what the real run recorded.

The manifests were written by the training workers from the live engine/optimizer/scheduler objects
at save time (ckpt_tools/train/manifest.py), so these tests compare the reader with the frameworks,
not with itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckpt_tools
from conftest import SAMPLES

#: Megatron-LM's samples have their own manifest fields (iteration, num_steps, next LR) and are checked against
#: them in test_format_megatron_lm.py
NOT_READ_YET = ("megatron_lm",)
MANIFESTS = sorted(m for m in SAMPLES.glob("*/*.manifest.json") if m.parent.name not in NOT_READ_YET)
IDS = [f"{m.parent.name}/{m.name[: -len('.manifest.json')]}" for m in MANIFESTS]


def _load(mpath: Path) -> tuple[Path, dict]:
    """(the checkpoint the manifest describes, the manifest): a producer's run folder with several saves (torchtitan's
    `step-N/`) records which one holds the full training state (`extra.full_save`)."""
    m = json.loads(mpath.read_text())
    path = mpath.with_name(mpath.name[: -len(".manifest.json")])
    return (path / m["extra"]["full_save"] if m["extra"].get("full_save") else path), m


def test_every_sample_has_a_manifest():
    from ckpt_tools.samples import SAMPLES as SPECS

    for spec in SPECS:
        assert (SAMPLES / spec.group / (spec.path + ".manifest.json")).is_file(), spec.name


def _what_the_files_hold(m: dict) -> tuple[dict, dict]:
    """The manifest records the live run; some formats do not save every value. Those must read as
    None (never guessed), so the expectation is adjusted here, each with the reason."""
    counters, lr = dict(m["counters"]), dict(m["lr"])
    if m["format"] == "safetensors":  # weights only: no counters, no optimizer, no scheduler
        counters = dict.fromkeys(counters)
        lr = {"param_groups": [], "base_lrs": None, "last_lr": None}
    if m["format"] == "accelerate" and m["extra"].get("distributed_type") != "DEEPSPEED":
        counters["global_step"] = None  # Accelerate saves no loop step (DeepSpeed's engine does)
    if m["extra"].get("layout") == "torchtitan" and m["extra"].get("producer", "").endswith("(real)"):
        # torchtitan saves only lr_scheduler.last_epoch: base_lrs and the scheduler's LR come back from the job config
        counters["scheduler_step_count"] = None
        lr["base_lrs"] = lr["last_lr"] = None
        counters.pop("ntokens_seen")  # not a header counter: test_torchtitan_train_state checks it in the tree
    if m["format"] == "torchtune":
        # recipe_state.pt saves no scheduler (the recipe rebuilds it from initial_lr); the epoch counters are
        # checked in tests/test_torchtune.py
        counters["scheduler_last_epoch"] = counters["scheduler_step_count"] = None
        lr["base_lrs"] = lr["last_lr"] = None
        for k in ("epochs_run", "max_steps_per_epoch", "seed", "steps_per_epoch", "total_epochs"):
            counters.pop(k, None)
    if m["extra"].get("optimizers"):  # several optimizers: the header lists every one's groups, in order
        opts = m["extra"]["optimizers"]
        lr = {
            "param_groups": [x for o in opts for x in o["lr"]],
            "base_lrs": [x for o in opts for x in o["base_lrs"]],
            "last_lr": [x for o in opts for x in o["last_lr"]],
        }
    return counters, lr


@pytest.mark.parametrize("mpath", MANIFESTS, ids=IDS)
def test_header_matches_the_real_run(mpath):
    path, m = _load(mpath)
    ck = ckpt_tools.open_checkpoint(path)
    expected, lr = _what_the_files_hold(m)
    assert ck.format == m["format"]
    # a LoRA save holds the adapter only: the live model's trainable part
    params = m["extra"]["trainable_parameters"] if m["extra"].get("lora") else m["parameters"]
    assert ck.parameter_count == params["count"]
    assert ck.parameter_tensors == params["tensors"]
    topo = m["topology"]
    if m["format"] not in ("safetensors", "torch_file"):
        assert (ck.topology.dp, ck.topology.tp, ck.topology.pp, ck.topology.zero_stage) == (
            topo["dp"],
            topo["tp"],
            topo["pp"],
            topo.get("zero_stage"),
        )
    got = ck.counters.__dict__
    for key, value in expected.items():
        assert got[key] == value, f"counter {key}: checkpoint says {got[key]}, the run had {value}"
    assert list(ck.lr.param_groups) == pytest.approx(lr["param_groups"])
    assert (list(ck.lr.base_lrs) if ck.lr.base_lrs is not None else None) == (
        pytest.approx(lr["base_lrs"]) if lr["base_lrs"] is not None else None
    )
    want_last = lr["last_lr"]
    assert (list(ck.lr.last_lr) if ck.lr.last_lr is not None else None) == (
        pytest.approx(want_last) if want_last is not None else None
    )


@pytest.mark.parametrize("mpath", MANIFESTS, ids=IDS)
def test_clean_samples_have_no_warnings(mpath):
    path, m = _load(mpath)
    ck = ckpt_tools.open_checkpoint(path)
    expected_codes = set(m["extra"].get("expected_warnings", [])) | KNOWN_WARNINGS.get(
        mpath.parent.name + "/" + path.name, set()
    )
    assert {w.code for w in ck.warnings} == expected_codes, ck.warnings


#: what ckpt warns about in a sample whose producer wrote it that way (asserted, so a change shows)
KNOWN_WARNINGS = {
    # torchtune's LoRA recipe: the optimizer lists the frozen base model's parameters (no state) beside the adapter
    "torchtune/torchtune_lora": {"optimizer-state-missing"},
}


def test_torchtitan_train_state():
    """torchtitan's own counters, as its Trainer recorded them at the full save: train_state.step and
    ntokens_seen, lr_scheduler.last_epoch."""
    mpath = SAMPLES / "dcp" / "torchtitan_real.manifest.json"
    path, m = _load(mpath)
    tree = ckpt_tools.open_checkpoint(path).tree.children
    train = tree["client_state"].children["train_state"].children
    assert (train["step"].value, train["ntokens_seen"].value) == (
        m["counters"]["global_step"],
        m["counters"]["ntokens_seen"],
    )
    assert tree["scheduler"].children["last_epoch"].value == m["counters"]["scheduler_last_epoch"]
