"""Convert a COCO instances JSON (and its image folder) to a YOLO dataset that trains directly.

    python tools/coco2yolo.py --json annotations/instances_train.json --images train/ \\
        --out my_coco --split train
    python tools/coco2yolo.py --json annotations/instances_val.json --images val/ \\
        --out my_coco --split val            # adds the val split to my_coco
    python train.py --data my_coco/data.yaml ...
    python validation.py --weights runs/x/best.pt --save-json out/   # ids of the COCO JSON

Writes, for ``--split S``::

    OUT/images/S/<file_name>   the images: hard links (copies across file systems, or --copy)
    OUT/labels/S/<stem>.txt    one ``class cx cy w h`` line per object, normalised to [0, 1]
    OUT/data.yaml              path, the splits converted so far, names, coco_ids
    OUT/coco_ids.json          class -> category id and image -> image id of the source JSON
    OUT/coco2yolo_S_report.txt what was skipped and why

Classes: the JSON's category ids sorted, numbered 0..nc-1 (ids 3, 7, 11 become classes 0, 1,
2), named by their ``name``. Boxes (``[x, y, w, h]`` in pixels) become normalised centre and
size, clipped to the image: normalised by the JSON's ``width``/``height`` where they are the
image's shape (a resized copy was annotated), else by the image's own size.
Skipped, each with a line in the report: annotations with ``iscrowd`` set (as ultralytics'
``convert_coco`` does: a crowd region is not one object; pycocotools ignores detections there
instead), boxes empty after clipping, unknown image or category ids, and images named in the
JSON that are missing, unreadable or outside ``--images``. An image without annotations gets an
empty label file (a background image). The input is only read.

``OUT`` must be empty or hold an earlier conversion of the same categories (another split is
added); a split converted before, or any other content, needs ``--exist-ok``, which replaces the
files of that split written by the earlier conversion and nothing else.

``validation.py --save-json`` reads ``coco_ids`` from the data.yaml and writes predictions with
the source JSON's image and category ids, so pycocotools scores them against that JSON.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from build_utils.atomic import make_output_dir, reported_write, write_text
from build_utils.checks import check_folder, finite_float, is_int
from build_utils.errors import ConfigError
from build_utils.image_io import check_image, is_image_file
from build_utils.labels import img2label_path, yolo_txt_lines
from build_utils.parse_config import data_yaml_text, split_role
from build_utils.safe_yaml import short_repr, short_text
from build_utils.yolo_output import DATA_YAML, place_image, report_text, same_aspect, write_labels
from train_utils.cli import HelpFormatter, path_arg, run_script
from train_utils.evaluation.detection_files import (
    COCO_IDS_FILE,
    CocoIdMap,
    read_coco_ids,
    read_json_file,
)

LOGGER = logging.getLogger("coco2yolo")


@dataclass
class Report:
    """What one split's conversion did: counts and one line per problem."""

    images: int = 0
    written: int = 0
    background: int = 0
    objects: int = 0
    crowd: int = 0
    skipped_images: int = 0
    skipped_objects: int = 0
    lines: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.images} images in the JSON: {self.written} converted ({self.background} "
            f"without objects), {self.skipped_images} skipped; {self.objects} objects written, "
            f"{self.crowd} crowd annotations and {self.skipped_objects} other objects skipped"
        )


@dataclass(frozen=True)
class CocoFile:
    """The parts of a COCO instances JSON a detector needs, checked."""

    path: Path
    category_ids: list[int]  # sorted: class k is category category_ids[k]
    names: list[str]
    images: list[dict[str, Any]]  # id, file_name, width, height (None when absent)
    annotations: dict[int, list[dict[str, Any]]]  # image id -> its annotations, in file order
    unknown_images: int  # annotations naming an image id the JSON lists no image for


def _positive(value: Any) -> float | None:
    x = finite_float(value)
    return x if x is not None and x > 0 else None


def read_coco(path: Path) -> CocoFile:
    """Read and check a COCO instances JSON.

    Raises:
        ConfigError: one line for a file that is not a usable COCO JSON: missing, over
            ``MAX_ANNOTATION_BYTES``, not JSON, no ``images``/``annotations``/``categories``
            lists, categories or images without integer ids, ids given twice.
    """
    data = read_json_file(path, "COCO annotation JSON")
    if not isinstance(data, dict):
        raise ConfigError("expected a COCO JSON object with images, annotations, categories", path)
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise ConfigError(f"'{key}' must be a list (is this a COCO instances file?)", path)
    cats: dict[int, str] = {}
    for k, c in enumerate(data["categories"]):
        cid = c.get("id") if isinstance(c, dict) else None
        if not is_int(cid):
            raise ConfigError(f"categories[{k}] has no integer 'id': {short_repr(c)}", path)
        if cid in cats:
            raise ConfigError(f"category id {cid} is given twice", path)
        name = c.get("name")
        named = isinstance(name, str | int) and str(name).strip()
        cats[cid] = str(name).strip() if named else str(cid)
    if not cats:
        raise ConfigError("'categories' is empty: no classes to train", path)
    images: list[dict[str, Any]] = []
    seen: set[int] = set()
    for k, im in enumerate(data["images"]):
        iid = im.get("id") if isinstance(im, dict) else None
        if not is_int(iid) or not isinstance(im.get("file_name"), str):
            raise ConfigError(
                f"images[{k}] needs an integer 'id' and a 'file_name': {short_repr(im)}", path
            )
        if iid in seen:
            raise ConfigError(f"image id {iid} is given twice", path)
        seen.add(iid)
        images.append(
            {
                "id": iid,
                "file_name": im["file_name"],
                "width": _positive(im.get("width")),
                "height": _positive(im.get("height")),
            }
        )
    anns: dict[int, list[dict[str, Any]]] = {}
    unknown = 0
    for a in data["annotations"]:
        iid = a.get("image_id") if isinstance(a, dict) else None
        if not is_int(iid) or iid not in seen:
            unknown += 1
            continue
        anns.setdefault(iid, []).append(a)
    ids = sorted(cats)
    return CocoFile(path, ids, [cats[i] for i in ids], images, anns, unknown)


def yolo_lines(
    anns: Sequence[dict[str, Any]], classes: dict[int, int], w: float, h: float, where: str
) -> tuple[list[str], list[str], int, int]:
    """Label lines of one image's annotations, the report lines, and the crowd and other
    annotations skipped."""
    kept, notes, crowd, skipped = [], [], 0, 0  # kept: x1, y1, x2, y2, conf (unused), class
    for k, a in enumerate(anns):
        head = f"{where}: annotation {k}"
        if a.get("iscrowd"):
            crowd += 1
            continue
        cid = a.get("category_id")
        cls = classes.get(cid) if is_int(cid) else None  # 3.0 or True is no category id
        if cls is None:
            notes.append(f"{head}: unknown category {short_repr(a.get('category_id'))}, skipped")
            skipped += 1
            continue
        box = a.get("bbox")
        values = [finite_float(v) for v in box] if isinstance(box, list) and len(box) == 4 else []
        if not values or None in values:
            notes.append(f"{head}: bbox {short_repr(box)} is not 4 numbers, skipped")
            skipped += 1
            continue
        x1, y1, bw, bh = values
        x2, y2 = x1 + bw, y1 + bh
        cx1, cy1, cx2, cy2 = max(x1, 0.0), max(y1, 0.0), min(x2, w), min(y2, h)
        if cx2 <= cx1 or cy2 <= cy1:
            notes.append(
                f"{head}: box {short_repr(box)} is empty in the {w:g}x{h:g} image, skipped"
            )
            skipped += 1
            continue
        if (cx1, cy1, cx2, cy2) != (x1, y1, x2, y2):
            notes.append(f"{head}: box {short_repr(box)} clipped to the {w:g}x{h:g} image")
        kept.append((cx1, cy1, cx2, cy2, 0.0, cls))
    return yolo_txt_lines(kept, w, h, save_conf=False), notes, crowd, skipped


def _relative_image(file_name: str) -> PurePosixPath | None:
    """``file_name`` as a relative path inside the image folder, or None when it is absolute or
    climbs out with ``..`` (it could name any file on the machine)."""
    rel = PurePosixPath(file_name.replace("\\", "/"))
    parts = [p for p in rel.parts if p not in ("", ".")]
    if rel.is_absolute() or ".." in parts or not parts:
        return None
    return PurePosixPath(*parts)


def prepare_out(out: Path, split: str, coco: CocoFile, exist_ok: bool) -> CocoIdMap:
    """The id map to extend (a fresh one for a new folder), after refusing what would mix or
    overwrite a user's files: a non-empty folder that is no conversion of these categories, or
    a split converted before, without --exist-ok. With --exist-ok, the files the earlier
    conversion of this split wrote are removed (nothing else is)."""
    fresh = CocoIdMap(coco.category_ids, coco.names)
    try:
        entries = sorted(p.name for p in out.iterdir())
    except OSError as e:
        raise ConfigError(f"--out cannot be listed ({e.strerror or e})", out) from e
    if not entries:
        return fresh
    map_path = out / COCO_IDS_FILE
    if not map_path.is_file():
        if not exist_ok:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ConfigError(
                f"--out is not empty ({shown}) "
                "and holds no earlier conversion; choose another folder or pass --exist-ok",
                out,
            )
        return fresh
    old = read_coco_ids(map_path)
    if old.category_ids != coco.category_ids:
        raise ConfigError(
            f"--out holds a conversion of other categories ({short_repr(old.category_ids)}, this "
            f"JSON has {short_repr(coco.category_ids)}); its labels would not agree: choose "
            "another folder",
            out,
        )
    renamed = [(i, a, b) for i, a, b in zip(old.category_ids, old.names, coco.names) if a != b]
    if renamed:
        i, before, now = renamed[0]
        LOGGER.warning(
            "%d categories are named otherwise than in --out's earlier conversion (id %d: %s "
            "there, %s here); the earlier names are kept",
            len(renamed),
            i,
            short_repr(before),
            short_repr(now),
        )
    prefix = f"images/{split}/"
    previous = [k for k in old.images if k.startswith(prefix)]
    taken = (out / "images" / split).exists() or (out / "labels" / split).exists()
    if (previous or taken) and not exist_ok:
        raise ConfigError(
            f"split '{split}' was converted into --out before; pass --exist-ok to replace it",
            out,
        )
    for rel in previous:
        image = out / rel
        for f in (image, Path(img2label_path(str(image)))):
            f.unlink(missing_ok=True)
        del old.images[rel]
    return old


def convert(
    coco: CocoFile, images_dir: Path, out: Path, split: str, id_map: CocoIdMap, copy: bool
) -> Report:
    """Write ``out/images/<split>``, ``out/labels/<split>`` and add the split's images to
    ``id_map``; the report of what was skipped."""
    report = Report(images=len(coco.images))
    classes = {cid: k for k, cid in enumerate(coco.category_ids)}
    img_root = out / "images" / split
    taken: dict[PurePosixPath, int] = {}  # image path -> the id that took it
    if coco.unknown_images:
        report.lines.append(
            f"{coco.path}: {coco.unknown_images} annotation(s) name an image id the JSON lists "
            "no image for, skipped"
        )
        report.skipped_objects += coco.unknown_images
    for im in coco.images:
        where = f"image {im['id']} ({short_text(im['file_name'], 60)})"
        rel = _relative_image(im["file_name"])
        if rel is None:
            report.lines.append(f"{where}: skipped: the file name leaves --images")
            report.skipped_images += 1
            continue
        if rel in taken:
            report.lines.append(f"{where}: skipped: image {taken[rel]} has the same file")
            report.skipped_images += 1
            continue
        taken[rel] = im["id"]
        src = images_dir / rel
        if not is_image_file(src):
            report.lines.append(f"{where}: skipped: not an image file name")
            report.skipped_images += 1
            continue
        # check_image refuses a FIFO, device, folder or oversized file before reading it.
        size, problem = check_image(src)
        if size is None:
            report.lines.append(f"{where}: skipped: {problem}")
            report.skipped_images += 1
            continue
        w, h = im["width"] or float(size[0]), im["height"] or float(size[1])
        if (w, h) != (float(size[0]), float(size[1])):
            if same_aspect((w, h), (float(size[0]), float(size[1]))):
                why = "boxes normalised by the JSON's (the frame they were drawn in)"
            else:  # not the image resized: a wrong size (trans_voc2yolo.py judges alike)
                why = "not the image's shape: boxes normalised by the image's size"
                w, h = float(size[0]), float(size[1])
            # A side the JSON gives as no positive number reads "none".
            given = "x".join(f"{v:g}" if v else "none" for v in (im["width"], im["height"]))
            report.lines.append(
                f"{where}: the JSON's size {given} differs from the image's upright "
                f"{size[0]}x{size[1]}; {why}"
            )
        lines, notes, crowd, skipped = yolo_lines(
            coco.annotations.get(im["id"], []), classes, w, h, where
        )
        report.lines += notes
        report.crowd += crowd
        report.skipped_objects += skipped
        dst = img_root / rel
        label = Path(img2label_path(str(dst)))  # where the loader will look
        dst.parent.mkdir(parents=True, exist_ok=True)
        label.parent.mkdir(parents=True, exist_ok=True)
        place_image(src, dst, copy)
        write_labels(label, lines)
        id_map.images[f"images/{split}/{rel.as_posix()}"] = im["id"]
        report.written += 1
        report.objects += len(lines)
        report.background += not lines
    if crowd_total := report.crowd:
        report.lines.append(
            f"{crowd_total} crowd (iscrowd) annotation(s) skipped, as ultralytics' convert_coco "
            "does; score against the source JSON for pycocotools' treatment of crowd regions"
        )
    return report


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], add_help=add_help, formatter_class=HelpFormatter
    )
    p.add_argument("--json", type=path_arg, required=True, help="COCO instances JSON")
    p.add_argument(
        "--images", type=path_arg, required=True, help="folder the JSON's file_name entries are in"
    )
    p.add_argument("--out", type=path_arg, required=True, help="the YOLO dataset folder to write")
    p.add_argument(
        "--split",
        default=None,
        help="split name: train..., val... or test... (default: the JSON's name without "
        "'instances_', e.g. val2017)",
    )
    p.add_argument(
        "--copy", action="store_true", help="copy the images (default: hard links where possible)"
    )
    p.add_argument(
        "--exist-ok",
        action="store_true",
        help="write into a non-empty --out / replace a split converted before",
    )
    return p


def check_places(args: argparse.Namespace, split: str) -> None:
    """--images exists, and --out neither lies inside it nor holds it as this split's folder."""
    check_folder(args.images, "--images")
    out = args.out
    if out.resolve().is_relative_to(args.images.resolve()):
        raise ConfigError(
            "--out lies inside --images; the input is only read: choose another folder", out
        )
    # ultralytics' layout invites converting in place (--images OUT/images/val2017,
    # --out OUT): the split's images would be linked onto themselves, and the next
    # --exist-ok run deletes the split's previous images, which would be the input itself.
    split_dir = out / "images" / split
    if args.images.resolve().is_relative_to(split_dir.resolve()):
        raise ConfigError(
            f"--images is (or lies inside) {split_dir}, where this split is written; "
            "replacing the split would delete the input: choose another --out",
            args.images,
        )


def coco_to_yolo(args: argparse.Namespace) -> None:
    # An empty --split (an unset shell variable) is refused, not read as "not given".
    split = args.json.stem.removeprefix("instances_") if args.split is None else args.split
    if not split or "/" in split or split in (".", ".."):
        raise ConfigError(f"--split {short_repr(split)}: give a plain folder name")
    role = split_role(split)
    check_places(args, split)
    out = args.out
    coco = read_coco(args.json)
    make_output_dir(out, "--out")
    id_map = prepare_out(out, split, coco, args.exist_ok)
    with reported_write(out, "--out", folder=True):
        report = convert(coco, args.images, out, split, id_map, args.copy)
    # A second split of one role (train and train2) is added to it, as the README says (was:
    # the later replaced the earlier in data.yaml, which then trained on one of them).
    known = id_map.splits.get(role, [])
    folders = [known] if isinstance(known, str) else list(known)
    folders += [f"images/{split}"] if f"images/{split}" not in folders else []
    id_map.splits[role] = folders[0] if len(folders) == 1 else folders
    if len(folders) > 1:
        LOGGER.info("%s: %s is now %s", out / DATA_YAML, role, ", ".join(folders))
    id_map.sources[split] = str(args.json.resolve())
    write_text(out / COCO_IDS_FILE, id_map.to_json(), "--out")
    yaml_text = data_yaml_text(
        id_map.splits, id_map.names, "written by tools/coco2yolo.py", {"coco_ids": COCO_IDS_FILE}
    )
    write_text(out / DATA_YAML, yaml_text, "--out")
    report_path = out / f"coco2yolo_{split}_report.txt"
    text = report_text(report.summary(), report.lines)
    write_text(report_path, text, "--out", errors="surrogateescape")  # names as on disk
    LOGGER.info(
        "%s; %d classes; %s (report: %s)",
        report.summary(),
        len(coco.category_ids),
        out / DATA_YAML,
        report_path,
    )
    missing = [r for r in ("train", "val") if r not in id_map.splits]
    if missing:
        LOGGER.info(
            "data.yaml has no %s split yet: convert its JSON into the same --out with --split "
            "%s to train on it%s",
            " or ".join(missing),
            missing[0],
            "" if "val" in missing else " (validation.py scores its val split as it is)",
        )


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_args_parser(), coco_to_yolo, argv)


if __name__ == "__main__":
    sys.exit(main())
