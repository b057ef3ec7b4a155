"""`ckpt resume` without the user's model: a replica of the checkpoint's parameters, a synthetic loss with a known
gradient, and the optimizer state checked against the closed-form Adam step applied to the saved state.

The unseen-model checkpoints are made here by real DeepSpeed (2 CPU ranks, gloo) with
`ckpt_tools.samples.workers.ds_unseen` (a 3-block MLP `ckpt` has no recipe for, two param groups of different LR
and weight decay, a torch CosineAnnealingLR) in a module-scoped temporary folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import run_cli, sample
from ckpt_tools.resume import frameworks as ops
from ckpt_tools.train import replica as R


def ckpt(*args, expect=0, env=None):
    proc = run_cli(*args, env=env)
    assert proc.returncode == expect, f"exit {proc.returncode} (wanted {expect}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def checks(doc) -> dict[str, dict]:
    if isinstance(doc, ops.ResumeResult):
        doc = doc.to_dict()
    return {c["name"]: c for c in doc["checks"]}


@pytest.fixture(scope="module")
def unseen(tmp_path_factory):
    """name -> a DeepSpeed checkpoint of the unseen MLP, made on first use."""
    from ckpt_tools.samples import run_torchrun

    from ckpt_tools.samples.workers._common import then
    from ckpt_tools.samples.workers.ds_unseen import VARIANTS

    out = tmp_path_factory.mktemp("unseen")

    def get(name: str) -> Path:
        if not (out / f"{name}.manifest.json").exists():  # all variants on first use, in one launch
            argv = then(*(["--sample", v, "--out", str(out)] for v in VARIANTS))
            run_torchrun("ckpt_tools.samples.workers.ds_unseen", 2, argv)
        return out / name

    return get


@pytest.fixture(scope="module")
def unseen_universal(unseen, tmp_path_factory) -> Path:
    """`ckpt to-universal` of unseen_zero2 (tests that edit it work on a copy)."""
    uni = tmp_path_factory.mktemp("unseen_universal") / "uni"
    ckpt("to-universal", unseen("unseen_zero2"), uni)
    return uni


# --- the closed forms against torch's own optimizers (no DeepSpeed) -----------------------------------------


def _state(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    return p, torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4, torch.randn(n, generator=g) * 1e-2


@pytest.mark.parametrize(
    "cls,decoupled,amsgrad",
    [(torch.optim.AdamW, True, False), (torch.optim.Adam, False, False), (torch.optim.AdamW, True, True)],
)
def test_expected_adam_matches_torch(cls, decoupled, amsgrad):
    """Three steps of a real torch Adam(W) from a non-zero state (step 7) against the formula, chained."""
    p0, m0, v0, grad = _state(257, 1)
    param = torch.nn.Parameter(p0.clone())
    opt = cls([param], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, amsgrad=amsgrad)
    st = {"step": torch.tensor(7.0), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    if amsgrad:
        st["max_exp_avg_sq"] = v0.clone() * 1.5
    opt.state[param] = st
    cur = {"param": p0, "exp_avg": m0, "exp_avg_sq": v0, "step": 7, "max_exp_avg_sq": st.get("max_exp_avg_sq")}
    cur = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in cur.items()}
    for lr in (3e-3, 2e-3, 1e-3):
        opt.param_groups[0]["lr"] = lr
        param.grad = grad.clone()
        saved = cur["param"]
        opt.step()
        cur = R.expected_adam(
            cur["param"],
            grad,
            cur["exp_avg"],
            cur["exp_avg_sq"],
            cur["step"],
            lr=lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.05,
            decoupled=decoupled,
            amsgrad=amsgrad,
            max_exp_avg_sq=cur.get("max_exp_avg_sq"),
        )
        assert cur["step"] == int(opt.state[param]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert R.state_close(opt.state[param][key], cur[key], "moment")[0], key
        assert R.state_close(param.detach(), cur["param"], "param", saved=saved)[0]
    # and the check has teeth: the same step from a zeroed exp_avg is far outside the tolerance
    bad = R.expected_adam(
        p0,
        grad,
        torch.zeros_like(m0),
        v0,
        7,
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.05,
        decoupled=decoupled,
    )
    good = R.expected_adam(
        p0, grad, m0, v0, 7, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, decoupled=decoupled
    )
    assert not R.state_close(bad["exp_avg"], good["exp_avg"], "moment")[0]
    assert not R.state_close(bad["param"], good["param"], "param", saved=p0)[0]


@pytest.mark.parametrize("momentum,dampening,nesterov", [(0.9, 0.0, False), (0.9, 0.0, True), (0.8, 0.1, False)])
def test_expected_sgd_matches_torch(momentum, dampening, nesterov):
    p0, buf0, _, grad = _state(129, 2)
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([param], lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=0.01)
    cur = {"param": p0.clone(), "momentum_buffer": None}
    for _ in range(3):
        param.grad = grad.clone()
        saved = cur["param"]
        opt.step()
        cur = R.expected_sgd(
            cur["param"],
            grad,
            cur["momentum_buffer"],
            lr=0.1,
            momentum=momentum,
            dampening=dampening,
            weight_decay=0.01,
            nesterov=nesterov,
        )
        assert R.state_close(opt.state[param]["momentum_buffer"], cur["momentum_buffer"], "moment")[0]
        assert R.state_close(param.detach(), cur["param"], "param", saved=saved)[0]


def test_replica_mirrors_a_real_model():
    """Names, order, dtypes, frozen and tied parameters of a real model; its state dict loads strictly."""
    from ckpt_tools.samples.workers import ds_unseen

    model = ds_unseen.build(ds_unseen.VARIANTS["unseen_zero1_tied"]).to(torch.bfloat16)
    specs = [
        R.ParamSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
        for n, p in model.named_parameters()
    ]
    rep = R.build_replica(specs, tied={"head.weight": "embed.weight"})
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in rep.named_parameters()] == [
        (n, p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()
    ]
    assert set(rep.state_dict()) == set(model.state_dict())
    rep.load_state_dict(model.state_dict(), strict=True)
    assert rep.head.weight is rep.embed.weight
    # an order the nesting alone would not give (a child's parameter before its parent's own)
    odd = [
        R.ParamSpec("a.b.w", (2,), "float32"),
        R.ParamSpec("a.w", (3,), "float32"),
        R.ParamSpec("c", (1,), "float16"),
    ]
    assert [n for n, _ in R.build_replica(odd).named_parameters()] == ["a.b.w", "a.w", "c"]


def test_synthetic_gradient_is_exact():
    specs = [
        R.ParamSpec("x.w", (300, 40), "bfloat16"),
        R.ParamSpec("x.b", (40,), "float16"),
        R.ParamSpec("y", (7,), "float32", requires_grad=False),
    ]
    d = R.synthetic_directions(specs, seed=3, max_norm=1.0)
    assert set(d) == {"x.w", "x.b"} and R.grad_norm(d) <= 0.5
    assert all(torch.equal(r.to(torch.bfloat16).float(), r) and torch.equal(r.half().float(), r) for r in d.values())
    assert all(torch.equal(a, b) for a, b in zip(d.values(), R.synthetic_directions(specs, seed=3).values()))
    rep = R.build_replica(specs)
    R.synthetic_loss(rep, d).backward()
    for n, p in rep.named_parameters():
        assert (p.grad is None) if n == "y" else torch.equal(p.grad.float(), d[n])
    assert R.clip_factor(d, 1.0) == 1.0 and 0 < R.clip_factor(d, R.grad_norm(d) / 4) < 0.26


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 5], 0.3),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10, 1e-5),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, [1e-2, 2e-2], total_steps=12),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 3, 2),
        lambda o: torch.optim.lr_scheduler.PolynomialLR(o, 8, 2.0),
    ],
    ids=["step", "multistep", "cosine", "linear", "onecycle", "warmrestarts", "polynomial"],
)
def test_torch_schedulers_rebuild_from_their_state(make):
    """A torch scheduler's state dict alone (what DeepSpeed saves: no class name) gives the next LRs."""
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.AdamW([{"params": [params[0]], "lr": 1e-3}, {"params": [params[1]], "lr": 3e-3}])
    sched = make(opt)
    for _ in range(4):
        opt.step()
        sched.step()
    state = sched.state_dict()
    lrs = [g["lr"] for g in opt.param_groups]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    want = []
    for _ in range(4):
        want.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert R.infer_torch_scheduler(state) == type(sched).__name__
    got = R.expected_torch_lrs(state, lrs, 4, saved_groups=groups)
    assert [x for row in got for x in row] == pytest.approx([x for row in want for x in row], rel=1e-12)


# --- model-free resumes with real DeepSpeed -----------------------------------------------------------------


def test_unseen_model_zero2_resumes_model_free(unseen, capsys):
    """The issue's case: a ZeRO-2 checkpoint of a model ckpt has never seen, `--model auto`: all rows pass."""
    src = unseen("unseen_zero2")
    # one resume, as `ckpt resume SRC --steps 2` runs it; its --json document and its human output (the CLI's
    # own renderer) both come from this one result
    result = ops.run_resume(ops.plan_resume(src, steps=2, device="cpu", model="auto"))
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["plan"]["model"] == "replica"
    c = checks(doc)
    assert {k: v["status"] for k, v in c.items()} == {
        "global step": "pass",
        "optimizer step": "pass",
        "learning rate": "pass",
        "optimizer state": "pass",
        "loss": "n/a",
    }
    assert "--model" in c["loss"]["detail"]
    assert "CosineAnnealingLR rebuilt from its saved state" in c["learning rate"]["detail"]
    # two groups of different LR, each continuing its own schedule
    lr5, lr6 = (r["lr"] for r in doc["records"])
    assert lr5[0] != lr5[1] and lr5 != lr6
    assert [r["actual"]["step"] for r in c["optimizer state"]["rows"]] == [5, 6]
    assert "26 parameters" in c["optimizer state"]["detail"]
    # the human output has the row and says what needs --model
    from ckpt_cli.resume import _render

    _render(result, quiet=False)
    out = capsys.readouterr().out
    assert "optimizer state" in out and "needs --model" in out and "verdict" in out


@pytest.mark.parametrize(
    "where,name",
    [
        pytest.param("unseen", "unseen_zero1_tied", marks=pytest.mark.slow),
        ("unseen", "unseen_zero3"),
        pytest.param("unseen", "unseen_zero2_sgd", marks=pytest.mark.slow),
        ("deepspeed", "zero3_bf16"),
        ("deepspeed", "zero2_bf16"),
    ],
)
def test_model_free_on_other_layouts(unseen, where, name):
    """Tied + frozen parameters (ZeRO-1), ZeRO-3 with DeepSpeed's own AdamW and WarmupLR, torch SGD with
    Nesterov momentum and a StepLR, and the bundled bf16 samples forced model-free (the fp32 master is what
    is checked)."""
    src = unseen(name) if where == "unseen" else sample(where, name)
    doc = json.loads(ckpt("resume", src, "--steps", "2", "--model", "replica", "--json").stdout)
    c = checks(doc)
    assert c["optimizer state"]["status"] == "pass", c["optimizer state"]
    want = "n/a" if name.endswith("_sgd") else "pass"  # SGD keeps no step counter
    assert c["optimizer step"]["status"] == want
    assert all(v["status"] == "pass" for k, v in c.items() if k not in ("loss", "optimizer step")), c
    if name.endswith("_sgd"):
        assert "momentum buffer" in c["optimizer state"]["detail"]


@pytest.mark.slow
def test_dp2_to_dp1_universal_model_free(unseen, unseen_universal):
    """The universal output at another DP size: one process accumulates two micro-batches (the synthetic
    gradient stays exact) and the optimizer state still follows the formula, also checked `--against` the
    source checkpoint (the untouched output passes: the control of the zeroed-moment test below)."""
    src = unseen("unseen_zero2")
    args = ("--universal", "--nproc", "1", "--steps", "2", "--against", src, "--json")
    doc = json.loads(ckpt("resume", unseen_universal, *args).stdout)
    assert (doc["plan"]["dp"], doc["plan"]["gas"]) == (1, 2)
    assert all(c["status"] in ("pass", "n/a") for c in doc["checks"]), doc["checks"]
    assert checks(doc)["optimizer state"]["status"] == "pass"


def test_universal_with_a_zeroed_moment_fails_the_optimizer_state_check(unseen, unseen_universal, tmp_path):
    """`ckpt to-universal`, one Adam moment zeroed by hand: resumed with `--universal --against` the source
    checkpoint, the optimizer-state row fails (exit 1) while counters and LR pass. (The untouched universal
    output passes: test_dp2_to_dp1_universal_model_free.)"""
    import shutil

    src = unseen("unseen_zero2")
    uni = tmp_path / "uni"
    shutil.copytree(unseen_universal, uni)
    moment = uni / "global_step4_universal" / "zero" / "blocks.1.proj_in.weight" / "exp_avg.pt"
    blob = torch.load(moment, weights_only=False)  # test-only surgery on a file we just wrote
    blob["param"] = torch.zeros_like(blob["param"])
    torch.save(blob, moment)
    doc = json.loads(ckpt("resume", uni, "--universal", "--steps", "1", "--against", src, "--json", expect=1).stdout)
    c = checks(doc)
    assert (c["global step"]["status"], c["optimizer step"]["status"], c["learning rate"]["status"]) == (
        "pass",
        "pass",
        "pass",
    )
    assert c["optimizer state"]["status"] == "fail"
    assert "exp_avg of blocks.1.proj_in.weight" in c["optimizer state"]["detail"]


def test_skipped_optimizer_and_scheduler_loads_are_caught(unseen):
    """The worker told not to load the optimizer state (Adam restarts) or the scheduler state (the cosine
    restarts): the optimizer-state row, resp. the LR row, fails."""
    src = unseen("unseen_zero2")
    plan = ops.plan_resume(src, steps=2, device="cpu")
    no_opt = ops.run_resume(replace(plan, load_optimizer_states=False))
    c = checks(no_opt)
    assert not no_opt.ok and c["optimizer state"]["status"] == "fail" and c["optimizer step"]["status"] == "fail"
    no_sched = ops.run_resume(replace(plan, load_lr_scheduler_states=False))
    c = checks(no_sched)
    assert c["global step"]["status"] == "pass" and c["learning rate"]["status"] == "fail"
    rows = {r["step"]: r for r in c["learning rate"]["rows"]}
    assert rows[5]["ok"] and not rows[6]["ok"]  # step 5 runs at the saved LR; the fresh cosine then restarts


def test_lambdalr_without_and_with_its_function():
    """A LambdaLR's function is not in the checkpoint: model-free, only the first resumed LR and the loaded
    state are checked (the verdict says so); with --scheduler module:function every step is."""
    src = sample("deepspeed", "zero2_lambdalr")
    c = checks(json.loads(ckpt("resume", src, "--model", "replica", "--steps", "2", "--json").stdout))
    lr = c["learning rate"]
    assert lr["status"] == "pass" and "NOT checked" in lr["detail"] and "--scheduler" in lr["detail"]
    assert "state was loaded" in lr["detail"]
    assert c["optimizer state"]["status"] == "pass" and "taken from the engine" in c["optimizer state"]["detail"]
    c = checks(
        json.loads(
            ckpt(
                "resume",
                src,
                "--model",
                "replica",
                "--steps",
                "2",
                "--scheduler",
                "ckpt_tools.samples.workers._common:lr_factor",
                "--json",
            ).stdout
        )
    )
    assert c["learning rate"]["status"] == "pass" and "NOT checked" not in c["learning rate"]["detail"]
    assert len(c["learning rate"]["rows"]) == 2
    assert "taken from the engine" not in c["optimizer state"]["detail"]


@pytest.mark.slow
def test_zero3_universal_load_of_groups_with_different_lr_is_caught(unseen_universal, tmp_path):
    """Issue 12: DeepSpeed's ZeRO-3 universal loader gives every group group 0's lr. The expected LR per group
    comes from the saved state, so the LR row fails (DeepSpeed 0.19.8)."""
    uni = unseen_universal
    cfg = tmp_path / "z3.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    doc = json.loads(ckpt("resume", uni, "--universal", "--steps", "1", "--config", cfg, "--json", expect=1).stdout)
    assert any("group 1 will train with lr" in n for n in doc["plan"]["notes"])  # said before the launch
    lr = checks(doc)["learning rate"]
    assert lr["status"] == "fail"
    (row,) = lr["rows"]
    assert row["expected"][0] != row["expected"][1] and row["actual"][1] == row["actual"][0]


def test_mismatched_model_fails_before_launch(unseen, tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = ckpt("resume", unseen("unseen_zero2"), "--model", "tiny-gpt", "--steps", "1", expect=2, env=env)
    (line,) = proc.stderr.strip().splitlines()
    assert "the model has 29 parameters, the checkpoint 26: missing wte.weight" in line
    assert "unexpected embed.weight" in line and "drop --model for the model-free check" in line
    assert not list(tmp_path.glob("ckpt-resume-*"))  # nothing was launched


def test_worker_error_is_its_own_last_line(tmp_path):
    (tmp_path / "badfac.py").write_text(
        "from ckpt_tools.resume.workers.deepspeed import tiny_gpt\n"
        "def build(ctx):\n"
        "    if ctx.rank == 1:\n"
        "        raise ValueError('boom on rank 1:\\n  the factory refused')\n"
        "    return tiny_gpt(ctx)\n"
    )
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    proc = ckpt(
        "resume",
        sample("deepspeed", "zero2_lambdalr"),
        "--steps",
        "1",
        "--model",
        "badfac:build",
        "-q",
        expect=2,
        env=env,
    )
    (line,) = proc.stderr.strip().splitlines()  # -q: no progress bar, so stderr is the error alone
    assert "rank 1: ValueError: boom on rank 1: the factory refused" in line
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    (log,) = tmp_path.glob("ckpt-resume-*.log")
    assert str(log) in line and "boom on rank 1" in log.read_text()


def test_bad_scheduler_and_against_options_exit_2(unseen):
    src = unseen("unseen_zero2")
    proc = ckpt("resume", src, "--scheduler", "no_such_module_xyz:f", expect=2)
    assert "--scheduler" in proc.stderr
    proc = ckpt("resume", src, "--against", sample("deepspeed", "zero2_bf16"), expect=2)
    assert "--against has other parameters" in proc.stderr
