"""Writing so that a reader, or a crash, sees the old content or the new and never a part: every file and directory
the toolkit publishes (checkpoint and stage markers, data-cache memos, predictions, merged models and tokenizers)
is written under a temporary sibling name, synced to disk, renamed over its target, and the directory that names
it synced (without the last sync a power loss can undo the rename, or keep it and lose the data)."""

import errno
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress


def sync_path(path: str) -> None:
    """os.fsync a file, or a directory (which makes the names it holds durable). A file system that cannot sync a
    directory (some network and FUSE mounts answer EINVAL) keeps its own promise about renames."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as err:
        if not (os.path.isdir(path) and err.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)):
            raise
    finally:
        os.close(descriptor)


def sync_tree(directory: str) -> None:
    """Every file under directory on disk, then the directories naming them, deepest first: otherwise the kernel may
    write a rename that publishes the directory before its data, and a power loss right after would leave a
    complete-looking directory with empty or torn files."""
    for root, _, names in os.walk(directory, topdown=False):
        for name in names:
            sync_path(os.path.join(root, name))
        sync_path(root)


def write_atomically(path: str, content: str | bytes, make_parents: bool = False) -> None:
    """Write content to path: a temporary file beside it (created with the usual umask), synced, renamed over it,
    then the directory synced. make_parents: create missing directories above it first."""
    directory = os.path.dirname(os.path.abspath(path))
    if make_parents:
        os.makedirs(directory, exist_ok=True)
    tmp_path = os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(6)}")
    try:
        with open(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            handle.write(content.encode("utf-8") if isinstance(content, str) else content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with suppress(FileNotFoundError):  # renamed already, or never made
            os.unlink(tmp_path)
        raise
    sync_path(directory)


def write_json_atomically(path: str, value: object, indent: int | None = 2, make_parents: bool = False) -> None:
    """value as JSON (non-ASCII kept readable), written by write_atomically."""
    write_atomically(path, json.dumps(value, indent=indent, ensure_ascii=False) + "\n", make_parents)


@contextmanager
def atomic_output_dir(output_dir: str) -> Iterator[str]:
    """Yield a temporary sibling of output_dir to fill; when the block completes, sync it to disk and rename it to
    output_dir (an empty output_dir is replaced), then sync the parent; if the block fails, delete it. Readers never
    see a half-written result, and a crash leaves the whole result or none. The temporary name is
    .<output name>.tmp-<random>, which merge.output's leftover check looks for."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.tmp-", dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
        sync_tree(tmp)
        os.rename(tmp, output_dir)  # replaces an empty output_dir in the same step (rename(2))
        sync_path(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only still there after a failure


def replace_directory(built: str, target: str) -> None:
    """Put the complete directory built in target's place (both on one filesystem): built is synced to disk, the
    old target (if any) renamed aside, built renamed to target, the parents synced, then the old one deleted. A
    crash in between leaves target whole or absent, never a mix of the two; the pipeline replaces a stage's
    output with its rerun this way."""
    sync_tree(built)
    parent = os.path.dirname(os.path.abspath(target))
    aside = None
    if os.path.lexists(target):
        aside = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(target))}.replaced-", dir=parent)
        os.rename(target, aside)  # over the empty directory mkdtemp made
    os.rename(built, target)
    sync_path(parent)
    sync_path(os.path.dirname(os.path.abspath(built)))
    if aside is not None:
        shutil.rmtree(aside)
