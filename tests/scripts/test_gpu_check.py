"""``make gpu-check`` (bench/gpu_check.py) on the CPU: its verdicts and arithmetic, its reports,
its orchestration of failing, skipped and hanging steps, the no-CUDA exit, the ``cuda`` marker,
and (slow) the real steps' code at toy sizes with the internal ``--device cpu --tiny``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import (
    PLAN_AMP_SPEEDUP,
    StepSpec,
    check,
    compare_stats,
    fit_batch,
    get_parser,
    plan_target,
    select_steps,
    verdict,
    workers_needed,
    write_reports,
)
from build_utils.errors import ConfigError, OutputError

REPO = Path(__file__).resolve().parents[2]
STEPS = "tests.workers.gpu_check_steps"


def test_verdicts_against_the_plan() -> None:
    assert plan_target(416, "NVIDIA H100 80GB HBM3") == 1000
    assert plan_target(608, "NVIDIA H100 80GB HBM3") == 450
    assert plan_target(608, "NVIDIA H100 PCIe") == pytest.approx(315)  # 0.7x the SXM's
    assert plan_target(320, "NVIDIA H100 80GB HBM3") is None
    assert verdict(1200.0, 1000.0) == "met"
    assert verdict(1000.0, 1000.0) == "met"
    assert verdict(730.0, 1000.0) == "73% of target"
    assert verdict(None, 1000.0) == verdict(500.0, None) == "-"
    assert verdict(1.9, PLAN_AMP_SPEEDUP) == "met"
    assert verdict(1.26, PLAN_AMP_SPEEDUP) == "70% of target"


def test_workers_needed_and_the_gpu_rate_they_feed() -> None:
    assert workers_needed(1000.0, 140.0) == 8  # 7.14 workers: 8
    assert workers_needed(1000.0, 125.0) == 8  # exactly 8
    assert workers_needed(450.0, 500.0) == 1
    with pytest.raises(ValueError, match="positive"):
        workers_needed(1000.0, 0.0)
    earlier = {
        "train-416": {"size": 416, "fastest": {"img_per_s": 1234.5}},
        "train-608": {"size": 608, "fastest": {"img_per_s": 567.0}},
        "data": {},
    }
    # The 640 loader feeds the 608 step, the nearest measured size.
    assert gpu_check._gpu_rate_for(640, earlier, None) == (567.0, "train-608 fastest")
    assert gpu_check._gpu_rate_for(416, earlier, None) == (1234.5, "train-416 fastest")
    # No train step measured: the plan's target at the nearest plan size.
    rate, source = gpu_check._gpu_rate_for(640, {}, "NVIDIA H100 80GB HBM3")
    assert (rate, source) == (450.0, "plan at 608 (no train step measured)")


def test_fit_batch_halves_until_the_step_fits() -> None:
    tried, freed = [], []

    def step(batch: int) -> dict:
        tried.append(batch)
        if batch > 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"batch": batch}

    assert fit_batch(step, 64, lambda: freed.append(1)) == ({"batch": 16}, [64, 32])
    assert tried == [64, 32, 16] and len(freed) == 2

    def never(batch: int) -> dict:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        fit_batch(never, 4)


def test_steps_are_chosen_by_name() -> None:
    specs = gpu_check.step_specs(gpu_check.Settings())
    names = [s.name for s in specs]
    assert names == ["env", "cuda-tests", "eval", "ddp", "train-416", "train-608", "data"]
    quick = gpu_check.step_specs(gpu_check.Settings().quick())
    assert [s.name for s in quick][4:] == ["train-416", "data"]
    # --compile: the slow CUDA tests and the compile step, last; the whole fits --budget-s 800.
    args = get_parser().parse_args(["--compile"])
    compiled = gpu_check.step_specs(dataclasses.replace(gpu_check.Settings(), compile=args.compile))
    assert [s.name for s in compiled] == [*names, "cuda-slow-tests", "compile-416"]
    assert compiled[-2].target.endswith("step_cuda_tests:slow")
    assert compiled[-1].target.endswith("step_train:416:compile")
    assert gpu_check.plan_fits(compiled, 800) and not gpu_check.plan_fits(compiled, 570)
    assert gpu_check._train_variants("bf16", True) == [("bf16", "channels_last", True)]
    assert all(not v[2] for v in gpu_check._train_variants("bf16", False))
    chosen = select_steps(specs, ["data,train", "env"])
    assert [s.name for s in chosen] == ["env", "train-416", "train-608", "data"]
    with pytest.raises(ConfigError, match="unknown step.*trian"):
        select_steps(specs, ["trian"])


@pytest.mark.parametrize("quick", [False, True])
def test_the_steps_limits_add_up_within_the_default_budget(quick) -> None:
    # Was: 1,210 s of limits in a 570 s budget, so the last steps were cut as "timed out".
    settings = gpu_check.Settings().quick() if quick else gpu_check.Settings()
    specs = gpu_check.step_specs(settings)
    budget = get_parser().parse_args([]).budget_s
    assert gpu_check.plan_fits(specs, budget)
    assert sum(s.limit_s for s in specs) + gpu_check.ORCHESTRATION_S <= budget
    assert not gpu_check.plan_fits(specs, budget / 2)


def test_the_ddp_step_runs_one_process_per_gpu_up_to_two() -> None:
    # Was: skipped on one GPU, though one torchrun process runs NCCL, DDP and the gathers.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [gpu_check.ddp_processes(cuda, n) for n in (1, 2, 8)] == [1, 2, 2]
    assert gpu_check.ddp_processes(cpu, 0) == 2  # gloo


def test_the_eval_step_holds_autocast_to_float32() -> None:
    autocast = {"mAP50": 0.5, "mAP50-95": 0.3}
    assert gpu_check.amp_problems(autocast, {"mAP50": 0.504, "mAP50-95": 0.3}, 0.0) == []
    (far,) = gpu_check.amp_problems(autocast, {"mAP50": 0.5, "mAP50-95": 0.33}, 0.01)
    assert far == (
        "validation.py under autocast and with --amp off differ by 0.0300 on mAP50-95 "
        "(tolerance 0.01)"
    )
    # What bf16 decoding did at 608 px: centres up to 2 px off.
    (coarse,) = gpu_check.amp_problems(autocast, autocast, 2.0)
    assert coarse.startswith("box centres decoded under autocast differ from float32's by 2.000")
    assert gpu_check.amp_problems(autocast, autocast, float("nan"))  # never passes unmeasured
    figures = gpu_check.amp_figures(autocast, {"mAP50": 0.49, "mAP50-95": 0.3}, 0.0, "bf16")
    assert figures["amp_table"]["columns"] == [
        "stat",
        "validation.py (bf16)",
        "--amp off",
        "|diff|",
    ]
    assert figures["amp_table"]["rows"][0] == ["mAP50", 0.5, 0.49, 0.01]


def test_train_figures_hold_the_verdicts() -> None:
    def row(label: str, img_s: float, compiled: bool = False) -> dict:
        return {"label": label, "img_per_s": img_s, "compile": compiled, "batch": 64}

    rows = [
        row("fp32/contiguous", 500.0),
        row("fp32/channels_last", 520.0),
        row("bf16/contiguous", 800.0),
        row("bf16/channels_last", 950.0),
        row("bf16/channels_last +compile", 1140.0, compiled=True),
    ]
    for r in rows:
        r.update(tflop_per_s=1.0, first_call_s=1.0)
    f = gpu_check.train_figures(rows, "bf16", 1000.0)
    assert [r["vs_fp32"] for r in rows] == [1.0, 1.04, 1.6, 1.9, 2.28]
    assert (f["amp_channels_last_img_s"], f["verdict"]) == (950.0, "95% of target")
    assert (f["amp_speedup"], f["amp_speedup_verdict"]) == (1.9, "met")
    assert f["compile_gain"] == 1.2
    assert f["fastest"] == {"label": "bf16/channels_last +compile", "img_per_s": 1140.0}
    assert f["table"]["columns"][-1] == "plan: 1000 img/s, 1.8x fp32"
    assert f["table"]["rows"][3][-1] == "95% of target; 1.90x fp32: met"
    assert f["compile_verdict"] == "met" and f["table"]["rows"][4][-1] == "met; 1.20x eager"
    # compile-<size> alone (no train-<size> before it): no fp32 row to compare with, no 1.00x.
    alone = gpu_check.train_figures([dict(rows[4])], "bf16", 1000.0)
    assert alone["rows"][0]["vs_fp32"] is None and "compile_gain" not in alone
    assert alone["table"]["rows"][0][4] == "-" and alone["table"]["rows"][0][-1] == "met"
    # No AMP on the device (the CPU): no verdict, only the ratios.
    cpu = gpu_check.train_figures(rows[:2], None, None)
    assert "verdict" not in cpu and cpu["fastest"]["label"] == "fp32/channels_last"


def test_the_cuda_tests_step_runs_the_marked_files(tmp_path) -> None:
    files = {p.name for p in gpu_check.cuda_test_files()}
    assert {"test_cuda.py", "test_loss.py", "test_devices.py", "test_trackers.py"} <= files
    cmd = gpu_check.pytest_command([REPO / "tests" / "test_cuda.py"], tmp_path / "j.xml")
    assert cmd[1:5] == ["-m", "pytest", "-m", "cuda"] and f"--junitxml={tmp_path / 'j.xml'}" in cmd
    slow = gpu_check.pytest_command([], tmp_path / "j.xml", "cuda and slow")
    assert slow[3:5] == ["-m", "cuda and slow"]
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b">'
        '<failure message="AssertionError: 3 != 4&#10;assert 3 == 4"/></testcase>'
        '<testcase classname="tests.test_loss" name="test_c"><error message="y"/></testcase>'
        '<testcase classname="tests.test_loss" name="test_d"><skipped message="z"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_check.junit_counts(junit) == {
        "tests": 4,
        "passed": 1,
        "failed": 2,
        "skipped": 1,
        "failures": {
            "tests.test_cuda::test_b": "AssertionError: 3 != 4",
            "tests.test_loss::test_c": "y",
        },
    }


def test_a_failed_command_is_reported_by_its_cause_not_by_torchruns_summary() -> None:
    torchrun_stderr = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "train_multi_GPU.py", line 9, in <module>',
            "[rank0]: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1234, invalid usage",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "=" * 60,
            "/work/train_multi_GPU.py FAILED",
            "=" * 60,
        ]
    )
    assert gpu_check._error_line(torchrun_stderr) == (
        "[rank0]: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1234, invalid usage"
    )
    assert gpu_check._error_line("torch.OutOfMemoryError: CUDA out of memory\n") == (
        "torch.OutOfMemoryError: CUDA out of memory"
    )
    # No exception line: the last line, as before.
    assert gpu_check._error_line("step 3\nexit 1\n") == "exit 1"


def test_logged_and_validated_stats_are_compared_key_by_key() -> None:
    logged = {"mAP50": "0.5", "mAP50-95": "0.3", "epoch": "4"}
    cmp = compare_stats(logged, {"mAP50": 0.504, "mAP50-95": 0.3})
    assert cmp["agree"] and cmp["worst_key"] == "mAP50"
    assert cmp["max_abs_diff"] == pytest.approx(0.004)
    assert not compare_stats(logged, {"mAP50": 0.52, "mAP50-95": 0.3})["agree"]
    missing = compare_stats(logged, {"mAP50": 0.5, "mAR100": 0.4})
    assert not missing["agree"] and missing["missing_keys"] == ["mAR100"]


def _report(steps: list[dict]) -> dict:
    return {
        "stamp": "20261124T050000Z",
        "started_utc": "2026-11-24 05:00:00 UTC",
        "duration_s": 12.5,
        "quick": False,
        "budget_s": 570.0,
        "machine": {
            "device": "NVIDIA H100 80GB HBM3 x 1",
            "slug": "nvidia-h100-80gb-hbm3",
            "torch": "2.11.0",
            "cuda": "13.0",
            "cudnn": 91300,
            "cpu": "Intel Xeon",
            "usable_cpus": 16,
        },
        "steps": steps,
        "summary": gpu_check.summary_line(steps),
        "exit_status": 1,
    }


def test_reports_are_written_whole_and_never_over_another(tmp_path) -> None:
    steps = [
        {
            "name": "train-416",
            "status": "passed",
            "reason": None,
            "duration_s": 80.0,
            "limit_s": 240,
            "error_tail": None,
            "figures": {"table": {"columns": ["variant", "img/s"], "rows": [["bf16/cl", 1100]]}},
        },
        {
            "name": "ddp",
            "status": "failed",
            "reason": "torchrun exited 1: NCCL error",
            "duration_s": 3.0,
            "limit_s": 180,
            "error_tail": "Traceback\nNCCL error",
            "figures": {},
        },
    ]
    report = _report(steps)
    json_path, md_path = write_reports(report, tmp_path)
    assert json_path.name == "gpu-check-20261124T050000Z-nvidia-h100-80gb-hbm3.json"
    assert json.loads(json_path.read_text()) == report
    md = md_path.read_text()
    assert "| train-416 | passed | 80.0 | 240 |  |" in md
    assert "| ddp | failed | 3.0 | 180 | torchrun exited 1: NCCL error |" in md
    assert "| variant | img/s |\n|---|---|\n| bf16/cl | 1100 |" in md
    assert "## ddp: last lines of its output\n\n```\nTraceback\nNCCL error\n```" in md
    assert report["summary"] == (
        "1 passed, 1 failed, 0 skipped: failed ddp (torchrun exited 1: NCCL error)"
    )
    # The same second again: a new name, the first report untouched.
    first = json_path.read_bytes()
    again = write_reports(_report(steps[:1]), tmp_path)
    assert again[0].name.endswith("-hbm3-2.json") and again[1].name.endswith("-hbm3-2.md")
    assert json_path.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (json_path, md_path, *again)
    )


def test_a_failing_step_is_recorded_and_the_others_still_run(tmp_path, capsys) -> None:
    specs = [
        StepSpec("crash", f"{STEPS}:crashes", 120),
        StepSpec("problem", f"{STEPS}:finds_a_problem", 120),
        StepSpec("skip", f"{STEPS}:skips", 120),
        StepSpec("absent", f"{STEPS}:passes", 120, needs=("no_such_module_here",)),
        StepSpec("hang", f"{STEPS}:hangs", 4),
        StepSpec("pass", f"{STEPS}:passes", 120),
    ]
    args = get_parser().parse_args(["--device", "cpu", "--out-dir", str(tmp_path)])
    assert check(args, specs) == 1
    (json_path,) = tmp_path.glob("gpu-check-*-cpu.json")
    steps = {s["name"]: s for s in json.loads(json_path.read_text())["steps"]}
    crash = steps["crash"]
    assert crash["status"] == "failed" and "RuntimeError: boom: the step crashed" in crash["reason"]
    assert "Traceback" in crash["error_tail"] and crash["figures"] == {"before_the_crash": 1}
    assert steps["problem"]["status"] == "failed"
    assert steps["problem"]["reason"] == "the figures disagree"
    assert steps["problem"]["figures"] == {"measured": 2}
    assert (steps["skip"]["status"], steps["skip"]["reason"]) == (
        "skipped",
        "nothing to check here",
    )
    assert steps["absent"]["status"] == "skipped"
    assert "needs no_such_module_here (not installed" in steps["absent"]["reason"]
    assert steps["hang"]["status"] == "failed" and steps["hang"]["reason"] == "timed out after 4 s"
    assert steps["hang"]["duration_s"] < 60
    # The last step ran after all that, with the figures of every step before it.
    assert steps["pass"]["status"] == "passed"
    assert steps["pass"]["figures"]["earlier"] == ["absent", "crash", "hang", "problem", "skip"]
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gpu-check: 1 passed, 3 failed, 2 skipped: failed crash (exited 1: ")
    assert "problem (the figures disagree); hang (timed out after 4 s)" in err


def test_a_step_the_budget_stops_is_reported_as_cut(tmp_path, monkeypatch, capsys) -> None:
    # Was: "failed: timed out after 6 s", as if the step had hung.
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)
    specs = [StepSpec("long", f"{STEPS}:hangs", 600)]
    args = get_parser().parse_args(
        ["--device", "cpu", "--budget-s", "6", "--out-dir", str(tmp_path)]
    )
    assert check(args, specs) == 0  # nothing failed
    (json_path,) = tmp_path.glob("gpu-check-*-cpu.json")
    (step,) = json.loads(json_path.read_text())["steps"]
    assert step["status"] == "skipped"
    assert step["reason"].startswith(
        "cut after 6 s: the check's --budget-s 6 ran out before the step's own 600 s"
    )
    err = capsys.readouterr().err
    assert "the steps' limits need up to 620 s, --budget-s is 6: the last steps may be cut" in err
    assert err.strip().splitlines()[-1].startswith("gpu-check: 0 passed, 0 failed, 1 skipped;")


def test_every_table_of_a_step_is_in_the_report(tmp_path) -> None:
    one = {"columns": ["a"], "rows": [[1]]}
    two = {"columns": ["b"], "rows": [[2]]}
    step = {"name": "eval", "status": "passed", "reason": None, "duration_s": 1.0}
    step.update(limit_s=110, error_tail=None, figures={"table": one, "amp_table": two})
    md = gpu_check.markdown(_report([step]))
    assert "## eval\n\n| a |\n|---|\n| 1 |\n\n| b |\n|---|\n| 2 |" in md


def test_no_cuda_device_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "reports"
    assert gpu_check.main(["--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: make gpu-check needs an NVIDIA GPU: ") and err.count("\n") == 1
    assert "nothing was run" in err and not out.exists()


@pytest.mark.parametrize("budget", ["-1", "0", "nan", "inf"])
def test_a_budget_that_is_no_number_of_seconds_is_one_line(budget, tmp_path, capsys) -> None:
    # Was: -1 skipped every step and exited 0 ("0 passed"); nan ran without a limit.
    out = tmp_path / "reports"
    argv = ["--device", "cpu", "--steps", "env", "--budget-s", budget, "--out-dir", str(out)]
    assert gpu_check.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --budget-s must be a positive number of seconds, got {float(budget)}\n"
    assert not out.exists()


def test_an_out_dir_that_cannot_be_made_is_one_line_before_any_step(tmp_path, capsys) -> None:
    # Was: a NotADirectoryError traceback once every step had run (the figures lost).
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "reports"
    specs = [StepSpec("hang", f"{STEPS}:hangs", 60)]
    args = get_parser().parse_args(["--device", "cpu", "--out-dir", str(out)])
    with pytest.raises(OutputError, match="--out-dir"):
        check(args, specs)
    assert "hang" not in capsys.readouterr().err
    assert gpu_check.main(["--device", "cpu", "--steps", "env", "--out-dir", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: cannot ")


pytest_plugins = ["pytester"]

CUDA_SAMPLE = """
import pytest

@pytest.mark.cuda
def test_needs_cuda():
    pass
"""


def test_the_cuda_marker_skips_without_cuda_and_fails_when_cuda_is_required(
    pytester, pytestconfig, monkeypatch
) -> None:
    markers = pytestconfig.getini("markers")
    assert any(m.startswith("cuda:") for m in markers)  # registered in pyproject.toml
    pytester.makeini("[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers))
    pytester.makepyfile(CUDA_SAMPLE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("YOLO_REQUIRE_CUDA", raising=False)
    skipped = pytester.runpytest_inprocess("-p", "cuda_marker", "--strict-markers", "-rs")
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["*needs a CUDA device*"])
    monkeypatch.setenv("YOLO_REQUIRE_CUDA", "1")
    failed = pytester.runpytest_inprocess("-p", "cuda_marker", "--strict-markers")
    failed.assert_outcomes(errors=1)
    failed.stdout.fnmatch_lines(["*YOLO_REQUIRE_CUDA=1 but this test needs a CUDA device*"])
    assert failed.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.slow
def test_the_real_steps_run_on_the_cpu_at_toy_sizes(tmp_path) -> None:
    """env, the train-step bench, the data pipeline and the eval-vs-validation.py step, with
    the internal --device cpu --tiny: the code a GPU session runs, minus the sizes."""
    argv = ["--device", "cpu", "--tiny", "--budget-s", "3600", "--out-dir", str(tmp_path)]
    args = get_parser().parse_args([*argv, "--steps", "env", "train", "data", "eval"])
    assert check(args) == 0
    (json_path,) = tmp_path.glob("gpu-check-*-cpu.json")
    report = json.loads(json_path.read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert [s["status"] for s in report["steps"]] == ["passed"] * 4
    assert steps["env"]["figures"]["amp_auto"] == "off"  # the CPU: no AMP row below
    train = steps["train-64"]["figures"]
    assert [r["label"] for r in train["rows"]] == ["fp32/contiguous", "fp32/channels_last"]
    assert all(r["img_per_s"] > 0 and r["batch"] == 2 for r in train["rows"])
    (data,) = steps["data"]["figures"]["rows"]
    assert data["gpu_rate_from"] == "train-64 fastest"
    assert data["gpu_img_per_s"] == train["fastest"]["img_per_s"]
    assert data["workers_needed"] == workers_needed(
        data["gpu_img_per_s"], data["img_per_s_per_worker"]
    )
    evaluation = steps["eval"]["figures"]
    assert evaluation["agree"] and evaluation["checkpoint_precision"]["amp"] is None
    assert evaluation["max_abs_diff"] <= 1e-6  # on the CPU the two agree exactly
    # No autocast on the CPU: the first evaluation is the float32 one (not run twice).
    assert evaluation["fp32_evaluated_again"] is False
    for stats in evaluation["amp_vs_fp32"].values():
        assert stats["autocast"] == stats["fp32"]
    assert evaluation["decode_centre_diff_px"] == 0.0


@pytest.mark.slow
def test_the_ddp_step_runs_two_gloo_processes_on_the_cpu(tmp_path) -> None:
    argv = ["--device", "cpu", "--tiny", "--budget-s", "1800", "--out-dir", str(tmp_path)]
    args = get_parser().parse_args([*argv, "--steps", "ddp"])
    assert check(args) == 0
    (json_path,) = tmp_path.glob("gpu-check-*-cpu.json")
    (ddp,) = json.loads(json_path.read_text())["steps"]
    assert ddp["status"] == "passed" and ddp["figures"]["backend"] == "gloo"
    assert ddp["figures"]["processes"] == 2
    assert ddp["figures"]["agree"] and ddp["figures"]["max_abs_diff"] <= 1e-6


@pytest.mark.slow
def test_the_cuda_tests_step_fails_where_cuda_is_missing(tmp_path, monkeypatch) -> None:
    """The real cuda-tests step with no visible GPU: under YOLO_REQUIRE_CUDA=1 every CUDA test
    fails instead of skipping, so the step fails and names them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # also on a GPU machine
    argv = ["--device", "cpu", "--tiny", "--budget-s", "1800", "--out-dir", str(tmp_path)]
    assert check(get_parser().parse_args([*argv, "--steps", "cuda-tests"])) == 1
    (json_path,) = tmp_path.glob("gpu-check-*-cpu.json")
    (step,) = json.loads(json_path.read_text())["steps"]
    figures = step["figures"]
    assert step["status"] == "failed" and figures["returncode"] == 1
    assert figures["tests"] == figures["failed"] >= 5 and figures["passed"] == 0
    assert "tests/scenarios/test_cuda.py" in figures["files"]
    assert step["reason"].startswith("pytest -m 'cuda and not slow' exited 1: tests.")
