"""scripts/gpu_acceptance.py: the acceptance run's CPU mode end to end on data prepared elsewhere,
its budget, its limits and its clean-up, and how it reads each stage's output.

The prepared folder is made once per module and moved before it is used, as it is when copied from
a connected machine to a GPU node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import gpu_acceptance as ga
from tests.torchrun_jobs import job_processes

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_acceptance.py"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared folder, moved after ``prepare`` wrote it (its audio paths point to the old place)."""
    root = tmp_path_factory.mktemp("acceptance")
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "prepare",
            "--data",
            str(root / "made"),
            "--sizes",
            "hi=30,en=30",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    moved = root / "copied" / "acceptance"
    moved.parent.mkdir()
    shutil.move(str(root / "made"), moved)
    return moved


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "PROBE"))}
    env.update(PROBE_JOB=f"acceptance-{os.getpid()}-{time.monotonic_ns()}", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _run(prepared: Path, out: Path, *args: str, env: dict | None = None, timeout: float = 900):
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "run",
            "--cpu",
            "--data",
            str(prepared),
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or _env(),
    )


def _stages(out: Path) -> dict[str, dict]:
    summary = json.loads((out / "acceptance.json").read_text())
    return {s["name"]: s for s in summary["stages"]}


def test_prepare_leaves_only_what_the_run_reads(prepared):
    record = json.loads((prepared / ga.PREPARED).read_text())
    assert (
        record["rows"]["train_manifest_v2.parquet"] > 0
        and record["rows"]["val_manifest_v2.parquet"] > 0
    )
    assert (
        not list(prepared.rglob("*.tar")) and (prepared / "tokenizer" / "tokenizer.model").is_file()
    )
    assert not prepared.with_name(prepared.name + ".partial").exists()


@pytest.mark.slow
def test_cpu_mode_runs_every_stage_on_a_moved_folder_and_leaves_no_process(prepared, tmp_path):
    env = _env()
    out = tmp_path / "out"
    done = _run(prepared, out, env=env)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    stages = _stages(out)
    assert list(stages) == [
        "environment",
        "data",
        "tdt-loss",
        "training",
        "decode-language",
        "step-bench",
        "preflight",
        "max-batch",
        "throughput",
    ]
    for name, stage in stages.items():
        # The benchmarks' verdicts are timings on a shared machine: they may warn, never fail.
        timed = ("ok", "warn")
        expected = {
            "max-batch": ("skip",),
            "step-bench": timed,
            "decode-language": timed,
            "throughput": timed,
        }
        expected = expected.get(name, ("ok",))
        assert stage["verdict"] in expected, (name, stage["figure"])
    assert "CUDA only" in stages["max-batch"]["figure"]
    made = prepared.parents[1].resolve() / "made"  # where prepare wrote it, before the move
    assert f"moved from {made} to {prepared.resolve()}" in stages["data"]["figure"]
    training = stages["training"]["figure"]
    assert "50 optimizer steps" in training and "SIGTERM at step 10 saved (exit 75)" in training
    assert "ratio" in stages["step-bench"]["figure"]
    # the real batch against NeMo, the profile's parts (its trace kept) and the data path
    throughput = stages["throughput"]["figure"]
    assert "x GRAD_ACCUM 2" in throughput and "ratio" in throughput and "profile: " in throughput
    assert "fed by the loader" in throughput and "workers per GPU" in throughput
    assert (out / ga.TRACE_FILE).is_file() and (out / "throughput-data.log").is_file()
    # the prepared tokenizer counted each language's scripts: all four decodings were timed
    decoding = stages["decode-language"]["figure"]
    assert "given_tag" in decoding and "given_scripts" in decoding and "both" in decoding
    table = (out / "acceptance.md").read_text()
    assert "| training | ok |" in table and "CPU mode" in table
    assert "| stage | verdict | seconds | figure |" in done.stdout
    for name in ("environment", "data", "tdt-loss", "training", "step-bench", "preflight"):
        assert (out / f"{name}.log").is_file(), name
    assert job_processes(env) == []


def test_a_small_budget_skips_the_stages_it_cannot_fit_and_says_so(prepared, tmp_path):
    out = tmp_path / "out"
    done = _run(prepared, out, "--budget", "45", "--only", "environment,training,step-bench")
    stages = _stages(out)
    # The data stage runs unasked: the stages named need it.
    assert stages["environment"]["verdict"] == "ok" and stages["data"]["verdict"] == "ok"
    for name in ("training", "step-bench"):
        assert stages[name]["verdict"] == "skip"
        assert (
            "the budget has" in stages[name]["figure"]
            and "needs at least" in stages[name]["figure"]
        )
    assert stages["tdt-loss"]["figure"] == "not asked for (--only)"
    assert done.returncode == 0, done.stdout[-3000:]


def test_relative_data_out_and_work_folders_are_the_callers(prepared, tmp_path):
    caller = tmp_path / "caller"
    shutil.copytree(prepared, caller / "acceptance")
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "run",
            "--cpu",
            "--data",
            "acceptance",
            "--out",
            "out",
            "--work",
            "scratch",
            "--only",
            "data",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=caller,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert _stages(caller / "out")["data"]["verdict"] == "ok"
    assert (caller / "scratch" / "manifests" / "train_manifest_v2.parquet").is_file()


def test_a_folder_used_where_prepare_wrote_it_is_not_said_to_have_moved(prepared, tmp_path):
    """prepare builds in <folder>.partial and renames it, so its record names that folder: a
    folder nobody moved is read in place, and the data stage says so (no "moved from")."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    here = (tmp_path / "acceptance").resolve()
    shutil.copytree(prepared, here)
    record = json.loads((here / ga.PREPARED).read_text())
    # what `prepare --data <here>` itself would have recorded: its paths under <here>.partial
    built = str(here) + ".partial"
    for name in ("train_manifest_v2.parquet", "val_manifest_v2.parquet"):
        table = pq.read_table(here / name)
        paths = pc.replace_substring(
            table.column("audio_filepath"), record["root"] + "/", built + "/", max_replacements=1
        )
        table = table.set_column(
            table.column_names.index("audio_filepath"), "audio_filepath", paths
        )
        pq.write_table(table, here / name)
    record["root"] = built
    (here / ga.PREPARED).write_text(json.dumps(record), encoding="utf-8")
    out = tmp_path / "out"
    done = _run(here, out, "--only", "data")
    assert done.returncode == 0, done.stdout[-3000:]
    figure = _stages(out)["data"]["figure"]
    assert f"in {here}, where prepare wrote it" in figure and "moved" not in figure


def test_a_folder_prepare_did_not_write_fails_the_data_stage_naming_the_command(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    done = _run(tmp_path / "empty", out, "--only", "data,training")
    stages = _stages(out)
    assert done.returncode == 1
    assert stages["data"]["verdict"] == "fail"
    assert "gpu_acceptance.py prepare --data" in stages["data"]["figure"]
    assert stages["training"]["figure"] == "needs the data stage, which failed"


def test_a_stage_past_its_limit_is_killed_with_everything_it_started(tmp_path):
    env = _env()
    summary = ga.Summary(mode="CPU mode", budget_s=60, started="now")
    runner = ga.Runner(summary, tmp_path, tmp_path, tmp_path, cpu=True)
    stage = ga.Stage("training", limit_s=2, min_s=1)
    started = time.monotonic()
    code, log = runner.spawn(
        stage, ["bash", "-c", "sleep 300 & sleep 300 & echo started; wait"], env
    )
    assert code is None and "started" in log
    assert time.monotonic() - started < 20
    assert job_processes(env) == []


@pytest.mark.slow
def test_sigterm_mid_run_stops_the_stage_and_writes_the_table(prepared, tmp_path):
    env = _env()
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "run",
            "--cpu",
            "--data",
            str(prepared),
            "--out",
            str(out),
            "--only",
            "data,training",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 300
    while not (out / "training.log").is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # train.py is starting
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-3000:]
    summary = json.loads((out / "acceptance.json").read_text())
    assert summary["interrupted"] == "SIGTERM"
    assert {s["name"]: s["verdict"] for s in summary["stages"]}["training"] != "ok"
    assert job_processes(env) == []


# --------------------------------------------------------------------------------------------------
# Reading the stages' output
# --------------------------------------------------------------------------------------------------


def test_a_failed_smoke_run_gives_its_reason_and_the_logs_last_lines():
    log = (
        "[smoke] training in /tmp/x\nerror: TDT loss check failed on cuda:0\n"
        "[smoke] FAILED: train.py ended before step 10 (tail of train.log):\n"
    )
    verdict, figure = ga.training_figure(log, [])
    assert verdict == "fail"
    assert figure.startswith("FAILED: train.py ended before step 10")
    assert "TDT loss check failed" in figure


def test_the_step_benchmarks_lines_become_one_figure_with_the_ratios():
    log = (
        "model: configs/parakeet_tdt_0.6b.yaml: 0.632 B parameters (631,886,182), vocabulary 12000\n"
        "micro-batch: the sampler's heaviest at MAX_BATCH_DURATION=90: 6 utterances, 120.0 s of audio, longest 20.0 s\n"
        "phase 1 project: median step    0.153 s over 5 steps (min 0.150, max 0.160),    784.0 audio s/s, "
        "peak GPU memory allocated 14.40 GiB, 100.0 GFLOP/step, MFU 4.6%\n"
        "phase 1 nemo   : median step    0.147 s over 5 steps (min 0.140, max 0.150),    816.0 audio s/s, "
        "peak GPU memory allocated 14.40 GiB, 100.0 GFLOP/step, MFU 4.8%\n"
        "phase 1 ratio project / NeMo step time: 1.040 (misses the target <= 1.0); per round 1.040\n"
    )
    verdict, figure = ga.bench_figure(log)
    assert verdict == "ok"
    assert figure == (
        "0.632 B parameters, 6 utterances, 120.0 s of audio; phase 1: 0.153 s/step, 784 audio s/s, "
        "peak 14.4 GiB, MFU 4.6%; NeMo 0.147 s; ratio 1.040"
    )
    assert (
        ga.bench_figure(
            log.replace(
                "ratio project / NeMo step time: 1.040", "ratio project / NeMo step time: 1.200"
            )
        )[0]
        == "warn"
    )


def test_the_decoding_benchmarks_runs_become_one_figure_per_precision():
    run = (
        "model EncDecRNNTBPEModel, 1.0 M parameters on cuda, precision {p}; 117 utterances, 478 s "
        "of audio in 5 batches; 7 rounds\n"
        "auto              0.054 s     800 words   auto decoding\n"
        "given_tag / auto: decoding 1.050, with the encoder 1.002   per round: 1.0, 1.1\n"
        "given_scripts / auto: decoding 1.080, with the encoder {g}   per round: 1.0, 1.1\n"
        "both / auto: decoding 1.500, with the encoder 1.040   per round: 1.4, 1.6\n"
        "CUDA graphs: full_graph; texts with graphs against without, differing: auto 0, "
        "given_tag 0, given_scripts 0 of 117\n"
    )
    log = run.format(p="32", g="1.004") + run.format(p="bf16", g="1.009")
    verdict, figure = ga.decode_language_figure(log, 0)
    assert verdict == "ok"
    assert figure.startswith("search / auto: 32: given_tag 1.050 (1.002 with encoder)")
    assert "bf16: given_tag" in figure and "given_scripts 1.080 (1.009 with encoder)" in figure
    assert (
        "graphs full_graph, texts differing auto 0, given_tag 0, given_scripts 0 of 117" in figure
    )
    slow = run.format(p="32", g="1.004") + run.format(p="bf16", g="1.090")
    verdict, figure = ga.decode_language_figure(slow, 0)
    assert verdict == "warn" and figure.startswith("given above 1.05 with the encoder in bf16;")
    assert ga.decode_language_figure("Traceback ...\nRuntimeError: boom", 1) == (
        "fail",
        "exit 1: Traceback ... / RuntimeError: boom",
    )


def test_preflight_verdicts_are_counted_and_the_bad_ones_named():
    log = (
        "ok    gpu          NVIDIA H200\nwarn  data         900 audio s/s -> raise NUM_WORKERS\n"
        "fail  tdt-loss     TDTLossCheckFailed: numba\nskip  all-reduce   one process\n"
    )
    verdict, figure = ga.preflight_figure(log, 1)
    assert verdict == "fail"
    assert figure.startswith("1 ok, 1 warn, 1 fail, 1 skip of 4 checks")
    assert "fail tdt-loss: TDTLossCheckFailed" in figure


def test_a_search_that_reaches_its_upper_end_says_more_fits():
    log = (
        "     600 s: fits (38 utterances; peak 84.2 of 139.8 GiB)\n"
        "largest ... -> set MAX_BATCH_DURATION=600 (GRAD_ACCUM ...)"
    )
    verdict, figure = ga.max_batch_figure(log, 0, 600)
    assert verdict == "ok" and "upper end: more fits" in figure and "84.2 of 139.8 GiB" in figure
    verdict, figure = ga.max_batch_figure(log.replace("=600", "=455"), 0, 600)
    assert "MAX_BATCH_DURATION=455 fits phase 2" in figure


def test_prepare_refuses_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(RuntimeError, match="is not a prepared folder"):
        ga.prepare(tmp_path / "mine", "hi=5")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_only_adds_the_data_stage_where_a_named_stage_needs_it():
    assert ga.needed_stages(["training"]) == {"training", "data"}
    assert ga.needed_stages(["environment", "tdt-loss"]) == {"environment", "tdt-loss"}


def test_throughput_without_a_batch_duration_runs_the_max_batch_search_first():
    assert ga.needed_stages(["throughput"], batch_given=False) == {
        "throughput",
        "data",
        "max-batch",
    }
    assert ga.needed_stages(["throughput"], batch_given=True) == {"throughput", "data"}


THROUGHPUT_BENCH = (
    "model: configs/parakeet_tdt_0.6b.yaml: 0.632 B parameters (631,886,182), vocabulary 12000\n"
    "micro-batch: the sampler's heaviest at MAX_BATCH_DURATION=600: 30 utterances, 600.0 s of "
    "audio, longest 20.0 s; 4 per optimizer step\n"
    "phase 1 project: median step    1.600 s over 3 steps (min 1.5, max 1.7),   1500.0 audio s/s, "
    "peak GPU memory allocated 60.00 GiB, 400000.0 GFLOP/step, MFU {mfu1}%\n"
    "phase 1 nemo   : median step    1.800 s over 3 steps (min 1.7, max 1.9),   1333.0 audio s/s, "
    "peak GPU memory allocated 61.00 GiB, 400000.0 GFLOP/step, MFU 22.5%\n"
    "phase 1 ratio project / NeMo step time: 0.889 (meets the target <= 1.0); per round 0.889\n"
    "phase 2 project: median step    2.400 s over 3 steps (min 2.3, max 2.5),   1000.0 audio s/s, "
    "peak GPU memory allocated 84.00 GiB, 900000.0 GFLOP/step, MFU {mfu2}%\n"
    "phase 2 nemo   : median step    2.700 s over 3 steps (min 2.6, max 2.8),    888.0 audio s/s, "
    "peak GPU memory allocated 85.00 GiB, 900000.0 GFLOP/step, MFU 33.7%\n"
    "phase 2 ratio project / NeMo step time: 0.889 (meets the target <= 1.0); per round 0.889\n"
)
THROUGHPUT_PROFILE = (
    "where one phase-2 optimizer step's time goes (1 micro-batch(es) of ...; cuda, bf16-mixed):\n"
    "part                                        host ms   share  device ms   share\n"
    "encoder forward                               120.0   20.0%      300.0   25.0%\n"
    "TDT loss backward                              30.0    5.0%      200.0   16.7%\n"
    "joint forward                                  60.0   10.0%      250.0   20.8%\n"
    "encoder backward                              100.0   16.7%      450.0   37.5%\n"
    "host syncs (40; 40 scalar reads)              290.0   48.3%        0.0    0.0%\n"
    "total (self times)                            600.0             1200.0\n"
    "wall 1400.0 ms; device busy 85.7% of it (kernels), idle 14.3%\n"
)
THROUGHPUT_DATA = (
    "corpus: train_manifest_v2.parquet x 40 = 4680 utterances, 4.20 h; ...\n"
    "one worker: 2100 audio s/s (40 micro-batches in 15.0 s after the first, page cache warm)\n"
    "fed by the loader: phase 2, NUM_WORKERS=4: median step 2.300 s, 1010.0 audio s/s, data wait "
    "{wait}% of step time (worst step 2.5%) over 3 steps\n"
    "workers per GPU for a data wait under 2%: 1 (demand 1500 audio s/s, one worker 2100, x1.25 "
    "headroom); a 8-GPU node needs 8 x (1 + 1) = 16 cores (NUM_WORKERS=1)\n"
)


def test_the_throughput_stage_says_step_mfu_nemo_data_wait_and_workers_in_one_figure():
    verdict, figure = ga.throughput_figure(
        THROUGHPUT_BENCH.format(mfu1="25.0", mfu2="41.5"),
        THROUGHPUT_PROFILE,
        THROUGHPUT_DATA.format(wait="0.4"),
        600,
        4,
    )
    assert verdict == "ok", figure
    assert figure.startswith("MAX_BATCH_DURATION=600 x GRAD_ACCUM 4: 0.632 B parameters")
    assert "phase 2: 2.400 s/step, 1000 audio s/s, peak 84.0 GiB, MFU 41.5%; NeMo 2.700 s" in figure
    # the profile's three largest parts by device time, the busy share and the syncs
    assert (
        "profile: encoder backward 38%, encoder forward 25%, joint forward 21%; device busy 85.7%; "
        "40 host syncs a step" in figure
    )
    assert "data wait 0.4% of step time (worst step 2.5%) at 1010 audio s/s" in figure
    assert (
        "one worker 2100 audio s/s; 1 workers per GPU (8-GPU node: 8 x (1 + 1) = 16 cores)"
        in figure
    )
    assert "for 1500 audio s/s" in figure  # the faster phase's rate is the demand


def test_the_throughput_stage_warns_for_each_target_it_misses():
    verdict, figure = ga.throughput_figure(
        THROUGHPUT_BENCH.format(mfu1="9.0", mfu2="12.0"),
        THROUGHPUT_PROFILE,
        THROUGHPUT_DATA.format(wait="7.5"),
        600,
        4,
    )
    assert verdict == "warn"
    assert figure.startswith("misses: phase-2 MFU 12.0% < 40%, data wait 7.5% > 2%;")


def test_the_throughput_stage_fails_without_a_profile_or_a_data_path():
    bench = THROUGHPUT_BENCH.format(mfu1="25.0", mfu2="41.5")
    assert (
        ga.throughput_figure(bench, "Traceback", THROUGHPUT_DATA.format(wait="0.1"), 600, 4)[0]
        == "fail"
    )
    verdict, figure = ga.throughput_figure(bench, THROUGHPUT_PROFILE, "RuntimeError: x", 600, 4)
    assert verdict == "fail" and "data path: no result" in figure


@pytest.mark.parametrize(
    ("driver", "bindings", "verdict", "said"),
    [
        # A 550 driver (CUDA 12.4) and numba-cuda's cu12 extra: the numba loss runs.
        (12040, "12.9.10", "ok", "can run"),
        # A 535 driver (CUDA 12.2) and the cu13 extra's bindings: it cannot; cu12 would.
        (12020, "13.5.0", "warn", "cannot run (CUDA 13 bindings need a driver for CUDA 13)"),
    ],
)
def test_the_environment_stage_names_the_cuda_combination_and_whether_the_numba_loss_runs(
    monkeypatch, driver, bindings, verdict, said
):
    import types

    import torch

    from scripts import preflight

    gpu = "NVIDIA H100 (cuda), 79.1 GiB, 78.6 free; driver 550.127.05 (CUDA 12.4: NVML)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(preflight, "check_gpu", lambda node: preflight.Check("gpu", "ok", gpu))
    monkeypatch.setattr(preflight, "driver_cuda_version", lambda: (driver, "NVML"))
    installed = {"numba-cuda": "0.30.4", "cuda-bindings": bindings}
    monkeypatch.setattr(ga, "_version", lambda dist: installed.get(dist, "1.0"))
    # libNVVM found, as numba-cuda's NVVM wrapper reports it on a GPU node.
    nvvm = types.ModuleType("numba.cuda.cudadrv.nvvm")
    nvvm.NVVM = lambda: types.SimpleNamespace(get_version=lambda: (2, 0))
    cudadrv = types.ModuleType("numba.cuda.cudadrv")
    cudadrv.nvvm = nvvm
    for name, module in (
        ("numba.cuda", types.ModuleType("numba.cuda")),
        ("numba.cuda.cudadrv", cudadrv),
        ("numba.cuda.cudadrv.nvvm", nvvm),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    got, figure = ga.stage_environment(cpu=False)
    assert got == verdict, figure
    major = bindings.split(".")[0]
    assert (
        f"numba-cuda 0.30.4 on cuda-bindings {bindings} (CUDA {major}: its cu{major} extra)"
        in figure
    )
    assert f"driver CUDA {driver // 1000}.{driver % 1000 // 10}, torch CUDA 12.6" in figure
    assert f"NeMo's numba loss {said}" in figure


def test_a_preparation_step_that_fails_says_why_in_the_error(tmp_path):
    """A step's own reason (extract_audio's failed shard, a traceback's last line), not only its
    exit status, reaches the user; prepare.log keeps the whole output."""
    from scripts import gpu_acceptance

    said = (
        "print('shards: 2 (extracted=1, failed=1)'); "
        "print('FAILED /d/s1: disk full writing /d/s1/a.flac (No space left on device): free "
        "space and rerun'); print('tars deleted: 0'); raise SystemExit(1)"
    )
    log_path = tmp_path / "prepare.log"
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("an earlier step's output: error here is not this step's\n")
        with pytest.raises(RuntimeError) as failed:
            gpu_acceptance._run_step([sys.executable, "-c", said], dict(os.environ), log)
    message = str(failed.value)
    assert "failed (exit 1): FAILED /d/s1: disk full writing /d/s1/a.flac" in message
    assert message.endswith(f"see {log_path}")
    assert "tars deleted" in log_path.read_text()
