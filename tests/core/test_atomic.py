"""lorakit.core.atomic: a reader sees the old content or the new, never a part, and a failed write leaves
neither a changed target nor a temporary file behind."""

import json
import os

import pytest

from lorakit.core import atomic


def test_a_write_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "deep" / "marker.json"
    atomic.write_json_atomically(str(target), {"step": 3, "text": "中文"}, make_parents=True)
    atomic.write_json_atomically(str(target), {"step": 4})
    assert json.loads(target.read_text(encoding="utf-8")) == {"step": 4}
    assert os.listdir(target.parent) == ["marker.json"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~umask)  # a file as open() would create it


def test_a_marker_is_not_written_into_a_directory_that_is_gone(tmp_path):
    """A checkpoint's completion marker must not create the checkpoint it vouches for."""
    with pytest.raises(FileNotFoundError):
        atomic.write_json_atomically(str(tmp_path / "checkpoint-7" / "complete.json"), {"step": 7})
    assert os.listdir(tmp_path) == []


def test_a_failed_write_keeps_the_old_content(tmp_path, monkeypatch):
    target = tmp_path / "predictions.jsonl"
    atomic.write_atomically(str(target), "old\n")
    with pytest.raises(TypeError):
        atomic.write_json_atomically(str(target), {"value": object()})  # fails before anything is written
    monkeypatch.setattr(os, "replace", lambda *_: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        atomic.write_atomically(str(target), "new\n")  # fails after the temporary file is complete
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["predictions.jsonl"]


def test_an_output_directory_is_published_whole_or_not_at_all(tmp_path):
    out = tmp_path / "merged"
    with pytest.raises(RuntimeError), atomic.atomic_output_dir(str(out)) as tmp:
        (tmp_path / os.path.basename(tmp) / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed mid-write")
    assert os.listdir(tmp_path) == []
    out.mkdir()  # an empty output directory is replaced by the result
    with atomic.atomic_output_dir(str(out)) as tmp:
        (tmp_path / os.path.basename(tmp) / "sub").mkdir()
        (tmp_path / os.path.basename(tmp) / "sub" / "model.bin").write_bytes(b"weights")
    assert (out / "sub" / "model.bin").read_bytes() == b"weights" and os.listdir(tmp_path) == ["merged"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
