"""Every shell command of README.md runs and exits 0, on tiny generated data.

The README's code blocks (```bash, ```sh, ```shell, and untagged blocks whose first word is a
program) are parsed into commands: backslash continuations joined, comments dropped, a
``#!`` script block kept whole. Each command is one test (``pytest -v`` lists them by README
line), run as a subprocess in its own working folder that holds what the README's placeholder
paths name:

- ``mydata/mydata.data``, ``mydata/my_data.data`` (calculate_dataset's name), ``d.data``,
  ``my.data``, ``data/coco.data``: a tiny shapes dataset
  (4 train / 4 val images of 64 px, 5 classes), built once per session;
- ``runs/mydata/`` (``best.pt``, ``last.pt``, ``model.cfg``): one tiny run (1 epoch), trained
  once per session; ``best.pt`` and ``weights/yolov3-spp.pt`` are copies of its ``best.pt``;
- ``mydata/data.yaml``: the same dataset as an ultralytics data.yaml;
- ``img.jpg``, ``folder/``, ``video.mp4``, ``clip.mp4``: validation images and a 3-frame video;
- ``instances_val.json`` with ``val/``: the validation images as a COCO instances file;
- ``cfg/``: a copy of the repository's, since ``tools/make_cfg.py`` writes beside its input.

So that each command takes seconds, ``train.py``, ``train_multi_GPU.py``, ``validation.py`` and
``predict.py`` get ``--img-size 64``, training ``--epochs 1 --batch-size 2 --workers 0
--no-multi-scale --noplots`` (validation ``--no-plots``: the pictures are tests/scripts'
concern), a search ``--evolve 2``, ``--cfg cfg/yolov3-spp.cfg`` (63M parameters) becomes the
nano cfg, and the README's ``...`` becomes the flags the README's first command of that kind
spells out; a resume trains a second epoch. The commands run two at a time, one thread each.
Commands that need a GPU, a camera, a cluster, the network or downloaded weights are skipped
with the reason, as are
``make demo``, ``make test`` and ``make gpu-check`` (the demo takes ten minutes; ``make test``
runs this file; ``make gpu-check`` needs a GPU). The reasons are in ``SKIPS``; ``pytest -rs``
prints them. Where a command exits 0 but does not yet do what its README comment says,
``CHECKS`` marks it xfail with the reason.

The last tests keep the README's prose honest: the contents links reach headings, the map of
the house names every module, and every file or test the README and docs/ name exists.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cv2
import pytest
import warm_python
from conftest import TORCHRUN, WARM_TORCHRUN

from data.make_shapes import make_dataset
from train_utils.distributed.launch import free_port

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# What a command's working folder links to (read-only parts of the checkout; outputs stay local).
LINKED = (
    "train.py",
    "train_multi_GPU.py",
    "validation.py",
    "predict.py",
    "build_utils",
    "models",
    "train_utils",
    "tools",
)
SHELL_LANGS = {"bash", "sh", "shell"}
PROGRAMS = {"python", "torchrun", "srun", "sbatch", "make", "pip", "git", "bash", "tensorboard"}
TIMEOUT_S = 300
# Commands run at once: the suite's machine has 2 cores, and each command runs one thread.
PARALLEL = 2
IMG = "64"
TRAIN_SCRIPTS = {"train.py", "train_multi_GPU.py"}
MODEL_SCRIPTS = TRAIN_SCRIPTS | {"validation.py", "predict.py"}
# The full YOLOv3-SPP takes most of a minute per command on two cores; the nano cfg is the same
# kind of model (Darknet cfg, SPP, three heads) at 1.4M parameters.
HEAVY_CFGS = {"cfg/yolov3-spp.cfg": "cfg/yolov3-spp-nano.cfg"}
# What the README's "..." stands for, per script: the flags its first command of the kind spells.
ELLIPSIS = {
    "train.py": ["--cfg", "cfg/yolov3-spp.cfg", "--data", "mydata/mydata.data"],
    "train_multi_GPU.py": ["--cfg", "cfg/yolov3-spp.cfg", "--data", "mydata/mydata.data"],
    "validation.py": ["--weights", "runs/mydata/best.pt"],
}


@dataclass(frozen=True)
class Command:
    line: int  # README line where the command starts
    text: str  # as written, continuations joined, comment dropped
    script: bool = False  # a whole ``#!`` block (e.g. an sbatch file)

    @property
    def id(self) -> str:
        return f"L{self.line}:{' '.join(self.text.split())[:70]}"


def parse_commands(markdown: str) -> list[Command]:
    """The shell commands of ``markdown``'s code blocks, in order."""
    commands: list[Command] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1).lower(), i + 1
        end = start
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        i = end + 1
        body = lines[start:end]
        if lang not in SHELL_LANGS and not (lang == "" and _starts_with_program(body)):
            continue
        if body and body[0].startswith("#!"):
            commands.append(Command(start + 1, "\n".join(body), script=True))
            continue
        commands.extend(_block_commands(body, start + 1))
    return commands


def _starts_with_program(body: list[str]) -> bool:
    words = [ln.split()[0] for ln in body if ln.strip() and not ln.lstrip().startswith("#")]
    return bool(words) and words[0] in PROGRAMS


def _block_commands(body: list[str], first_line: int) -> list[Command]:
    out, parts, start = [], [], None
    for n, raw in enumerate(body, first_line):
        if not parts and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        start = n if not parts else start
        if raw.rstrip().endswith("\\"):
            parts.append(raw.rstrip()[:-1].strip())
            continue
        parts.append(raw.strip())
        out.append(Command(start, shlex.join(shlex.split(" ".join(parts), comments=True))))
        parts = []
    return out


# (predicate on the command's words, reason). The first that matches skips the command.
SKIPS: list[tuple[Callable[[list[str]], bool], str]] = [
    (
        lambda w: w[:2] == ["make", "demo"],
        "the ten-minute demo; tests/scripts/test_demo.py runs it small",
    ),
    (lambda w: w[:2] == ["make", "test"], "runs the whole suite, this file included"),
    (
        lambda w: w[:2] == ["make", "gpu-check"],
        "needs a CUDA GPU (tests/scripts/test_gpu_check.py runs its steps on the CPU)",
    ),
    (
        lambda w: _opt(w, "--recipe") == "darknet",
        "trains the cfg's max_batches iterations; tests/scenarios/test_darknet_recipe_runs.py runs "
        "the recipe small",
    ),
    (lambda w: w[0] in {"pip", "git"}, "network: installs or clones"),
    (
        lambda w: w[0] == "ray" or _opt(w, "--evolve-backend") == "ray",
        "starts a Ray cluster; tests/scenarios/test_evolve_ray.py runs the Ray backend small",
    ),
    (lambda w: w[0] in {"srun", "sbatch"}, "needs a SLURM cluster"),
    (lambda w: any(x.startswith("--nnodes") for x in w), "needs several nodes"),
    (lambda w: _opt(w, "--source") == "0", "needs a camera"),
    (lambda w: any("://" in x for x in w), "needs the network (a stream URL)"),
    (
        lambda w: "--half" in w or _opt(w, "--device", "").startswith(("cuda", "0")),
        "needs a CUDA GPU",
    ),
    (lambda w: _processes(w) > 2, "needs one GPU per process (the 2-process CPU form runs)"),
    (
        lambda w: re.search(r"\.weights$|\.conv\.\d+$", _opt(w, "--weights", "")) is not None,
        "needs Darknet's pretrained weights, a download",
    ),
]


def _opt(words: list[str], flag: str, default: str | None = None) -> str | None:
    """The value of ``flag`` (``--flag v`` or ``--flag=v``) in ``words``."""
    for k, w in enumerate(words):
        if w == flag and k + 1 < len(words):
            return words[k + 1]
        if w.startswith(flag + "="):
            return w.split("=", 1)[1]
    return default


def _processes(words: list[str]) -> int:
    n = _opt(words, "--nproc_per_node") or _opt(words, "--nproc-per-node") or "1"
    return int(n) if n.isdigit() else 1


def skip_reason(cmd: Command) -> str | None:
    if cmd.script:
        return "an sbatch script: needs a SLURM cluster"
    words = shlex.split(cmd.text)
    return next((reason for pred, reason in SKIPS if pred(words)), None)


def _script_of(words: list[str]) -> tuple[int, str | None]:
    for k, w in enumerate(words):
        if w.endswith(".py"):
            return k, w
    return -1, None


def _set(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (replaced where given, else appended)."""
    out, k = [], 0
    found = False
    while k < len(args):
        if args[k] == flag:
            out += [flag, value]
            k += 2
            found = True
            continue
        if args[k].startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(args[k])
        k += 1
    return out if found else [*out, flag, value]


def _given(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def tiny_argv(cmd: Command) -> list[str]:
    """The command as it runs here: this interpreter, tiny sizes, the nano cfg, ``...`` spelled."""
    words = shlex.split(cmd.text)
    k, script = _script_of(words)
    head, args = words[: k + 1], words[k + 1 :]
    name = Path(script).name if script else None
    if "..." in args:
        at = args.index("...")
        given = _given(args)
        fill, j = [], 0
        spelled = ELLIPSIS.get(name, [])
        while j < len(spelled):
            if spelled[j] not in given:
                fill += spelled[j : j + 2]
            j += 2
        args = args[:at] + fill + args[at + 1 :]
    if name in MODEL_SCRIPTS:
        cfg = _opt(args, "--cfg")
        if cfg in HEAVY_CFGS:
            args = _set(args, "--cfg", HEAVY_CFGS[cfg])
        elif cfg is None and name in TRAIN_SCRIPTS and not _given(args) & {"--resume", "--weights"}:
            # The default cfg is YOLOv3-SPP: its nano width trains the same code in seconds.
            args = _set(args, "--cfg", HEAVY_CFGS["cfg/yolov3-spp.cfg"])
        args = _set(args, "--img-size", IMG)
    if name in TRAIN_SCRIPTS:
        resuming = "--resume" in _given(args)
        # The session's run has 1 epoch; a resume that continues it trains a second.
        args = _set(args, "--epochs", "2" if resuming else "1")
        args = _set(args, "--batch-size", "2")
        args = _set(args, "--workers", "0")
        if not _given(args) & {"--multi-scale", "--no-multi-scale"}:
            args.append("--no-multi-scale")
        args.append("--noplots")  # most of a tiny run's time; tests/scripts look at pictures
        if "--evolve" in _given(args):  # two candidates show the search; each is a tiny run
            args = _set(args, "--evolve", "2")
    if name == "validation.py":
        args = _set(args, "--workers", "0")
        args.append("--no-plots")
    if head[0] == "python":
        head = [sys.executable, *head[1:]]
    elif head[0] == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", *head[1:]]
    launcher = "torch.distributed.run" in head or "torch.distributed.launch" in head
    # Other test processes on the machine may hold the default port 29500.
    if launcher and not any(x.startswith("--master_port") for x in head):
        head = [*head[:-1], f"--master_port={free_port()}", head[-1]]
    return head + args


def _keeps_runs_mydata(argv: list[str]) -> bool:
    """Whether the session's run belongs in the working folder: not when the command starts a
    new ``runs/mydata`` (a finished run is never overwritten)."""
    _, script = _script_of(argv)
    afresh = bool(script) and Path(script).name in TRAIN_SCRIPTS and "--resume" not in argv
    return not (afresh and _opt(argv, "--name") == "mydata")


# (predicate on the README command, check of the working folder after exit 0, xfail reason or
# None). A check states what the README's comment promises beyond the exit status.
def _continues_runs_mydata(work: Path) -> None:
    with (work / "runs" / "mydata" / "results.csv").open() as f:
        epochs = [int(r["epoch"]) for r in csv.DictReader(f)]
    assert epochs == [0, 1], f"runs/mydata/results.csv has epochs {epochs}, not [0, 1]"


def _has(*names: str) -> Callable[[Path], None]:
    """A check that the command wrote each of ``names`` (relative to its working folder)."""

    def check(work: Path) -> None:
        missing = [n for n in names if not (work / n).exists()]
        assert not missing, f"the command did not write {missing}"

    return check


CHECKS: list[tuple[Callable[[str], bool], Callable[[Path], None], str | None]] = [
    (lambda t: "--name mydata --resume" in t, _continues_runs_mydata, None),
    (lambda t: "--resume runs/mydata/last.pt" in t, _continues_runs_mydata, None),
    # "Coming from YOLOv5/YOLOv8": each command writes where a YOLOv5 user looks.
    (
        lambda t: "train.py" in t and "--project runs/train --name exp" in t,
        _has("runs/train/exp/best.pt", "runs/train/exp/results.csv"),
        None,
    ),
    (
        lambda t: "validation.py" in t and "--project runs/val --name exp" in t,
        _has("runs/val/exp/per_class.csv", "runs/val/exp/errors.json"),
        None,
    ),
    (
        lambda t: "tools/export.py" in t and "openvino" in t,
        _has(
            "runs/mydata/best.onnx",
            "runs/mydata/best.torchscript",
            "runs/mydata/best_openvino_model/best.xml",
        ),
        None,
    ),
    (
        lambda t: "tools/coco2yolo.py --json" in t,
        _has("mycoco/data.yaml", "mycoco/labels", "mycoco/images"),
        None,
    ),
]

COMMANDS = parse_commands(README.read_text(encoding="utf-8"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # One thread per process: these models are tiny, and on a busy 2-core machine a second
    # thread spinning for a core tripled a training command's CPU time (6 s -> 19 s).
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _subprocess(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` run in ``cwd``; a ``python script.py`` command forked from a warm interpreter
    (tests/warm_python.py: the same run without the seconds of importing torch), a torchrun
    command with its ranks forked warm too (tests/conftest.py ``WARM_TORCHRUN``: the flags and
    the script are the README's; how fresh ranks start is test_ddp_launches.py's subject)."""
    k, script = _script_of(argv)
    if argv[: len(TORCHRUN)] == TORCHRUN and script is not None:
        argv = [*WARM_TORCHRUN, *argv[len(TORCHRUN) : k], str(cwd / script), *argv[k + 1 :]]
    if argv[0] == sys.executable and (argv[1].endswith(".py") or argv[1] == "-m"):
        return warm_python.run(argv, cwd=cwd, env=_env(), timeout=TIMEOUT_S)
    return subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _tail(proc: subprocess.CompletedProcess, n: int = 40) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-n:])


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 train / 4 val images of 64 px; returns the folder holding ``mydata.data``."""
    root = tmp_path_factory.mktemp("readme_data") / "mydata"
    data = make_dataset(
        root, 4, 4, img_size_range=(64, 64), seed=0, obj_size_range=(12.0, 0.6), workers=1
    )
    shutil.copy(data, root / "mydata.data")
    shutil.copy(data, root / "my_data.data")  # as tools/calculate_dataset.py --name my names it
    # The same data as YOLOv5 describes it (README "Coming from YOLOv5/YOLOv8").
    names = (root / "shapes.names").read_text().split()
    (root / "data.yaml").write_text(f"train: train/images\nval: val/images\nnames: {names}\n")
    return root


def _workdir(path: Path, data: Path, run: Path | None, keep_run: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (path / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "cfg", path / "cfg")
    (path / "mydata").symlink_to(data)
    absolute = (
        f"classes=5\ntrain={data / 'train.txt'}\nvalid={data / 'val.txt'}\n"
        f"names={data / 'shapes.names'}\n"
    )
    (path / "data").mkdir()
    for name in ("d.data", "my.data", "data/coco.data"):
        (path / name).write_text(absolute)
    (path / "folder").mkdir()
    images = sorted((data / "val" / "images").iterdir())
    for img in images:
        shutil.copy(img, path / "folder" / img.name)
    shutil.copy(images[0], path / "img.jpg")
    _write_coco_json(path / "instances_val.json", path / "val", images)
    _write_video(path / "video.mp4", cv2.imread(str(images[0])))
    shutil.copy(path / "video.mp4", path / "clip.mp4")
    if run is not None:
        if keep_run:
            shutil.copytree(run, path / "runs" / "mydata")
        (path / "weights").mkdir()
        shutil.copy(run / "best.pt", path / "weights" / "yolov3-spp.pt")
        shutil.copy(run / "best.pt", path / "best.pt")
    return path


def _write_coco_json(json_path: Path, folder: Path, images: list[Path]) -> None:
    """``instances_val.json`` and its image folder ``val/``: the tiny validation images and their
    YOLO labels as a COCO instances file (category ids 1.., image ids 100..)."""
    folder.mkdir()
    entries, annotations = [], []
    for k, img in enumerate(images):
        shutil.copy(img, folder / img.name)
        h, w = cv2.imread(str(img)).shape[:2]
        entries.append({"id": 100 + k, "file_name": img.name, "width": w, "height": h})
        label = img.parent.parent / "labels" / f"{img.stem}.txt"
        for row in label.read_text().split("\n"):
            if row.strip():
                c, cx, cy, bw, bh = (float(v) for v in row.split())
                box = [(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h]
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": 100 + k,
                        "category_id": int(c) + 1,
                        "bbox": box,
                        "area": box[2] * box[3],
                        "iscrowd": 0,
                    }
                )
    categories = [{"id": c + 1, "name": f"class{c}"} for c in range(5)]
    coco = {"images": entries, "annotations": annotations, "categories": categories}
    json_path.write_text(json.dumps(coco))


def _write_video(path: Path, frame) -> None:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 5, frame.shape[1::-1])
    for _ in range(3):
        writer.write(frame)
    writer.release()


@pytest.fixture(scope="session")
def tiny_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 1-epoch run of the nano cfg on the tiny data: the README's ``runs/mydata``."""
    work = _workdir(tmp_path_factory.mktemp("readme_run"), tiny_data, None)
    argv = tiny_argv(Command(0, "python train.py ... --name mydata"))
    proc = _subprocess(argv, work)
    assert proc.returncode == 0, _tail(proc)
    run = work / "runs" / "mydata"
    for name in ("best.pt", "last.pt", "model.cfg"):
        assert (run / name).is_file(), name
    return run


def test_the_readme_has_commands() -> None:
    scripts = {_script_of(shlex.split(c.text))[1] for c in COMMANDS if not c.script}
    assert {"train.py", "validation.py", "predict.py", "train_multi_GPU.py"} <= scripts
    assert len(COMMANDS) >= 20


@dataclass(frozen=True)
class Outcome:
    argv: list[str]
    proc: subprocess.CompletedProcess
    work: Path


def _selected_commands(session: pytest.Session) -> list[Command]:
    """The commands of the parametrized test that this pytest run selected (``-k`` included)."""
    return [
        item.callspec.params["cmd"]
        for item in session.items
        if getattr(item, "originalname", None) == "test_readme_command"
    ]


@pytest.fixture(scope="session")
def outcomes(
    request: pytest.FixtureRequest,
    tiny_data: Path,
    tiny_run: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Outcome]:
    """Every selected, runnable command run once, PARALLEL at a time (each one thread)."""
    jobs = []
    for cmd in _selected_commands(request.session):
        if skip_reason(cmd) is None:
            argv = tiny_argv(cmd)
            base = tmp_path_factory.mktemp(f"L{cmd.line}")
            jobs.append((cmd, argv, _workdir(base, tiny_data, tiny_run, _keeps_runs_mydata(argv))))

    def run(job: tuple[Command, list[str], Path]) -> tuple[str, Outcome]:
        cmd, argv, work = job
        return cmd.id, Outcome(argv, _subprocess(argv, work), work)

    with ThreadPoolExecutor(PARALLEL) as pool:
        return dict(pool.map(run, jobs))


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_readme_command(cmd: Command, request: pytest.FixtureRequest) -> None:
    reason = skip_reason(cmd)
    if reason:
        pytest.skip(reason)
    checks = [(check, why) for pred, check, why in CHECKS if pred(cmd.text)]
    for _, why in checks:
        if why:
            request.applymarker(pytest.mark.xfail(reason=why, strict=False))
    outcome = request.getfixturevalue("outcomes")[cmd.id]
    proc = outcome.proc
    assert proc.returncode == 0, f"{shlex.join(outcome.argv)}\n{_tail(proc)}"
    for check, _ in checks:
        check(outcome.work)
    # Passed: its folder goes now, not at the session's end (the batch's folders come to ~3 GB).
    shutil.rmtree(outcome.work, ignore_errors=True)


# The README's prose, kept honest the same way: links, the map of the house, named files.
def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_contents_links_reach_headings() -> None:
    text = README.read_text(encoding="utf-8")
    anchors = {_anchor(h) for h in re.findall(r"^#{2,4} (.+)$", text, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links
    assert [a for a in links if a not in anchors] == []


def _map_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    return section.split("```text", 1)[1].split("```", 1)[0]


def test_the_map_names_every_module() -> None:
    """Each module of the packages and each tool has its line, and each line names a file."""
    names = {line.split()[0] for line in _map_block().splitlines() if line.strip()}
    for package in ("models", "build_utils", "train_utils", "tools"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name != "__init__.py":
                assert path.name in names, f"{path.relative_to(REPO)} is missing from the map"
        assert f"{package}/" in names
    for sub in ("distributed", "evaluation"):
        assert f"{sub}/" in names
    top = {n for n in names if "/" in n.rstrip("/") or n.endswith(".py")}
    missing = [n for n in top if not any(REPO.rglob(n.rstrip("/")))]
    assert missing == []


# A section of old module names or commands (DESIGN.md, README): up to the next "## " heading.
OLD_NAMES_SECTION = r"### Old (module names|commands).*?(?=\n## |\Z)"


def test_named_files_and_tests_exist() -> None:
    """Every repository path the README or docs/ name in backquotes exists (and every
    ``tests/x.py::name`` test), so a renamed module cannot leave a stale name behind."""
    docs = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
    roots = ("train_utils/", "build_utils/", "models/", "tools/", "tests/", "docs/", "bench/")
    stale = []
    for doc in docs:
        # The tables of old names and commands name what is gone on purpose.
        text = re.sub(OLD_NAMES_SECTION, "", doc.read_text(encoding="utf-8"), flags=re.S)
        for ref in re.findall(r"`([^`\s]+)`", text):
            path, _, test = ref.partition("::")
            if not path.startswith(roots) or any(c in path for c in "*<{"):
                continue
            file = REPO / path
            if not file.exists() or (
                test and not re.search(rf"def {re.escape(test)}\b", file.read_text())
            ):
                stale.append(f"{doc.name}: {ref}")
    assert stale == []


def test_no_module_names_from_before_the_rooms() -> None:
    old = (
        "train_eval_utils",
        "distributed_utils",
        "coco_utils",
        "eval_report",
        *(f"train_utils/{m}.py" for m in ("devices", "launch", "slurm", "speed", "plots")),
        *(f"train_utils/{m}.py" for m in ("metrics", "exports", "coco_eval", "builders")),
        "evaluation/exports",
        "distributed/precision",
        "tools/export_onnx",
    )
    docs = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
    found = []
    for doc in docs:
        # Test files are named after their modules; their paths are not module names.
        text = re.sub(r"tests/(\w+/)*test_\w+\.py", "", doc.read_text(encoding="utf-8"))
        # DESIGN.md's table of old -> new names (README's of old commands) is where old names
        # belong.
        text = re.sub(OLD_NAMES_SECTION, "", text, flags=re.S)
        found += [f"{doc.name}: {n}" for n in old if re.search(rf"\b{re.escape(n)}\b", text)]
    assert found == []


def test_no_placeholder_is_left_in_the_docs() -> None:
    """Was: README's Darknet section read 'MEASURED_TABLE_PLACEHOLDER' where its table belongs."""
    docs = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
    found = [
        f"{doc.name}:{n}: {line.strip()}"
        for doc in docs
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"PLACEHOLDER|\bTODO\b|\bTBD\b|\bFIXME\b", line)
    ]
    assert found == []
