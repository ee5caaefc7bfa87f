"""Every file of this repository's folders (cfg/, data/, weights/) that README.md or a script's
or tool's docstring cites is shipped, written by the command that cites it, or one the user
makes (listed below, with where the text says how)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.-])((?:cfg|data|weights)/[\w./-]+\.\w+)")
OUTPUT_FLAGS = re.compile(r"(?:-o|--out-cfg|--out|--output|--names-out)\s+(\S+)")
# Files the user makes or downloads, each explained where it is cited.
USER_FILES = {
    "data/coco.data": "README: 'not shipped: write it for your COCO copy'",
    "data/my_data.data": "written by tools/calculate_dataset.py (its --name my)",
    "data/other.data": "any other dataset's .data (validation.py's docstring)",
    "data/x.data": "any .data (train_multi_GPU.py's docstring)",
    "data/coco/train.txt": "the lineage convention parse_data_cfg describes",
    "weights/yolov3-spp.pt": "weights/README.md: download and convert",
    "weights/x.pt": "any weights (train.py's docstring)",
    "weights/darknet53.conv.74": "weights/README.md: download",
    "weights/yolov4.conv.137": "weights/README.md: download",
    "cfg/x.cfg": "an example path in parse_config's docstring",
    "data/train.txt": "an example list file in labels.py's docstring (where caches live)",
    "data/train.cache.npz": "the cache labels.py's docstring says is written beside it",
}


def _texts() -> dict[str, str]:
    texts = {"README.md": (REPO / "README.md").read_text()}
    for py in [*REPO.glob("*.py"), *REPO.glob("tools/*.py"), *REPO.glob("*_utils/**/*.py")]:
        doc = ast.get_docstring(ast.parse(py.read_text())) or ""
        texts[str(py.relative_to(REPO))] = doc
    return texts


def test_cited_files_exist_or_are_made():
    missing = []
    for where, text in _texts().items():
        written = set(OUTPUT_FLAGS.findall(text))
        for path in sorted(set(PATH.findall(text))):
            if (REPO / path).exists() or path in written or path in USER_FILES:
                continue
            missing.append(f"{where}: {path}")
    assert not missing, missing
