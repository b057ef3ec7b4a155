"""URLs on the command line (s3://, gs://, az://, hf://, file://, any fsspec URL): read-only commands run on a
mounted mirror (`ckpt_tools.read.remote`); writing commands are refused with one line. Output spells the mirror as
the URL."""

from __future__ import annotations

import sys

from ckpt_tools.read import remote
from ckpt_tools.errors import CkptError

#: commands whose second positional argument is a local output; their sources are read through the mirror
_WRITES_OUTPUT = {"export", "convert", "to-universal"}
#: commands whose readers may run in other processes (workers, torchrun), where the mirror's on-demand fetch
#: cannot follow: the whole source is fetched first
_FETCH_ALL = {"convert", "to-universal"}
_READS = {"inspect", "diff", "check-tp-sync", *_WRITES_OUTPUT}


class _ToUrl:
    """A text stream that writes mirror paths as their URLs; everything else goes to the stream it wraps.
    Holding, it keeps what is written until `release` (the end of a command whose store is checked for
    changed objects only at the end: a command that fails that check shows no output)."""

    def __init__(self, stream, hold: bool = False):
        self._stream = stream
        self._held: list[str] | None = [] if hold else None

    def write(self, text: str) -> int:
        if self._held is not None:
            self._held.append(text)
        else:
            self._stream.write(remote.to_url(text))
        return len(text)

    def release(self) -> None:
        held, self._held = self._held, None
        if held:
            self._stream.write(remote.to_url("".join(held)))

    def discard(self) -> None:
        self._held = None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def take_storage_options(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--storage-options JSON` (allowed anywhere: it belongs to no one command), and its value."""
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--storage-options":
            if i + 1 >= len(argv):
                raise CkptError(
                    "--storage-options needs a JSON object", hint="e.g. --storage-options '{\"anon\": true}'"
                )
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith("--storage-options="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, value


def mount_urls(argv: list[str]) -> list[str]:
    """argv with every URL argument replaced by the local mirror of its prefix (listed once, first reads
    fetched); raises CkptError (exit 2) for a command that would write to a URL. Nothing is mounted, and argv
    comes back unchanged, when no argument is a URL."""
    argv, opts_text = take_storage_options(argv)
    urls = [i for i, a in enumerate(argv) if remote.is_url(a)]
    if not urls:
        return argv
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    url = argv[urls[0]]
    if command in remote.WRITING_COMMANDS:
        raise CkptError(
            f"ckpt {command} {remote.WRITING_COMMANDS[command]} a checkpoint in place and does not "
            "write to object storage",
            path=url,
            hint="copy it to a local folder (aws s3 sync / gsutil rsync / fsspec), run the command "
            "there, then upload the result",
        )
    if command not in _READS:
        raise CkptError(
            f"ckpt {command or '(no command)'} does not read URLs",
            path=url,
            hint="copy the checkpoint to a local folder first",
        )
    if command in _WRITES_OUTPUT:
        positional = [i for i, a in enumerate(argv[1:], 1) if not a.startswith("-")]
        for i in urls:
            if positional and i != positional[0]:
                raise CkptError(
                    f"ckpt {command} writes its output to a local path, not to a URL",
                    path=argv[i],
                    hint="write to a local folder, then upload it",
                )
    opts = remote.storage_options_from(opts_text)
    argv = list(argv)
    mounts = []
    for i in urls:
        m = remote.mount(argv[i], opts)
        if command in _FETCH_ALL:
            _fetch_all(m, quiet="--json" in argv)
        argv[i] = m.root
        mounts.append(m)
    # a store whose reads are not pinned to the listed version is checked at the end: output waits for it
    sys.stdout = _ToUrl(sys.stdout, hold=not all(m.pinned for m in mounts))
    sys.stderr = _ToUrl(sys.stderr)
    return argv


def _fetch_all(m: remote.Mount, quiet: bool) -> None:
    """Every byte of the source, with a progress bar (convert and to-universal read it in other processes)."""
    from tqdm import tqdm

    with tqdm(
        total=m.missing_bytes(), unit="B", unit_scale=True, desc=f"fetching {m.url}", disable=quiet or None, leave=False
    ) as bar:
        m.fetch_all(progress=bar.update)


def check_unchanged() -> None:
    """The end of a command on a URL: fail (exit 2, no output shown) if an object read changed since the
    listing."""
    try:
        remote.check_unchanged()
    except CkptError:
        if isinstance(sys.stdout, _ToUrl):
            sys.stdout.discard()
        raise


def report_line() -> str | None:
    """`remote  5 requests (1 list, 4 ranged GETs), 440,443 bytes fetched of 440,443 listed in 4 objects`."""
    s = remote.stats()
    if s is None:
        return None
    return (
        f"{s['requests']:,} requests ({s['list_requests']:,} list, {s['get_requests']:,} ranged GET"
        f"{'s' if s['get_requests'] != 1 else ''}), {s['bytes_fetched']:,} bytes fetched of "
        f"{s['objects_bytes']:,} listed in {s['objects']:,} object{'s' if s['objects'] != 1 else ''}"
    )


def finish() -> None:
    """Remove the mirrors and put the streams back (end of a command)."""
    if isinstance(sys.stdout, _ToUrl):
        try:
            sys.stdout.release()
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            pass
        sys.stdout = sys.stdout._stream
    if isinstance(sys.stderr, _ToUrl):
        sys.stderr = sys.stderr._stream
    remote.unmount_all()
