"""`ckpt_tools.train.procgroup.leave`: how every distributed entry point (sample workers, the resume worker,
`to-universal --distributed`) ends. Real 2-rank gloo groups under torchrun."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from ckpt_tools.samples import free_port, worker_env

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from ckpt_tools.train.procgroup import leave

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    flag = torch.tensor([rank + 1, 7])
    dist.all_reduce(flag[:1], op=dist.ReduceOp.MIN)  # a Python-visible view, freed later on gloo's thread
    dist.barrier()
    sys.stdout.write(f"rank{rank} min={int(flag[0])}")  # no newline, no flush: leave() must flush it
    leave(int(sys.argv[1]) if rank == 1 else 0)
    print("unreachable")
""")


def _run(tmp_path, code: int) -> subprocess.CompletedProcess:
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    env = dict(worker_env(), MASTER_ADDR="127.0.0.1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "--tee",
            "3",
            str(script),
            str(code),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_leave_flushes_and_ends_every_rank_with_its_code(tmp_path):
    ok = _run(tmp_path, 0)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "rank0 min=1" in ok.stdout and "rank1 min=1" in ok.stdout
    assert "unreachable" not in ok.stdout

    failed = _run(tmp_path, 3)
    assert failed.returncode != 0
    assert "exitcode  : 3" in failed.stderr and "rank      : 1" in failed.stderr
    assert "rank1 min=1" in failed.stdout
