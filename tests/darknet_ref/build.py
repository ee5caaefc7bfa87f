"""Build Darknet (AlexeyAB/darknet, CPU) and the test harness linked against its objects, once.

The source is the tarball in ``../shared/darknet/`` beside the checkout (present for the
developers and in CI, absent in a user's clone). Everything is built under the repository's
``.cache-darknet/`` (git-ignored)::

    .cache-darknet/darknet-59596d78/      the extracted source and its objects (make OPTS=-O2)
    .cache-darknet/darknet-59596d78/darknet   Darknet's own program (darknet_path)
    .cache-darknet/harness                tests/darknet_ref/harness.c linked against them
    .cache-darknet/harness.key            what the harness was built from (see _build_key)

Several pytest-xdist workers may ask at the same time: the whole check-and-build runs under an
exclusive ``fcntl`` lock on ``.cache-darknet/build.lock``, so one builds and the others wait and
then find it built. The harness is rebuilt when ``harness.c``, the tarball or the compiler
flags change; Darknet itself is extracted and built once per tarball.

Run as a script, it builds and prints the harness's path::

    python -m tests.darknet_ref.build
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED_DARKNET = REPO.parent / "shared" / "darknet"
TARBALL_NAME = "darknet-59596d78.tar.gz"
CACHE = REPO / ".cache-darknet"
HARNESS_SOURCE = Path(__file__).with_name("harness.c")
# -O2, not the Makefile's -Ofast: fast-math would change the very float arithmetic compared.
MAKE_OPTS = "OPTS=-O2"
HARNESS_CFLAGS = ("-O2", "-Wall")
LINK_LIBS = ("-lm", "-pthread", "-lstdc++")
MAIN_OBJECT = "darknet.o"  # Darknet's own main(), left out of the harness
BUILD_TIMEOUT_S = 900  # two busy shared cores: ~15 CPU-seconds alone, minutes under load
# AlexeyAB/darknet#7320 (open since 2021): the CPU build's col2im_cpu_ext zeroes the input
# layer's delta before adding a convolution's gradient to it, so whatever a [route] or
# [shortcut] had already added there is lost (yolov4-tiny: every CSP skip and the second
# head's path into the backbone). Dropping that line (the maintainer's suggestion there) is
# half the fix: that zeroing was also what reset a [route]'s own delta between passes, since
# the CPU forward_network zeroes only the deltas of layers built with ``train`` set
# (convolutions), so the other half zeroes every layer's delta, as forward_network_gpu does.
# With both, the CPU build computes what the GPU build (cuDNN adds, beta = 1) does.
CPU_BACKWARD_FIX = {
    Path("src") / "col2im.c": ("    caffe_set(height * width * channels, 0.0F, data_im);\n", ""),
    Path("src") / "network.c": (
        "if(l.delta && state.train && l.train){",
        "if(l.delta && state.train){",
    ),
}


class DarknetUnavailable(Exception):
    """The reference cannot be built here (no ../shared, no compiler): tests skip with this."""


def _tools() -> tuple[str, str]:
    cc, make = shutil.which("gcc") or shutil.which("cc"), shutil.which("make")
    if cc is None or make is None:
        raise DarknetUnavailable("no C compiler (gcc/cc) or make on PATH to build Darknet")
    return cc, make


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fixed_sources(source: Path) -> dict[Path, str]:
    """The files of ``CPU_BACKWARD_FIX`` in the Darknet tree ``source``, fixed (path relative
    to ``source`` -> text)."""
    fixed = {}
    for rel, (old, new) in CPU_BACKWARD_FIX.items():
        text = (source / rel).read_text()
        if text.count(old) != 1:
            raise RuntimeError(f"{rel} no longer holds {old.strip()!r} once: check the #7320 fix")
        fixed[rel] = text.replace(old, new)
    return fixed


def _build_key(tarball: Path, cc: str, fixed: bool) -> str:
    parts = [_file_digest(tarball), _file_digest(HARNESS_SOURCE), cc, MAKE_OPTS, str(fixed)]
    parts += [*HARNESS_CFLAGS, *LINK_LIBS]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed (exit {proc.returncode}) in {cwd}:\n{proc.stderr[-4000:]}"
        )


def _extract(tarball: Path, dest: Path) -> Path:
    """The tarball's single top folder extracted under ``dest`` (replacing an old copy)."""
    source = dest / tarball.name.removesuffix(".tar.gz")
    stamp = source / ".extracted"
    if stamp.is_file() and stamp.read_text() == _file_digest(tarball):
        return source
    shutil.rmtree(source, ignore_errors=True)
    staging = dest / ".extracting"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(staging, filter="data")
    (top,) = list(staging.iterdir())
    top.rename(source)
    staging.rmdir()
    stamp.write_text(_file_digest(tarball))
    return source


def _build_darknet(source: Path, make: str) -> list[Path]:
    """``make`` in ``source`` (a no-op once built); Darknet's objects without its main()."""
    jobs = f"-j{min(2, os.cpu_count() or 1)}"
    _run([make, "-C", str(source), jobs, MAKE_OPTS], source)
    objects = sorted(p for p in (source / "obj").glob("*.o") if p.name != MAIN_OBJECT)
    if not objects:
        raise RuntimeError(f"make left no objects in {source / 'obj'}")
    return objects


def _fixed_objects(cc: str, source: Path) -> list[Path]:
    """The files of ``CPU_BACKWARD_FIX``, fixed and compiled under ``.cache-darknet/fixed/``
    (the fixed harness links them in place of Darknet's own objects of the same names)."""
    folder = CACHE / "fixed"
    folder.mkdir(exist_ok=True)
    includes = [f"-I{source / d}" for d in ("include", "src", "3rdparty/stb/include")]
    objects = []
    for rel, text in fixed_sources(source).items():
        c_file = folder / rel.name
        c_file.write_text(text)
        obj = c_file.with_suffix(".o")
        _run([cc, *HARNESS_CFLAGS, *includes, "-c", str(c_file), "-o", str(obj)], folder)
        objects.append(obj)
    return objects


def harness_path(fixed: bool = False) -> Path:
    """The built harness (building Darknet and it first when needed); with ``fixed``, the one
    linked with AlexeyAB/darknet#7320 fixed (see ``CPU_BACKWARD_FIX``).

    Raises:
        DarknetUnavailable: no ``../shared/darknet`` tarball, or no compiler: the caller skips.
        RuntimeError: the build itself failed (a real failure, with the compiler's output).
    """
    tarball = SHARED_DARKNET / TARBALL_NAME
    if not tarball.is_file():
        raise DarknetUnavailable(
            f"{tarball} is absent (Darknet's source only exists beside the development checkout)"
        )
    cc, make = _tools()
    CACHE.mkdir(exist_ok=True)
    harness = CACHE / ("harness-7320-fixed" if fixed else "harness")
    key_file = harness.with_suffix(".key")
    with (CACHE / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key = _build_key(tarball, cc, fixed)
        if harness.is_file() and key_file.is_file() and key_file.read_text() == key:
            return harness
        source = _extract(tarball, CACHE)
        objects = _build_darknet(source, make)
        if fixed:
            replacements = _fixed_objects(cc, source)
            names = {o.name for o in replacements}
            objects = [o for o in objects if o.name not in names] + replacements
        partial = harness.with_suffix(".partial")
        cmd = [cc, *HARNESS_CFLAGS, f"-I{source / 'include'}", f"-I{source / 'src'}"]
        cmd += [str(HARNESS_SOURCE), *map(str, objects), *LINK_LIBS, "-o", str(partial)]
        _run(cmd, source)
        partial.replace(harness)
        key_file.write_text(key)
    return harness


def darknet_path() -> Path:
    """Darknet's own program (``darknet detector train/map ...``), built with the harness.

    Raises:
        DarknetUnavailable: see :func:`harness_path`.
    """
    harness = harness_path()
    program = harness.parent / TARBALL_NAME.removesuffix(".tar.gz") / "darknet"
    if not program.is_file():
        raise RuntimeError(f"make built no {program}")
    return program


if __name__ == "__main__":
    try:
        print(harness_path())
    except DarknetUnavailable as e:
        print(f"unavailable: {e}", file=sys.stderr)
        sys.exit(2)
