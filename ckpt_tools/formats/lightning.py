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

from ..read.state import StateMap
from ..read.tree import Checkpoint, GroupNode, Topology, scalar
from . import torch_file

FORMAT = "lightning"
VERSION_KEYS = ("pytorch-lightning_version", "lightning_version")


def sniff(path: Path) -> bool:
    """A torch file named `*.ckpt` (Lightning's suffix); its keys are checked when it is opened."""
    return path.suffix == ".ckpt" and torch_file.sniff(path)


def open(path: Path) -> Checkpoint:  # noqa: A001
    """The Lightning `.ckpt` file at `path`, read by `torch_file.open` (inert; tensors lazy); a file without a
    Lightning version is returned as the plain torch file it is. Training state: the file, plus the loop-progress
    counters that hold the global step (`training_state`)."""
    ck = torch_file.open(path)
    client = ck.tree.children.get("client_state")
    kids = client.children if isinstance(client, GroupNode) else {}
    version = next((scalar(kids[k]) for k in VERSION_KEYS if k in kids), None)
    if version is None:  # a .ckpt that Lightning did not write: a plain torch file
        return ck
    details = {**ck.details, "lightning_version": version, "epoch": scalar(kids.get("epoch"))}
    # one consolidated file: whatever the run's world size, the file itself is dp=tp=pp=1
    return replace(ck, format=FORMAT, details=details, topology=Topology(dp=1, tp=1, pp=1, zero_stage=None))


#: where Lightning keeps the optimizer-step count it restores `trainer.global_step` from (the top-level
#: `global_step` is written for readers only): fit_loop -> epoch_loop.automatic_optimization.optim_progress
_OPTIM_STEPS = ("loops", "fit_loop", "epoch_loop.automatic_optimization.optim_progress", "optimizer", "step")


def training_state(ck: Checkpoint):
    """The file, with the loop-progress counters that hold the global step: total and current
    ready/completed of the automatic optimizer steps (current only where it equals total: the same epoch)."""
    base = torch_file.training_state(ck)
    if ck.format != FORMAT:
        return base
    node = ck.tree
    for k in ("client_state",) + _OPTIM_STEPS:
        node = node.children.get(k) if isinstance(node, GroupNode) else None
    paths = []
    if isinstance(node, GroupNode):
        total = node.children.get("total")
        for part in ("total", "current"):
            sub = node.children.get(part)
            if not isinstance(sub, GroupNode):
                continue
            for fld in ("ready", "completed"):
                if part == "total" or (
                    isinstance(total, GroupNode) and scalar(sub.children.get(fld)) == scalar(total.children.get(fld))
                ):
                    paths.append(_OPTIM_STEPS + (part, fld))
    (src,) = base.sources
    return StateMap(base.root, (replace(src, counter_paths=tuple(paths)),))
