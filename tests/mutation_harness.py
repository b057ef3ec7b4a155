"""The mutation harness of the accounting guarantee: break every bundled sample one way at a time and run the
commands on it. The only acceptable outcomes are a refusal (a `CkptError`: exit 2 with one line) or a warning,
or an answer that visibly differs from the intact checkpoint's; never the intact checkpoint's answer with no word
about the broken piece (a "silent" outcome).

Mutations (per sample): delete each file in turn, truncate each file to half, drop one key (one parameter's
optimizer state, one param group, the scheduler) from the first torch file that holds it, copy rank 0's file over
rank 1's, add a stray `extra.pt`. Commands: inspect, export (planned and written), set-lr --dry-run (planned),
to-universal (planned), convert (planned), diff (logical, against the intact copy).

    python tests/mutation_harness.py [--max-files N] [--only SAMPLE]   # prints the outcome table

`tests/test_mutations.py` runs it on every sample with a cap on files per sample and asserts 0 silent outcomes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_ckpts"
STATE_SUFFIXES = (".pt", ".bin", ".distcp", ".safetensors", ".pth", ".ckpt", ".pkl", ".json", ".metadata")


@dataclass(frozen=True)
class Outcome:
    sample: str
    mutation: str
    command: str
    kind: str  # refused | warned | changed | silent | crash | n/a
    detail: str = ""


def sample_paths() -> list[Path]:
    """Every bundled checkpoint (folders and single files), not the manifests."""
    out = []
    for group in sorted(SAMPLES.iterdir()):
        if not group.is_dir():
            continue
        for p in sorted(group.iterdir()):
            if p.name.endswith(".manifest.json"):
                continue
            m = p.with_name(p.name + ".manifest.json")
            extra = json.loads(m.read_text()).get("extra", {}) if m.is_file() else {}
            saves = [extra[k] for k in ("full_save", "model_only_save") if extra.get(k)]
            out += [p / s for s in saves] if saves else [p]  # a run folder of several saves: each save
    return out


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def _pick(files: list[Path], cap: int | None) -> list[Path]:
    """At most `cap` files, spread over the sorted list (every distinct kind of file in a small sample)."""
    if cap is None or len(files) <= cap:
        return files
    step = len(files) / cap
    return [files[int(i * step)] for i in range(cap)]


def _ranked_pairs(files: list[Path]) -> list[tuple[Path, Path]]:
    """(rank 0's file, rank 1's file) pairs: names that differ only in a rank number."""
    import re

    pats = [
        r"(zero_pp_rank_)1(_)",
        r"(__)1(_\d+\.distcp)",
        r"(random_states_)1(\.pkl)",
        r"(rng_state_)1(\.pth)",
        r"(mp_rank_0)1(\b|_)",
        r"(expp_rank_)1(_)",
        r"(rank)1(\.)",
    ]
    out = []
    for f in files:
        for pat in pats:
            if re.search(pat, f.name):
                other = f.with_name(re.sub(pat, r"\g<1>0\g<2>", f.name, count=1))
                if other.exists() and other != f:
                    out.append((other, f))
                    break
    return out[:1]


def _drop_key(path: Path, what: str) -> bool:
    """Rewrite the torch file `path` without one parameter's optimizer state / one param group / the scheduler.
    True when something was dropped."""
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001  not a torch file we can rewrite (safetensors, DCP, json)
        return False
    done = [False]

    def visit(o, depth=0):
        if done[0] or depth > 6:
            return
        if isinstance(o, dict):
            if what == "param-state" and isinstance(o.get("state"), dict) and o["state"] and "param_groups" in o:
                o["state"].pop(next(iter(o["state"])))
                done[0] = True
                return
            if what == "param-group" and isinstance(o.get("param_groups"), list) and len(o["param_groups"]) >= 2:
                o["param_groups"].pop()
                done[0] = True
                return
            if what == "scheduler":
                for k in ("lr_scheduler", "scheduler", "lr_schedulers", "opt_param_scheduler"):
                    if o.get(k) is not None:
                        o[k] = None if k != "lr_schedulers" else []
                        done[0] = True
                        return
            for v in list(o.values()):
                visit(v, depth + 1)
        elif isinstance(o, list):
            for v in o:
                visit(v, depth + 1)

    visit(obj)
    if done[0]:
        torch.save(obj, path)
    return done[0]


def _in_scope(sample: Path) -> list[Path]:
    """The files of `sample` that belong to the checkpoint `ckpt` opens there: the files it read and those beside
    them (a run folder with several `checkpoint-N` opens the newest: the older ones are other checkpoints)."""
    from ckpt_tools import open_checkpoint

    files = _files(sample)
    if sample.is_file():
        return files
    try:
        ck = open_checkpoint(sample)
    except Exception:  # noqa: BLE001  a sample that does not open: every file is in scope
        return files
    root = Path(ck.path)
    dirs = {(root / f.path).resolve().parent for f in ck.files} | {root.resolve()}
    return [f for f in files if f.resolve().parent in dirs]


def mutations(sample: Path, cap: int | None):
    """(name, function(copy_root) -> the piece's name, or None when the mutation does not apply)."""
    rel = [f.relative_to(sample) if sample.is_dir() else Path(sample.name) for f in _in_scope(sample)]

    def at(root: Path, r: Path) -> Path:
        return root / r if root.is_dir() else root

    def delete(r):
        def f(root):
            at(root, r).unlink()
            return r.name

        return f

    def truncate(r):
        def f(root):
            p = at(root, r)
            size = p.stat().st_size
            if size < 2:
                return None
            with open(p, "r+b") as fh:
                fh.truncate(size // 2)
            return r.name

        return f

    def drop(what):
        def f(root):
            for r in rel:
                p = at(root, r)
                if p.suffix in (".pt", ".bin", ".pth", ".ckpt") and _drop_key(p, what):
                    return r.name
            return None

        return f

    def copy_rank(root):
        pairs = _ranked_pairs([at(root, r) for r in rel])
        if not pairs:
            return None
        src, dst = pairs[0]
        shutil.copyfile(src, dst)
        return dst.name

    def stray(root):
        if root.is_file():
            return None
        holder = at(root, rel[0]).parent if rel else root
        shutil.copyfile(SAMPLES / "torch" / "plain.pt", holder / "extra.pt")
        return "extra.pt"

    chosen = _pick(rel, cap)
    out = [(f"delete {r}", delete(r)) for r in chosen if sample.is_dir()]
    out += [(f"truncate {r}", truncate(r)) for r in chosen if r.suffix in STATE_SUFFIXES or r.name == ".metadata"]
    out += [(f"drop {w}", drop(w)) for w in ("param-state", "param-group", "scheduler")]
    out += [("copy rank 0 over rank 1", copy_rank), ("stray extra.pt", stray)]
    return out


def _answer(fn):
    """(kind, value): ("refused", message) for a CkptError, ("crash", traceback tail) for anything else,
    ("ok", value) otherwise."""
    from ckpt_tools.errors import CkptError

    try:
        return "ok", fn()
    except CkptError as e:
        return "refused", e.one_line()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001  any other exception is a crash the harness reports
        return "crash", f"{type(e).__name__}: {e}"[:300] + " | " + traceback.format_exc().splitlines()[-3][:200]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in _files(path):
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def commands(work: Path):
    """name -> function(path, intact) returning a comparable answer."""
    from ckpt_tools import open_checkpoint
    from ckpt_tools.ops import convert as conv
    from ckpt_tools.ops import diff as D
    from ckpt_tools.ops import export as E
    from ckpt_tools.ops import lr as LR
    from ckpt_tools.ops import to_universal as TU
    from ckpt_tools.ops.inspect import open_for_inspect, summary

    n = [0]

    def fresh(name):
        n[0] += 1
        return work / f"out{n[0]}" / name

    def inspect(p, intact):
        s = summary(open_for_inspect(p))
        for k in ("path", "files", "files_unread", "details", "warnings"):
            s.pop(k, None)
        return json.dumps(s, sort_keys=True, default=str)

    def export(p, intact):
        out = fresh("model.safetensors")
        out.parent.mkdir(parents=True)
        plan = E.plan_export(p, out)
        E.execute(plan)
        return _digest(out)

    def set_lr(p, intact):
        lp = LR.plan_set_lr(open_checkpoint(p), scale=0.5)
        return json.dumps(lp.to_json(), sort_keys=True, default=str).replace(str(p), "<ckpt>")

    def to_universal(p, intact):
        out = fresh("universal")
        plan = TU.plan_to_universal(p, out)
        return sorted(j.name for j in plan.params)

    def convert(p, intact):
        out = fresh("dcp")
        plan = conv.plan_convert(p, out, to="dcp")
        return json.dumps(plan.to_json(), sort_keys=True, default=str).replace(str(p), "<ckpt>")

    def diff(p, intact):
        rep = D.logical_diff(intact, p)
        return sorted(map(str, D.iter_lines(rep)))

    return {
        "inspect": inspect,
        "export": export,
        "set-lr --dry-run": set_lr,
        "to-universal": to_universal,
        "convert": convert,
        "diff": diff,
    }


def _warned(path: Path, piece: str) -> bool:
    """Whether opening the mutated checkpoint gives a warning (or an error) that names `piece`."""
    from ckpt_tools.errors import CkptError
    from ckpt_tools.ops.inspect import open_for_inspect

    try:
        ck = open_for_inspect(path)
    except CkptError:
        return True
    except Exception:  # noqa: BLE001
        return False
    return any(piece in (w.message + " " + (w.path or "")) for w in ck.warnings) or (
        piece in ("param-state", "param-group", "scheduler") and bool(ck.warnings)
    )


def run(samples: list[Path], cap: int | None = 6, log=None) -> list[Outcome]:
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="ckpt-mutations-") as tmp:
        tmp = Path(tmp)
        cmds = commands(tmp / "work")
        for sample in samples:
            name = str(sample.relative_to(SAMPLES)) if sample.is_relative_to(SAMPLES) else sample.name
            intact_dir = tmp / "intact" / sample.parent.name
            intact_dir.mkdir(parents=True, exist_ok=True)
            intact = intact_dir / sample.name
            if not intact.exists():
                (shutil.copytree if sample.is_dir() else shutil.copyfile)(sample, intact)
            base = {c: _answer(lambda c=c: fn(intact, intact)) for c, fn in cmds.items()}
            for mname, mutate in mutations(sample, cap):
                work = tmp / "m" / sample.parent.name
                if work.exists():
                    shutil.rmtree(work)
                work.mkdir(parents=True)
                broken = work / sample.name
                (shutil.copytree if sample.is_dir() else shutil.copyfile)(sample, broken)
                piece = mutate(broken)
                if piece is None:
                    continue
                piece = mname.split()[1] if mname.startswith("drop ") else piece
                warned = _warned(broken, piece)
                for c, fn in cmds.items():
                    if base[c][0] != "ok":
                        outcomes.append(Outcome(name, mname, c, "n/a", base[c][1][:120]))
                        continue
                    kind, val = _answer(lambda: fn(broken, intact))
                    if kind == "ok":
                        if c == "diff":
                            kind = "changed" if val else ("warned" if warned else "silent")
                        elif warned:
                            kind = "warned"
                        elif val != base[c][1]:
                            kind = "changed"
                        else:
                            kind = "silent"
                    outcomes.append(Outcome(name, mname, c, kind, str(val)[:200] if kind != "ok" else ""))
                    if log and kind in ("silent", "crash"):
                        log(f"{kind}: {name} | {mname} | {c} | {str(val)[:200]}")
    return outcomes


#: silent outcomes that no reader can turn into a warning, each with the reason (reported, not hidden: the
#: harness's table counts them as silent)
KNOWN_GAPS = {
    "custom_checkpoint_0.pkl": "Accelerate saves one custom_checkpoint_N.pkl per object registered with "
    "register_for_checkpointing and records their number nowhere: a deleted last one "
    "cannot be told from a run that registered one object fewer",
}


def known_gap(o: Outcome) -> bool:
    return o.kind == "silent" and o.mutation.startswith("delete ") and Path(o.mutation[7:]).name in KNOWN_GAPS


def table(outcomes: list[Outcome]) -> str:
    cnt = Counter((o.command, o.kind) for o in outcomes)
    kinds = ["refused", "warned", "changed", "silent", "crash", "n/a"]
    cmds = sorted({o.command for o in outcomes})
    lines = [f"{'command':18s} " + " ".join(f"{k:>8s}" for k in kinds)]
    for c in cmds:
        lines.append(f"{c:18s} " + " ".join(f"{cnt[(c, k)]:8d}" for k in kinds))
    tot = Counter(o.kind for o in outcomes)
    lines.append(f"{'total':18s} " + " ".join(f"{tot[k]:8d}" for k in kinds))
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--only", action="append")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    ss = [s for s in sample_paths() if not a.only or any(o in str(s) for o in a.only)]
    res = run(ss, a.max_files, log=lambda m: print(m, flush=True))
    print(table(res))
    applied = {(o.sample, o.mutation) for o in res}
    print(f"{len(applied)} mutations x {len({o.command for o in res})} commands = {len(res)} outcomes")
