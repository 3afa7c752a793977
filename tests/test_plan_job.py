"""scripts/plan_job.py: a job's steps, time, workers and disk from its corpus and GPUs, every figure
marked measured or predicted, and wrong input as one line with exit code 2."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import checkpoints  # noqa: F401  (imported here, not inside the first test that plans)
import config
import training_step
from manifest_schema import OUTPUT_COLUMNS, tagged_text
from scripts import plan_job

REPO = Path(__file__).resolve().parents[1]
# Lines that are not figures: the inputs echoed, notes, train.py's warnings, the knobs to run with.
NOT_FIGURES = ("given:", "note:", "warning:", "run with:")
H200_JOB = "--hours 3000 --epochs 3 --gpus 8 --gpu h200"


@pytest.fixture(autouse=True)
def job_defaults(monkeypatch):
    """Every knob at its default, whatever this shell exports."""
    knobs = config.read_config({})
    monkeypatch.setattr(config, "KNOBS", knobs)
    for name, knob in knobs.items():
        monkeypatch.setattr(config, name, knob.value)


def write_manifest(path: Path, durations: dict[str, list[float]]) -> Path:
    """A manifest of the contract's columns, ``durations`` per language (no audio: a plan reads
    durations and languages only)."""
    rows = {k: [] for k in OUTPUT_COLUMNS}
    for lang, values in durations.items():
        for i, duration in enumerate(values):
            rows["segment_id"].append(f"{lang}-{i}")
            rows["shard_id"].append(f"src1/{lang}/shard_0000")
            rows["text"].append(tagged_text(lang, "hello world"))
            rows["duration"].append(duration)
            rows["lang"].append(lang)
            rows["audio_filepath"].append(f"/audio/{lang}_{i:04d}.flac")
            rows["source"].append("src1")
    pq.write_table(pa.table(rows), path)
    return path


def plan(capsys, args: str) -> list[str]:
    """The lines plan_job.py prints for ``args`` (split at spaces)."""
    assert plan_job.main(args.split()) == 0
    return capsys.readouterr().out.splitlines()


def figure(lines: list[str], label: str) -> str:
    """The value of the figure line ``label`` (the text between the label and its source)."""
    found = [line for line in lines if line.strip().startswith(label + ":")]
    assert len(found) == 1, (label, lines)
    return found[0].split(":", 1)[1].split("  (")[0].strip()


def number(text: str) -> float:
    return float(re.match(r"[\d,.]+", text).group().replace(",", ""))


def test_steps_per_epoch_are_the_epochs_audio_over_an_optimizer_steps_audio(
    tmp_path, capsys, monkeypatch
):
    # 11 s utterances: 8 fill a 90 s micro-batch (88 s), a ninth would pass it.
    monkeypatch.setattr(config, "GRAD_ACCUM", 2)
    manifest = write_manifest(tmp_path / "train.parquet", {"hi": [11.0] * 100, "ta": [11.0] * 60})
    lines = plan(capsys, f"--manifest {manifest} --epochs 3 --gpus 2 --gpu h200")
    audio = 160 * 11.0
    per_step = 2 * 2 * 8 * 11.0  # ranks x GRAD_ACCUM x a micro-batch's audio
    assert number(figure(lines, "optimizer steps per epoch")) == math.ceil(audio / per_step) == 5
    assert number(figure(lines, "optimizer steps in all")) == 15
    assert number(figure(lines, "audio per optimizer step")) == per_step
    assert "run with: MAX_STEPS=15" in lines


def test_nodes_multiply_the_ranks_an_optimizer_step_spans(tmp_path, capsys):
    manifest = write_manifest(tmp_path / "train.parquet", {"hi": [10.0] * 9 * 32 * 3})
    one = plan(capsys, f"--manifest {manifest} --epochs 1 --gpus 4 --gpu h200")
    two = plan(capsys, f"--manifest {manifest} --epochs 1 --gpus 4 --nodes 2 --gpu h200")
    assert number(figure(one, "optimizer steps per epoch")) == 9 * 32 * 3 * 10 / (4 * 4 * 90) == 6
    assert number(figure(two, "optimizer steps per epoch")) == 3


def test_hours_give_the_steps_their_audio_needs_however_the_languages_split_them(capsys):
    even = plan(capsys, "--hours 3000 --languages hi,ta,en --epochs 3 --gpus 8 --gpu h100")
    split = plan(capsys, "--languages hi:1500,ta:500,en:1000 --epochs 3 --gpus 8 --gpu h100")
    half = plan(capsys, "--hours 1500 --epochs 3 --gpus 8 --gpu h100")
    steps = number(figure(even, "optimizer steps per epoch"))
    per_step = number(figure(even, "audio per optimizer step"))
    assert abs(steps - 3000 * 3600 / per_step) <= 1
    # The sampler fills a micro-batch to nearly MAX_BATCH_DURATION, never past it.
    assert 0.9 * 8 * 4 * 90 < per_step <= 8 * 4 * 90
    # The languages' shares move a few batches between the sampler's lanes, no more.
    assert number(figure(split, "optimizer steps per epoch")) == pytest.approx(steps, rel=0.005)
    assert abs(number(figure(half, "optimizer steps per epoch")) - steps / 2) <= 1
    assert "hi 1,500 h, ta 500 h, en 1,000 h" in split[0]


@pytest.mark.parametrize("gpu", ["h200", "h100", "a100"])
def test_every_printed_figure_says_measured_or_predicted(capsys, gpu):
    lines = plan(capsys, f"--hours 3000 --languages hi,ta,en --epochs 3 --gpus 8 --gpu {gpu}")
    figures = [
        line for line in lines if re.search(r"\d", line) and not line.startswith(NOT_FIGURES)
    ]
    assert len(figures) >= 6
    for line in figures:
        assert re.search(r"\((measured|predicted): ", line), line
    for line in lines:
        if "(measured: " in line:  # a measurement names its device, date and page
            assert re.search(r"\b(H200|x86-64)\b", line) and re.search(r"2026-\d\d-\d\d", line)
            assert "docs/benchmarks.md" in line, line


def test_an_h100_is_predicted_from_the_h200_and_never_called_measured(capsys):
    lines = plan(capsys, "--hours 3000 --epochs 3 --gpus 8 --gpu h100")
    timed = [line for line in lines if "H100" in line and not line.startswith("given:")]
    assert timed and all("(predicted: " in line for line in timed)
    assert any("no H100 was measured" in line for line in timed)
    h200 = plan(capsys, H200_JOB)
    # The H100's time per micro-batch is the H200's times their bandwidth ratio.
    ratio = plan_job.H200_TB_PER_S / plan_job.H100_SXM_TB_PER_S
    hours = number(figure(lines, "GPU-hours")) / number(figure(h200, "GPU-hours"))
    assert hours == pytest.approx(ratio, rel=0.01)


def test_a_gpu_kind_without_measurements_says_so_and_predicts_no_time(capsys):
    lines = plan(capsys, "--hours 3000 --epochs 3 --gpus 8 --gpu A100")
    assert any("nothing is measured on a100" in line for line in lines)
    assert not [line for line in lines if line.strip().startswith(("wall time", "GPU-hours"))]
    assert number(figure(lines, "optimizer steps per epoch")) > 0  # what needs no GPU stays


def test_workers_per_gpu_are_the_gpus_demand_over_a_workers_rate_with_a_quarter_spare(
    capsys, monkeypatch
):
    figures = plan_job.FIGURES
    demand = figures["step_audio_s"].value / figures["step_phase1_s"].value
    rate = figures["worker_audio_s_per_s"].value
    lines = plan(capsys, H200_JOB)
    workers = math.ceil(1.25 * demand / rate)
    assert number(figure(lines, "DataLoader workers per GPU")) == workers == 1
    assert number(figure(lines, "CPU cores per node")) == 8 * (workers + 1)
    # The usual augmentation, measured as such: a worker delivers 0.55 of its rate.
    monkeypatch.setattr(config, "SPEED_PERTURB", (0.9, 1.0, 1.1))
    monkeypatch.setattr(config, "NOISE_PROB", 0.5)
    lines = plan(capsys, H200_JOB)
    workers = math.ceil(1.25 * demand / (0.55 * rate))
    assert number(figure(lines, "DataLoader workers per GPU")) == workers == 2
    assert any("x 0.55" in line and "(measured: " in line for line in lines)


def test_the_workers_per_gpu_the_docs_state_are_what_the_plan_prints(capsys, monkeypatch):
    stated = "1 per GPU at the step measured on an H200, 2 with SPEED_PERTURB"
    assert stated in config.KNOBS["NUM_WORKERS"].help
    for gpu in ("h200", "h100"):
        lines = plan(capsys, f"--hours 3000 --epochs 3 --gpus 8 --gpu {gpu}")
        assert number(figure(lines, "DataLoader workers per GPU")) == 1
    monkeypatch.setattr(config, "SPEED_PERTURB", (0.9, 1.0, 1.1))
    for gpu in ("h200", "h100"):
        lines = plan(capsys, f"--hours 3000 --epochs 3 --gpus 8 --gpu {gpu}")
        assert number(figure(lines, "DataLoader workers per GPU")) == 2


def test_an_augmentation_never_measured_as_such_is_predicted_from_the_measured_costs(
    capsys, monkeypatch
):
    monkeypatch.setattr(config, "NOISE_PROB", 0.3)
    lines = plan(capsys, H200_JOB)
    ratio = 0.27 / (0.27 + 0.3 * 0.07)
    assert any(f"x {ratio:.2f}" in line and "(predicted: " in line for line in lines)


def test_the_schedule_warnings_are_train_pys_for_the_planned_total(capsys, monkeypatch):
    lines = plan(capsys, H200_JOB)
    total = int(number(figure(lines, "optimizer steps in all")))
    assert total < config.UNFREEZE_STEP
    monkeypatch.setattr(config, "MAX_STEPS", total)
    expected = [f"warning: {line}" for line in training_step.schedule_warnings()]
    assert expected and all(line in lines for line in expected)
    assert "warning: MAX_STEPS=600000 (in effect) is" in "\n".join(lines)
    # A schedule that fits the total warns of nothing.
    monkeypatch.setattr(config, "UNFREEZE_STEP", total // 5)
    monkeypatch.setattr(config, "WARMUP_STEPS", total // 50)
    monkeypatch.setattr(config, "PHASE2_WARMUP", total // 50)
    lines = plan(capsys, H200_JOB)
    assert not [line for line in lines if line.startswith("warning:")]
    assert any(
        line.strip().startswith(f"phase 2, everything trains: steps {total // 5:,}-")
        for line in lines
    )


def test_disk_holds_every_checkpoint_saved_and_the_final_nemo(capsys, monkeypatch):
    monkeypatch.setattr(config, "CHECKPOINT_EVERY", 1000)
    lines = plan(capsys, H200_JOB)
    total = int(number(figure(lines, "optimizer steps in all")))
    params = plan_job.FIGURES["parameters"].value
    size = params * (4 + 2 * 4) * 1.01  # float32 weights and AdamW's two moments, 1% more
    assert number(figure(lines, "one step checkpoint")) == pytest.approx(size / 2**30, abs=0.01)
    saved = total // 1000
    assert number(figure(lines, "step checkpoints saved")) == saved
    need = (saved * size + params * 4) / 2**30
    assert number(figure(lines, "CHECKPOINT_DIR needs")) == pytest.approx(need, abs=0.1)
    monkeypatch.setattr(config, "KEEP_CHECKPOINTS", 2)
    lines = plan(capsys, H200_JOB)
    need = (4 * size + params * 4) / 2**30  # 2 newest + the best + the one being written
    assert number(figure(lines, "CHECKPOINT_DIR needs")) == pytest.approx(need, abs=0.1)


def test_every_figure_is_what_its_page_of_the_docs_says():
    entries = [*plan_job.FIGURES.values(), *plan_job.AUGMENTATION_RATIOS.values()]
    for fig in entries:
        page = " ".join((REPO / fig.page).read_text(encoding="utf-8").split())
        assert fig.quote in page, (fig.quote, fig.page)
        stated = [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", fig.quote)]
        assert fig.value in stated or fig.value / 1e9 in stated, (fig.value, fig.quote)


def test_without_a_corpus_it_plans_train_manifest_path(tmp_path, capsys, monkeypatch):
    manifest = write_manifest(tmp_path / "train.parquet", {"hi": [10.0] * 9 * 16})
    monkeypatch.setattr(config, "TRAIN_MANIFEST_PATH", manifest)
    lines = plan(capsys, "--epochs 2 --gpus 4 --gpu h200")
    assert lines[0].startswith(f"given: {manifest}: 144 utterances")
    assert number(figure(lines, "optimizer steps per epoch")) == 144 * 10 / (4 * 4 * 90) == 1


@pytest.mark.parametrize(
    "args, named",
    [
        ("--manifest {tmp}/missing.parquet", "--manifest"),
        ("--hours 3000 --languages hi;ta", "--languages"),
        ("--hours 3000 --languages hi:lots,ta:5", "--languages"),
        ("--languages hi,ta", "--languages"),
        ("--hours 0", "--hours"),
        ("--hours 3000 --gpus 0", "--gpus"),
        ("--hours 3000 --gpus eight", "--gpus"),
        ("--hours 3000 --nodes 0", "--nodes"),
        ("--hours 3000 --epochs 0", "--epochs"),
        ("--hours 3000 --gpu h100!", "--gpu"),
        ("--manifest m.parquet --hours 3000", "--manifest"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument_and_exit_code_2(tmp_path, capsys, args, named):
    args = args.replace("{tmp}", str(tmp_path)).split()
    for flag, value in {"--epochs": "3", "--gpus": "8", "--gpu": "h100"}.items():
        if flag not in args:
            args += [flag, value]
    assert plan_job.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
