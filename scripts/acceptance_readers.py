"""The readers of scripts/gpu_acceptance.py's subprocess stages: each stage's output (its log, its
metrics file) turned into a verdict (ok, warn, fail) and the figure its summary line shows, with the
targets each verdict is judged against."""

from __future__ import annotations

import contextlib
import json
import re
import statistics
from pathlib import Path

SLOWER_THAN_NEMO = 1.10  # the step-bench ratio that warns
MFU_TARGET = 40.0  # percent: the throughput stage warns below it (GPU)
DATA_WAIT_TARGET = 2.0  # percent of step time: the throughput stage warns above it
GIVEN_BOUND = 1.05  # decoding with the language given against auto, with the encoder: above warns


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def training_figure(log: str, metrics: list[dict]) -> tuple[str, str]:
    """(verdict, figure) of smoke_test.sh's output and its run's metrics.jsonl."""
    said = [line[len("[smoke] ") :] for line in log.splitlines() if line.startswith("[smoke] ")]
    if not any(line.startswith("passed") for line in said):
        failed = next(
            (line for line in said if line.startswith("FAILED")), "smoke_test.sh did not pass"
        )
        tail = [l for l in log.strip().splitlines() if l.strip() and not l.startswith("[smoke]")][
            -3:
        ]
        return "fail", f"{failed} {' / '.join(tail)[-500:]}"
    steps = [r for r in metrics if "train/loss" in r]
    step_s = [r["time/step_s"] for r in steps if "time/step_s" in r]
    audio = [r["throughput/audio_s_per_s"] for r in steps if "throughput/audio_s_per_s" in r]
    val = [r for r in metrics if any(k.startswith("val/wer/") for k in r)]
    parts = [
        f"{len(steps)} optimizer steps, SIGTERM at step 10 saved (exit 75), resumed to 50, .nemo exported"
    ]
    if step_s:
        parts.append(f"median step {statistics.median(step_s[2:] or step_s):.3f} s")
    if audio:
        parts.append(f"{statistics.median(audio):.0f} audio s/s")
    peak = max((r.get("gpu/peak_memory_gib", 0) for r in metrics), default=0)
    if peak:
        parts.append(f"peak {peak:.2f} GiB")
    if val:
        wers = ", ".join(
            f"{k.rsplit('/', 1)[-1]} {v:.2f}"
            for k, v in sorted(val[-1].items())
            if k.startswith("val/wer/")
        )
        parts.append(
            f"validated at steps {', '.join(str(r['step']) for r in val)} (last WER {wers})"
        )
    losses = [r["train/loss"] for r in steps]
    if losses and not all(l == l and abs(l) != float("inf") for l in losses):  # noqa: PLR0124
        return "fail", "; ".join(parts) + "; a non-finite training loss"
    if len(losses) >= 2:
        parts.append(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return "ok", "; ".join(parts)


BENCH_LINE = re.compile(
    r"phase (\d) (project|nemo)\s*: median step\s+([\d.]+) s .*?,\s+([\d.]+) audio s/s, "
    r"(?:peak GPU memory allocated|peak host RSS) ([\d.]+) GiB(?:.*?MFU ([\d.]+)%)?"
)
RATIO_LINE = re.compile(r"phase (\d) ratio project / NeMo step time: ([\d.]+)")


def bench_figure(log: str) -> tuple[str, str]:
    model = next((l for l in log.splitlines() if l.startswith("model: ")), "")
    params = re.search(r"([\d.]+) B parameters", model)
    batch = next((l for l in log.splitlines() if l.startswith("micro-batch:")), "")
    shape = re.search(r": (\d+ utterances, [\d.]+ s of audio)", batch)
    rows = BENCH_LINE.findall(log)
    ratios = dict(RATIO_LINE.findall(log))
    if not rows:
        tail = " / ".join(log.strip().splitlines()[-3:])[-400:]
        return "fail", f"no step timed: {tail}"
    parts = []
    if params:
        parts.append(f"{params.group(1)} B parameters" + (f", {shape.group(1)}" if shape else ""))
    for phase in sorted({r[0] for r in rows}):
        sides = {r[1]: r for r in rows if r[0] == phase}
        p = sides.get("project")
        text = f"phase {phase}:"
        if p:
            text += f" {float(p[2]):.3f} s/step, {float(p[3]):.0f} audio s/s, peak {float(p[4]):.1f} GiB"
            if p[5]:
                text += f", MFU {p[5]}%"
        if "nemo" in sides:
            text += f"; NeMo {float(sides['nemo'][2]):.3f} s"
        if phase in ratios:
            text += f"; ratio {ratios[phase]}"
        parts.append(text)
    # A few timed steps a side: within 10% is noise, not a slower step.
    slower = [float(r) for r in ratios.values() if float(r) > SLOWER_THAN_NEMO]
    return ("warn" if slower else "ok"), "; ".join(parts)


DECODE_RATIO = re.compile(
    r"^(given_tag|given_scripts|both) / auto: decoding ([\d.]+), with the encoder ([\d.]+)", re.M
)
DECODE_PRECISION = re.compile(r"precision (\w+);")
DECODE_GRAPHS = re.compile(
    r"^CUDA graphs: (\S+); texts with graphs against without, differing: (.*)$", re.M
)


def decode_language_figure(log: str, returncode: int) -> tuple[str, str]:
    """One figure from bench_decode_language.py's runs (one per precision): each decoding's
    ratio to auto, the search alone and with the encoder; warn where the language given (its
    scripts kept, else the tag alone) costs more than GIVEN_BOUND with the encoder."""
    runs = [run for run in re.split(r"^(?=model )", log, flags=re.M) if run.startswith("model ")]
    parts, slow = [], []
    for run in runs:
        ratios = {name: (float(a), float(b)) for name, a, b in DECODE_RATIO.findall(run)}
        if not ratios:
            continue
        precision = DECODE_PRECISION.search(run)
        text = f"{precision.group(1) if precision else '?'}: " + ", ".join(
            f"{name} {a:.3f} ({b:.3f} with encoder)" for name, (a, b) in ratios.items()
        )
        graphs = DECODE_GRAPHS.search(run)
        if graphs:
            text += f"; graphs {graphs.group(1)}, texts differing {graphs.group(2)}"
        given = ratios.get("given_scripts") or ratios.get("given_tag")
        if given and given[1] > GIVEN_BOUND:
            slow.append(text.split(":")[0])
        parts.append(text)
    if "records no scripts" in log:
        parts.append("the model records no scripts: given_scripts not measured")
    if returncode != 0 or not parts:
        tail = " / ".join(log.strip().splitlines()[-3:])[-400:]
        return "fail", f"exit {returncode}: " + ("; ".join(parts) or tail)
    figure = "search / auto: " + "; ".join(parts)
    if slow:
        return "warn", f"given above {GIVEN_BOUND} with the encoder in {', '.join(slow)}; {figure}"
    return "ok", figure


PREFLIGHT_LINE = re.compile(r"^(ok|warn|fail|skip)\s+(\S+)\s+(.*)$")


def preflight_figure(log: str, returncode: int) -> tuple[str, str]:
    checks = [m.groups() for m in map(PREFLIGHT_LINE.match, log.splitlines()) if m]
    if not checks:
        tail = " / ".join(log.strip().splitlines()[-3:])[-400:]
        return "fail", f"no report (exit {returncode}): {tail}"
    bad = [f"{v} {n}: {fig[:160]}" for v, n, fig in checks if v in ("warn", "fail")]
    step = next((fig for v, n, fig in checks if n == "step"), "")
    counts = {v: sum(1 for c in checks if c[0] == v) for v in ("ok", "warn", "fail", "skip")}
    figure = ", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" of {len(checks)} checks"
    if step:
        figure += f"; step: {step[:200]}"
    if bad:
        figure += "; " + "; ".join(bad)
    verdict = (
        "fail"
        if counts["fail"] or returncode not in (0, 1)
        else ("warn" if counts["warn"] else "ok")
    )
    return verdict, figure


def max_batch_figure(log: str, returncode: int, upper_s: float) -> tuple[str, str]:
    found = re.search(r"set MAX_BATCH_DURATION=([\d.]+)", log)
    if found:
        best = float(found.group(1))
        peak = re.findall(r"peak ([\d.]+) of ([\d.]+) GiB", log)
        memory = (
            f" (peak {peak[-1][0]} of {peak[-1][1]} GiB at the last size tried)" if peak else ""
        )
        if best >= upper_s:
            return "ok", (
                f"MAX_BATCH_DURATION={best:g} fits, the search's upper end: more fits "
                f"(--max-search){memory}"
            )
        return (
            "ok",
            f"MAX_BATCH_DURATION={best:g} fits phase 2 of the full-size model in 90% of the GPU{memory}",
        )
    if "does not fit" in log:
        return "fail", next(l for l in log.splitlines() if "does not fit" in l)
    tail = " / ".join(log.strip().splitlines()[-3:])[-400:]
    return "fail", f"no result (exit {returncode}): {tail}"


PROFILE_ROW = re.compile(
    r"^(?P<part>\S.*?)\s{2,}(?P<host>[\d.]+)\s+(?P<hshare>[\d.]+)%(?:\s+(?P<dev>[\d.]+)\s+(?P<dshare>[\d.]+)%)?$",
    re.M,
)
PROFILE_SYNCS = re.compile(r"^host syncs \((\d+);", re.M)
PROFILE_BUSY = re.compile(r"device busy ([\d.]+)% of it")
WORKER_LINE = re.compile(r"^one worker: ([\d.]+) audio s/s", re.M)
FED_LINE = re.compile(
    r"^fed by the loader: .*?NUM_WORKERS=(\d+): median step ([\d.]+) s, ([\d.]+) audio s/s, "
    r"data wait ([\d.]+)% of step time \(worst step ([\d.]+)%\)",
    re.M,
)
NEED_LINE = re.compile(
    r"^workers per GPU for a data wait under .*?: (\d+) .*?needs (.*?) cores", re.M
)


def profile_figure(log: str) -> str:
    """The profile table's three largest parts (by device time on a GPU, host time on a CPU), the
    device's busy share and the host syncs, in one phrase; "" when the log has no table."""
    rows = [
        m
        for m in PROFILE_ROW.finditer(log)
        if not m.group("part").startswith(("total", "part", "host syncs", "allocator"))
    ]
    if not rows:
        return ""
    device = all(m.group("dshare") for m in rows)
    share = (lambda m: float(m.group("dshare"))) if device else (lambda m: float(m.group("hshare")))
    top = sorted(rows, key=share, reverse=True)[:3]
    text = "profile: " + ", ".join(f"{m.group('part')} {share(m):.0f}%" for m in top)
    busy = PROFILE_BUSY.search(log)
    if busy:
        text += f"; device busy {busy.group(1)}%"
    syncs = PROFILE_SYNCS.search(log)
    if syncs:
        text += f"; {syncs.group(1)} host syncs a step"
    return text


def data_path_figure(log: str, demand: float | None) -> tuple[str, str, float | None]:
    """(verdict, figure, data wait %) of bench_data_path.py's output; ``demand``: the fastest
    phase's audio s/s measured at full size, for the workers a GPU needs."""
    worker = WORKER_LINE.search(log)
    fed = FED_LINE.search(log)
    need = NEED_LINE.search(log)
    if not worker:
        tail = " / ".join(log.strip().splitlines()[-3:])[-300:]
        return "fail", f"data path: no result ({tail})", None
    parts, verdict, wait = [], "ok", None
    if fed:
        workers, _, audio, wait_s, worst = fed.groups()
        wait = float(wait_s)
        parts.append(
            f"fed by the loader (NUM_WORKERS={workers}): data wait {wait:.1f}% of step time "
            f"(worst step {float(worst):.1f}%) at {float(audio):.0f} audio s/s"
        )
        if wait > DATA_WAIT_TARGET:
            verdict = "warn"
    parts.append(f"one worker {float(worker.group(1)):.0f} audio s/s")
    if need:
        parts.append(f"{need.group(1)} workers per GPU (8-GPU node: {need.group(2)} cores)")
    if demand:
        parts[-1] += f" for {demand:.0f} audio s/s"
    return verdict, "; ".join(parts), wait


def throughput_figure(
    bench_log: str, profile_log: str, data_log: str, seconds: float, grad_accum: int
) -> tuple[str, str]:
    """One verdict and figure of the throughput stage's three runs: the step benchmark at the real
    batch (``bench_figure``), the profile (``profile_figure``) and the data path; warns where a
    target is missed: MFU < MFU_TARGET, project slower than NeMo, data wait > DATA_WAIT_TARGET."""
    verdict, figure = bench_figure(bench_log)
    if verdict == "fail":
        return "fail", figure
    rows = BENCH_LINE.findall(bench_log)
    demand = max((float(r[3]) for r in rows if r[1] == "project"), default=None)
    misses = []
    mfu = [float(r[5]) for r in rows if r[1] == "project" and r[0] == "2" and r[5]]
    if mfu and mfu[0] < MFU_TARGET:
        misses.append(f"phase-2 MFU {mfu[0]:.1f}% < {MFU_TARGET:g}%")
    parts = [f"MAX_BATCH_DURATION={seconds:g} x GRAD_ACCUM {grad_accum}: {figure}"]
    profile = profile_figure(profile_log)
    parts.append(profile or "profile: no table (see throughput-profile.log)")
    data_verdict, data_text, wait = data_path_figure(data_log, demand)
    parts.append(data_text)
    if wait is not None and wait > DATA_WAIT_TARGET:
        misses.append(f"data wait {wait:.1f}% > {DATA_WAIT_TARGET:g}%")
    if data_verdict == "fail" or not profile:
        verdict = "fail"
    elif misses or verdict == "warn":
        verdict = "warn"
    text = "; ".join(parts)
    return verdict, (f"misses: {', '.join(misses)}; " if misses else "") + text
