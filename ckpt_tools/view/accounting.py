"""What an open read, and what it did not: the guarantee that no command answers for part of a checkpoint.

Every format module lists the files it read (`Checkpoint.files`). After a format has opened a checkpoint,
`account` lists the checkpoint's folder the way a loader would see it and compares: a file that may hold model
or training state (`*.pt`, `*.bin`, `*.distcp`, `*.safetensors`, `*.pth`, `*.ckpt`) that no reader took is an
`unread-files` warning naming it (a DeepSpeed MoE expert file, a second TP rank's folder, a shard the index does
not name). A single file that is one piece of a larger checkpoint is a `part-of-checkpoint` warning naming the
whole, found from the file's own content (Megatron's `args` with TP/PP > 1) or its name
(`zero_pp_rank_*`, `layer_*_expert_*`, `model_optim_rng.pt`, ...).

Read-only commands show these warnings; every command that writes, exports or converts calls `require_whole`
before it plans anything, which refuses (exit 2, one line naming the pieces) while the checkpoint is
incomplete, unless the user knowingly leaves unread files behind (`allow_unread`, the CLI's
`--allow-unread`), which the command's result then lists.

Nothing here reads tensor bytes; the listing is one `scandir` per folder of the checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from .. import formats
from ..errors import CkptError, CorruptCheckpoint, UnsupportedCheckpoint
from ..formats import megatron_dist, megatron_lm
from ..read import gate, remote
from ..read.state import lost_scheduler_warnings
from ..read.tree import Checkpoint, GroupNode, OpaqueNode, Warning_, scalar

#: suffixes of files that may hold model or training state
STATE_SUFFIXES = (".pt", ".bin", ".distcp", ".safetensors", ".pth", ".ckpt")

#: warnings that mean the open did not see the whole checkpoint: writing, exporting and converting refuse
#: while one is present (`require_whole`); `unread-files` alone can be waived with `allow_unread`
#: (in the order a refusal names them: the most telling first)
INCOMPLETE = (
    "part-of-checkpoint",
    "megatron-torch-dist",
    "corrupt-file",
    "declared-mismatch",
    "duplicate-rank-file",
    "extra-rank-file",
    "unreferenced-file",
    "not-mapped",
    "unread-files",
)

#: names that say a file is one piece of a sharded checkpoint whatever folder it sits in
_PIECE_NAMES = (
    (
        re.compile(r"^mp_rank_\d+_model_states\.pt$"),
        "the model-states file of a DeepSpeed checkpoint (the "
        "optimizer state is in the zero_pp_rank_* files beside it)",
    ),
    (
        re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$"),
        "one shard of a sharded checkpoint (its index names the rest)",
    ),
    (re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(optim|model)_states\.pt$"), "one DP rank's ZeRO partition"),
    (
        re.compile(r"^layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt$"),
        "one expert's weights of a DeepSpeed MoE checkpoint",
    ),
    (
        re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$"),
        "one expert-parallel rank's optimizer of a DeepSpeed MoE checkpoint",
    ),
    (
        re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"),
        "one pipeline layer's weights of a DeepSpeed pipeline checkpoint",
    ),
    (re.compile(r"^distrib_optim\.pt$"), "one rank's distributed-optimizer state of a Megatron-LM checkpoint"),
    (re.compile(r"^__\d+_\d+\.distcp$"), "one rank's items of a torch distributed checkpoint"),
)

#: the most directory entries one accounting pass lists (a wrong path such as a home folder stays cheap)
_MAX_ENTRIES = 200_000


def account(ck: Checkpoint, given: Path) -> Checkpoint:
    """`ck` with `details["accounting"]` = {"read": [...], "unread": [...]} and the warnings for what the open
    did not account for: files beside the ones read that no reader took, and (for a single file) the larger
    checkpoint it is one piece of."""
    root = Path(ck.path)
    read = {_norm(root / f.path) for f in ck.files}
    warnings: list[Warning_] = []
    unread: list[str] = []
    if given.is_dir():
        # folders the reader names as other saves of the run beside this one (torchtune's final model-only epoch)
        others = tuple(os.path.join(_norm(root), str(d)) + os.sep for d in ck.details.get("other_saves") or ())
        unread = sorted(u for u in _unread(root, read) if not (_norm(root / u) + os.sep).startswith(others))
        if unread:
            shown = ", ".join(unread[:6]) + (f", … {len(unread) - 6} more" if len(unread) > 6 else "")
            warnings.append(
                Warning_(
                    "unread-files",
                    f"{len(unread)} file(s) that may hold model or training state were not read by the "
                    f"{ck.format} reader: {shown}. What is shown leaves them out; commands that write, export or "
                    "convert refuse unless given --allow-unread",
                    unread[0],
                )
            )
    else:
        part = piece_of_whole(ck, given)
        if part is not None:
            warnings.append(part)
    tag = ck.details.get("tag")
    if (
        given.is_dir()
        and isinstance(tag, str)
        and (root / tag).is_dir()
        and not any((root / n).is_file() for n in ("latest", "latest_universal", "latest_checkpointed_iteration.txt"))
    ):
        warnings.append(
            Warning_(
                "latest-missing",
                f"no `latest` file beside the tag folder: {tag} was taken as the "
                "only tag folder here, but a loader asked for this folder without a tag (DeepSpeed's "
                f"load_checkpoint) finds nothing. Write the tag into {root / 'latest'}",
                "latest",
            )
        )
    acc = {"read": sorted(f.path for f in ck.files), "unread": unread}
    require_declared_groups(ck)
    warnings += optimizer_state_warnings(ck) + duplicate_rank_files(ck)
    known = {(w.code, w.path) for w in ck.warnings}
    new = [w for w in warnings if (w.code, w.path) not in known]
    return replace(ck, warnings=(*new, *ck.warnings), details={**ck.details, "accounting": acc})


def _norm(p: Path) -> str:
    return os.path.normpath(os.path.abspath(p))


def _unread(root: Path, read: set[str]) -> Iterable[str]:
    """State-like files under `root` (the folders that hold read files, and `root` itself) that were not read.
    A sub-folder that holds no read file and that a format claims by itself (another tag folder beside the
    one `latest` names, a run's other iterations) is another checkpoint, not part of this one."""
    read_dirs = {os.path.dirname(p) for p in read}
    top = _norm(root)
    stack = [top]
    seen = 0
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        seen += len(entries)
        if seen > _MAX_ENTRIES:
            return
        for e in entries:
            if e.name.startswith("."):
                continue
            full = os.path.join(d, e.name)
            if e.is_dir(follow_symlinks=False):
                holds_read = any(r == full or r.startswith(full + os.sep) for r in read_dirs)
                if not holds_read:
                    try:
                        if formats.claim(Path(full)) is not None:
                            continue
                    except Exception:  # noqa: BLE001  a sub-folder no format can even sniff is listed below
                        pass
                stack.append(full)
            elif e.name.endswith(STATE_SUFFIXES) and full not in read:
                yield os.path.relpath(full, top)


def piece_of_whole(ck: Checkpoint, file: Path) -> Warning_ | None:
    """A `part-of-checkpoint` warning when the single file `file` is one piece of a larger checkpoint: its own
    content says so (Megatron-LM's `args` with tensor or pipeline parallel size > 1: one rank's shards), a
    checkpoint above it opens and holds it, or its name does (a ZeRO partition, an expert file, a DCP rank
    file). The folder named is the one to open."""
    args = _megatron_args(ck)
    if args is not None:
        tp, pp = args.get("tensor_model_parallel_size") or 1, args.get("pipeline_model_parallel_size") or 1
        if tp * pp > 1 or (file.parent / "distrib_optim.pt").is_file():
            whole = _megatron_whole(file)
            return Warning_(
                "part-of-checkpoint",
                f"this file is one rank's part of a Megatron-LM checkpoint (its args: "
                f"tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}"
                + (
                    "; the distributed optimizer's state is in distrib_optim.pt beside it"
                    if (file.parent / "distrib_optim.pt").is_file()
                    else ""
                )
                + f"): tensors have local shapes and the LRs/steps of one rank only; the whole "
                f"checkpoint is {whole}",
                str(whole),
            )
    whole = part_of(file)
    if whole is not None:
        folder, fmt, nfiles = whole
        n = f"one of the {nfiles} files" if nfiles else "one file"
        return Warning_(
            "part-of-checkpoint",
            f"shown alone, this file is {n} of the {fmt} checkpoint {folder}; "
            f"the whole checkpoint: ckpt inspect {folder}",
            str(folder),
        )
    for pat, what in _PIECE_NAMES:
        if pat.search(file.name):
            return Warning_(
                "part-of-checkpoint",
                f"this file is {what}; the whole checkpoint is its folder {file.parent}",
                str(file.parent),
            )
    return None


def part_of(file: Path) -> tuple[Path, str, int | None] | None:
    """(folder, format, file count) of the checkpoint that `file` is one of several files of, or None. The
    folders above it that a format claims are opened, the farthest first (a tag folder's parent with `latest`
    before the tag folder); the first that opens and holds the file (read, or found unread beside the files it
    read) wins. A folder that does not open is not named: a claim of "part of X" needs X to open."""
    mine = _norm(file)
    for up, mod in reversed(formats.enclosing(file)):
        try:
            whole = account(mod.open(up), up)
        except (CkptError, OSError):
            continue
        held = {_norm(Path(whole.path) / f.path) for f in whole.files}
        held |= {_norm(Path(whole.path) / f) for f in unread_files(whole)}
        if mine in held:
            return (up, whole.format, len(held)) if len(held) > 1 else None
    return None


def _megatron_whole(file: Path) -> Path:
    """The iteration folder (or run folder) above a Megatron-LM rank file `.../iter_N/mp_rank_XX/file`."""
    for up in file.resolve().parents:
        if re.fullmatch(r"iter_\d+|release", up.name):
            return up.parent if (up.parent / "latest_checkpointed_iteration.txt").is_file() else up
    return file.parent


def _megatron_args(ck: Checkpoint) -> dict[str, Any] | None:
    """The scalar fields of a Megatron-style `args` namespace saved in the checkpoint, or None."""
    for section in (ck.tree.children.get("client_state"), ck.tree):
        if not isinstance(section, GroupNode):
            continue
        node = section.children.get("args")
        if isinstance(node, OpaqueNode) and node.cls.endswith("Namespace"):
            kids = node.children
            return {
                k: scalar(v)
                for k, v in kids.items()
                if k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
            }
    return None


def incomplete(ck: Checkpoint, *, allow_unread: bool = False) -> list[Warning_]:
    """The warnings that make `ck` an incomplete view: what `require_whole` refuses on."""
    return [w for w in ck.warnings if w.code in INCOMPLETE and not (allow_unread and w.code == "unread-files")]


def require_whole(ck: Checkpoint, command: str, *, allow_unread: bool = False) -> None:
    """Refuse (UnsupportedCheckpoint, exit 2) to write, export or convert from a view that is not the whole
    checkpoint: unread state files (unless `allow_unread`), a file that is one piece of a larger checkpoint,
    rank or shard files the checkpoint's own metadata does not account for."""
    # state a reader shows as saved without mapping it to parameters (the distributed optimizer's flat buffers):
    # LR/step edits touch only the param groups beside it; weight and state movers would leave it behind
    exempt = {"not-mapped"} if command in ("set-lr", "set-step") else set()
    bad = sorted(
        (w for w in incomplete(ck, allow_unread=allow_unread) if w.code not in exempt),
        key=lambda w: INCOMPLETE.index(w.code),
    )
    if not bad:
        return
    w = bad[0]
    more = sorted({b.code for b in bad[1:]} - {w.code})
    also = f" (also: {', '.join(more)}; `ckpt inspect` lists them)" if more else ""
    if w.code == "part-of-checkpoint":
        raise UnsupportedCheckpoint(
            f"{command} needs the whole checkpoint: {w.message}",
            path=ck.path,
            hint=f"pass the whole checkpoint: {w.path}",
        )
    if w.code == "unread-files":
        files = unread_files(ck)
        raise UnsupportedCheckpoint(
            f"the checkpoint holds {len(files)} file(s) that may hold model or training state which no reader took "
            f"and {command} would leave behind: "
            f"{', '.join(files[:6])}{', …' if len(files) > 6 else ''}{also}",
            path=ck.path,
            hint="move them out if they are not part of this checkpoint, or pass --allow-unread to leave them "
            "behind knowingly",
        )
    if w.code in ("corrupt-file", "declared-mismatch"):
        hint = "copy the named piece back from where the checkpoint was saved (or use an intact checkpoint)"
    elif w.code == "not-mapped":
        raise UnsupportedCheckpoint(
            f"{command} would leave part of this checkpoint behind: {w.message}{also}",
            path=w.path and str(Path(ck.path) / w.path) or ck.path,
            hint="ckpt does not map this state to parameters yet; the framework's own "
            "tools read it (Megatron-LM: tools/checkpoint, load_checkpoint)",
        )
    else:
        hint = "move the leftover file out of the checkpoint folder, then run it again"
    raise UnsupportedCheckpoint(
        f"{command} refuses an inconsistent checkpoint: {w.message}{also}",
        path=w.path and str(Path(ck.path) / w.path) or ck.path,
        hint=hint,
    )


def unread_files(ck: Checkpoint) -> list[str]:
    """The checkpoint's state files that no reader took (relative to its root)."""
    return list((ck.details.get("accounting") or {}).get("unread", ()))


def guard(
    ck: Checkpoint, given: str | os.PathLike, command: str, *, allow_unread: bool = False, trust_pickles: bool = False
) -> Checkpoint:
    """A writer's checks of its source: `require_whole` on `ck` as opened from `given` (accounted first when a
    format module's own `open` made it, not `open_checkpoint`), then `read.gate.check_source` (a global outside
    the allowlist or a foreign zip member anywhere in it is refused unless `trust_pickles`; trusted, the warning
    is kept in `details["carried_pickles"]` for `left_behind`). Returns the accounted checkpoint."""
    if "accounting" not in ck.details:
        ck = lost_scheduler_warnings(account(ck, Path(given)))
    require_whole(ck, command, allow_unread=allow_unread)
    carried = gate.check_source(ck, given, trust_pickles=trust_pickles, command=command)
    if carried:
        ck = replace(ck, details={**ck.details, "carried_pickles": carried})
    return ck


def left_behind(ck: Checkpoint) -> list[str]:
    """The plan lines every writer shows first: the untrusted pickle globals it carries (`--trust-pickles`), and
    the unread state files it was told to leave behind (`allow_unread`)."""
    carried = list(ck.details.get("carried_pickles", ()))
    files = unread_files(ck)
    if not files:
        return carried
    return carried + [
        f"left behind (--allow-unread): {len(files)} unread file(s), not read and not carried: "
        f"{', '.join(files[:6])}{', …' if len(files) > 6 else ''}"
    ]


def optimizer_state_warnings(ck: Checkpoint) -> list[Warning_]:
    """Declared vs found inside a torch optimizer state dict: every parameter id its param groups list should have
    state once any has (a parameter whose state was lost restarts its moments at zero), and every id with state
    must be listed by a group (a lost param group). Ids only: no tensor bytes."""
    out = []
    for name, opt in ck.tree.children.items():
        if not name.startswith("optimizer") or not isinstance(opt, GroupNode):
            continue
        state, groups = opt.children.get("state"), opt.children.get("param_groups")
        if not isinstance(state, GroupNode) or not isinstance(groups, GroupNode) or not state.children:
            continue
        listed: set[str] = set()
        for g in groups.children.values():
            ids = scalar(g.children.get("params")) if isinstance(g, GroupNode) else None
            if not isinstance(ids, (list, tuple)):
                return out  # groups without id lists (ZeRO's flat groups, DCP by FQN): nothing to reconcile here
            listed |= {str(i) for i in ids}
        have = set(state.children)
        if not listed:
            continue
        if all(k.isdigit() for k in have):
            lost = sorted(listed - have, key=lambda s: (len(s), s))
            orphan = sorted(have - listed, key=lambda s: (len(s), s))
            n_lost, shown = len(lost), ", ".join(lost[:6]) + (" …" if len(lost) > 6 else "")
        elif len(have) < len(listed):
            # state keyed by parameter name (the reader mapped torch's ids): only the counts can be reconciled;
            # more names than ids is a flat (ZeRO) group un-flattened, not a mismatch
            n_lost, shown, orphan = len(listed) - len(have), "ids not named", []
        else:
            continue
        if n_lost:
            out.append(
                Warning_(
                    "optimizer-state-missing",
                    f"{name}: {n_lost} of {len(listed)} parameters its "
                    f"param groups list have no state ({shown}): "
                    "lost, or never updated (frozen in practice); a resume restarts their moments at zero",
                    f"{name}.state",
                )
            )
        if orphan:
            out.append(
                Warning_(
                    "declared-mismatch",
                    f"{name}: state for {len(orphan)} parameter ids that no param "
                    f"group lists ({', '.join(orphan[:6])}{' …' if len(orphan) > 6 else ''}): a param "
                    "group was lost or the state belongs to another optimizer",
                    f"{name}.param_groups",
                )
            )
    return out


def require_declared_groups(ck: Checkpoint) -> None:
    """Refuse (CorruptCheckpoint, exit 2) a Megatron-LM view that holds optimizer state but fewer param groups
    than the checkpoint declares: Megatron's default grouping (dense weights, dense biases and norms, and at
    expert-parallel size > 1 the same pair for the experts: `args.num_experts`, `args.expert_model_parallel_size`,
    the groups' own `is_expert_parallel`) against the groups the reader found. Checked here, on the tree, not in
    the reader: a reader that looked in the wrong place (a ChainedOptimizer's inner optimizers) finds no group
    and would otherwise show no LR and convert none, and say nothing."""
    if ck.format not in (megatron_lm.FORMAT, megatron_dist.FORMAT):
        return
    node, opt, model = (ck.tree.children.get(k) for k in ("args", "optimizer", "model"))
    args = {k: scalar(v) for k, v in node.children.items()} if isinstance(node, (GroupNode, OpaqueNode)) else {}
    if not args or args.get("no_save_optim") or not isinstance(model, GroupNode):
        return
    kids = opt.children if isinstance(opt, GroupNode) else {}
    held = (
        any(isinstance(kids.get(k), GroupNode) and kids[k].children for k in ("state", "param_groups"))
        or "distributed_optimizer" in ck.tree.children
    )
    if not held:
        return
    groups = (
        [
            {k: scalar(v) for k, v in g.children.items()}
            for g in kids["param_groups"].children.values()
            if isinstance(g, GroupNode)
        ]
        if isinstance(kids.get("param_groups"), GroupNode)
        else []
    )
    shapes = {n: tuple(t.shape) for n, t in model.children.items() if hasattr(t, "shape")}
    gone = megatron_lm.missing_groups(groups, shapes, args)
    if not gone:
        return
    want = megatron_lm.declared_groups(shapes, args) or set()
    moe = (
        f" (num_experts={args.get('num_experts')}, expert_model_parallel_size="
        f"{args.get('expert_model_parallel_size')}: a ChainedOptimizer, dense then expert)"
        if megatron_lm.expert_parallel(args)
        else ""
    )
    raise CorruptCheckpoint(
        f"the checkpoint declares {len(want)} param groups{moe} but {len(groups)} were found: "
        f"{', '.join(gone)} missing: their parameters would have no LR or weight-decay settings",
        path=ck.path,
        hint="copy the optimizer state back from where the run saved it "
        "(Megatron-LM: common.pt's optimizer, every rank file's)",
    )


def duplicate_rank_files(ck: Checkpoint, limit: int = 4 << 20) -> list[Warning_]:
    """Per-rank files (RNG states, small rank shards) that are byte-identical to another rank's: one rank's file
    copied over another's. Only files up to `limit` bytes are compared (hashing GBs on every open is not cheap)."""
    by_hash: dict[tuple[int, str], list[str]] = {}
    root = Path(ck.path) if Path(ck.path).is_dir() else Path(ck.path).parent
    ranked = [
        f for f in ck.files if re.search(r"(rank|states?)_?\d+|__\d+_\d+", Path(f.path).name) and 0 < f.bytes <= limit
    ]
    sizes = Counter(f.bytes for f in ranked)
    for f in ranked:
        if sizes[f.bytes] < 2:  # a file of a size no other has cannot be a copy: not read at all
            continue
        try:
            remote.ensure_file(root / f.path)
            digest = hashlib.sha1((root / f.path).read_bytes()).hexdigest()
        except OSError:
            continue
        by_hash.setdefault((f.bytes, digest), []).append(f.path)
    flagged = {w.path for w in ck.warnings if w.path}  # an extra rank file is already named for what it is
    return [
        Warning_(
            "duplicate-rank-file",
            f"{', '.join(paths)} are byte-identical: one rank's file copied over another's? Each rank saves its own",
            paths[-1],
        )
        for paths in by_hash.values()
        if len(paths) > 1 and not flagged & set(paths)
    ]
