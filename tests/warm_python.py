"""Start the project's scripts as processes forked from a Python that has already imported torch.

Why: a fresh ``python train.py`` spends about 5 CPU-seconds importing torch, torchvision (which
imports ``torch._dynamo``), TensorBoard and OpenCV before the script's first line runs, and the
suite starts a few hundred such processes: on the 2-core CI machine that start-up was most of
the suite's time. :func:`run` and :func:`start` instead fork the process from a server (the
standard library's multiprocessing forkserver) that imported those libraries once, and run the
script there as ``python script.py`` / ``python -m module`` would: as ``__main__``, with the
given argv, environment, working folder and ``sys.path``, stdout and stderr in files, non-daemon
threads joined and atexit handlers run at exit, and the exit status of ``sys.exit`` or of the
signal that ended it (negative, as ``subprocess`` reports it).

What a fork cannot repeat is what the interpreter does before the script: the libraries above
were imported under the server's environment. So the child applies what those libraries read
at import and the tests set per process: ``OMP_NUM_THREADS`` (the intra-op thread count). The
project's own modules are not preloaded: each child imports them, reading its own environment.
Tests about start-up itself (an environment variable that breaks an import, a launch's
rendezvous or environment) keep using :mod:`subprocess`. A torchrun launch can start warm too:
``tests/conftest.py``'s ``WARM_TORCHRUN`` forks the launcher from here and its ranks from it.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib.machinery
import io
import multiprocessing
import os
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path

# Imported once in the server; the children share them (copy-on-write).
PRELOAD = [
    "torch",
    "torchvision",
    "cv2",
    "numpy",
    "yaml",
    "tqdm",
    "torch.utils.tensorboard",
    "warm_python",
]
_POLL_S = 0.05
RSS_FILE = "peak_rss_mb"

_context: multiprocessing.context.ForkServerContext | None = None
_base_path: list[str] = []


def _server() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server started on first use with an environment like the
    one a test gives its processes (one OpenMP thread, no GPU)."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        # The server's environment is what the preloaded libraries read at import.
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["PYTHONPATH"] = str(Path(__file__).parent)  # this module, for the children
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = ctx
    return _context


class WarmProcess:
    """A started script: ``subprocess.Popen``'s ``pid``, ``poll``, ``wait``, ``send_signal`` and
    ``kill``; ``stdout``/``stderr`` are read from their files once it has ended."""

    def __init__(
        self,
        argv: Sequence[str],
        process: multiprocessing.process.BaseProcess,
        out: Path,
        err: Path | None,
    ) -> None:
        self.args = list(argv)
        self._process = process
        self._out, self._err = out, err
        self._text: tuple[str, str] | None = None
        self._peak_rss_mb: float | None = None

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) as text; stderr is "" when it went to stdout. Once the process has
        ended its files are removed and the text kept."""
        if self._text is None:
            err = self._err.read_text(errors="replace") if self._err else ""
            text = (self._out.read_text(errors="replace"), err)
            if self.poll() is None:
                return text
            self._text = text
            rss = self._out.parent / RSS_FILE
            if rss.is_file():
                self._peak_rss_mb = float(rss.read_text())
            shutil.rmtree(self._out.parent, ignore_errors=True)
        return self._text

    @property
    def peak_rss_mb(self) -> float | None:
        """The ended process's own peak resident memory (``ru_maxrss``: a forked child's count
        starts from the pages it touches, not the server's); None when a signal ended it."""
        self.output()
        return self._peak_rss_mb


def start(
    argv: Sequence[str | os.PathLike],
    *,
    cwd: str | os.PathLike,
    env: Mapping[str, str],
    merge_stderr: bool = False,
    address_space: int | None = None,
) -> WarmProcess:
    """Start ``argv`` (``[sys.executable, script, ...]`` or ``[sys.executable, "-m", module,
    ...]``) in a forked child; its output goes to files next to nothing the test reads.
    ``address_space``: the child's RLIMIT_AS in bytes (a runaway allocation fails in it)."""
    argv = [str(a) for a in argv]
    if argv[0] != sys.executable or len(argv) < 2 or (argv[1].startswith("-") and argv[1] != "-m"):
        raise ValueError(f"not a script or -m module of this interpreter: {argv[:3]}")
    folder = Path(tempfile.mkdtemp(prefix="warm-"))
    out = folder / "stdout"
    err = None if merge_stderr else folder / "stderr"
    process = _server().Process(
        target=_child,
        args=(argv[1:], str(cwd), dict(env), str(out), str(err or out), address_space),
    )
    process.start()
    return WarmProcess(argv, process, out, err)


def run(
    argv: Sequence[str | os.PathLike],
    *,
    cwd: str | os.PathLike,
    env: Mapping[str, str],
    timeout: float,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=, env=, capture_output=True, text=True, timeout=)`` through a
    forked child (``merge_stderr``: ``stderr=subprocess.STDOUT``). On timeout the child is killed
    and ``subprocess.TimeoutExpired`` raised, as subprocess does."""
    proc = start(argv, cwd=cwd, env=env, merge_stderr=merge_stderr)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    stdout, stderr = proc.output()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# ---------------------------------------------------------------- in the child


def _child(
    args: list[str], cwd: str, env: dict[str, str], out: str, err: str, address_space: int | None
) -> None:
    """Become ``python *args`` (see the module docstring) and exit with its status."""
    if address_space is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # Line-buffered like an interpreter writing to a pipe under PYTHONUNBUFFERED (the tests set
    # it): output written before a kill is in the file.
    sys.stdout = _line_buffered(1, "strict")
    sys.stderr = _line_buffered(2, "backslashreplace")
    # The interpreter's own start-up state: default signal handlers, Ctrl-C as KeyboardInterrupt.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _fresh_start_state(env)
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = _site_paths(sys.path)
    code = 0
    try:
        if args[0] == "-m":
            sys.path[:] = [os.getcwd(), *python_path, *base]
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            # As the interpreter does: the folder of the script, symbolic links resolved.
            sys.path[:] = [os.path.dirname(os.path.realpath(script)), *python_path, *base]
            sys.argv = list(args)  # argv[0] as given; __file__ absolute (Python >= 3.9)
            _run_as_main(script)
    except SystemExit as e:
        code = _exit_status(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())  # Python prints it, then dies by SIGINT
        code = -signal.SIGINT
    except BaseException:  # an uncaught error ends the process as Python's does
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code, Path(out).parent / RSS_FILE)


def _run_as_main(script: str) -> None:
    """Run ``script`` as the interpreter runs ``python script``: in a fresh ``__main__`` module
    (runpy.run_path would also rewrite sys.argv[0])."""
    main = types.ModuleType("__main__")
    loader = importlib.machinery.SourceFileLoader("__main__", script)
    main.__dict__.update(
        __file__=script, __cached__=None, __loader__=loader, __spec__=None, __package__=None
    )
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(Path(script).read_bytes(), script, "exec"), main.__dict__)


def _line_buffered(fd: int, errors: str) -> io.TextIOWrapper:
    return open(fd, "w", buffering=1, encoding="utf-8", errors=errors, closefd=False)


def _site_paths(paths: list[str]) -> list[str]:
    """The standard library and site-packages entries of ``paths`` (what a fresh interpreter
    has): without the current folder and this module's folder, which the server put there."""
    here = str(Path(__file__).parent)
    return [p for p in paths if p and p != here]


def _fresh_start_state(env: Mapping[str, str]) -> None:
    """What a fresh interpreter would start with under ``env`` and the server fixed at import:
    the intra-op thread count (OpenMP read ``OMP_NUM_THREADS`` when the server imported torch)
    and numpy's global random state (seeded from the OS at import; every child would otherwise
    share the server's). Python's ``random`` reseeds itself after a fork."""
    import numpy as np
    import torch

    np.random.seed()

    value = env.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) >= 1:
        torch.set_num_threads(int(value))
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)))


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int, rss_file: Path) -> None:
    """Exit as the interpreter does: join non-daemon threads, run atexit handlers, flush; a
    KeyboardInterrupt ends the process by SIGINT. The peak resident memory goes to ``rss_file``
    first (a parent of a forkserver child cannot ``wait4`` it)."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with contextlib.suppress(OSError):
        rss_file.write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(_POLL_S)
    os._exit(code)
