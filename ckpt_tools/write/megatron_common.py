"""What both Megatron-LM writers (`megatron_write`: legacy -> torch_dist, `megatron_to_legacy`: torch_dist -> legacy)
and the Mixture-of-Experts one (`megatron_moe`) share: the run's args, its legacy rank files, the refusal of what
neither writer carries, and the common tree of a legacy rank file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import UnsupportedCheckpoint
from ..read.pickle_reader import TensorRef
from ..read.tree import node_to_python

LATEST = "latest_checkpointed_iteration.txt"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _check_plain_adam(ck, src: Path, flag: str, writes: str, distopt_layout: str) -> None:
    """Refuse, in one line, what neither writer carries: the distributed optimizer, an fp32 run (no Float16
    optimizer with an fp32 master), a checkpoint without per-parameter Adam state."""
    args = _args(ck)
    if args.get("use_distributed_optimizer"):
        raise UnsupportedCheckpoint(
            f"{flag} {writes}; this run used Megatron's distributed optimizer "
            f"(args.use_distributed_optimizer), whose {distopt_layout} ckpt does not write",
            path=src,
        )
    if not (args.get("bf16") or args.get("fp16")):
        raise UnsupportedCheckpoint(
            f"{flag} is proven for bf16/fp16 runs (Float16 optimizer with an fp32 master); this run trained in fp32",
            path=src,
        )
    if ck.tree.children.get("optimizer") is None or "state" not in ck.tree.children["optimizer"].children:
        raise UnsupportedCheckpoint("the checkpoint holds no per-parameter Adam state to write", path=src)


def _args(ck) -> dict[str, Any]:
    node = ck.tree.children.get("args")
    val = node_to_python(node) if node is not None else None
    return val if isinstance(val, dict) else {}


def rank_files(ck) -> dict[tuple[int, ...], Path]:
    """{(tp, pp): the rank's model_optim_rng.pt} of a legacy checkpoint; {(tp, pp, ep): …} for a Mixture-of-Experts
    one at expert parallel EP > 1 (folders `mp_rank_TT_EEE`, PP 1), which the writers here refuse before asking."""
    root = Path(ck.path)
    return {
        (f.rank["tp"], f.rank.get("pp", 0), *((f.rank["ep"],) if "ep" in f.rank else ())): root / f.path
        for f in ck.files
        if f.role == "model" and f.path.endswith("model_optim_rng.pt")
    }


def _common_of_rank_file(src: Path, obj0: dict) -> dict:
    """What a torch_dist common.pt holds, taken from a legacy rank file's inert tree `obj0`: args (as saved),
    checkpoint_version, iteration, the param groups without their ids, the one common Adam step (refused when
    the parameters' steps differ), opt_param_scheduler, num_floating_point_operations_so_far."""
    opt = obj0["optimizer"]["optimizer"]
    steps = [s.get("step") for s in (opt.get("state") or {}).values() if isinstance(s, dict)]
    refs = [s for s in steps if isinstance(s, TensorRef) and s.numel == 1]
    values = {float(r.read_torch().item()) for r in refs}
    if not refs or len(refs) != len(steps) or len(values) != 1:
        raise UnsupportedCheckpoint(
            f"Adam steps {sorted(values)} across parameters: torch_dist keeps one common step", path=src
        )
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    return {
        "args": obj0["args"],
        "checkpoint_version": obj0["checkpoint_version"],
        "iteration": obj0["iteration"],
        "optimizer": {"optimizer": {"state": {"common_step": refs[0]}, "param_groups": groups}},
        "opt_param_scheduler": obj0["opt_param_scheduler"],
        "num_floating_point_operations_so_far": obj0.get("num_floating_point_operations_so_far"),
    }
