"""bf16 by default where the CPU has it: ``--amp auto`` resolves to bf16 only on CPUs with bf16
arithmetic (train_utils/precision.py), training keeps it only where two timed train
steps say it is clearly faster (train_utils/precision.choose_cpu_amp), and a resumed run
keeps the precision its checkpoint records whatever the timings say now."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import run_training, train_argv

from train_utils import memory_format, precision
from train_utils.memory_format import CACHE_ENV, MemoryFormatChoice, StepTiming, step_seconds
from train_utils.precision import (
    BF16_MIN_SPEEDUP,
    choose_cpu_amp,
    describe_amp,
    dtype_from_name,
    dtype_name,
    resolve_amp,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("mode", "native", "expected"),
    [
        ("auto", True, torch.bfloat16),
        ("auto", False, None),  # AVX2-only CPUs: nothing changes
        ("off", True, None),
        ("on", False, torch.bfloat16),  # asked for: oneDNN's emulation (AVX-512)
        ("bf16", False, torch.bfloat16),
    ],
)
def test_auto_is_bf16_only_on_cpus_with_bf16_arithmetic(mode, native, expected, monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)  # oneDNN runs bf16
    assert resolve_amp(mode, CPU, cpu_native_bf16=native) == expected


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(False, False, False), (True, False, True), (False, True, True)],
)
def test_native_bf16_is_avx512_bf16_or_amx_on_x86(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # tests/conftest.py caps it
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    # oneDNN's own check also says yes on AVX-512 CPUs that only emulate bf16: not enough.
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)
    precision.cpu_has_native_bf16.cache_clear()
    try:
        assert precision.cpu_has_native_bf16() is expected
    finally:
        precision.cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize(
    ("cap", "native", "any_bf16"),
    [
        ("AVX2", False, False),
        ("avx512_core", False, True),  # oneDNN emulates bf16 there: --amp may, auto does not
        ("AVX512_CORE_BF16", True, True),
        ("AVX10_1_512_AMX", True, True),
        ("DEFAULT", True, True),
    ],
)
def test_a_onednn_isa_cap_is_honoured(monkeypatch, cap, native, any_bf16) -> None:
    """A CPU with AMX whose oneDNN the user capped (as tests/conftest.py does)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    for check in (precision.cpu_has_native_bf16, precision.cpu_bf16_is_fast):
        check.cache_clear()
    try:
        assert precision.cpu_has_native_bf16() is native
        assert precision.cpu_bf16_is_fast() is any_bf16
    finally:
        for check in (precision.cpu_has_native_bf16, precision.cpu_bf16_is_fast):
            check.cache_clear()


def test_dtype_names_round_trip() -> None:
    for amp in (None, torch.bfloat16, torch.float16):
        assert dtype_from_name(dtype_name(amp)) is amp
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_from_name(None) is None


def test_bf16_is_kept_only_for_a_clear_gain() -> None:
    assert choose_cpu_amp(1.0, 0.5).amp is torch.bfloat16
    assert choose_cpu_amp(BF16_MIN_SPEEDUP * 0.8, 0.8).amp is torch.bfloat16  # exactly the bar
    assert choose_cpu_amp(1.3, 1.0).amp is None  # less than bf16's extra epochs cost
    slower = choose_cpu_amp(1.0, 0.95)  # 1.05x: within the noise of two short steps
    assert slower.amp is None and "not" in slower.reason
    line = describe_amp(choose_cpu_amp(0.9, 0.45))
    assert "900 ms fp32 vs 450 ms bf16, 2.00x" in line and line.startswith("precision bf16")


def test_step_seconds_is_the_format_the_run_uses() -> None:
    timed = MemoryFormatChoice(True, "timed now", contiguous_s=2.0, channels_last_s=1.5)
    assert step_seconds(timed, None) == 1.5
    assert step_seconds(timed, False) == 2.0
    with pytest.raises(ValueError, match="not timed"):
        step_seconds(MemoryFormatChoice(True, "--channels-last given"), None)


class FakeSteps:
    """Stands in for ``time_variants``: seconds per (precision, format), the variants timed
    recorded (each measurement once)."""

    def __init__(self, fp32_s: float, bf16_s: float, channels_last_x: float = 0.9) -> None:
        self.seconds = {None: fp32_s, torch.bfloat16: bf16_s}
        self.channels_last_x = channels_last_x  # channels_last's time as a share of contiguous's
        self.calls: list[tuple[torch.dtype | None, bool]] = []

    def __call__(self, model, img, batch, device, variants, *args) -> dict:
        self.calls += [(amp, channels_last) for channels_last, amp in variants]
        return {
            (cl, amp): StepTiming(self.seconds[amp] * (self.channels_last_x if cl else 1.0), 0.1, 5)
            for cl, amp in variants
        }


@pytest.fixture
def native_bf16_cpu(monkeypatch, tmp_path):
    """This CPU as one with bf16 arithmetic, and a fresh memory-format cache."""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    def timings(fp32_s: float, bf16_s: float, channels_last_x: float = 0.9) -> FakeSteps:
        fake = FakeSteps(fp32_s, bf16_s, channels_last_x)
        monkeypatch.setattr(memory_format, "time_variants", fake)
        return fake

    return timings


def _argv(data: Path, out: Path, *extra: str, epochs: int = 1) -> list[str]:
    """train_argv of these runs: 64 px, batch 2, and the memory format timed (not given)."""
    return train_argv(data, out, *extra, img=64, batch=2, epochs=epochs, channels_last=None)


def _recorded_amp(out: Path) -> str | None:
    return torch.load(out / "last.pt", weights_only=True)["precision"]["amp"]


def test_auto_trains_in_bf16_where_it_is_timed_faster(
    native_bf16_cpu, make_shapes_data, tmp_path, caplog
) -> None:
    data = make_shapes_data(n_train=4, n_val=2)
    steps = native_bf16_cpu(fp32_s=1.0, bf16_s=0.5)
    with caplog.at_level(logging.INFO, logger=memory_format.__name__):
        run_training(_argv(data, tmp_path / "fast"))
    assert _recorded_amp(tmp_path / "fast") == "bfloat16"
    # Both precisions in both formats, once each: the format follows from the same timings.
    assert sorted(steps.calls, key=str) == sorted(
        [(a, f) for a in (None, torch.bfloat16) for f in (False, True)], key=str
    )
    assert any("precision bf16" in r.getMessage() for r in caplog.records)
    # Said before the wait: what is timed, and that it is once per setting.
    assert any(
        r.getMessage().startswith(
            "timing fp32 vs bf16 autocast, contiguous vs channels_last train steps at 64 px, "
            "batch 2:"
        )
        and r.getMessage().endswith("(cached for later runs of this setting)")
        for r in caplog.records
    )


def test_auto_stays_fp32_where_bf16_is_not_faster(native_bf16_cpu, make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=4, n_val=2)
    native_bf16_cpu(fp32_s=1.0, bf16_s=0.95)
    run_training(_argv(data, tmp_path / "slow"))
    assert _recorded_amp(tmp_path / "slow") is None


@pytest.mark.parametrize(
    ("flag", "recorded", "line"),
    [
        ("off", None, "precision: full (float32) (--amp off), channels_last"),
        ("bf16", "bfloat16", "precision: bfloat16 autocast (--amp bf16), channels_last"),
    ],
)
def test_flags_bypass_the_timing_and_say_so(
    native_bf16_cpu, make_shapes_data, tmp_path, flag, recorded, line
) -> None:
    """Was: --amp bf16/off printed no precision line at all (--amp auto did). Now one line, on
    the console and in train.log, as validation.py and predict.py write it."""
    data = make_shapes_data(n_train=4, n_val=2)
    steps = native_bf16_cpu(fp32_s=1.0, bf16_s=0.5)  # channels_last 0.9x: the faster format
    run_training(_argv(data, tmp_path / flag, "--amp", flag))
    assert _recorded_amp(tmp_path / flag) == recorded
    assert {a for a, _ in steps.calls} == {dtype_from_name(recorded)}  # only the format timed
    log = (tmp_path / flag / "train.log").read_text()
    assert log.count(line) == 1 and log.count("precision") == 1


def test_forced_bf16_without_bf16_kernels_trains_and_records_fp32(
    make_shapes_data, tmp_path, monkeypatch
) -> None:
    """--amp bf16 where oneDNN has no bf16 kernels (an AVX2 CPU; the suite caps oneDNN there):
    fp32 runs, so fp32 is recorded, and a bf16 CPU evaluating the checkpoint replays fp32."""
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: False)
    data = make_shapes_data(n_train=4, n_val=2)
    run_training(_argv(data, tmp_path / "forced", "--amp", "bf16"))
    assert _recorded_amp(tmp_path / "forced") is None


def test_a_resumed_run_keeps_its_precision(
    native_bf16_cpu, make_shapes_data, tmp_path, monkeypatch
):
    data = make_shapes_data(n_train=4, n_val=2)
    out = tmp_path / "run"
    native_bf16_cpu(fp32_s=1.0, bf16_s=0.5)
    run_training(_argv(data, out, epochs=1))
    assert _recorded_amp(out) == "bfloat16"
    # Another day, bf16 times slower (and the cache is gone): the resumed run stays in bf16.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache2"))
    steps = native_bf16_cpu(fp32_s=0.5, bf16_s=1.0)
    run_training(_argv(data, out, "--resume", str(out / "last.pt"), epochs=2))
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["precision"]["amp"] == "bfloat16"
    assert steps.calls == []  # its format is the run's too (test_..._keeps_its_memory_format)


def test_a_resumed_run_keeps_its_memory_format(
    native_bf16_cpu, make_shapes_data, tmp_path, monkeypatch
):
    """Was: a resumed run timed the two formats again unless a steady timing was cached, and a
    busy machine (whose timings are not cached) could choose the other format, whose rounding
    differs: the resumed run was no longer the same computation as the uninterrupted one
    (tests/scripts/test_yolov5_flags.py's exact resume failed so in a full suite run)."""
    data = make_shapes_data(n_train=4, n_val=2)
    out = tmp_path / "run"
    native_bf16_cpu(fp32_s=1.0, bf16_s=0.5, channels_last_x=0.5)
    run_training(_argv(data, out, epochs=1))
    assert torch.load(out / "last.pt", weights_only=True)["precision"]["channels_last"] is True
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache2"))
    steps = native_bf16_cpu(fp32_s=1.0, bf16_s=0.5, channels_last_x=2.0)  # contiguous faster now
    run_training(_argv(data, out, "--resume", str(out / "last.pt"), epochs=2))
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["precision"]["channels_last"] is True
    assert steps.calls == []  # precision and format both the run's: nothing timed
