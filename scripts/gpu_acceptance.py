"""One acceptance run of the GPU path inside a fixed time budget: does this node train, and how fast?

Usage:
    # on a connected machine, once: the run's data (the demo corpus, split, tokenized)
    python scripts/gpu_acceptance.py prepare --data data/acceptance
    # on the GPU node (after the wheelhouse install: README, "GPU set-up"), with that folder copied over
    python scripts/gpu_acceptance.py run --data data/acceptance --out acceptance-results
    # the same stages at CPU sizes (CI runs this)
    python scripts/gpu_acceptance.py run --cpu --data data/acceptance --out acceptance-results

The stages, cheapest and most telling first; each runs as its own process group under its own time
limit inside the total ``--budget`` (default 900 s). A stage that cannot get its minimum from what is
left is skipped and says so; a stage past its limit is killed with everything it started.

  environment  GPU, driver (and the CUDA version it runs), torch and its CUDA, libNVVM, the versions
               of NeMo, Lightning, numba, numba-cuda, sentencepiece, wandb
  data         the prepared manifests moved to where they are now, their training caches built
  tdt-loss     train.py's start-up check: NeMo's numba TDT and RNN-T kernels against tdt_loss.py;
               when it fails, the fallback (TDT_LOSS=torch) checked instead; one loss's cost
  training     scripts/smoke_test.sh on the prepared data: configs/demo_tdt.yaml in PRECISION
               (bf16-mixed), validation at step 4 (the decoder's CUDA graphs), SIGTERM at step 10
               (saved, exit 75), a resume to step 50 and its .nemo export
  decode-language
               benchmarks/bench_decode_language.py on the prepared training audio: greedy decoding
               with the language given (the tag alone, and keeping to its scripts) and both ways
               as validation decodes, against auto, side by side, in the decoder's CUDA graphs,
               fp32 and bf16 autocast; whether graphs and the plain loop write the same texts
  step-bench   benchmarks/bench_train_step.py at full size (configs/parakeet_tdt_0.6b.yaml,
               VOCAB_SIZE pieces, MAX_BATCH_DURATION): project against NeMo's training_step,
               step time, audio seconds per second, peak memory, MFU
  preflight    scripts/preflight.py with one rank on the prepared data (no search)
  max-batch    the largest MAX_BATCH_DURATION of the full-size model that fits in 90% of the GPU
               (benchmarks/bench_train_step.py --find-max-batch-duration)
  throughput   the full-size model at the batch a real job runs (max-batch's value, or
               --batch-duration), GRAD_ACCUM micro-batches per optimizer step, both phases,
               against NeMo's training_step (bench_train_step.py --grad-accum): step time, audio
               s/s, MFU, peak memory; one phase-2 step profiled (--profile: where its time goes,
               the trace kept as throughput_trace.json beside the results); then train.py's
               DataLoader feeding the step (benchmarks/bench_data_path.py on the prepared audio
               repeated): the data wait, one worker's audio s/s and the workers a GPU needs

``--cpu`` runs the same stages at CPU sizes (configs/demo_tdt.yaml everywhere, float32, a few steps);
max-batch is CUDA-only and says so; throughput then runs at the data stage's MAX_BATCH_DURATION.
The summary table (stage, verdict, seconds, figure) is printed and written to ``--out``/acceptance.md
and acceptance.json, beside each stage's log. Exit 0 when no
stage failed, 1 otherwise, 130/143 when interrupted (the table still written).

``prepare`` needs the offline steps' packages (polars, espeak-ng where it can install it); ``run``
needs only what training needs: the folder ``prepare`` wrote, copied anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.acceptance_readers import (
    BENCH_LINE,
    bench_figure,
    decode_language_figure,
    max_batch_figure,
    preflight_figure,
    read_metrics,
    throughput_figure,
    training_figure,
)

REPO = Path(__file__).resolve().parents[1]
PREPARED = "prepared.json"
DEFAULT_BUDGET_S = 900.0
DEFAULT_MAX_SEARCH_S = 600.0  # the max-batch search's upper end (an H200 holds it: 84 GiB)
DEFAULT_SIZES = "hi=70,en=50,ta=30"
# The knobs the prepared data was made with; the run exports them again.
DATA_KNOBS = {
    "VOCAB_SIZE": "256",
    "MIN_DURATION": "0.5",
    "MAX_DURATION": "12",
    "BUCKET_BOUNDARIES": "2,3,4,6",
    "VAL_PER_LANG": "10",
}
# Transcript tokens per audio second of the full-size stages' synthetic batch: the step benchmark's
# own default without a manifest (about 2.5-3 words/s x 1.7 pieces/word for a 12k BPE).
FULL_SIZE_TOKENS_PER_SECOND = "5.0"
RESULT_MARK = "ACCEPTANCE-RESULT "
TRACE_FILE = "throughput_trace.json"


@dataclass
class Stage:
    name: str
    limit_s: float  # the most it may take
    min_s: float  # skipped when less than this is left
    verdict: str = "not run"
    figure: str = ""
    skip_reason: str = ""  # set before the run: why it will not run
    seconds: float = 0.0
    log: str = ""


@dataclass
class Summary:
    mode: str
    budget_s: float
    started: str
    stages: list[Stage] = field(default_factory=list)
    interrupted: str = ""

    def table(self) -> str:
        rows = ["| stage | verdict | seconds | figure |", "|---|---|---:|---|"]
        for s in self.stages:
            figure = s.figure.replace("|", "/").replace("\n", " ")
            rows.append(f"| {s.name} | {s.verdict} | {s.seconds:.0f} | {figure} |")
        return "\n".join(rows)


# --------------------------------------------------------------------------------------------------
# prepare (connected machine)
# --------------------------------------------------------------------------------------------------


def _run_step(cmd: list[str], env: dict[str, str], log) -> None:
    """Run one preparation step into ``log``; a failure is a RuntimeError naming the step, its
    exit status and the reason its own output gives (its last error line, else its last line)."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    start = log.tell()
    done = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        log.flush()
        with open(log.name, encoding="utf-8", errors="replace") as text:
            text.seek(start)
            said = [line.strip() for line in text.read().splitlines() if line.strip()]
        errors = [line for line in said if re.search(r"error|failed|unverified", line, re.I)]
        reason = (errors or said or ["no output"])[-1][:400]
        raise RuntimeError(
            f"{' '.join(cmd[1:3])} failed (exit {done.returncode}): {reason}; see {log.name}"
        )


def drop_unreadable_rows(manifest: Path) -> int:
    """Remove the rows of ``manifest`` whose audio soundfile cannot decode (the demo corpus plants a
    corrupt file): the acceptance run tests the node, not the data checks. Returns how many."""
    import pyarrow.parquet as pq
    import soundfile as sf

    table = pq.read_table(manifest)
    keep = []
    for path in table.column("audio_filepath").to_pylist():
        try:
            sf.read(path)  # the whole file: a corrupt body can follow a valid header
            keep.append(True)
        except Exception:  # noqa: BLE001  (any decode failure)
            keep.append(False)
    dropped = keep.count(False)
    if dropped:
        import pyarrow as pa

        pq.write_table(table.filter(pa.array(keep)), manifest)
    return dropped


def prepare(data: Path, sizes: str) -> dict:
    """The run's data in ``data``: the demo corpus (``sizes``), extracted, built into a manifest,
    split, its unreadable rows dropped, a tokenizer; tar shards removed, so the folder holds only
    what ``run`` reads. Built in a temporary folder beside ``data`` and renamed into place."""
    data = data.resolve()
    if (data / PREPARED).is_file():
        return json.loads((data / PREPARED).read_text(encoding="utf-8"))
    if data.exists():
        raise RuntimeError(
            f"{data} exists and is not a prepared folder (no {PREPARED}): give --data a new path"
        )
    tmp = data.with_name(data.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = {**os.environ, **DATA_KNOBS, "DATA_DIR": str(tmp), "INIT_MODEL": ""}
    env.setdefault("OMP_NUM_THREADS", "1")
    py = sys.executable
    with open(tmp / "prepare.log", "w", encoding="utf-8") as log:
        for cmd in (
            [py, "scripts/make_demo_corpus.py", "--out", str(tmp / "shards"), "--sizes", sizes],
            [py, "scripts/extract_audio.py"],
            [py, "build_manifest.py"],
            [py, "scripts/make_train_val.py", "--allow-short-val"],
        ):
            _run_step(cmd, env, log)
        dropped = {
            name: drop_unreadable_rows(tmp / name)
            for name in ("train_manifest_v2.parquet", "val_manifest_v2.parquet")
        }
        _run_step([py, "scripts/train_tokenizer.py"], env, log)
    for tar in (tmp / "shards").rglob("*.tar"):
        tar.unlink()
    import pyarrow.parquet as pq

    record = {
        "root": str(tmp),  # where the manifests' audio paths point; `run` moves them
        "sizes": sizes,
        "knobs": DATA_KNOBS,
        "rows": {
            name: pq.read_metadata(tmp / name).num_rows
            for name in ("train_manifest_v2.parquet", "val_manifest_v2.parquet")
        },
        "dropped_unreadable": dropped,
        "made": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (tmp / PREPARED).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    shutil.rmtree(data, ignore_errors=True)
    tmp.rename(data)
    return record


def relocate(data: Path, work: Path) -> dict[str, str]:
    """The prepared manifests with their audio paths moved from where ``prepare`` wrote them to
    where ``data`` is now, written into ``work``; returns the knobs that point the stages at them."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    record_path = data / PREPARED
    if not record_path.is_file():
        raise FileNotFoundError(
            f"{data} holds no {PREPARED}: make it on a connected machine with "
            f"`python scripts/gpu_acceptance.py prepare --data {data}` and copy the folder here"
        )
    record = json.loads(record_path.read_text(encoding="utf-8"))
    old, new = record["root"].rstrip("/"), str(data.resolve())
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for knob, name in (("TRAIN_MANIFEST_PATH", "train"), ("VAL_MANIFEST_PATH", "val")):
        table = pq.read_table(data / f"{name}_manifest_v2.parquet")
        paths = table.column("audio_filepath")
        moved = pc.replace_substring(paths, old + "/", new + "/", max_replacements=1)
        table = table.set_column(
            table.column_names.index("audio_filepath"), "audio_filepath", moved
        )
        target = work / f"{name}_manifest_v2.parquet"
        pq.write_table(table, target)
        first = moved[0].as_py() if len(moved) else None
        if first is not None and not Path(first).is_file():
            raise FileNotFoundError(f"{target}: audio {first} does not exist after the move")
        out[knob] = str(target)
    out["TOKENIZER_DIR"] = str(data / "tokenizer")
    out.update(record["knobs"])
    return out


# --------------------------------------------------------------------------------------------------
# In-process stages (run in a child: `gpu_acceptance.py stage NAME`)
# --------------------------------------------------------------------------------------------------


def _version(module: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "not installed"


def stage_environment(cpu: bool) -> tuple[str, str]:
    import torch

    from scripts import preflight

    versions = ", ".join(
        f"{name} {_version(dist)}"
        for name, dist in (
            ("nemo", "nemo_toolkit"),
            ("lightning", "lightning"),
            ("numba", "numba"),
            ("numba-cuda", "numba-cuda"),
            ("sentencepiece", "sentencepiece"),
            ("wandb", "wandb"),
        )
    )
    python = f"Python {sys.version.split()[0]}"
    if cpu:
        return (
            "ok",
            f"CPU mode: {os.cpu_count()} cores; torch {torch.__version__}; {python}; {versions}",
        )
    if not torch.cuda.is_available():
        return "fail", f"torch {torch.__version__} sees no CUDA device; {versions}"
    gpu = preflight.check_gpu(preflight.Node(device=torch.device("cuda")))
    if gpu.verdict == "fail":
        return "fail", f"{gpu.figure} -> {gpu.advice}; {versions}"
    warnings = [gpu.advice] if gpu.advice else []
    nvvm_found = False
    try:
        from numba.cuda.cudadrv import nvvm

        nvvm_version = ".".join(map(str, nvvm.NVVM().get_version()))
        nvvm_found = True
        try:
            from numba.cuda.cuda_paths import get_cuda_paths

            where = get_cuda_paths()["nvvm"]
            nvvm_text = f"libNVVM {nvvm_version} ({getattr(where, 'by', '?')}: {getattr(where, 'info', '?')})"
        except Exception:  # noqa: BLE001  (numba-cuda internals differ between releases)
            nvvm_text = f"libNVVM {nvvm_version}"
    except Exception as exc:  # noqa: BLE001
        nvvm_text = f"libNVVM not found ({type(exc).__name__})"
        warnings.append(
            "no libNVVM: NeMo's numba loss cannot compile (TDT_LOSS=torch trains without it)"
        )
    if _version("wandb") == "not installed":
        warnings.append("wandb not installed: runs log to metrics.jsonl only")
    from scripts.build_wheelhouse import numba_loss_verdict

    numba_cuda, bindings = (
        None if _version(d) == "not installed" else _version(d)
        for d in ("numba-cuda", "cuda-bindings")
    )
    runs, combination = numba_loss_verdict(
        preflight.driver_cuda_version()[0], torch.version.cuda, numba_cuda, bindings, nvvm_found
    )
    if runs is False and nvvm_found:  # without libNVVM the warning above says it
        warnings.append("NeMo's numba loss cannot run here (TDT_LOSS=torch trains without it)")
    figure = f"{gpu.figure}; {nvvm_text}; {combination}; {python}; {versions}"
    if warnings:
        figure += " -- " + "; ".join(warnings)
    return ("warn" if warnings else "ok"), figure


def stage_tdt_loss(cpu: bool) -> tuple[str, str]:
    import torch

    import tdt_loss
    from scripts import preflight

    device = torch.device("cpu" if cpu else "cuda")
    durations, sigma = [0, 1, 2, 3, 4], 0.02  # configs/demo_tdt.yaml's and Parakeet-TDT's
    if cpu:
        loss = tdt_loss.DeviceDispatchTDTLoss(1024, durations, sigma=sigma)
        diff = tdt_loss.check_cuda_loss(loss, device)
        return "ok", (
            f"CPU: tdt_loss.py on both kernel families' problems agrees to {diff:.1e} "
            f"(NeMo's numba kernels need CUDA)"
        )
    figure, verdict, chosen = "", "ok", "numba"
    start = time.perf_counter()
    try:
        diff = tdt_loss.check_cuda_loss(
            tdt_loss.DeviceDispatchTDTLoss(1024, durations, sigma=sigma, cuda_backend="numba"),
            device,
        )
        figure = (
            f"TDT_LOSS=numba: NeMo's TDT and RNN-T kernels agree with tdt_loss.py to {diff:.1e} "
            f"({time.perf_counter() - start:.1f} s with compilation)"
        )
    except tdt_loss.TDTLossCheckFailed as exc:
        chosen, verdict = "torch", "warn"
        figure = f"TDT_LOSS=numba FAILED ({str(exc).splitlines()[0][:200]})"
        try:
            diff = tdt_loss.check_cuda_loss(
                tdt_loss.DeviceDispatchTDTLoss(1024, durations, sigma=sigma, cuda_backend="torch"),
                device,
            )
            figure += f"; the fallback TDT_LOSS=torch agrees to {diff:.1e}: train with it"
        except tdt_loss.TDTLossCheckFailed as exc2:
            return "fail", figure + f"; the fallback TDT_LOSS=torch failed too ({exc2})"
    backends = tdt_loss.BACKENDS if chosen == "numba" else ("torch",)
    figure += "; " + preflight.loss_costs_text(durations, sigma, device, backends)
    return verdict, figure


IN_PROCESS = {"environment": stage_environment, "tdt-loss": stage_tdt_loss}


# --------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------


def plan_stages(cpu: bool) -> list[Stage]:
    """The stages with their (limit, minimum) seconds, in the order they run."""
    limits = {  # name: (GPU limit, CPU limit, minimum)
        "environment": (60, 60, 15),
        "data": (60, 60, 10),
        "tdt-loss": (120, 60, 20),
        "training": (200, 240, 90),
        "decode-language": (150, 120, 30),
        "step-bench": (180, 150, 60),
        "preflight": (120, 120, 45),
        "max-batch": (150, 0, 60),
        "throughput": (420, 240, 90),
    }
    stages = []
    for name, (gpu, cpu_limit, minimum) in limits.items():
        stage = Stage(name, cpu_limit if cpu else gpu, minimum)
        if stage.limit_s == 0:
            stage.skip_reason = "CUDA only (GPU memory): not run in CPU mode"
        stages.append(stage)
    return stages


class Runner:
    """Runs each stage as a process group, kills what outlives it, and keeps the budget."""

    def __init__(self, summary: Summary, data: Path, out: Path, work: Path, cpu: bool):
        self.summary, self.data, self.out, self.work, self.cpu = summary, data, out, work, cpu
        self.start = time.monotonic()
        self.current: subprocess.Popen | None = None
        self.max_search = DEFAULT_MAX_SEARCH_S
        self.env: dict[str, str] = {}
        # The throughput stage's MAX_BATCH_DURATION: --batch-duration, else what max-batch found.
        self.batch_duration: float | None = None

    def left(self) -> float:
        return self.summary.budget_s - (time.monotonic() - self.start)

    def kill_group(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the stage's whole process group, SIGKILL to what is left 10 s later; returns
        once no process of the group is left (or after 10 s more)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # still a member: SIGKILL lands asynchronously
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def spawn(
        self,
        stage: Stage,
        cmd: list[str],
        env: dict[str, str],
        log_name: str | None = None,
        limit: float | None = None,
    ) -> tuple[int | None, str]:
        """Run ``cmd`` for at most ``limit`` (default the stage's limit) and what the budget has
        left, its output in ``log_name`` (default ``<stage>.log``, the stage's log); returns (exit
        code or None when killed at the limit, its output)."""
        log_path = self.out / (log_name or f"{stage.name}.log")
        if log_name is None:
            stage.log = log_path.name
        limit = min(stage.limit_s if limit is None else limit, self.left())
        with open(log_path, "w", encoding="utf-8") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.current = proc
            try:
                code: int | None = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                code = None
            # Whatever the stage left behind (DataLoader workers, W&B's service) goes with it.
            self.kill_group(proc)
            self.current = None
        return code, log_path.read_text(encoding="utf-8", errors="replace")

    def stage_env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, **self.env, **extra}
        env["PYTHONUNBUFFERED"] = "1"
        # The checkout's modules import from the stages' own processes, installed (-e .) or not.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return env

    def run_stage(self, stage: Stage) -> None:
        left = self.left()
        if stage.skip_reason:
            stage.verdict, stage.figure = "skip", stage.skip_reason
            return
        if left < stage.min_s:
            stage.verdict = "skip"
            stage.figure = f"the budget has {max(left, 0):.0f} s left, this stage needs at least {stage.min_s:.0f} s"
            return
        started = time.monotonic()
        try:
            getattr(self, "stage_" + stage.name.replace("-", "_"))(stage)
        except Exception as exc:  # noqa: BLE001  (a broken stage is that stage's failure)
            stage.verdict, stage.figure = "fail", f"{type(exc).__name__}: {str(exc)[:300]}"
        stage.seconds = time.monotonic() - started

    def _in_process(self, stage: Stage, **extra: str) -> None:
        cmd = [sys.executable, str(Path(__file__)), "stage", stage.name] + (
            ["--cpu"] if self.cpu else []
        )
        code, log = self.spawn(stage, cmd, self.stage_env(**extra))
        found = [l for l in log.splitlines() if l.startswith(RESULT_MARK)]
        if found:
            result = json.loads(found[-1][len(RESULT_MARK) :])
            stage.verdict, stage.figure = result["verdict"], result["figure"]
        elif code is None:
            stage.verdict, stage.figure = "fail", f"killed at its {stage.limit_s:.0f} s limit"
        else:
            tail = " / ".join(log.strip().splitlines()[-3:])[-400:]
            stage.verdict, stage.figure = "fail", f"exit {code}: {tail}"

    def stage_environment(self, stage: Stage) -> None:
        self._in_process(stage)

    def stage_tdt_loss(self, stage: Stage) -> None:
        self._in_process(stage)

    def stage_data(self, stage: Stage) -> None:
        data = self.data
        knobs = relocate(data, self.work / "manifests")
        self.env.update(knobs)
        self.env.update(
            {
                "DATA_DIR": str(self.work),
                "CACHE_DIR": str(self.work / "cache"),
                "MODEL_CONFIG": str(REPO / "configs" / "demo_tdt.yaml"),
                "MAX_BATCH_DURATION": "40",
                "GRAD_ACCUM": "1",
                "INIT_MODEL": "",
                "RESUME_FROM": "",
                "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
                "PRECISION": "32-true" if self.cpu else os.environ.get("PRECISION", "bf16-mixed"),
                "ACCELERATOR": "cpu" if self.cpu else "gpu",
            }
        )
        if self.cpu:
            self.env.update({"NUM_WORKERS": "1", "OMP_NUM_THREADS": "1"})
        code, log = self.spawn(
            stage, [sys.executable, "scripts/build_training_cache.py"], self.stage_env()
        )
        record = json.loads((data / PREPARED).read_text(encoding="utf-8"))
        rows = record["rows"]
        if code != 0:
            tail = " / ".join(log.strip().splitlines()[-3:])[-400:]
            stage.verdict, stage.figure = (
                "fail",
                f"the training caches did not build (exit {code}): {tail}",
            )
            return
        # prepare builds in <data>.partial beside the folder and renames it: the manifests' paths
        # name that folder even where nobody moved anything since.
        here = data.resolve()
        built = Path(record["root"])
        moved = built not in (here, here.with_name(here.name + ".partial"))
        written = built.with_name(built.name.removesuffix(".partial"))
        where = f"moved from {written} to {here}" if moved else f"in {here}, where prepare wrote it"
        stage.verdict = "ok"
        stage.figure = (
            f"{rows['train_manifest_v2.parquet']} train + {rows['val_manifest_v2.parquet']} validation "
            f"utterances ({record['sizes']}) {where}; caches built"
        )

    def stage_training(self, stage: Stage) -> None:
        smoke = self.work / "smoke"
        shutil.rmtree(smoke, ignore_errors=True)
        env = self.stage_env(SMOKE_DIR=str(smoke), PY=sys.executable)
        code, log = self.spawn(stage, ["bash", "scripts/smoke_test.sh"], env)
        metrics = read_metrics(smoke / "wandb_logs" / "smoke" / "metrics.jsonl")
        stage.verdict, stage.figure = training_figure(log, metrics)
        if code is None:
            stage.verdict = "fail"
            stage.figure = f"killed at its {stage.limit_s:.0f} s limit; " + stage.figure

    def stage_decode_language(self, stage: Stage) -> None:
        bench = [
            sys.executable,
            "benchmarks/bench_decode_language.py",
            "--manifest",
            self.env["TRAIN_MANIFEST_PATH"],
            "--tokenizer",
            self.env["TOKENIZER_DIR"],
            "--config",
            str(REPO / "configs" / "demo_tdt.yaml"),
        ]
        if self.cpu:
            runs = [bench + ["--device", "cpu", "--utterances", "24", "--rounds", "2"]]
        else:
            runs = [
                bench + ["--device", "cuda", "--rounds", "7"],
                bench + ["--device", "cuda", "--rounds", "7", "--precision", "bf16"],
            ]
        script = " && ".join(" ".join(shlex.quote(a) for a in run) for run in runs)
        code, log = self.spawn(stage, ["bash", "-c", script], self.stage_env())
        stage.verdict, stage.figure = decode_language_figure(log, code if code is not None else -9)
        if code is None:
            stage.verdict = "fail"
            stage.figure = f"killed at its {stage.limit_s:.0f} s limit; " + stage.figure

    def full_size_env(self) -> dict[str, str]:
        """The step benchmark's and the search's knobs: at full size on a GPU, the demo's on CPU."""
        if self.cpu:
            return self.stage_env()
        return self.stage_env(
            MODEL_CONFIG=str(REPO / "configs" / "parakeet_tdt_0.6b.yaml"),
            TOKENIZER_DIR=str(self.work / "no-tokenizer"),  # a synthetic VOCAB_SIZE-piece one
            VOCAB_SIZE=os.environ.get("VOCAB_SIZE", "12000"),
            MAX_BATCH_DURATION=os.environ.get("MAX_BATCH_DURATION", "90"),
            MAX_DURATION=os.environ.get("MAX_DURATION", "20"),
            BUCKET_BOUNDARIES=os.environ.get("BUCKET_BOUNDARIES", "3,5,8,12,16"),
        )

    def bench_args(self) -> list[str]:
        args = [
            sys.executable,
            "benchmarks/bench_train_step.py",
            "--work-dir",
            str(self.work / "bench"),
        ]
        if not self.cpu:
            args += ["--tokens-per-second", FULL_SIZE_TOKENS_PER_SECOND]
        return args

    def stage_step_bench(self, stage: Stage) -> None:
        steps = (
            ["--steps", "2", "--warmup", "1", "--rounds", "1"]
            if self.cpu
            else ["--steps", "5", "--warmup", "2", "--rounds", "1"]
        )
        code, log = self.spawn(stage, self.bench_args() + steps, self.full_size_env())
        stage.verdict, stage.figure = bench_figure(log)
        if code != 0:
            stage.verdict = "fail"
            stage.figure = (
                "killed at its limit; " if code is None else f"exit {code}; "
            ) + stage.figure

    def stage_preflight(self, stage: Stage) -> None:
        cmd = [sys.executable, "scripts/preflight.py", "--no-search", "--data-seconds", "10"]
        code, log = self.spawn(stage, cmd, self.stage_env())
        stage.verdict, stage.figure = preflight_figure(log, code if code is not None else -9)
        if code is None:
            stage.verdict, stage.figure = "fail", "killed at its limit; " + stage.figure

    def stage_max_batch(self, stage: Stage) -> None:
        cmd = self.bench_args() + [
            "--find-max-batch-duration",
            "--max-search",
            f"{self.max_search:g}",
        ]
        code, log = self.spawn(stage, cmd, self.full_size_env())
        stage.verdict, stage.figure = max_batch_figure(
            log, code if code is not None else -9, self.max_search
        )
        found = re.search(r"set MAX_BATCH_DURATION=([\d.]+)", log)
        if found and self.batch_duration is None:
            self.batch_duration = float(found.group(1))
        if code is None:
            stage.verdict = "fail"
            stage.figure = f"killed at its {stage.limit_s:.0f} s limit; " + stage.figure

    def stage_throughput(self, stage: Stage) -> None:
        """The step at the batch a real job runs, its profile and the data path (module docstring)."""
        started = time.monotonic()
        grad_accum = int(os.environ.get("GRAD_ACCUM", "4"))
        if self.cpu:
            # The machinery at CPU sizes: phase 2 alone, one optimizer step of two micro-batches.
            seconds, grad_accum = 20.0, 2
            steps = ["--phases", "2", "--steps", "1", "--warmup", "0", "--rounds", "1"]
            profile_warmup = "0"
            data_steps = ["--steps", "1", "--warmup", "1", "--worker-seconds", "3"]
            data_model = str(REPO / "configs" / "demo_tdt.yaml")
        else:
            if self.batch_duration is None:
                stage.verdict = "fail"
                stage.figure = (
                    "no MAX_BATCH_DURATION to run at: the max-batch stage found none in this run; "
                    "run it too, or give --batch-duration"
                )
                return
            seconds = self.batch_duration
            steps = ["--steps", "3", "--warmup", "1", "--rounds", "1"]
            profile_warmup = "1"
            data_steps = ["--steps", "3", "--warmup", "1", "--worker-seconds", "15"]
            data_model = str(REPO / "configs" / "parakeet_tdt_0.6b.yaml")
        knobs = {"MAX_BATCH_DURATION": f"{seconds:g}", "GRAD_ACCUM": str(grad_accum)}
        env = {**self.full_size_env(), **knobs}

        def left() -> float:
            return stage.limit_s - (time.monotonic() - started)

        code, bench_log = self.spawn(
            stage, self.bench_args() + ["--grad-accum", str(grad_accum)] + steps, env
        )
        trace = self.out / TRACE_FILE
        code_p, profile_log = self.spawn(
            stage,
            self.bench_args() + ["--profile", "--warmup", profile_warmup, "--trace", str(trace)],
            env,
            log_name="throughput-profile.log",
            limit=left(),
        )
        demand = max(
            (float(r[3]) for r in BENCH_LINE.findall(bench_log) if r[1] == "project"), default=0
        )
        # The prepared audio, repeated until an epoch outlasts the run's micro-batches.
        import pyarrow.parquet as pq

        manifest = self.env["TRAIN_MANIFEST_PATH"]
        audio_s = float(sum(pq.read_table(manifest, columns=["duration"]).column(0).to_pylist()))
        micro_batches = (int(data_steps[1]) + int(data_steps[3]) + 1) * grad_accum
        repeat = max(1, math.ceil(1.5 * micro_batches * seconds / max(audio_s, 1.0)))
        data_cmd = [
            sys.executable,
            "benchmarks/bench_data_path.py",
            "--manifest",
            manifest,
            "--repeat",
            str(repeat),
            "--work-dir",
            str(self.work / "data-path"),
            *data_steps,
        ]
        if demand:
            data_cmd += ["--demand", f"{demand:.1f}"]
        code_d, data_log = self.spawn(
            stage,
            data_cmd,
            self.stage_env(MODEL_CONFIG=data_model, **knobs),
            log_name="throughput-data.log",
            limit=left(),
        )
        stage.verdict, stage.figure = throughput_figure(
            bench_log, profile_log, data_log, seconds, grad_accum
        )
        if trace.is_file():
            stage.figure += f"; trace {TRACE_FILE}"
        failed = [
            name
            for name, c in (("step", code), ("profile", code_p), ("data path", code_d))
            if c != 0
        ]
        if failed:
            stage.verdict = "fail"
            stage.figure = (
                f"{', '.join(failed)} run(s) failed or were killed at the limit; " + stage.figure
            )


# Stages that read nothing of the prepared data; every other one runs after the data stage.
WITHOUT_DATA = ("environment", "tdt-loss")


def needed_stages(only: list[str], batch_given: bool = True) -> set[str]:
    """The stages ``--only`` runs: those named, the data stage when any of them needs it, and
    max-batch for throughput when no batch duration was given (``batch_given``)."""
    needed = set(only) | ({"data"} if set(only) - set(WITHOUT_DATA) else set())
    if "throughput" in needed and not batch_given:
        needed.add("max-batch")
    return needed


def write_summary(summary: Summary, out: Path) -> None:
    text = (
        f"# GPU acceptance run ({summary.mode})\n\nstarted {summary.started}, budget "
        f"{summary.budget_s:.0f} s, took {sum(s.seconds for s in summary.stages):.0f} s"
        + (f", interrupted: {summary.interrupted}" if summary.interrupted else "")
        + "\n\n"
        + summary.table()
        + "\n"
    )
    (out / "acceptance.md").write_text(text, encoding="utf-8")
    (out / "acceptance.json").write_text(
        json.dumps(asdict(summary), indent=1) + "\n", encoding="utf-8"
    )


def run(
    data: Path,
    out: Path,
    budget_s: float,
    cpu: bool,
    work: Path | None = None,
    only: list[str] | None = None,
    max_search: float = DEFAULT_MAX_SEARCH_S,
    batch_duration: float | None = None,
) -> int:
    # The stages run in the checkout with these paths in their knobs: relative ones would move.
    data, out = Path(data).resolve(), Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    own_work = work is None
    work = Path(work or tempfile.mkdtemp(prefix="gpu-acceptance-")).resolve()
    summary = Summary(
        mode="CPU mode" if cpu else "GPU",
        budget_s=budget_s,
        started=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        stages=plan_stages(cpu),
    )
    for stage in summary.stages:
        if (
            only
            and stage.name not in needed_stages(only, cpu or batch_duration is not None)
            and not stage.skip_reason
        ):
            stage.skip_reason = "not asked for (--only)"
    runner = Runner(summary, data, out, work, cpu)
    runner.max_search = max_search
    runner.batch_duration = batch_duration

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        for stage in summary.stages:
            print(
                f"== {stage.name} (limit {max(min(stage.limit_s, runner.left()), 0):.0f} s)",
                flush=True,
            )
            runner.run_stage(stage)
            print(f"   {stage.verdict}: {stage.figure}", flush=True)
            if stage.name == "data" and stage.verdict == "fail":
                for later in summary.stages[summary.stages.index(stage) + 1 :]:
                    if later.name not in WITHOUT_DATA and not later.skip_reason:
                        later.skip_reason = "needs the data stage, which failed"
    except KeyboardInterrupt as exc:
        summary.interrupted = str(exc) or "SIGINT"
        if runner.current is not None:
            runner.kill_group(runner.current)
        code = 143 if summary.interrupted == "SIGTERM" else 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        write_summary(summary, out)
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + summary.table())
    print(f"\nwritten: {out / 'acceptance.md'}, {out / 'acceptance.json'} and each stage's log")
    if code:
        return code
    return 1 if any(s.verdict == "fail" for s in summary.stages) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="make the run's data (connected machine)")
    p.add_argument(
        "--data",
        type=Path,
        default=REPO / "data" / "acceptance",
        help="a new folder to write (default data/acceptance)",
    )
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"utterances per language (default {DEFAULT_SIZES})"
    )
    r = sub.add_parser("run", help="the acceptance run (GPU node; --cpu anywhere)")
    r.add_argument(
        "--data",
        type=Path,
        default=REPO / "data" / "acceptance",
        help="the folder `prepare` wrote, copied anywhere (default data/acceptance)",
    )
    r.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the table and the logs go (default acceptance-<UTC time> in the current folder)",
    )
    r.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_S, help="total seconds (default 900)"
    )
    r.add_argument("--cpu", action="store_true", help="the same stages at CPU sizes")
    r.add_argument(
        "--max-search",
        type=float,
        default=DEFAULT_MAX_SEARCH_S,
        help="upper end of the max-batch search, seconds (default 600; each try is two steps)",
    )
    r.add_argument(
        "--batch-duration",
        type=float,
        default=None,
        help="the throughput stage's MAX_BATCH_DURATION, seconds (default: what the max-batch "
        "stage finds in this run)",
    )
    r.add_argument(
        "--only",
        type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
        default=None,
        help="run these stages alone, e.g. training,step-bench (with the data stage, which every "
        "stage but environment and tdt-loss needs)",
    )
    r.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch folder (default: a new temporary one, removed)",
    )
    s = sub.add_parser("stage", help=argparse.SUPPRESS)
    s.add_argument("name", choices=sorted(IN_PROCESS))
    s.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        try:
            record = prepare(args.data, args.sizes)
        except (RuntimeError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"prepared {args.data}: {json.dumps(record['rows'])}; copy the folder to the node")
        return 0
    if args.command == "stage":
        import logging

        logging.basicConfig(level=logging.WARNING)
        verdict, figure = IN_PROCESS[args.name](args.cpu)
        print(RESULT_MARK + json.dumps({"verdict": verdict, "figure": figure}), flush=True)
        return 0
    out = args.out or Path(f"acceptance-{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}")
    names = [s.name for s in plan_stages(args.cpu)]
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such stage (stages: {', '.join(names)})")
    return run(
        args.data,
        out,
        args.budget,
        args.cpu,
        args.work,
        args.only,
        args.max_search,
        args.batch_duration,
    )


if __name__ == "__main__":
    sys.exit(main())
