"""Every metric a training run logs, declared once: its W&B key, its meaning, how ranks combine it.

Usage:
    python training_metrics.py --markdown        # docs/metrics.md's metric list
    python training_metrics.py --update-docs     # rewrite that list in docs/metrics.md between its markers

A metric is computed from **measures**: quantities each rank measures over one optimizer step (the
"window" of GRAD_ACCUM micro-batches), combined over ranks by one all-reduce per kind (``sum`` or
``max``). A measure with ``of_micro_batch`` is measured by itself from every micro-batch; the others
are timers and counters that callbacks.TrainingMetricsCallback sets. A ``cumulative`` measure is
also summed over the whole run (the totals survive a resume).

Adding a metric: one ``Metric`` line in ``STEP_METRICS`` (plus one ``Measure`` line when it needs a
quantity nobody measures yet), then ``python training_metrics.py --update-docs`` (or ``make docs``).
Keys containing ``<lang>`` or ``<reason>`` stand for one key per language or bad-audio reason; their
value function returns ``{lang or reason: value}``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from collectives import all_reduce_tensor

# ---- measures: what each rank measures over one optimizer step -----------------------------------


@dataclass(frozen=True)
class Measure:
    """A quantity one rank measures over an optimizer step; ``reduce`` combines the ranks' values.

    ``per``: "lang" or "reason" for a value per language / bad-audio reason ({key: value}).
    ``of_micro_batch(batch, pl_module)``: its value for one micro-batch, summed over the window.
    ``module_counter``: the growth over the step of the TrainingModule attribute of the same name (a
    per-rank fault counter that restarts at 0 in a resumed process).
    """

    name: str
    reduce: str  # "sum" or "max"
    per: str | None = None
    of_micro_batch: Callable[[Any, Any], Any] | None = None
    cumulative: bool = False
    module_counter: bool = False


def _non_empty(batch) -> bool:
    return batch.signal.shape[0] > 0


def _loss_sum(batch, module):
    """The micro-batch's loss where finite, else 0: a 0-d tensor left on its device (the window
    sums it there and reads it once per optimizer step)."""
    loss = module.last_loss
    if not _non_empty(batch) or loss is None:
        return 0.0
    loss = loss.detach().to(torch.float64)
    return torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss))


def _loss_count(batch, module):
    loss = module.last_loss
    if not _non_empty(batch) or loss is None:
        return 0.0
    return torch.isfinite(loss.detach()).to(torch.float64)


def _distill_sum(batch, module):
    """What distillation added to the micro-batch's loss where it added anything, else 0."""
    term = getattr(module, "last_distill", None)
    if not _non_empty(batch) or term is None:
        return 0.0
    return term.detach().to(torch.float64)


def _distill_count(batch, module):
    return float(_non_empty(batch) and getattr(module, "last_distill", None) is not None)


MEASURES: tuple[Measure, ...] = (
    Measure("loss_sum", "sum", of_micro_batch=_loss_sum),
    Measure("loss_count", "sum", of_micro_batch=_loss_count),
    Measure("distill_sum", "sum", of_micro_batch=_distill_sum),
    Measure("distill_count", "sum", of_micro_batch=_distill_count),
    Measure("utterances", "sum", of_micro_batch=lambda b, m: float(b.signal.shape[0])),
    Measure("audio_seconds", "sum", of_micro_batch=lambda b, m: float(sum(b.durations))),
    Measure("tokens", "sum", of_micro_batch=lambda b, m: float(b.token_count)),
    Measure("real_samples", "sum", of_micro_batch=lambda b, m: float(b.sample_count)),
    Measure("padded_samples", "sum", of_micro_batch=lambda b, m: float(b.signal.numel())),
    Measure("lang_utterances", "sum", per="lang", of_micro_batch=lambda b, m: _count(b.langs)),
    Measure(
        "bad_audio",
        "sum",
        per="reason",
        cumulative=True,
        of_micro_batch=lambda b, m: dict(b.bad_audio),
    ),  # fmt: skip
    # Set by the callback: timers and the growth of TrainingModule's fault counters.
    Measure("wait_seconds", "sum"),
    Measure("step_seconds", "sum"),
    Measure("step_seconds_max", "max"),
    Measure("wait_fraction_max", "max"),
    Measure("checkpoint_seconds", "max"),
    Measure("peak_memory_gib", "max"),
    Measure("peak_reserved_gib", "max"),
    Measure("empty_micro_batches", "sum", cumulative=True, module_counter=True),
    Measure("nonfinite_losses", "sum", cumulative=True, module_counter=True),
    # A skip is decided on every rank alike: the ranks' counts are equal, not to be summed.
    Measure("skipped_steps", "max", cumulative=True, module_counter=True),
)
MODULE_COUNTERS = tuple(m.name for m in MEASURES if m.module_counter)


def _count(keys: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in keys:
        out[k] = out.get(k, 0.0) + 1.0
    return out


# ---- metrics: what is logged ---------------------------------------------------------------------


@dataclass
class Step:
    """What a metric's value is computed from, at the end of one optimizer step (on every rank).

    ``measures``: this step's measures, combined over ranks (per-key ones as {key: value});
    ``total``: the cumulative measures summed over the run; ``recent_langs``: utterances per language
    over the last ``share_window`` steps; ``target_share``: the sampler's target per language."""

    measures: dict[str, Any]
    total: dict[str, Any]
    trainer: Any
    module: Any
    lr: float
    recent_langs: dict[str, float] = field(default_factory=dict)
    target_share: dict[str, float] = field(default_factory=dict)


# How a metric combines the ranks: "sum" or "max" of their values; "pooled" = a ratio of sums (for
# example total real samples / total padded samples); "sum / max" = summed audio over the slowest
# rank's time; "same" = identical on every rank (rank 0's is logged); "gathered" = every rank's
# hypotheses gathered and scored together; "rank 0" = measured on global rank 0.
RANK_REDUCTIONS = ("sum", "max", "pooled", "sum / max", "same", "gathered", "rank 0")


@dataclass(frozen=True)
class Metric:
    key: str
    ranks: str  # how ranks combine it: one of RANK_REDUCTIONS
    meaning: str
    value: Callable[[Step], Any] | None = None  # None: logged by the evaluation, not per step
    cuda_only: bool = False


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _float(v: Any) -> float:
    return math.nan if v is None else float(v)


def _shares(counts: Mapping[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: _ratio(v, total) for k, v in counts.items()}


STEP_METRICS: tuple[Metric, ...] = (
    Metric("train/loss", "pooled", "mean loss of this step's micro-batches with a finite loss, all ranks",
           lambda s: _ratio(s.measures["loss_sum"], s.measures["loss_count"])),
    Metric("train/distill", "pooled", "mean of what distillation added to the loss (DISTILL_WEIGHT "
           "and DISTILL_JOINT_WEIGHT, weights applied) over this step's micro-batches with "
           "utterances of the base's languages, all ranks; NaN where none had one; not logged "
           "while both are 0",
           lambda s: _ratio(s.measures["distill_sum"], s.measures["distill_count"])
           if getattr(s.module, "distill_weight", 0) > 0
           or getattr(s.module, "distill_joint_weight", 0) > 0 else None),
    Metric("train/lr", "same", "learning rate this optimizer step used", lambda s: s.lr),
    Metric("train/phase", "same", "1 = encoder frozen, 2 = the whole model trains",
           lambda s: _float(s.module.phase)),
    Metric("train/grad_norm", "same", "gradient norm before clipping (the same on every rank)",
           lambda s: _float(s.module.last_grad_norm)),
    Metric("train/epoch", "same", "sampler epoch", lambda s: float(s.trainer.current_epoch)),
    Metric("train/micro_batch", "same", "micro-batches each rank has processed in this epoch",
           lambda s: float(s.trainer.fit_loop.epoch_loop.batch_progress.current.processed)),
    Metric("train/skipped_steps", "max", "optimizer steps skipped so far (non-finite loss or gradient, "
           "or no utterance on any rank)", lambda s: s.total["skipped_steps"]),
    Metric("train/empty_micro_batches", "sum", "micro-batches so far whose every utterance was bad audio, "
           "all ranks", lambda s: s.total["empty_micro_batches"]),
    Metric("train/nonfinite_losses", "sum", "micro-batches so far with a non-finite loss, all ranks",
           lambda s: s.total["nonfinite_losses"]),
    Metric("time/step_s", "max", "wall time of this optimizer step, slowest rank",
           lambda s: s.measures["step_seconds_max"]),
    Metric("time/checkpoint_s", "max", "seconds of this step spent saving a checkpoint",
           lambda s: s.measures["checkpoint_seconds"]),
    Metric("time/data_wait_fraction", "pooled", "share of step time spent waiting for data, ranks pooled",
           lambda s: _ratio(s.measures["wait_seconds"], s.measures["step_seconds"])
           if s.measures["step_seconds"] else 0.0),
    Metric("time/data_wait_fraction_max", "max", "share of step time spent waiting for data, worst rank",
           lambda s: s.measures["wait_fraction_max"]),
    Metric("throughput/audio_s_per_step", "sum", "seconds of audio in this optimizer step, all ranks, "
           "as trained (after SPEED_PERTURB: a row played at 1.1 counts its duration / 1.1)",
           lambda s: s.measures["audio_seconds"]),
    Metric("throughput/audio_s_per_s", "sum / max", "seconds of audio trained per second of wall time",
           lambda s: _ratio(s.measures["audio_seconds"], s.measures["step_seconds_max"])),
    Metric("throughput/utterances_per_step", "sum", "utterances in this optimizer step, all ranks",
           lambda s: s.measures["utterances"]),
    Metric("throughput/tokens_per_step", "sum", "target tokens (language tag included) in this step, all ranks",
           lambda s: s.measures["tokens"]),
    Metric("throughput/utterances_per_s", "sum / max", "utterances trained per second of wall time",
           lambda s: _ratio(s.measures["utterances"], s.measures["step_seconds_max"])),
    Metric("data/padding_efficiency", "pooled", "real audio samples / padded samples in this step's batches",
           lambda s: _ratio(s.measures["real_samples"], s.measures["padded_samples"])),
    Metric("data/bad_audio_total", "sum", "utterances so far skipped as bad audio, all ranks",
           lambda s: float(sum(s.total["bad_audio"].values()))),
    Metric("data/bad_audio/<reason>", "sum", "the same per reason (missing, unreadable, empty, ...)",
           lambda s: dict(s.total["bad_audio"])),
    Metric("lang_share/<lang>", "pooled", "share of utterances per language over the last 100 steps",
           lambda s: _shares(s.recent_langs)),
    Metric("lang_target/<lang>", "same", "the sampler's target share per language (TEMPERATURE, "
           "BASE_LANGUAGE_SHARE)",
           lambda s: {lang: s.target_share.get(lang, math.nan) for lang in s.recent_langs}),
    Metric("gpu/peak_memory_gib", "max", "peak GPU memory allocated in this step, largest rank",
           lambda s: s.measures["peak_memory_gib"], cuda_only=True),
    Metric("gpu/peak_reserved_gib", "max", "peak GPU memory the caching allocator held in this "
           "step (allocated + cached, what the device really gave), largest rank",
           lambda s: s.measures["peak_reserved_gib"], cuda_only=True),
)  # fmt: skip

EVALUATION_METRICS: tuple[Metric, ...] = (
    Metric("val/wer/<lang>", "gathered", "greedy WER on the validation set, corpus-level, hypothesis and "
           "reference normalized alike (lower case, no punctuation, dandas or tags: see below); "
           "<lang> = all pools every language"),
    Metric("val/cer/<lang>", "gathered", "the same for CER (characters, single spaces included)"),
    Metric("val/wer_sub/<lang>", "gathered", "substituted words per reference word (the WER is "
           "wer_sub + wer_del + wer_ins)"),
    Metric("val/wer_del/<lang>", "gathered", "deleted words per reference word"),
    Metric("val/wer_ins/<lang>", "gathered", "inserted words per reference word"),
    Metric("val/punct_f1/<lang>", "gathered", "punctuated targets (TRANSCRIPT_STYLE) only: F1 of the "
           "sentence marks ending each word (. , ? ! ; : danda), words aligned ignoring case and "
           "marks (punctuation_scoring.py); 1 = every mark right"),
    Metric("val/case_err/<lang>", "gathered", "punctuated targets only: share of the correctly "
           "recognized words with a cased letter written in another case than the reference's "
           "(languages with case only)"),
    Metric("val/lid_acc/<lang>", "gathered", "language identification: share of the language's "
           "utterances whose greedy hypothesis (auto decoding) starts with the language's own tag, "
           "the first decoded token; <lang> = all pools every utterance"),
    Metric("val/wer_given/<lang>", "gathered", "VAL_LANGUAGE_GIVEN=1 (default): the greedy WER "
           "with the language given, every utterance decoded from its own language's tag and, "
           "with LANGUAGE_GIVEN_SCRIPTS=1 (default), in that language's scripts (the same "
           "encoder forward as val/wer); val/wer minus this is the error a wrong language guess "
           "costs"),
    Metric("val/cer_given/<lang>", "gathered", "the same for CER"),
    Metric("val/forgetting/<lang>", "rank 0", "when finetuning, for each of the base's languages "
           "(BASE_LANGUAGES or the base's record): val/wer now minus at the step-0 validation, in "
           "WER points (positive: worse than the base); a warning above FORGETTING_WARN_POINTS"),
    Metric("val/forgetting_given/<lang>", "rank 0", "the same for val/wer_given"),
    Metric("val/loss", "gathered", "the training loss on the validation utterances (the training loss's "
           "reduction per batch, averaged over utterances: comparable with train/loss)"),
    Metric("val/utterances", "gathered", "validation utterances decoded (bad audio excluded)"),
    Metric("val/seconds", "rank 0", "wall time of the evaluation"),
)  # fmt: skip

TABLES = {
    "val/examples": "up to 3 (lang, reference, hypothesis) rows per language per evaluation",
    "val/lid_confusion": "language identification per evaluation: (true, guessed, utterances) rows, "
    "the guess being the tag the greedy hypothesis starts with, none when it starts with no tag",
}


def evaluation_metrics(
    results: Mapping[str, Any],
    utterances: int,
    seconds: float,
    lid_accuracy: Mapping[str, float] | None = None,
    results_given: Mapping[str, Any] | None = None,
    forgetting: Mapping[str, Mapping[str, float | None]] | None = None,
) -> dict:
    """The EVALUATION_METRICS values of one evaluation (``results``: ErrorCounts per language,
    decoded auto; ``lid_accuracy``: evaluation.language_id_accuracy; ``results_given``: ErrorCounts
    per language decoded with the language given; ``forgetting``: evaluation.forgetting)."""
    out = {"val/utterances": float(utterances), "val/seconds": float(seconds)}
    for lang, accuracy in (lid_accuracy or {}).items():
        out[f"val/lid_acc/{lang}"] = accuracy
    for lang, counts in (results_given or {}).items():
        out[f"val/wer_given/{lang}"] = counts.wer
        out[f"val/cer_given/{lang}"] = counts.cer
    for lang, row in (forgetting or {}).items():
        out[f"val/forgetting/{lang}"] = row["points"]
        if row.get("points_given") is not None:
            out[f"val/forgetting_given/{lang}"] = row["points_given"]
    for lang, counts in results.items():
        out[f"val/wer/{lang}"] = counts.wer
        out[f"val/cer/{lang}"] = counts.cer
        out[f"val/wer_sub/{lang}"] = counts.rate(counts.substitutions)
        out[f"val/wer_del/{lang}"] = counts.rate(counts.deletions)
        out[f"val/wer_ins/{lang}"] = counts.rate(counts.insertions)
    return out


def step_metrics(step: Step, cuda: bool) -> dict[str, float]:
    """Every STEP_METRICS value for ``step``, per-key metrics expanded."""
    out: dict[str, float] = {}
    for metric in STEP_METRICS:
        if metric.cuda_only and not cuda:
            continue
        value = metric.value(step)
        if value is None:  # a metric of something this run does not do
            continue
        if isinstance(value, Mapping):
            placeholder = "<lang>" if "<lang>" in metric.key else "<reason>"
            for key, v in value.items():
                out[metric.key.replace(placeholder, str(key))] = float(v)
        else:
            out[metric.key] = float(value)
    return out


# ---- the window of one optimizer step, and its reduction over ranks -------------------------------


class Window:
    """The measures of one rank over one optimizer step.

    ``keys``: the keys of each per-key kind ({"lang": [...], "reason": [...]}), the same on every
    rank, in the same order (the reduction packs values by it)."""

    def __init__(self, keys: Mapping[str, Sequence[str]]):
        self.keys = {kind: list(k) for kind, k in keys.items()}
        self.values: dict[str, Any] = {}
        for measure in MEASURES:
            self.values[measure.name] = (
                dict.fromkeys(self.keys.get(measure.per, []), 0.0) if measure.per else 0.0
            )

    def add_micro_batch(self, batch, module) -> None:
        """Add one micro-batch's measures. None of them reads a value from the device: host numbers
        come from what the host knew when it made the batch, device ones (the loss) are summed as
        tensors and read with the step's reduction."""
        for measure in MEASURES:
            if measure.of_micro_batch is None:
                continue
            value = measure.of_micro_batch(batch, module)
            if measure.per:
                known = self.values[measure.name]
                for key, v in value.items():
                    if key in known:
                        known[key] += float(v)
            elif isinstance(value, torch.Tensor):
                self.values[measure.name] = self.values[measure.name] + value
            else:
                self.values[measure.name] += float(value)

    def set(self, name: str, value: float) -> None:
        self.values[name] = float(value)

    def add(self, name: str, value: float) -> None:
        self.values[name] += float(value)

    def reduced(self, device: torch.device) -> dict[str, Any]:
        """The measures combined over every rank: one all-reduce per kind of reduction."""
        out: dict[str, Any] = {}
        for op in ("sum", "max"):
            names = [m for m in MEASURES if m.reduce == op]
            flat: list = []
            for m in names:
                v = self.values[m.name]
                flat.extend(v.values() if m.per else [v])
            on_device = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
            packed = torch.tensor(
                [0.0 if isinstance(v, torch.Tensor) else float(v) for v in flat],
                dtype=torch.float64,
            ).to(device)
            if on_device:
                packed[on_device] = torch.stack(
                    [flat[i].to(device, torch.float64).reshape(()) for i in on_device]
                )
            combined = all_reduce_tensor(packed, op)
            combined = combined.cpu().tolist()
            i = 0
            for m in names:
                if m.per:
                    keys = list(self.values[m.name])
                    out[m.name] = dict(zip(keys, combined[i : i + len(keys)]))
                    i += len(keys)
                else:
                    out[m.name] = combined[i]
                    i += 1
        return out


def add_to_totals(totals: dict[str, Any], reduced: Mapping[str, Any]) -> None:
    """Add this step's cumulative measures to the run's ``totals`` (in place)."""
    for m in MEASURES:
        if not m.cumulative:
            continue
        if m.per:
            bucket = totals.setdefault(m.name, {})
            for key, v in reduced[m.name].items():
                bucket[key] = bucket.get(key, 0.0) + v
        else:
            totals[m.name] = totals.get(m.name, 0.0) + reduced[m.name]


def empty_totals(keys: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    return {
        m.name: dict.fromkeys(keys.get(m.per, []), 0.0) if m.per else 0.0
        for m in MEASURES
        if m.cumulative
    }


def recent_sum(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """{key: sum over ``history``} of per-key values."""
    out: dict[str, float] = {}
    for counts in history:
        for k, v in counts.items():
            out[k] = out.get(k, 0.0) + v
    return out


# ---- overfitting: the validation loss rising while the training loss falls ------------------------


@dataclass(frozen=True)
class LossAtValidation:
    """The losses of one validation: ``val_loss`` (val/loss) and ``train_loss``, the mean finite
    train/loss over the optimizer steps since the previous validation, this one's step included
    (None when there was none: the step-0 validation of a finetune, or every step skipped)."""

    step: int
    val_loss: float | None
    train_loss: float | None


def overfitting_at(validations: Sequence[LossAtValidation], rises: int) -> bool:
    """Whether a run overfits at the last of ``validations`` (in step order): with v the validation
    losses and t the training-loss means of ``LossAtValidation``, and n the last validation,

        v[n-rises] < v[n-rises+1] < ... < v[n]     (the validation loss rose at each of the last
                                                     ``rises`` validations)
        t[n] < t[n-rises+1]                         (the training loss fell over the same steps:
                                                     its mean between the last two validations is
                                                     below its mean between the window's first two)

    False with fewer than ``rises`` + 1 validations, with a loss of the window unknown, and for
    ``rises`` < 2 (the window then holds one training interval, nothing to fall from)."""
    if rises < 2 or len(validations) < rises + 1:
        return False
    window = validations[-(rises + 1) :]
    losses = [v.val_loss for v in window]
    first, last = window[1].train_loss, window[-1].train_loss
    if any(loss is None or not math.isfinite(loss) for loss in losses):
        return False
    if first is None or last is None:
        return False
    return all(b > a for a, b in zip(losses, losses[1:])) and last < first


def overfitting_steps(validations: Sequence[LossAtValidation], rises: int) -> list[int]:
    """The steps of the validations at which ``overfitting_at`` holds (each judged on the
    validations up to it)."""
    return [
        v.step for i, v in enumerate(validations) if overfitting_at(validations[: i + 1], rises)
    ]


def losses_at_validations(
    val_loss: Sequence[tuple[int, float]], train_loss: Sequence[tuple[int, float]]
) -> list[LossAtValidation]:
    """``LossAtValidation`` of each (step, val/loss) of a run, from its (step, train/loss) series
    (both in step order; non-finite training losses left out of the means)."""
    out: list[LossAtValidation] = []
    i, total, count = 0, 0.0, 0
    for step, loss in val_loss:
        # one pass over the training series: each step's loss joins the interval it ends in
        while i < len(train_loss) and train_loss[i][0] <= step:
            t = train_loss[i][1]
            if t is not None and math.isfinite(t):
                total, count = total + t, count + 1
            i += 1
        out.append(LossAtValidation(step, loss, total / count if count else None))
        total, count = 0.0, 0
    return out


class OverfittingWatch:
    """``LossAtValidation`` gathered while a run trains: ``train_step`` with each optimizer step's
    train/loss, then ``validation`` with each validation's loss, which answers ``overfitting_at``
    (``rises``). Its ``state_dict`` goes into checkpoints, so a resumed run judges the validations
    of the jobs before it and ``warned`` stays set once a warning was given."""

    def __init__(self, rises: int):
        self.rises = int(rises)
        self.validations: list[LossAtValidation] = []
        self.warned = False
        self._sum, self._count = 0.0, 0

    @property
    def last_step(self) -> int | None:
        return self.validations[-1].step if self.validations else None

    def train_step(self, loss: float | None) -> None:
        if loss is not None and math.isfinite(loss):
            self._sum, self._count = self._sum + float(loss), self._count + 1

    def validation(self, step: int, loss: float | None) -> bool:
        """Record the validation at ``step`` (closing the training interval); whether the run
        now overfits."""
        mean = self._sum / self._count if self._count else None
        self.validations.append(LossAtValidation(int(step), loss, mean))
        self._sum, self._count = 0.0, 0
        return overfitting_at(self.validations, self.rises)

    def state_dict(self) -> dict[str, Any]:
        return {
            "validations": [[v.step, v.val_loss, v.train_loss] for v in self.validations],
            "warned": self.warned,
            "interval": [self._sum, self._count],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.validations = [LossAtValidation(int(s), v, t) for s, v, t in state["validations"]]
        self.warned = bool(state.get("warned", False))
        self._sum, self._count = state.get("interval", (0.0, 0))


# ---- docs/metrics.md -----------------------------------------------------------------------------

LIST_START = "<!-- metrics-list:start (generated by `python training_metrics.py --update-docs`) -->"
LIST_END = "<!-- metrics-list:end -->"


def markdown_list() -> str:
    """docs/metrics.md's table of metrics, from the declarations above."""
    rows = ["| key | over ranks | meaning |", "|---|---|---|"]
    for metric in STEP_METRICS + EVALUATION_METRICS:
        suffix = " (CUDA only)" if metric.cuda_only else ""
        rows.append(f"| `{metric.key}` | {metric.ranks} | {metric.meaning}{suffix} |")
    for key, meaning in TABLES.items():
        rows.append(f"| `{key}` (table) | rank 0 | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    from pathlib import Path

    from doc_tables import update_section

    if "--update-docs" in sys.argv[1:]:
        page = Path(__file__).resolve().parent / "docs" / "metrics.md"
        changed = update_section(page, LIST_START, LIST_END, markdown_list())
        print("docs/metrics.md metric list " + ("updated" if changed else "already up to date"))
    else:
        print(markdown_list())
