"""The hostile corpus, run through every command: each hostile copy of a bundled sample (every format reader: DeepSpeed
ZeRO and MoE, the Megatron-DeepSpeed pipeline, Megatron-LM legacy / torch_dist / distributed optimizer, DCP and
torchtitan, FSDP1, torchtune, HF Trainer, Accelerate, Lightning, universal, torch files legacy and zip) x every
command: the read-only ones, every writer for real (not --dry-run: a missed payload would be written), and `ckpt
resume` (each framework's planner). Locally and over a real S3 server (moto, on 127.0.0.1).

The runs happen in one child process (`hostile/corpus_driver.py`): a signal death there fails the test naming the
run. Counted: payloads executed (marker files), signal deaths, tracebacks, hangs, a writer or resume that went ahead
(exit 0), payloads in any file written (scanned by the test's own opcode walk, `hostile.scan`), changes to a source.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLES
from hostile import pickles as H
from hostile.runner import snapshot
from hostile.scan import file_globals

#: more targets than the reader tests' (hostile.pickles.TARGETS): the formats added since, all payloads at once
EXTRA_TARGETS = [
    ("megatron_lm", "megatron_tp2_legacy", "iter_0000010/mp_rank_01/model_optim_rng.pt", "setitem"),
    ("megatron_lm", "megatron_pp2_torch_dist", "iter_0000010/common.pt", "setitem"),
    ("megatron_lm", "megatron_dp2_distopt_legacy", "iter_0000010/mp_rank_00/distrib_optim.pt", "setitem"),
    ("torchtune", "torchtune_full", "recipe_state/recipe_state.pt", "setitem"),
    ("dcp", "torchtitan_real", "step-5/.metadata", "prefix"),
    ("hf_trainer", "hf_trainer_ddp", "checkpoint-4/optimizer.pt", "setitem"),
    ("lightning", "onecycle.ckpt", "", "setitem"),
    ("moe", "moe_zero2_bf16", "global_step4/layer_1_expert_2_mp_rank_00_model_states.pt", "setitem"),
    ("accelerate", "accelerate_two_models", "optimizer_1.bin", "setitem"),
]

READ_ONLY = ("inspect", "diff", "check-tp-sync")


def _extra_cases(root: Path, markers: Path) -> list[H.Hostile]:
    out = []
    names = list(H.payloads(Path("x")))
    for group, name, rel, mode in EXTRA_TARGETS:
        case = f"x-{name}"
        src = SAMPLES / group / name
        dst = root / case / name
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            dst.parent.mkdir(parents=True)
            shutil.copy2(src, dst)
        f = dst / rel if rel else dst
        marker = markers / case
        want: list[str] = []
        for i, p in enumerate(names):
            code, gl = H.payloads(marker)[p]
            H.poison_file(f, code, mode, key=f"ckpt_hostile_{i}")
            want += [g for g in gl if g not in want]
        ck = f.parent if name == "torchtitan_real" else dst
        out.append(H.Hostile(case, ck, f, marker, want, "plain"))
    return out


def _clean_twin(c: H.Hostile) -> Path | None:
    rel = c.ckpt.relative_to(
        c.ckpt.parents[1] if c.ckpt.parent.name.startswith(("x-", "t", "p-", "deep")) else c.ckpt.parent
    )
    for cand in (*SAMPLES.glob(f"*/{c.ckpt.name}"), *SAMPLES.glob(f"*/*/{c.ckpt.name}")):
        if cand.name == rel.name:
            return cand
    return None


def _jobs(cases: list[H.Hostile], out: Path, source=lambda c: str(c.ckpt)) -> list[dict]:
    jobs = []
    for c in cases:
        ck = source(c)
        o = out / c.name
        twin = _clean_twin(c)
        argvs = {
            "inspect": ["inspect", ck],
            "inspect-json": ["inspect", ck, "--json"],
            "diff": ["diff", str(twin), ck] if twin is not None else None,
            "check-tp-sync": ["check-tp-sync", ck],
            "set-lr": ["set-lr", ck, "--scale", "0.5", "--yes"],
            "set-step": ["set-step", ck, "--step", "7", "--yes"],
            "sync-tp": ["sync-tp", ck, "--yes"],
            "to-universal": ["to-universal", ck, f"{o}-universal"],
            "convert-dcp": ["convert", ck, f"{o}-dcp", "--to", "dcp"],
            "convert-megatron": ["convert", ck, f"{o}-megatron", "--to", "megatron"],
            "convert-torch": ["convert", ck, f"{o}-torch.pt", "--to", "torch"],
            "export": ["export", ck, f"{o}.safetensors"],
            "export-hf": ["export", ck, f"{o}-hf", "--hf"],
            "resume": ["resume", ck, "--steps", "1", "--device", "cpu"],
        }
        jobs += [
            {"id": f"{c.name}|{cmd}", "argv": argv, "case": c.name, "cmd": cmd}
            for cmd, argv in argvs.items()
            if argv is not None
        ]
    return jobs


def _run_driver(jobs: list[dict], tmp: Path, env: dict | None = None, timeout: float = 1500) -> dict[str, dict]:
    jf, rf = tmp / "jobs.json", tmp / "results.jsonl"
    jf.write_text(json.dumps(jobs))
    rf.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "hostile" / "corpus_driver.py"), str(jf), str(rf)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    results: dict[str, dict] = {}
    started = []
    for line in rf.read_text().splitlines():
        d = json.loads(line)
        if d.get("start"):
            started.append(d["id"])
        else:
            results[d["id"]] = d
    dead = [j for j in started if j not in results]
    assert proc.returncode == 0, f"the driver died (exit {proc.returncode}) during {dead}: {proc.stderr[-2000:]}"
    assert len(results) == len(jobs), f"{len(jobs) - len(results)} runs missing: {proc.stderr[-2000:]}"
    return results


def _judge(cases: list[H.Hostile], jobs: list[dict], results: dict[str, dict]) -> list[str]:
    by_case = {c.name: c for c in cases}
    problems = []
    for j in jobs:
        r, c = results[j["id"]], by_case[j["case"]]
        where = j["id"]
        if r["traceback"]:
            problems.append(f"{where}: traceback {r['traceback'][-600:]}")
        if r["hung"]:
            problems.append(f"{where}: hung")
        if j["cmd"] not in READ_ONLY and j["cmd"] not in ("inspect-json",) and r["code"] != 2:
            problems.append(
                f"{where}: exit {r['code']} (a writer or resume must refuse a hostile source: 2) {r['errors']}"
            )
        if j["cmd"] in ("inspect", "inspect-json") and (r["code"] != 0 or not r["warned"]):
            problems.append(f"{where}: exit {r['code']}, no unknown-global warning {r['errors']}")
    for c in cases:
        if c.marker.exists():
            problems.append(f"{c.name}: a payload RAN")
    return problems


def _refused_for_the_payload(jobs: list[dict], results: dict[str, dict]) -> int:
    """Writer and resume runs whose one-line refusal is the pickle check's (not some other reason to stop)."""
    return sum(
        1
        for j in jobs
        if j["cmd"] not in READ_ONLY + ("inspect-json",)
        and any("not a class real checkpoints carry" in e for e in results[j["id"]]["errors"])
    )


def _outputs_clean(out: Path) -> list[str]:
    from ckpt_tools.read import allowlist

    bad = []
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        gl, names = file_globals(f)
        bad += [
            f"{f}: {m}.{n}" for m, n in gl if not allowlist.is_allowed(m, n) and (m, n) not in allowlist.CHECKED_CALLS
        ]
        bad += [f"{f}: member {n}" for n in names if ".." in n]
    return bad


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    markers = root / "markers"
    cases = H.build_corpus(SAMPLES, root / "ckpts", markers)
    # every payload at once per target, the deep ones and the legacy files (the one-payload cases are the reader
    # tests' business), and the formats added since
    cases = [c for c in cases if not c.name.startswith("p-")] + _extra_cases(root / "extra", markers)
    return root, cases


def test_corpus_through_every_command(corpus, tmp_path):
    root, cases = corpus
    out = tmp_path / "out"
    out.mkdir()
    before = {c.name: snapshot(c.ckpt if c.ckpt.is_dir() else c.ckpt.parent) for c in cases}
    jobs = _jobs(cases, out)
    results = _run_driver(jobs, tmp_path)
    problems = _judge(cases, jobs, results)
    problems += [
        f"{c.name}: the source changed"
        for c in cases
        if snapshot(c.ckpt if c.ckpt.is_dir() else c.ckpt.parent) != before[c.name]
    ]
    problems += _outputs_clean(out)
    gated = _refused_for_the_payload(jobs, results)
    print(
        f"hostile corpus: {len(cases)} checkpoints, {len(jobs)} runs ({gated} writer/resume runs refused by the "
        f"pickle check, the rest for another reason); {len(problems)} problems"
    )
    assert len(jobs) >= 300 and gated >= 200
    assert not problems, "\n".join(problems[:40])


def test_corpus_over_s3(corpus, tmp_path):
    """A checkpoint of each reader family from the corpus, uploaded to a real S3 server and read through s3://."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    import test_remote_s3 as S

    root, cases = corpus
    picked = [
        c
        for c in cases
        if c.name.startswith(
            (
                "t00-",
                "t03-",
                "t11-",
                "t13-",
                "deep-dcp",
                "x-megatron_pp2",
                "x-megatron_tp2",
                "x-torchtitan",
                "x-torchtune",
            )
        )
    ]
    assert len(picked) >= 8
    with S.moto_server(tmp_path / "moto.log") as endpoint:
        fs = S._fs(endpoint)
        fs.mkdir("corpus")
        urls = {}
        for c in picked:
            key = f"corpus/{c.name}/{c.ckpt.name}"
            fs.put(str(c.ckpt), key, recursive=c.ckpt.is_dir())
            urls[c.name] = f"s3://{key}"
        out = tmp_path / "out"
        out.mkdir()
        tmpdir = tmp_path / "tmp"
        tmpdir.mkdir()
        jobs = _jobs(picked, out, source=lambda c: urls[c.name])
        results = _run_driver(jobs, tmp_path, env=S._env(endpoint, TMPDIR=str(tmpdir)))
        problems = _judge(picked, jobs, results) + _outputs_clean(out)
        gated = _refused_for_the_payload(jobs, results)
        print(
            f"hostile corpus over S3: {len(picked)} checkpoints, {len(jobs)} runs ({gated} refused by the pickle "
            f"check); {len(problems)} problems"
        )
        assert gated >= 40
        assert not problems, "\n".join(problems[:40])
        assert not list(tmpdir.glob("ckpt-remote-*")), "a remote mirror was left behind"
