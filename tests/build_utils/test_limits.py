"""build_utils/limits.py: the named limits, the regular-file check and the bounded text reader."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from build_utils.errors import ConfigError
from build_utils.limits import (
    ALL_LIMITS,
    MAX_IMAGE_BYTES,
    MAX_TEXT_BYTES,
    check_config_file,
    file_problem,
    format_bytes,
    read_config_text,
)
from tests.conftest import REPO_ROOT, run_training, train_argv


def limit_rows() -> list[str]:
    """The README's limits table rows, as build_utils/limits.py defines the limits."""
    return [
        f"| {lim.name} | {lim.describe(lim.default)} | `{lim.env}` | {lim.why} |"
        for lim in ALL_LIMITS
    ]


def test_readme_lists_every_limit_with_its_default_and_variable():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.splitlines()
    start = lines.index("| Limit | Default | Raise with | Sized for |") + 2
    table = lines[start : start + len(ALL_LIMITS) + 1]
    assert table[: len(ALL_LIMITS)] == limit_rows(), "regenerate README's limits table"
    assert not table[len(ALL_LIMITS)].startswith("|"), "README lists a limit the code lacks"


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1 << 20) == "1 MiB"
    assert format_bytes(3 << 29) == "1.5 GiB"


def test_environment_variable_raises_a_limit_and_a_bad_one_is_one_line(monkeypatch):
    assert MAX_IMAGE_BYTES.value() == MAX_IMAGE_BYTES.default
    monkeypatch.setenv(MAX_IMAGE_BYTES.env, "1_000")
    assert MAX_IMAGE_BYTES.value() == 1000
    for bad in ("-1", "0", "lots", "1e9"):
        monkeypatch.setenv(MAX_IMAGE_BYTES.env, bad)
        with pytest.raises(ConfigError, match=f"{MAX_IMAGE_BYTES.env}=.* positive whole number"):
            MAX_IMAGE_BYTES.value()


def test_file_problem_names_every_kind_of_non_file(tmp_path: Path, monkeypatch):
    good = tmp_path / "a.jpg"
    good.write_bytes(b"x" * 100)
    assert file_problem(good, MAX_IMAGE_BYTES) is None
    monkeypatch.setenv(MAX_IMAGE_BYTES.env, "99")
    assert file_problem(good, MAX_IMAGE_BYTES) == (
        f"100 B, over the limit of 99 B ({MAX_IMAGE_BYTES.name}); "
        f"set {MAX_IMAGE_BYTES.env} to raise it"
    )
    monkeypatch.delenv(MAX_IMAGE_BYTES.env)

    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.jpg"
    folder.mkdir()
    loop = tmp_path / "loop.jpg"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling.jpg"
    dangling.symlink_to(tmp_path / "gone.jpg")
    sock_path = tmp_path / "s.jpg"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        reasons = {
            p.name: file_problem(p, MAX_IMAGE_BYTES)
            for p in (fifo, folder, loop, dangling, sock_path, Path("/dev/zero"))
        }
    finally:
        sock.close()
    assert reasons == {
        "fifo.jpg": "a FIFO (named pipe), not a regular file",
        "folder.jpg": "a folder, not a file",
        "loop.jpg": "a symbolic link loop",
        "dangling.jpg": "dangling symbolic link",
        "s.jpg": "a socket, not a regular file",
        "zero": "a character device, not a regular file",
    }
    assert file_problem(tmp_path / "none.jpg", MAX_IMAGE_BYTES) == "file not found"
    link = tmp_path / "link.jpg"
    link.symlink_to(good)
    assert file_problem(link, MAX_IMAGE_BYTES) is None


def test_config_text_is_bounded_and_utf8(tmp_path: Path, monkeypatch):
    cfg = tmp_path / "x.cfg"
    cfg.write_bytes(b"\xef\xbb\xbf[net]\nwidth=416\n")
    assert read_config_text(cfg, MAX_TEXT_BYTES, "model cfg") == "[net]\nwidth=416\n"
    cfg.write_bytes("[net]\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(
        ConfigError, match=r"x\.cfg:2: model cfg is not UTF-8 text \(byte 0xe9 at offset 11"
    ):
        read_config_text(cfg, MAX_TEXT_BYTES, "model cfg")
    cfg.write_bytes("[net]\n".encode("utf-16"))
    with pytest.raises(ConfigError, match="model cfg is UTF-16 text; save it as UTF-8"):
        read_config_text(cfg, MAX_TEXT_BYTES, "model cfg")
    big = tmp_path / "big.cfg"
    with big.open("wb") as f:
        f.truncate(MAX_TEXT_BYTES.default + 1)  # sparse: no disk used, never read
    with pytest.raises(
        ConfigError, match=f"model cfg: 4.0 MiB, over the limit of 4 MiB .*{MAX_TEXT_BYTES.env}"
    ):
        read_config_text(big, MAX_TEXT_BYTES, "model cfg")
    fifo = tmp_path / "f.cfg"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"f\.cfg: model cfg: a FIFO \(named pipe\)"):
        check_config_file(fifo, MAX_TEXT_BYTES, "model cfg")


@pytest.mark.parametrize("env", [*(limit.env for limit in ALL_LIMITS), "YOLO_MEMORY_AVAILABLE"])
def test_a_malformed_limit_setting_stops_a_run_before_it_writes_anything(
    env, monkeypatch, make_shapes_data, tmp_path
) -> None:
    # Was: YOLO_MAX_IMAGE_PIXELS=abc stopped at the first image decoded in training, with
    # args.yaml, results.csv and train.log in the run folder; YOLO_MEMORY_AVAILABLE=abc at the
    # model's build, with train.log (either way the next run went to run2).
    data = make_shapes_data(n_train=2, n_val=1)
    monkeypatch.setenv(env, "abc")
    with pytest.raises(ConfigError, match=f"{env}='abc' must be a positive whole number"):
        run_training(train_argv(data, tmp_path / "run", img=64, batch=2))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["validation", "predict"])
def test_a_malformed_limit_setting_stops_validation_and_predict_before_they_load(
    script, monkeypatch, tmp_path, capsys
) -> None:
    module = __import__(script)
    missing = str(tmp_path / "missing.pt")  # the limit's line must come first
    monkeypatch.setenv("YOLO_MAX_IMAGE_PIXELS", "abc")
    argv = ["--weights", missing, "--source" if script == "predict" else "--data", str(tmp_path)]
    assert module.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: YOLO_MAX_IMAGE_PIXELS='abc' must be a positive whole number (pixels)"]


def test_reading_a_small_image_reserves_its_size_not_the_limit(tmp_path: Path):
    """read(n) reserves n bytes up front: reading each image with the 512 MiB image limit as n
    failed under an address-space cap (as where memory is not overcommitted). A child process
    with 256 MiB of address space to spare reads a 1 KiB image, its labels and a data file."""
    image = tmp_path / "a.jpg"
    image.write_bytes(b"\xff\xd8" + bytes(1022))
    (tmp_path / "a.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    code = f"""
import resource
from build_utils import image_io, labels, limits
with open('/proc/self/statm') as f:
    pages = int(f.read().split()[0])
spare = 256 << 20
resource.setrlimit(resource.RLIMIT_AS, (pages * resource.getpagesize() + spare,) * 2)
assert len(limits.read_data_file({str(image)!r}, limits.MAX_IMAGE_BYTES)) == 1024
image_io.read_image_data({str(image)!r})
labels.label_file_digest({str(tmp_path / "a.txt")!r})
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
