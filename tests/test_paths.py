"""The one rule for paths read and written (odeify.core.paths), the strict reader (odeify.core.fileio)
and the run lock (odeify.core.lock): each refusal against what the file system says the path is.

No check here writes to a path it expects to be refused: a broken check would otherwise replace a
device. Where a refusal is checked through a writer (save, the CLI), the path is a FIFO or a socket
in a temporary folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from odeify.core.errors import ConfigError, OdeifyError
from odeify.core.fileio import atomic_write_bytes, read_json
from odeify.core.lock import LOCK_FILE, folder_lock
from odeify.core.paths import input_file, output_file, output_folder


@pytest.fixture
def odd_files(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a unix socket, a folder, a file, and links to some of them."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.safetensors").write_bytes(b"x")
    (tmp_path / "to_zero").symlink_to("/dev/zero")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    yield {"fifo": fifo, "socket": tmp_path / "sock", "folder": tmp_path / "folder",
           "file": tmp_path / "file.safetensors", "to_zero": tmp_path / "to_zero",
           "dangling": tmp_path / "dangling"}  # fmt: skip
    sock.close()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("fifo", "is a named pipe (FIFO), not a regular file"),
        ("socket", "is a socket, not a regular file"),
        ("folder", "is a directory (a folder), not a file"),
        ("to_zero", "is a character device (a link to /dev/zero), not a regular file"),
        ("dangling", "does not exist (a link to"),
    ],
)
def test_an_input_that_is_not_a_regular_file_is_named_for_what_it_is(odd_files, kind, message) -> None:
    started = time.perf_counter()
    with pytest.raises(OdeifyError, match="the file") as info:
        input_file(odd_files[kind], "the file")
    assert message in str(info.value)
    assert time.perf_counter() - started < 1  # nothing opened: a FIFO would block
    assert input_file(odd_files["file"]) == odd_files["file"]
    assert input_file(odd_files["folder"], folders=True) == odd_files["folder"]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("fifo", "is a named pipe (FIFO), not a regular file: odeify writes a file by replacing the path"),
        ("socket", "is a socket, not a regular file"),
        ("to_zero", "is a character device (a link to /dev/zero)"),
        ("folder", "is a folder (a directory); name a file in it"),
    ],
)
def test_an_output_that_is_not_a_regular_file_is_refused(odd_files, kind, message) -> None:
    with pytest.raises(OdeifyError) as info:
        output_file(odd_files[kind], "-o")
    assert message in str(info.value)
    assert odd_files["fifo"].is_fifo()  # still what it was


def test_a_device_is_refused_as_an_output() -> None:
    """`-o /dev/null` as root would have replaced the device with a regular file (issue 18, 2)."""
    with pytest.raises(OdeifyError, match="/dev/null is a character device, not a regular file"):
        output_file("/dev/null", "-o")
    assert Path("/dev/null").is_char_device()


def test_an_output_equal_to_an_input_or_with_another_suffix_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "w.pth"
    source.write_bytes(b"weights")
    with pytest.raises(OdeifyError, match=r"is also the input \(MODEL\)"):
        output_file(source, "-o", inputs=[("MODEL", source)])
    link = tmp_path / "same.safetensors"
    link.symlink_to(source)  # another name of the same file
    with pytest.raises(OdeifyError, match="is also the input"):
        output_file(link, "-o", inputs=[("MODEL", str(source))])
    with pytest.raises(OdeifyError, match=r"written as a \.safetensors file .* use .*model\.safetensors"):
        output_file(tmp_path / "model.pt", "-o", suffix=".safetensors")
    assert source.read_bytes() == b"weights"
    assert output_file(tmp_path / "new.safetensors", "-o", suffix=".safetensors").name == "new.safetensors"


@pytest.mark.parametrize("path", ["", "   ", "a\0b", None, 3])
def test_an_empty_or_non_path_is_refused(path) -> None:
    with pytest.raises(OdeifyError, match="file path|NUL"):
        output_file(path, "-o")
    with pytest.raises(OdeifyError, match="file path|NUL"):
        input_file(path, "MODEL")


def test_an_output_folder_must_be_one(odd_files) -> None:
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        output_folder(odd_files["file"], "--out", error=ConfigError)
    with pytest.raises(ConfigError, match="is a named pipe"):
        output_folder(odd_files["fifo"], "--out", error=ConfigError)
    with pytest.raises(ConfigError, match="empty string"):
        output_folder("", "--out", error=ConfigError)
    assert output_folder(odd_files["folder"] / "new") == odd_files["folder"] / "new"


# -- the strict JSON reader ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": 1, "a": 2}', "'a' appears twice"),
        ('[{"b": {"a": 1, "a": 1}}]', "'a' appears twice"),
        ('{"a": ' + "9" * 5000 + "}", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ("{", "not valid JSON"),
    ],
)
def test_json_is_read_strictly(text: str, message: str) -> None:
    with pytest.raises(OdeifyError, match="f.json") as info:
        read_json(text, "f.json", OdeifyError, 10**6)
    assert message in str(info.value)
    assert read_json('{"a": [1, 2.5, "x", null]}', "f.json", OdeifyError, 100) == {"a": [1, 2.5, "x", None]}
    assert json.loads('{"a": 1, "a": 2}') == {"a": 2}  # what a plain reader would have believed
    # NaN and overflow are read as the floats they are: each schema names the field it refuses
    assert read_json('{"a": 1e999}', "f.json", OdeifyError, 100)["a"] == float("inf")


def test_a_failed_write_names_the_file(tmp_path: Path, monkeypatch) -> None:
    def full(*args, **kwargs):
        raise OSError(27, "File too large")  # what a write past a file-size limit raises: no filename

    monkeypatch.setattr("odeify.core.fileio.os.replace", full)
    with pytest.raises(OSError, match="File too large") as info:
        atomic_write_bytes(tmp_path / "train_state.safetensors", b"data")
    assert info.value.filename == str(tmp_path / "train_state.safetensors")
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too


# -- the run lock ----------------------------------------------------------------------------------
def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    with folder_lock(tmp_path):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid()
        with (
            pytest.raises(ConfigError, match=rf"another fine-tuning run \(pid {os.getpid()} "),
            folder_lock(tmp_path),
        ):
            pass
    assert not (tmp_path / LOCK_FILE).exists()  # released and removed
    with folder_lock(tmp_path):  # free again
        pass


_HOLDER = """
import sys, time
from pathlib import Path
from odeify.core.lock import folder_lock
with folder_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_lock_held_by_another_process_then_left_by_its_kill(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"pid {holder.pid} "), folder_lock(tmp_path):
            pass
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind by the kill
    previous = []
    with folder_lock(tmp_path, on_takeover=previous.append):  # the kernel dropped its flock: taken over
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert [p["pid"] for p in previous] == [holder.pid]
