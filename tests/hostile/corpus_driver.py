"""Runs a list of `ckpt` command lines in ONE process (in-process, fast), one JSON line per run to a results file,
written before (`start`) and after (`end`) each run: a signal death (a segfault in C code) kills this process, and
the parent then knows which run did it. Usage: python corpus_driver.py JOBS.json RESULTS.jsonl"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostile.runner import run  # noqa: E402


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    with open(sys.argv[2], "a", buffering=1) as out:
        for job in jobs:
            out.write(json.dumps({"id": job["id"], "start": True}) + "\n")
            out.flush()
            os.fsync(out.fileno())
            r = run(*job["argv"], timeout=job.get("timeout", 120))
            out.write(
                json.dumps(
                    {
                        "id": job["id"],
                        "code": r.code,
                        "traceback": r.traceback,
                        "hung": r.hung,
                        "warned": "unknown-global" in r.stdout,
                        "carried": "untrusted-pickle" in r.stdout,
                        "errors": r.error_lines()[-5:],
                    }
                )
                + "\n"
            )
            out.flush()


if __name__ == "__main__":
    main()
