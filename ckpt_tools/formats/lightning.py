"""Lightning `.ckpt` files (`Trainer.save_checkpoint`, `ModelCheckpoint`): one torch.save file holding
`state_dict` (the LightningModule's weights), `optimizer_states` and `lr_schedulers` (LISTS, one entry per
optimizer / scheduler config), `epoch`, `global_step`, `loops` (the fit loop's progress counters),
`callbacks`, `pytorch-lightning_version` and `hparams` when saved.

Read as a torch file (`torch_file.split_training_dict` takes the lists apart: `optimizer`, `optimizer_1`, ...);
this module only names the format and shows the Lightning version and epoch.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..tree import Checkpoint, GroupNode, Topology, scalar
from . import torch_file

FORMAT = "lightning"
VERSION_KEYS = ("pytorch-lightning_version", "lightning_version")


def sniff(path: Path) -> bool:
    """A torch file named `*.ckpt` (Lightning's suffix); its keys are checked when it is opened."""
    return path.suffix == ".ckpt" and torch_file.sniff(path)


def open(path: Path) -> Checkpoint:  # noqa: A001
    ck = torch_file.open(path)
    client = ck.tree.children.get("client_state")
    kids = client.children if isinstance(client, GroupNode) else {}
    version = next((scalar(kids[k]) for k in VERSION_KEYS if k in kids), None)
    if version is None:  # a .ckpt that Lightning did not write: a plain torch file
        return ck
    details = {**ck.details, "lightning_version": version, "epoch": scalar(kids.get("epoch"))}
    # one consolidated file: whatever the run's world size, the file itself is dp=tp=pp=1
    return replace(ck, format=FORMAT, details=details, topology=Topology(dp=1, tp=1, pp=1, zero_stage=None))


def training_state(ck: Checkpoint):
    return torch_file.training_state(ck)
