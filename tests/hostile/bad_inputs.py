"""A corpus of broken checkpoints, generated from the samples with a fixed seed.

Each `Case` is one damaged copy: `path` is what the commands are pointed at, `names` are strings one of
which the one-line error must contain (the damaged file or folder), `codes` the exit codes that are right
for it, with `why` when 0 or 1 is allowed (damage that reading metadata cannot see, or that a check
reports as a finding rather than refusing the input).
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

SEED = 20240607


@dataclass
class Case:
    name: str
    path: Path
    kind: str  # "ds", "pipe", "other": which commands apply beyond inspect
    names: list[str]
    codes: set[int] = field(default_factory=lambda: {2})
    why: str = ""
    cmd_codes: dict[str, set[int]] = field(default_factory=dict)  # per command, overriding `codes`
    warning: str | None = None  # when inspect exits 0, its output must show this warning code

    def allowed(self, cmd: str) -> set[int]:
        return self.cmd_codes.get(cmd, self.codes)


def _copy(samples: Path, rel: str, dst: Path) -> Path:
    src = samples / rel
    out = dst / Path(rel).name
    if src.is_dir():
        shutil.copytree(src, out)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)
    return out


#: (sample, files inside it to damage, kind)
SOURCES = [
    (
        "deepspeed/zero2_bf16",
        ["global_step4/mp_rank_00_model_states.pt", "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        "ds",
    ),
    (
        "deepspeed/zero3_bf16",
        [
            "global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt",
            "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ],
        "ds",
    ),
    (
        "megatron/gpt_tp2_pp2",
        [
            "global_step4/layer_03-model_01-model_states.pt",
            "global_step4/mp_rank_01_model_states.pt",
            "global_step4/bf16_zero_pp_rank_0_mp_rank_02_optim_states.pt",
        ],
        "pipe",
    ),
    (
        "universal/zero2_bf16_universal",
        [
            "global_step4_universal/mp_rank_00_model_states.pt",
            "global_step4_universal/zero/blocks.0.attn_proj.weight/fp32.pt",
        ],
        "other",
    ),
    ("fsdp/fsdp2_dcp", [".metadata", "__0_0.distcp"], "other"),
    ("fsdp/fsdp1_sharded", ["rank0.pt"], "other"),
    (
        "accelerate/accelerate_ddp",
        ["scheduler.bin", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl", "model.safetensors"],
        "other",
    ),
    ("accelerate/accelerate_deepspeed", ["pytorch_model/mp_rank_00_model_states.pt", "scheduler.bin"], "ds"),
    ("torch/plain.pt", [""], "other"),
    ("safetensors/model.safetensors", [""], "other"),
    ("safetensors/sharded", ["model-00002-of-00002.safetensors"], "other"),
]

# reading metadata never touches these bytes: only --stats (values) or a real load would notice
_TENSOR_BYTES = (
    "a tensor member's bytes are not read by metadata-only commands (no CRC check); "
    "exit 0 is correct, the values are simply different"
)


def build(samples: Path, root: Path) -> list[Case]:
    rng = random.Random(SEED)
    cases: list[Case] = []

    def new(name: str, rel: str) -> Path:
        return _copy(samples, rel, root / name)

    for src, files, kind in SOURCES:
        sname = Path(src).name
        for rel in files:
            label = f"{sname}-{Path(rel).name or sname}"
            # truncated at 3 seeded offsets (never 0: that is the zero-byte case)
            for k in range(3):
                ck = new(f"trunc{k}-{label}", src)
                f = ck / rel if rel else ck
                size = f.stat().st_size
                cut = rng.randrange(1, size)
                with open(f, "r+b") as fh:
                    fh.truncate(cut)
                codes, why = {2}, ""
                if f.name.endswith(".distcp"):
                    codes, why = {0, 2}, "inspect reads a .distcp item only when asked for its values"
                cases.append(Case(f"trunc{k}@{cut}-{label}", ck, kind, [f.name], codes, why, _unread(src, rel)))
            ck = new(f"zero-{label}", src)
            f = ck / rel if rel else ck
            f.write_bytes(b"")
            codes, why = {2}, ""
            if f.name.endswith(".distcp"):
                codes, why = {0, 2}, "a .distcp file is opened only for values"
            cases.append(Case(f"zero-{label}", ck, kind, [f.name], codes, why, _unread(src, rel)))
            if rel.endswith((".pt", ".bin", ".pkl")) or (not rel and src.endswith(".pt")):
                cases += _zip_flips(new, src, rel, label, kind, rng)
            if rel.endswith(".safetensors") or src.endswith(".safetensors"):
                cases += _safetensors_lies(new, src, rel, label, kind)
    cases += _structural(new, samples)
    return cases


def _zip_flips(new, src, rel, label, kind, rng) -> list[Case]:
    out = []
    for member in ("data.pkl", "data/N"):
        ck = new(f"flip-{member.replace('/', '')}-{label}", src)
        f = ck / rel if rel else ck
        with zipfile.ZipFile(f) as zf:
            infos = [
                i
                for i in zf.infolist()
                if i.file_size
                and (i.filename.endswith("/data.pkl") if member == "data.pkl" else "/data/" in i.filename)
            ]
        if not infos:
            shutil.rmtree(ck.parent)
            continue
        info = infos[0]
        raw = bytearray(f.read_bytes())
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
        start = info.header_offset + 30 + name_len + extra_len
        pos = start + rng.randrange(info.file_size)
        raw[pos] ^= 0xFF
        f.write_bytes(bytes(raw))
        if member == "data.pkl":
            codes, why = (
                {0, 2},
                (
                    "a flipped byte inside a string or number of data.pkl changes a key or a "
                    "value: read as such, or refused when it breaks the opcode stream"
                ),
            )
        else:
            codes, why = {0}, _TENSOR_BYTES + "; check-tp-sync compares replica bytes, so there it may be a finding (1)"
        out.append(
            Case(
                f"flip-{member}@{pos}-{label}",
                ck,
                kind,
                [f.name],
                codes,
                why,
                {"check-tp-sync": codes | {1}} if member != "data.pkl" else {},
            )
        )
    return out


def _unread(src: str, rel: str) -> dict[str, set[int]]:
    # to-universal converts the DeepSpeed tag folder only; an Accelerate scheduler.bin beside it is not its input
    if src.endswith("accelerate_deepspeed") and not rel.startswith("pytorch_model/"):
        return {"to-universal": {0}}
    return {}


def _safetensors_lies(new, src, rel, label, kind) -> list[Case]:
    out = []

    def header(f: Path) -> tuple[dict, bytes]:
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        return json.loads(raw[8 : 8 + n]), raw[8 + n :]

    def write(f: Path, hdr: dict, body: bytes, length: int | None = None) -> None:
        h = json.dumps(hdr).encode()
        f.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + body)

    lies = {
        "offsets-past-end": lambda h: _first(h).__setitem__("data_offsets", [0, 10**9]),
        "offsets-reversed": lambda h: _first(h).__setitem__("data_offsets", [64, 8]),
        "offsets-wrong-size": lambda h: _first(h).__setitem__(
            "data_offsets", [_first(h)["data_offsets"][0], _first(h)["data_offsets"][0] + 3]
        ),
        "shape-too-big": lambda h: _first(h).__setitem__("shape", [10**6, 10**6]),
        "bad-dtype": lambda h: _first(h).__setitem__("dtype", "Q7"),
        "not-a-dict": lambda h: h.__setitem__(next(k for k in h if k != "__metadata__"), [1, 2]),
    }
    for lie, edit in lies.items():
        ck = new(f"st-{lie}-{label}", src)
        f = ck / rel if rel else ck
        hdr, body = header(f)
        edit(hdr)
        write(f, hdr, body)
        out.append(Case(f"st-{lie}-{label}", ck, kind, [f.name]))
    ck = new(f"st-hdrlen-huge-{label}", src)
    f = ck / rel if rel else ck
    hdr, body = header(f)
    write(f, hdr, body, length=2**62)
    out.append(Case(f"st-hdrlen-huge-{label}", ck, kind, [f.name]))
    ck = new(f"st-hdr-not-json-{label}", src)
    f = ck / rel if rel else ck
    f.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 64)
    out.append(Case(f"st-hdr-not-json-{label}", ck, kind, [f.name]))
    return out


def _first(h: dict) -> dict:
    return h[next(k for k in h if k != "__metadata__")]


def _structural(new, samples: Path) -> list[Case]:
    """Damage to the layout rather than to one file's bytes."""
    out: list[Case] = []
    z2 = "deepspeed/zero2_bf16"

    ck = new("missing-optim-rank", z2)
    (ck / "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    out.append(Case("missing-optim-rank", ck, "ds", ["zero_pp_rank_1", "global_step4"]))

    ck = new("missing-model-states", z2)
    (ck / "global_step4/mp_rank_00_model_states.pt").unlink()
    out.append(Case("missing-model-states", ck, "ds", ["global_step4", "zero2_bf16"]))

    ck = new("extra-rank-other-run", z2)
    shutil.copy2(
        samples / "deepspeed/zero2_fp32/global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ck / "global_step4/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
    )
    out.append(
        Case(
            "extra-rank-other-run",
            ck,
            "ds",
            ["zero_pp_rank_2", "global_step4"],
            {0, 2},
            "a rank file beyond dp_world_size: shown as a warning (the files of the run are complete)",
            warning="extra-rank-file",
        )
    )

    ck = new("rank-from-other-run", z2)
    shutil.copy2(
        samples / "deepspeed/zero2_fp32/global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ck / "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    )
    out.append(
        Case(
            "rank-from-other-run",
            ck,
            "ds",
            ["zero_pp_rank_1", "global_step4"],
            {0, 2},
            "an fp32 run's optimizer file renamed into a bf16 run: same shapes, same world size; "
            "the reader may accept it (it cannot know which run a file came from)",
        )
    )

    ck = new("mixed-world-sizes", z2)
    _edit_model_states(ck / "global_step4/mp_rank_00_model_states.pt", dp_world_size=4)
    out.append(Case("mixed-world-sizes", ck, "ds", ["zero_pp_rank", "global_step4", "dp_world_size"]))

    ck = new("mixed-zero-stages", z2)
    shutil.copy2(
        samples / "deepspeed/zero3_bf16/global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt",
        ck / "global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt",
    )
    out.append(
        Case(
            "mixed-zero-stages",
            ck,
            "ds",
            ["global_step4", "zero_pp_rank_1"],
            {0, 2},
            "a stray ZeRO-3 per-rank model file inside a ZeRO-2 tag: refused or reported as a warning",
        )
    )

    ck = new("latest-missing-tag", z2)
    (ck / "latest").write_text("global_step999")
    out.append(Case("latest-missing-tag", ck, "ds", ["latest"]))

    ck = new("latest-garbage", z2)
    (ck / "latest").write_bytes(b"\xff\xfe\x00garbage\n")
    shutil.rmtree(ck / "global_step4")
    out.append(Case("latest-garbage", ck, "ds", ["zero2_bf16", "latest"]))

    ck = new("megatron-missing-layer", "megatron/gpt_tp2_pp2")
    (ck / "global_step4/layer_05-model_01-model_states.pt").unlink()
    out.append(Case("megatron-missing-layer", ck, "pipe", ["layer_05", "global_step4"]))

    ck = new("megatron-missing-mp-rank", "megatron/gpt_tp2_pp2")
    (ck / "global_step4/mp_rank_03_model_states.pt").unlink()
    out.append(Case("megatron-missing-mp-rank", ck, "pipe", ["mp_rank_03", "global_step4"]))

    ck = new("megatron-extra-tp-rank", "megatron/gpt_tp2_pp2")
    shutil.copy2(
        ck / "global_step4/layer_03-model_01-model_states.pt", ck / "global_step4/layer_03-model_02-model_states.pt"
    )
    out.append(
        Case(
            "megatron-extra-tp-rank",
            ck,
            "pipe",
            ["model_02", "layer_03", "global_step4"],
            {0, 1, 2},
            "a third TP file for one layer: refused, or reported as a finding",
        )
    )

    ck = new("dcp-no-metadata", "fsdp/fsdp2_dcp")
    (ck / ".metadata").unlink()
    out.append(Case("dcp-no-metadata", ck, "other", ["fsdp2_dcp", ".metadata"]))

    ck = new("dcp-missing-distcp", "fsdp/fsdp2_dcp")
    (ck / "__1_0.distcp").unlink()
    out.append(Case("dcp-missing-distcp", ck, "other", ["__1_0.distcp"]))

    ck = new("fsdp1-missing-rank", "fsdp/fsdp1_sharded")
    (ck / "rank1.pt").unlink()
    out.append(
        Case(
            "fsdp1-missing-rank",
            ck,
            "other",
            ["rank1", "fsdp1_sharded"],
            {0, 2},
            "a lone FSDP1 rank file is a valid torch file by itself",
        )
    )

    ck = new("universal-missing-fp32", "universal/zero2_bf16_universal")
    (ck / "global_step4_universal/zero/blocks.0.attn_proj.weight/fp32.pt").unlink()
    out.append(
        Case(
            "universal-missing-fp32",
            ck,
            "other",
            ["fp32.pt", "blocks.0.attn_proj.weight"],
            {0, 2},
            "one parameter's fp32.pt missing: inspect shows the rest and warns",
            warning="missing-state",
        )
    )

    ck = new("universal-latest-missing", "universal/zero2_bf16_universal")
    (ck / "latest_universal").write_text("global_step7_universal")
    out.append(Case("universal-latest-missing", ck, "other", ["latest_universal"]))

    ck = new("sharded-index-missing-shard", "safetensors/sharded")
    (ck / "model-00002-of-00002.safetensors").unlink()
    out.append(Case("sharded-index-missing-shard", ck, "other", ["model-00002-of-00002.safetensors"]))

    ck = new("sharded-index-not-json", "safetensors/sharded")
    (ck / "model.safetensors.index.json").write_text("{ nope")
    out.append(Case("sharded-index-not-json", ck, "other", ["model.safetensors.index.json"]))

    ck = new("accel-missing-model", "accelerate/accelerate_ddp")
    (ck / "model.safetensors").unlink()
    out.append(
        Case(
            "accel-missing-model",
            ck,
            "other",
            ["accelerate_ddp", "model.safetensors"],
            {0, 2},
            "an Accelerate folder without weights still holds optimizer/scheduler state to show",
        )
    )

    d = Path(str(new("unrelated", "torch/plain.pt"))).parent
    (d / "plain.pt").unlink()
    (d / "notes.txt").write_text("hello\n")
    (d / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4)
    (d / "data.json").write_text('{"a": 1}')
    (d / "sub").mkdir()
    (d / "sub" / "x.csv").write_text("a,b\n1,2\n")
    out.append(Case("unrelated-files", d, "other", ["unrelated"]))

    d = new("text-named-pt", "torch/plain.pt")
    d.write_text("this is not a checkpoint\n")
    out.append(Case("text-named-pt", d, "other", ["plain.pt"]))

    d = new("pickle-header-garbage", "torch/plain.pt")
    d.write_bytes(b"\x80\x02" + bytes(random.Random(SEED).randrange(256) for _ in range(4096)))
    out.append(Case("pickle-header-garbage", d, "other", ["plain.pt"]))

    d = new("zip-without-pickle", "torch/plain.pt")
    with zipfile.ZipFile(d, "w") as zf:
        zf.writestr("archive/readme.txt", "no data.pkl here")
    out.append(Case("zip-without-pickle", d, "other", ["plain.pt"]))

    d = new("zip-compressed-members", "torch/plain.pt")
    with zipfile.ZipFile(samples / "torch/plain.pt") as zin, zipfile.ZipFile(d, "w", zipfile.ZIP_DEFLATED) as zout:
        for i in zin.infolist():
            zout.writestr(i.filename, zin.read(i.filename))
    out.append(
        Case(
            "zip-compressed-members",
            d,
            "other",
            ["plain.pt"],
            {0, 2},
            "a deflated torch zip: its pickle reads, tensor bytes are refused only when read",
        )
    )

    ck = new("rank-file-is-a-folder", z2)
    f = ck / "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.unlink()
    f.mkdir()
    out.append(Case("rank-file-is-a-folder", ck, "ds", ["zero_pp_rank_1", "global_step4"]))

    ck = new("symlink-loop", z2)
    f = ck / "global_step4/mp_rank_00_model_states.pt"
    f.unlink()
    f.symlink_to(f.name)
    out.append(Case("symlink-loop", ck, "ds", ["mp_rank_00_model_states.pt", "global_step4"]))

    ck = new("empty-tag-folder", z2)
    for p in (ck / "global_step4").iterdir():
        p.unlink()
    out.append(Case("empty-tag-folder", ck, "ds", ["zero2_bf16", "global_step4", "latest"]))

    d = root_empty = new("empty-dir", "torch/plain.pt").parent / "empty"
    root_empty.mkdir()
    out.append(Case("empty-dir", d, "other", ["empty"]))

    out.append(
        Case("no-such-path", new("no-such", "torch/plain.pt").parent / "does-not-exist", "other", ["does-not-exist"])
    )
    return out


def _edit_model_states(f: Path, **changes) -> None:
    """Change top-level fields of a DeepSpeed model_states file (through torch: it is our own sample)."""
    import torch

    sd = torch.load(f, map_location="cpu", weights_only=False)
    sd.update(changes)
    torch.save(sd, f)
