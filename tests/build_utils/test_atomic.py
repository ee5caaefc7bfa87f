"""build_utils/atomic.py: the one atomic writer (checkpoints, caches, results.csv, weights)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from build_utils.atomic import atomic_write, check_apart, check_new_outputs, temp_path
from build_utils.errors import ConfigError, OutputError


class Boom(Exception):
    pass


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize(
    ("mode", "content"), [("wb", b"\x00\x01binary\xff"), ("w", "text \u00e9\nline 2\n")]
)
def test_writes_and_replaces(tmp_path, mode, content):
    path = tmp_path / "out.dat"
    for data in (content, content * 2):  # a new file, then one replaced
        with atomic_write(path, mode) as f:
            f.write(data)
        got = path.read_bytes() if mode == "wb" else path.read_text(encoding="utf-8")
        assert got == data
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("mode", ["wb", "w"])
def test_old_file_survives_a_writer_that_fails_midway(tmp_path, mode):
    path = tmp_path / "out.dat"
    path.write_bytes(b"old")
    with pytest.raises(Boom), atomic_write(path, mode) as f:
        f.write(b"half of the new" if mode == "wb" else "half of the new")
        f.flush()
        assert _leftovers(tmp_path), "the data goes to a temporary file first"
        raise Boom
    assert path.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_a_failed_first_write_leaves_nothing(tmp_path):
    path = tmp_path / "new.dat"
    with pytest.raises(OSError), atomic_write(path) as f:
        f.write(b"x")
        raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_text_mode_options(tmp_path):
    path = tmp_path / "rows.csv"
    with atomic_write(path, "w", newline="") as f:
        f.write("a,b\r\n")
    assert path.read_bytes() == b"a,b\r\n"  # newline="" keeps the csv module's line ends
    with atomic_write(path, "w", encoding="latin-1") as f:
        f.write("\u00e9")
    assert path.read_bytes() == b"\xe9"


def test_temporary_names_are_hidden_unique_and_in_the_same_folder(tmp_path):
    path = tmp_path / "last.pt"
    a, b = temp_path(path), temp_path(path)
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name.startswith(f".last.pt.{os.getpid()}.") and a.name.endswith(".tmp")


def test_the_file_gets_the_usual_permissions(tmp_path):
    # Not mkstemp's 0600: a checkpoint or cache must be readable like any other file.
    umask = os.umask(0)
    os.umask(umask)
    path = tmp_path / "f"
    with atomic_write(path, durable_dir=True, fsync=False) as f:
        f.write(b"x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_a_missing_folder_or_a_bad_mode_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError), atomic_write(tmp_path / "no" / "f"):
        pass
    with pytest.raises(ValueError, match="mode must be one of"), atomic_write(tmp_path / "f", "a"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_the_output_policy_refuses_what_exists_unless_exist_ok(tmp_path):
    """One policy for every tool: an existing output (whoever wrote it) is named and refused
    without --exist-ok; an input is never an output; a file in the way is one line."""
    mine, new, cfg = tmp_path / "results.csv", tmp_path / "new.cfg", tmp_path / "a.cfg"
    mine.write_text("epoch\n")
    cfg.write_text("[net]\n")
    check_new_outputs([new], "-o", exist_ok=False)
    with pytest.raises(ConfigError, match=r"results.csv already exists; pass --exist-ok to "):
        check_new_outputs([new, mine], "-o", exist_ok=False)
    both = rf"{mine}, {cfg} already exist; .* choose another -o"
    with pytest.raises(ConfigError, match=both):
        check_new_outputs([mine, cfg], "-o", exist_ok=False)
    check_new_outputs([new, mine], "-o", exist_ok=True)
    with pytest.raises(ConfigError, match="-o .*a.cfg is the cfg this tool reads"):
        check_new_outputs([cfg], "-o", exist_ok=True, inputs={"the cfg": cfg})
    with pytest.raises(OutputError, match="is a file where a folder should be"):
        check_new_outputs([mine / "x.cfg"], "-o", exist_ok=True)
    assert mine.read_text() == "epoch\n" and not new.exists()


def test_outputs_stay_apart_from_each_other_and_from_the_folders_a_tool_fills(tmp_path):
    """Two flags naming one file, or an output among the labels a tool writes (a link to that
    folder too), are refused; outputs beside the folder pass."""
    labels, names = tmp_path / "labels", tmp_path / "a.names"
    labels.mkdir()
    (tmp_path / "link").symlink_to(labels)
    check_apart({"--names-out": names, "--report": tmp_path / "r.txt"}, [labels], "the labels")
    with pytest.raises(ConfigError, match=r"^--report .*a.names is also --names-out; choose"):
        check_apart({"--names-out": names, "--report": names}, [], "the labels")
    inside = tmp_path / "link" / "x.txt"
    with pytest.raises(ConfigError, match=rf"^--report {inside} lies in the labels {labels}; "):
        check_apart({"--names-out": None, "--report": inside}, [labels], "the labels")
    assert list(labels.iterdir()) == []


def test_an_output_on_a_link_loop_is_no_traceback(tmp_path):
    """Was: RuntimeError "Symlink loop" from Path.resolve (a traceback); the loop is left to the
    write, which names it in one line."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    labels = tmp_path / "labels"
    labels.mkdir()
    check_apart({"--json-out": tmp_path / "a"}, [labels], "the labels")
    with pytest.raises(ConfigError, match=r"^--report .*/a is also --json-out; choose"):
        check_apart({"--json-out": tmp_path / "a", "--report": tmp_path / "a"}, [], "the labels")
