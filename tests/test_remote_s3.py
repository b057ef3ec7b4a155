"""Checkpoints read straight from s3:// (ckpt_tools.read.remote): a real S3-compatible HTTP server (moto's server mode,
a separate process on 127.0.0.1) holds the bundled samples, uploaded with the real client (s3fs); every read-only
command run on the s3:// URL must answer what the same command answers on the local folder. Fault cases run
against the same server. Skipped when moto's server or s3fs is not installed (`pip install -e '.[dev]'`)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_ckpts"

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("moto", "s3fs", "flask", "boto3")),
    reason="needs moto[server] and s3fs (pip install -e '.[dev]')",
)

BUCKET = "ckpts"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

#: every bundled sample checkpoint (folders and single files), as `group/name`
ALL_SAMPLES = sorted(
    f"{g.name}/{c.name}"
    for g in SAMPLES.iterdir()
    if g.is_dir()
    for c in g.iterdir()
    if not c.name.endswith(".manifest.json")
)
#: torchtitan_real is a folder of two checkpoints: its step folders are samples of their own
ALL_SAMPLES = [s for s in ALL_SAMPLES if s != "dcp/torchtitan_real"] + ["dcp/torchtitan_real/step-5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start listening")


@contextlib.contextmanager
def moto_server(log: Path):
    """A moto S3 server in its own process on 127.0.0.1 (its output in `log`); yields its endpoint URL."""
    port = _free_port()
    with open(log, "wb") as out:  # a pipe nobody reads would fill up and stall the server
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_listening(port, proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """A moto S3 server in its own process, stopped at the end of the module."""
    with moto_server(tmp_path_factory.mktemp("moto") / "server.log") as url:
        yield url


def _fs(endpoint: str):
    s3fs = importlib.import_module("s3fs")  # optional: imported only when the tests run
    return s3fs.S3FileSystem(
        key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
    )


@pytest.fixture(scope="module")
def bucket(endpoint):
    """The bucket with every sample uploaded by s3fs under `samples/<group>/<name>`."""
    fs = _fs(endpoint)
    fs.mkdir(BUCKET)
    for s in ALL_SAMPLES:
        src = SAMPLES / s
        fs.put(str(src), f"{BUCKET}/samples/{s}", recursive=src.is_dir())
    return endpoint


def _env(endpoint: str, **extra) -> dict:
    env = dict(os.environ)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        env.pop(k, None)
    env.update(
        KEYS,
        AWS_ENDPOINT_URL=endpoint,
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_CONFIG_FILE="/nonexistent",
    )
    env.update(extra)
    return env


def ckpt(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, env=env, timeout=timeout)


def url(sample: str) -> str:
    return f"s3://{BUCKET}/samples/{sample}"


def _as_local(text: str, sample: str) -> str:
    """The remote run's output with the URL spelled as the sample's local path. (The other way round would also
    rewrite paths a sample saved as data, e.g. an HF Trainer's `output_dir` where the sample was made.)"""
    return text.replace(url(sample), str(SAMPLES / sample))


def _as_url(text: str, sample: str) -> str:
    """The local run's output with the sample's path spelled as its URL (what the remote run prints)."""
    return text.replace(str(SAMPLES / sample), url(sample))


@pytest.mark.parametrize("sample", ALL_SAMPLES)
def test_inspect_json_on_s3_equals_local(bucket, sample):
    local = ckpt("inspect", SAMPLES / sample, "--json")
    remote = ckpt("inspect", url(sample), "--json", env=_env(bucket))
    assert remote.returncode == local.returncode == 0, remote.stderr
    got = json.loads(_as_local(remote.stdout, sample))
    cost = got.pop("remote")
    assert got == json.loads(local.stdout)
    listed = (
        sum(p.stat().st_size for p in (SAMPLES / sample).rglob("*") if p.is_file())
        if (SAMPLES / sample).is_dir()
        else (SAMPLES / sample).stat().st_size
    )
    assert cost["objects_bytes"] == listed
    # one LIST; every byte at most once; at least the first reads fetched
    assert cost["list_requests"] == 1 and cost["get_requests"] >= 1
    assert 0 < cost["bytes_fetched"] <= listed


def test_inspect_header_says_requests_and_bytes(bucket):
    r = ckpt("inspect", url("deepspeed/zero2_bf16"), "-q", env=_env(bucket))
    assert r.returncode == 0, r.stderr
    local = ckpt("inspect", SAMPLES / "deepspeed/zero2_bf16", "-q")
    lines = r.stdout.splitlines()
    remote_line = [x for x in lines if x.startswith("remote")]
    assert len(remote_line) == 1
    assert "1 list" in remote_line[0] and "bytes fetched of 440,443 listed in 4 objects" in remote_line[0]
    assert [x for x in lines if not x.startswith("remote")] == _as_url(
        local.stdout, "deepspeed/zero2_bf16"
    ).splitlines()


@pytest.mark.parametrize(
    "sample", ["deepspeed/zero2_bf16", "dcp/torchtitan_real/step-5", "safetensors/sharded", "megatron/gpt_tp2_pp2"]
)
def test_inspect_stats_on_s3_equals_local(bucket, sample):
    local = ckpt("inspect", SAMPLES / sample, "--stats", "--json")
    remote = ckpt("inspect", url(sample), "--stats", "--json", env=_env(bucket))
    assert remote.returncode == local.returncode == 0, remote.stderr
    got = json.loads(_as_local(remote.stdout, sample))
    got.pop("remote")
    want = json.loads(local.stdout)
    assert len(want["stats"]) > 0
    assert got == want


def _small_first_reads(monkeypatch):
    """First reads of 1-2 KB, ranges widened to 512 bytes: tensor bytes, zip members and DCP items stay remote
    until a reader asks for them (the samples are small enough to be fetched whole at the real sizes)."""
    from ckpt_tools.read import remote

    monkeypatch.setattr(remote, "WHOLE_BYTES", 2048)
    monkeypatch.setattr(remote, "EDGE_BYTES", 1024)
    monkeypatch.setattr(remote, "ALIGN", 512)
    return {"key": "testing", "secret": "testing", "skip_instance_cache": True, "client_kwargs": {"endpoint_url": None}}


def _summary_json(ck, mirror: str | None = None, local: str | None = None) -> dict:
    """The summary as JSON; with the mirror's path spelled as the local sample's (never the other way round:
    a sample may hold its own local path as data)."""
    from ckpt_tools.ops import inspect as ops

    text = json.dumps(ops.summary(ck, ck.tree, None), default=repr)
    return json.loads(text.replace(mirror, local) if mirror else text)


@pytest.mark.parametrize("sample", ALL_SAMPLES)
def test_partial_ranged_reads_are_exact(bucket, monkeypatch, sample):
    """With small first reads, every sample's tree equals the local one while fewer bytes than the objects hold
    are fetched: no reader reads a byte the remote layer did not fetch first."""
    from ckpt_tools.read import remote
    from ckpt_tools.ops import inspect as ops

    opts = _small_first_reads(monkeypatch)
    opts["client_kwargs"]["endpoint_url"] = bucket
    m = remote.mount(url(sample), opts)
    try:
        got = _summary_json(ops.open_for_inspect(m.root), m.root, str(SAMPLES / sample))
        assert m.counters.list_requests == 1
        assert 0 < m.counters.bytes_fetched <= m.counters.objects_bytes
    finally:
        m.close()
    assert not os.path.exists(m.root)
    assert got == _summary_json(ops.open_for_inspect(str(SAMPLES / sample)))


@pytest.mark.parametrize(
    "sample",
    [
        "deepspeed/zero2_bf16",
        "dcp/torchtitan_real/step-5",
        "safetensors/model.safetensors",
        "torch/plain.pt",
        "megatron_lm/megatron_tp2_legacy",
    ],
)
def test_partial_ranged_reads_stats_are_exact(bucket, monkeypatch, sample):
    """Every statistic of every tensor read through small ranged reads equals the local one; the tree alone
    fetched less than the objects hold, the statistics never a byte twice."""
    from ckpt_tools.read import remote
    from ckpt_tools.ops import inspect as ops

    opts = _small_first_reads(monkeypatch)
    opts["client_kwargs"]["endpoint_url"] = bucket
    m = remote.mount(url(sample), opts)
    try:
        local_ck, remote_ck = ops.open_for_inspect(str(SAMPLES / sample)), ops.open_for_inspect(m.root)
        tree_bytes = m.counters.bytes_fetched
        assert tree_bytes < m.counters.objects_bytes
        want = [s.__dict__ for s in ops.tensor_stats(local_ck, None)]
        got = [s.__dict__ for s in ops.tensor_stats(remote_ck, None)]
        assert got == want and len(want) > 0
        assert tree_bytes < m.counters.bytes_fetched <= m.counters.objects_bytes
    finally:
        m.close()


def test_diff_url_against_local_and_url(bucket):
    same = ckpt("diff", url("deepspeed/zero2_bf16"), SAMPLES / "deepspeed/zero2_bf16", env=_env(bucket))
    local_same = ckpt("diff", SAMPLES / "deepspeed/zero2_bf16", SAMPLES / "deepspeed/zero2_bf16")
    assert same.returncode == local_same.returncode == 0, same.stderr
    a, b = "deepspeed/zero2_bf16", "deepspeed/zero2_lambdalr"
    remote = ckpt("diff", url(a), url(b), env=_env(bucket))
    local = ckpt("diff", SAMPLES / a, SAMPLES / b)
    assert remote.returncode == local.returncode == 1, remote.stderr
    assert remote.stdout == _as_url(_as_url(local.stdout, a), b)
    assert "ckpt: remote: " in remote.stderr and "bytes fetched" in remote.stderr


def test_check_tp_sync_on_s3_equals_local(bucket):
    s = "megatron/gpt_tp2_pp2_drifted"
    remote = ckpt("check-tp-sync", url(s), env=_env(bucket))
    local = ckpt("check-tp-sync", SAMPLES / s)
    assert remote.returncode == local.returncode == 1, remote.stderr
    assert remote.stdout == _as_url(local.stdout, s)


def test_export_from_s3_equals_local_export(bucket, tmp_path):
    from safetensors.numpy import load_file

    s = "deepspeed/zero2_bf16"
    remote = ckpt("export", url(s), tmp_path / "remote.safetensors", "--yes", env=_env(bucket))
    local = ckpt("export", SAMPLES / s, tmp_path / "local.safetensors", "--yes")
    assert remote.returncode == local.returncode == 0, remote.stderr
    want, got = load_file(tmp_path / "local.safetensors"), load_file(tmp_path / "remote.safetensors")
    assert sorted(got) == sorted(want) and len(want) == 29
    for k in want:
        assert got[k].dtype == want[k].dtype and (got[k] == want[k]).all(), k


@pytest.mark.parametrize("command", [("to-universal",), ("convert", "--to", "dcp")])
def test_to_universal_and_convert_from_s3_equal_local(bucket, tmp_path, command):
    s = "deepspeed/zero2_bf16"
    remote = ckpt(command[0], url(s), tmp_path / "remote", *command[1:], "--yes", env=_env(bucket))
    local = ckpt(command[0], SAMPLES / s, tmp_path / "local", *command[1:], "--yes")
    assert remote.returncode == local.returncode == 0, remote.stderr
    assert "ckpt: remote: " in remote.stderr
    same = ckpt("diff", tmp_path / "remote", tmp_path / "local", "--logical")
    assert same.returncode == 0, same.stdout
    assert "same: by logical name: " in same.stdout


def test_export_to_a_url_is_refused(bucket, tmp_path):
    r = ckpt("export", SAMPLES / "deepspeed/zero2_bf16", f"s3://{BUCKET}/out.safetensors", "--yes", env=_env(bucket))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"ckpt: error: s3://{BUCKET}/out.safetensors: ckpt export writes its "
        "output to a local path, not to a URL (write to a local folder, then "
        "upload it)"
    ]


@pytest.mark.parametrize(
    "args",
    [
        ("set-lr", "--scale", "0.5", "--yes"),
        ("set-step", "--global-step", "3", "--yes"),
        ("sync-tp", "--method", "rank0", "--yes"),
        ("restore",),
    ],
)
def test_writing_commands_on_a_url_exit_2_with_one_line(bucket, args):
    s = "deepspeed/zero2_bf16"
    fs = _fs(bucket)
    before = {k: fs.cat_file(k) for k in fs.find(f"{BUCKET}/samples/{s}")}
    r = ckpt(args[0], url(s), *args[1:], env=_env(bucket))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ckpt: error: {url(s)}: ckpt {args[0]} ")
    assert "does not write to object storage" in lines[0] and "copy it to a local folder" in lines[0]
    assert {k: fs.cat_file(k) for k in fs.find(f"{BUCKET}/samples/{s}")} == before


def _one_error_line(r) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_missing_bucket(bucket):
    line = _one_error_line(ckpt("inspect", "s3://no-such-bucket/run/global_step4", env=_env(bucket)))
    assert (
        line == "ckpt: error: s3://no-such-bucket/run/global_step4: no such bucket (check the bucket name and "
        "the endpoint)"
    )


def test_missing_prefix(bucket):
    line = _one_error_line(ckpt("inspect", f"s3://{BUCKET}/samples/deepspeed/nope", env=_env(bucket)))
    assert line == f"ckpt: error: s3://{BUCKET}/samples/deepspeed/nope: no such object or prefix (check the URL)"


def test_no_credentials(bucket):
    env = _env(bucket)
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    line = _one_error_line(ckpt("inspect", url("deepspeed/zero2_bf16"), env=env))
    assert line.startswith(f"ckpt: error: {url('deepspeed/zero2_bf16')}: no credentials found for this store (")


def test_storage_options_endpoint_and_bad_json(bucket):
    env = _env(bucket)
    del env["AWS_ENDPOINT_URL"]
    opts = json.dumps({"client_kwargs": {"endpoint_url": bucket}})
    r = ckpt("inspect", url("torch/plain.pt"), "-q", "--storage-options", opts, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split()[:2] == ["format", "torch_file"]
    bad = _one_error_line(ckpt("inspect", url("torch/plain.pt"), "--storage-options", "{nope", env=env))
    assert bad.startswith("ckpt: error: --storage-options is not JSON (")


def test_access_denied(bucket):
    """An authenticated IAM user whose policies allow nothing: S3 answers AccessDenied."""
    import urllib.request

    boto3 = importlib.import_module("boto3")  # moto's own dependency
    iam = boto3.client(
        "iam",
        endpoint_url=bucket,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]

    def reset_auth(after: bytes) -> None:  # moto's server: authenticate and authorise requests from now on
        urllib.request.urlopen(
            urllib.request.Request(
                f"{bucket}/moto-api/reset-auth", data=after, method="POST", headers={"Content-Type": "text/plain"}
            )
        ).close()

    reset_auth(b"0")
    try:
        env = _env(bucket, AWS_ACCESS_KEY_ID=key["AccessKeyId"], AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])
        line = _one_error_line(ckpt("inspect", url("deepspeed/zero2_bf16"), env=env))
    finally:
        reset_auth(b"1000000000")
    assert line.startswith(f"ckpt: error: {url('deepspeed/zero2_bf16')}: access denied (")


class _SlowDown(BaseHTTPRequestHandler):
    """Answers every request as a throttled S3 does."""

    hits = 0

    def _slow(self):
        type(self).hits += 1
        body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = _slow

    def log_message(self, *args):
        pass


def test_throttling_after_retries():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowDown)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        ep = f"http://127.0.0.1:{server.server_address[1]}"
        opts = json.dumps(
            {
                "client_kwargs": {"endpoint_url": ep},
                "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}},
            }
        )
        line = _one_error_line(ckpt("inspect", "s3://any/run", "--storage-options", opts, env=_env(ep), timeout=120))
    finally:
        server.shutdown()
    assert line.startswith("ckpt: error: s3://any/run: the store kept throttling the requests after retries (")
    assert _SlowDown.hits >= 2  # retried before giving up


def _mount_small(bucket, monkeypatch, key: str, data: bytes):
    from ckpt_tools.read import remote

    opts = _small_first_reads(monkeypatch)
    opts["client_kwargs"]["endpoint_url"] = bucket
    _fs(bucket).pipe_file(f"{BUCKET}/{key}", data)
    return remote.mount(f"s3://{BUCKET}/{key}", opts)


@pytest.mark.parametrize("how", ["shorter", "same size"])
def test_object_replaced_while_read(bucket, monkeypatch, how):
    """The object is replaced after the listing, by a shorter copy or by other bytes of the same size: the next
    read of it fails (S3 answers 412 to the GET's If-Match) with one line naming the object, never a silent
    read of two versions."""
    from ckpt_tools.errors import CorruptCheckpoint
    from ckpt_tools.ops import inspect as ops

    data = (SAMPLES / "torch/plain.pt").read_bytes()
    key = f"replaced/{how.replace(' ', '_')}/plain.pt"
    m = _mount_small(bucket, monkeypatch, key, data)
    try:
        ck = ops.open_for_inspect(m.root)
        before = m.counters.bytes_fetched
        other = data[: len(data) // 2] if how == "shorter" else bytes(b ^ 0xFF for b in data)
        _fs(bucket).pipe_file(f"{BUCKET}/{key}", other)
        with pytest.raises(CorruptCheckpoint) as e:
            list(ops.tensor_stats(ck, None))
        assert m.counters.bytes_fetched == before  # the refused GET brought no bytes
    finally:
        m.close()
    assert e.value.path == f"s3://{BUCKET}/{key}"
    assert e.value.message.startswith("the object changed while being read (its ETag is no longer the one listed")


def test_unchanged_object_reads_through_the_pin(bucket, monkeypatch):
    """The same pinned reads give every statistic of an object nobody touched."""
    from ckpt_tools.ops import inspect as ops

    data = (SAMPLES / "torch/plain.pt").read_bytes()
    m = _mount_small(bucket, monkeypatch, "pinned/plain.pt", data)
    try:
        got = [s.__dict__ for s in ops.tensor_stats(ops.open_for_inspect(m.root), None)]
        m.check_unchanged()  # pinned: nothing to list again
        assert m.pinned and m.counters.list_requests == 1
    finally:
        m.close()
    want = [s.__dict__ for s in ops.tensor_stats(ops.open_for_inspect(str(SAMPLES / "torch/plain.pt")), None)]
    assert got == want and len(want) > 0


def test_a_store_without_pinned_reads_is_listed_again_at_the_end(tmp_path):
    """file:// (any store other than S3): reads are not pinned, so the command lists the prefix once more at its
    end; an object read from whose bytes and time changed fails it, naming the object."""
    import shutil

    from ckpt_tools.read import remote
    from ckpt_tools.errors import CorruptCheckpoint
    from ckpt_tools.ops import inspect as ops

    src = tmp_path / "zero2"
    shutil.copytree(SAMPLES / "deepspeed/zero2_bf16", src)
    m = remote.mount(f"file://{src}")
    try:
        list(ops.tensor_stats(ops.open_for_inspect(m.root), None))
        assert not m.pinned
        m.check_unchanged()  # nothing changed: passes, one more LIST
        assert m.counters.list_requests == 2
        victim = next(p for p in sorted(src.rglob("*.pt")))
        st = victim.stat()
        victim.write_bytes(bytes(b ^ 0xFF for b in victim.read_bytes()))  # same size, other bytes
        os.utime(victim, (st.st_atime, st.st_mtime + 5))
        with pytest.raises(CorruptCheckpoint) as e:
            m.check_unchanged()
    finally:
        m.close()
    assert e.value.path == f"file://{victim}"
    assert e.value.message.startswith("the object changed while being read")


def test_a_command_whose_source_changed_shows_no_output_and_exits_2(tmp_path, monkeypatch, capsys):
    """Through the CLI (in this process, to change an object between the listing and the end of the command):
    the end check fails the command with one line naming the object, and the output it held is not shown."""
    import shutil

    from ckpt_tools.read import remote
    from ckpt_cli.main import main

    src = tmp_path / "zero2"
    shutil.copytree(SAMPLES / "deepspeed/zero2_bf16", src)
    victim = sorted(src.rglob("*.pt"))[0]
    real_mount = remote.mount

    def mount_then_change(*a, **k):  # the upload of a new version lands while the command runs
        m = real_mount(*a, **k)
        st = victim.stat()
        victim.write_bytes(bytes(b ^ 0xFF for b in victim.read_bytes()))
        os.utime(victim, (st.st_atime, st.st_mtime + 5))
        return m

    monkeypatch.setattr(remote, "mount", mount_then_change)
    with pytest.raises(SystemExit) as e:
        main(["inspect", f"file://{src}", "--json"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.splitlines() == [
        f"ckpt: error: file://{victim}: the object changed while being read (it was "
        "replaced or removed after the listing: what was read may mix two versions) "
        "(wait until the upload has finished, then run the command again)"
    ]


def test_file_url_output_waits_for_the_end_check(tmp_path):
    """A command on a store checked at the end shows its output after the check (and all of it)."""
    import shutil

    src = tmp_path / "zero2"
    shutil.copytree(SAMPLES / "deepspeed/zero2_bf16", src)
    r = ckpt("inspect", f"file://{src}", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["remote"]["list_requests"] == 1  # the header's count: before the end check


def test_local_run_mounts_nothing():
    """A local path never touches the remote layer: nothing is mounted and the hook is a no-op."""
    from ckpt_tools.read import remote
    from ckpt_tools.ops import inspect as ops

    ck = ops.open_for_inspect(str(SAMPLES / "deepspeed/zero2_bf16"))
    list(ops.tensor_stats(ck, None))
    assert remote.active() == [] and remote.stats() is None


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_scheme_whose_client_is_missing():
    line = _one_error_line(ckpt("inspect", "gs://bucket/run/global_step4"))
    assert line.startswith(
        "ckpt: error: gs://bucket/run/global_step4: reading gs:// URLs needs a storage client that is not installed: "
    )
    assert line.endswith("(pip install gcsfs)")


def test_file_url_equals_local():
    """file:// goes through the same mirror and ranged reads (fsspec's local filesystem), no server."""
    s = "deepspeed/zero3_bf16"
    target = f"file://{SAMPLES / s}"
    remote = ckpt("inspect", target, "--json")
    local = ckpt("inspect", SAMPLES / s, "--json")
    assert remote.returncode == local.returncode == 0, remote.stderr
    got = json.loads(remote.stdout)
    cost = got.pop("remote")
    assert got == json.loads(local.stdout.replace(str(SAMPLES / s), target))
    assert cost["bytes_fetched"] == cost["objects_bytes"] == 398376  # small objects: fetched whole, once
