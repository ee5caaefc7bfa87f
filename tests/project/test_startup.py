"""What the scripts import before they have read their flags: a ``--help`` or a mistyped flag is
answered without torchvision, which brings torch._dynamo with it (a large part of a script's
start-up), nor triton (torch.utils.flop_counter's import). Both are imported where first used."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT, script_env

HEAVY = ("torchvision", "torch._dynamo", "triton")
SCRIPTS = ("train.py", "train_multi_GPU.py", "validation.py", "predict.py", "tools/export.py")

# A fresh interpreter (the forked warm ones of tests/warm_python.py have torchvision already):
# each script's --help, then what is imported; then torchvision, to show that it brings the rest.
CODE = f"""
import runpy, sys
for script in {SCRIPTS!r}:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (script, e.code)
heavy = {HEAVY!r}
print(sorted(m for m in heavy if m in sys.modules))
import torchvision
print("torch._dynamo" in sys.modules)
"""


def test_help_is_answered_before_torchvision_is_imported() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CODE],
        cwd=REPO_ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = proc.stdout.strip().splitlines()[-2:]
    assert before == "[]"
    assert after == "True"  # what the lazy imports spare the scripts
