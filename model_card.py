"""The model card written beside every exported .nemo: what the model is, what it was trained on and
how well it does, in one Markdown file a teammate can read without the run's environment.

``render(record, model, nemo_name)`` writes it from a run record (``training_step.TrainingModule.
run_record``: the settings, hours of training audio per language, the step and the newest
validation), which the end of a training run has in memory and every step checkpoint carries, so
train.py and scripts/export_nemo.py write the same card. ``card_path`` names it:
``<name>.nemo`` -> ``<name>.model-card.md``. ``export_nemo`` writes a .nemo and its card as one set.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import asr_model
import config
import vocabulary
from atomic_files import write_together
from evaluation import NORMALIZED_SCORING, base_and_final_rates

# The settings a reader needs to judge or repeat the training, in this order.
TRAINING_SETTINGS = (
    "MAX_STEPS",
    "UNFREEZE_STEP",
    "PHASE1_LR",
    "PHASE2_LR",
    "MIN_LR",
    "WARMUP_STEPS",
    "PHASE2_WARMUP",
    "WEIGHT_DECAY",
    "GRAD_CLIP",
    "GRAD_ACCUM",
    "MAX_BATCH_DURATION",
    "TEMPERATURE",
    "MIN_DURATION",
    "MAX_DURATION",
    "MAX_TOKEN_LEN",
    "PRECISION",
    "SEED",
)

# The finetuning levers: what shapes how much a finetune keeps of its base and how fast it learns
# the new languages, listed in the card's "Finetuning levers" section in this order, each with the
# run's value and whether it is the default. A lever added to config.py shows up once named here;
# a knob of the run's settings whose name starts with one of FINETUNING_LEVER_PREFIXES shows up
# without being named.
FINETUNING_LEVERS = (
    "TOKENIZER_MODE",
    "VOCAB_SIZE",
    "DECODER_INIT",
    "NEW_PIECE_BIAS",
    "UNFREEZE_STEP",
    "ENCODER_LR_SCALE",
    "NEW_PIECE_LR_SCALE",
    "NEW_PIECE_WARMUP",
    "NEW_PIECE_DECAY",
    "BASE_LANGUAGE_SHARE",
    "BASE_LANGUAGES",
    "SPEED_PERTURB",
    "NOISE_PROB",
    "NOISE_SNR_DB",
    "NOISE_DIR",
)
FINETUNING_LEVER_PREFIXES = ("DISTILL_", "L2SP_", "AUTO_LANGUAGE", "BASE_ADAPTER")


def card_path(nemo_path: str | Path) -> Path:
    """Where the card of ``nemo_path`` goes: beside it, ``<name>.model-card.md``."""
    nemo_path = Path(nemo_path)
    return nemo_path.with_name(nemo_path.name.removesuffix(".nemo") + ".model-card.md")


def _rate(value: float | None) -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.4f}"
    )


def _evaluation_rows(results: dict[str, dict[str, int]]) -> list[str]:
    rows = [
        "| language | utterances | words | WER | substitutions | deletions | insertions | CER |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lang, c in results.items():
        words, chars = c.get("words", 0), c.get("chars", 0)

        def share(key: str, total: int = words, counts: dict = c) -> float | None:
            return counts.get(key, 0) / total if total else None

        rows.append(
            f"| {lang} | {c.get('utterances', 0):,} | {words:,} | {_rate(share('word_edits'))} | "
            f"{_rate(share('substitutions'))} | {_rate(share('deletions'))} | "
            f"{_rate(share('insertions'))} | {_rate(share('char_edits', chars))} |"
        )
    return rows


def _given_rows(evaluation: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Auto against the language given, per language, when the validation decoded both ways."""
    given = evaluation.get("results_given") or {}
    if not given:
        return []
    how = (
        "then only pieces of its scripts"
        if str(settings.get("LANGUAGE_GIVEN_SCRIPTS", "1")) == "1"
        else "then any piece"
    )
    rows = [
        "",
        f"With the language given (each utterance decoded from its own language's tag, {how}; "
        f"`transcribe.py --lang`), on the same utterances:",
        "",
        "| language | WER | WER given | CER | CER given |",
        "|---|---:|---:|---:|---:|",
    ]
    for lang, c in evaluation["results"].items():
        g = given.get(lang) or {}

        def rate(counts: dict, edits: str, total: str) -> str:
            return _rate(counts.get(edits, 0) / counts[total] if counts.get(total) else None)

        rows.append(
            f"| {lang} | {rate(c, 'word_edits', 'words')} | {rate(g, 'word_edits', 'words')} | "
            f"{rate(c, 'char_edits', 'chars')} | {rate(g, 'char_edits', 'chars')} |"
        )
    return rows


def _base_comparison_rows(
    base: dict[str, Any] | None, final: dict[str, Any], whose: str
) -> list[str]:
    """Base (the validation at step 0) against ``whose`` numbers ``final`` are, per language, when
    the run has both."""
    table = base_and_final_rates(base, final)
    if not table:
        return []
    rows = [
        "",
        f"Before and after: the base model as validated at step 0 (before any update) and {whose}, "
        f"on the same utterances:",
        "",
        "| language | base WER | WER | change | base CER | CER |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lang, (bw, fw, bc, fc) in table.items():
        change = f"{fw - bw:+.4f}" if bw is not None and fw is not None else "n/a"
        rows.append(
            f"| {lang} | {_rate(bw)} | {_rate(fw)} | {change} | {_rate(bc)} | {_rate(fc)} |"
        )
    return rows


def _vocabulary_lines(record: dict[str, Any]) -> list[str]:
    """How the tokenizer and the parts sized by the vocabulary relate to the base model's, when a
    record says."""
    lines = []
    tokenizer = record.get("tokenizer") or {}
    extension = tokenizer.get("extension")
    if tokenizer.get("mode") == "extend" and extension:
        lines.append(
            f"- tokenizer mode: extend ({extension['base_pieces']:,} base pieces kept with their "
            f"ids, {extension['appended_pieces']:,} pieces and {extension['appended_tags']} tags "
            f"appended)"
        )
    elif tokenizer.get("mode") == "tags" and extension:
        lines.append(
            f"- tokenizer mode: tags (the base's, {extension['appended_tags']} tags added)"
        )
    elif tokenizer.get("mode"):
        lines.append(f"- tokenizer mode: {tokenizer['mode']} (learned from the training manifest)")
    change = record.get("vocabulary_change")
    if change:
        # Counts without "heads" are those of the transducer's decoder and joint.
        heads = asr_model.heads_phrase(change.get("heads") or ("decoder", "joint"))
        if change.get("decoder_init") == "carry":
            lines.append(
                f"- {heads}: the base model's, {change['carried']:,} piece rows carried, "
                f"{change['new']:,} new, {change['dropped']:,} dropped"
            )
        else:
            lines.append(f"- {heads}: new (DECODER_INIT=fresh), trained from random")
    return lines


def finetuning_levers(settings: dict[str, Any]) -> list[str]:
    """The names of the levers ``settings`` holds: those of ``FINETUNING_LEVERS`` in its order, then
    every other setting whose name starts with one of ``FINETUNING_LEVER_PREFIXES``, in the
    settings' order. A lever whose value is None (NOISE_DIR unset) is left out."""
    named = [k for k in FINETUNING_LEVERS if k in settings]
    prefixed = [
        k
        for k in settings
        if k.startswith(FINETUNING_LEVER_PREFIXES) and k not in FINETUNING_LEVERS
    ]
    return [k for k in named + prefixed if settings[k] is not None]


def _setting_text(value: Any) -> str:
    """A setting as a user writes it in the environment, in code type (a list comma-separated), or
    the word empty for an empty one (an unset path, an empty list)."""
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"`{value}`" if value not in (None, "") else "empty"


def _lever_lines(settings: dict[str, Any]) -> list[str]:
    """The card's "Finetuning levers" section: each lever with the run's value, marked default or
    changed (with the default) against config.py's defaults; [] when the settings hold none."""
    levers = finetuning_levers(settings)
    if not levers:
        return []
    # The defaults as run settings are written (JSON types), so a value compares with its own kind.
    defaults = config.run_settings(config.read_config({}))
    rows = []
    for name in levers:
        value = settings[name]
        if name not in defaults:
            mark = "no default in this version of config.py"
        elif value == defaults[name]:
            mark = "default"
        else:
            mark = f"**changed** (default {_setting_text(defaults[name])})"
        rows.append(f"| `{name}` | {_setting_text(value)} | {mark} |")
    # A knob of another step (train_tokenizer's) is as the training run's environment had it, which
    # need not be what that step ran with; the tokenizer it made is the one the Model section shows.
    elsewhere = [n for n in levers if n in config.KNOBS and "train" not in config.KNOBS[n].steps]
    steps = sorted({s for n in elsewhere for s in config.KNOBS[n].steps})
    return [
        "",
        "## Finetuning levers",
        "",
        "What shapes how much of the base model a finetune keeps and how fast it learns new "
        "languages, as this run had them (docs/knobs.md):",
        "",
        "| lever | value | against the default |",
        "|---|---|---|",
        *rows,
        *(
            [
                "",
                f"{', '.join(f'`{n}`' for n in elsewhere)}: knobs of {', '.join(steps)}, not of "
                f"training, as the training run's environment had them; the tokenizer the model "
                f"has is the one under Model.",
            ]
            if elsewhere
            else []
        ),
    ]


def _scoring(evaluation: dict) -> str:
    """How the texts of ``evaluation``'s counts were compared, in words."""
    if evaluation.get("scoring") == NORMALIZED_SCORING:
        return (
            "hypothesis and reference normalized alike: lower case, punctuation, dandas and "
            "language tags removed (docs/metrics.md)"
        )
    return "language tags stripped from both sides"


def _whose_numbers(
    record: dict[str, Any], evaluation: dict[str, Any], nemo_name: str
) -> tuple[str, str]:
    """(whose weights the evaluation scored, the sentence that opens it): this file's when scored at
    export (``scored_at_export``) or when it is the checkpoint validated at that step; otherwise the
    checkpoint the record names (``evaluation_of``: a blend or an average exported unscored) or the
    step validated, said to be other weights than this file's."""
    step = evaluation.get("step")
    if evaluation.get("scored_at_export"):
        return "this model", "Greedy decoding of this file's weights, scored at export,"
    if record.get("evaluation_of"):
        return (
            f"{record['evaluation_of']} (step {step})",
            f"Not this file's weights: the numbers below are those of {record['evaluation_of']}, "
            f"validated at step {step} (score this file with `python scripts/evaluate.py "
            f"{nemo_name}`). Greedy decoding",
        )
    if record.get("step") is not None and step is not None and step != record.get("step"):
        return (
            f"the model at step {step}",
            f"Not this file's weights: the numbers below are the run's newest validation, at step "
            f"{step}, before this checkpoint's step {record['step']}. Greedy decoding at step {step}",
        )
    return f"this model at step {step}", f"Greedy decoding at step {step}"


def render(record: dict[str, Any], model, nemo_name: str) -> str:
    """The card's Markdown. ``record``: a run record (settings, training_hours, step, world_size,
    evaluation); ``model``: the exported NeMo model (its size and tokenizer are read from it)."""
    settings = record.get("settings") or {}
    hours = record.get("training_hours") or {}
    evaluation = record.get("evaluation")
    recorded_base = record.get("base_model") or {}
    init = recorded_base.get("path") or settings.get("INIT_MODEL") or ""
    digest = recorded_base.get("weights_sha256")
    base = (
        f"`{init}` (fine-tuned{f'; weights sha256 {digest}' if digest else ''})"
        if init
        else f"trained from scratch (`{settings.get('MODEL_CONFIG')}`)"
    )
    n_params = sum(p.numel() for p in model.parameters())
    tags = [
        t for t in vocabulary.model_pieces(model) or [] if t.startswith("<|") and t.endswith("|>")
    ]
    kind = next((k.name for k in asr_model.FAMILIES if k.owns(model)), "ASR model")
    lines = [
        f"# {nemo_name}",
        "",
        f"A NeMo {type(model).__name__} ({kind}, {n_params / 1e6:.1f} M parameters) that "
        f"writes a language tag, then the transcript: `<|hi|> नमस्ते दुनिया`. Strip the tag (the "
        f"first token) to get the text; it names the language the model heard.",
        "",
        "## Model",
        "",
        f"- base model: {base}",
        *_vocabulary_lines(record),
        *(
            [f"- finetuning trade-off: {record['finetuning_trade_off']}"]
            if record.get("finetuning_trade_off")
            else []
        ),
        f"- tokenizer: SentencePiece, {model.tokenizer.vocab_size:,} pieces, "
        f"{len(tags)} language tags ({', '.join(tags)}); from `{settings.get('TOKENIZER_DIR')}`",
        f"- sample rate: {settings.get('TARGET_SAMPLE_RATE')} Hz, mono",
        f"- trained for {record.get('step')} optimizer steps on {record.get('world_size')} "
        f"process(es)",
        *([f"- run: `{record['run']['name']}`"] if (record.get("run") or {}).get("name") else []),
        *(
            [
                f"- weights: the mean of {len(record['averaged'])} step checkpoints "
                f"({', '.join(record['averaged'])})"
            ]
            if record.get("averaged")
            else []
        ),
        *([f"- chosen as: {record['selected']}"] if record.get("selected") else []),
        "",
        "## Training data",
        "",
        f"`{settings.get('TRAIN_MANIFEST_PATH')}`, after the feasibility filter:",
        "",
        "| language | hours |",
        "|---|---:|",
        *(f"| {lang} | {h:,.2f} |" for lang, h in sorted(hours.items())),
        f"| all | {sum(hours.values()):,.2f} |",
        "",
        "## Training settings",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| `{k}` | `{settings[k]}` |" for k in TRAINING_SETTINGS if k in settings),
        *_lever_lines(settings),
        "",
        "## Evaluation",
        "",
    ]
    if evaluation and evaluation.get("results"):
        loss = evaluation.get("loss")
        manifest = evaluation.get("manifest") or settings.get("VAL_MANIFEST_PATH")
        whose, lead = _whose_numbers(record, evaluation, nemo_name)
        lines += [
            f"{lead} on `{manifest}`"
            f" (corpus-level rates, {_scoring(evaluation)}"
            + (f"; validation loss {loss:.4f}" if isinstance(loss, float) else "")
            + "):",
            "",
            *_evaluation_rows(evaluation["results"]),
            *(
                ["", f"Left out, not scored (rows per language): {evaluation['excluded']}"]
                if evaluation.get("excluded")
                else []
            ),
            *_given_rows(evaluation, settings),
            *_base_comparison_rows(record.get("base_evaluation"), evaluation, whose),
        ]
    else:
        lines.append(
            "No validation ran in this run (EVAL_EVERY_STEPS=0 or no VAL_MANIFEST_PATH): score it "
            f"with `python scripts/evaluate.py {nemo_name}`."
        )
    lines += [
        "",
        "## Use",
        "",
        "```bash",
        f"python scripts/transcribe.py {nemo_name} audio1.flac audio2.wav   # JSONL: lang + text",
        f"python scripts/transcribe.py {nemo_name} --lang hi call.wav       # the language known",
        f"python scripts/evaluate.py {nemo_name} --manifest test.json        # NeMo JSON or parquet",
        "```",
        "",
    ]
    return "\n".join(lines)


def export_nemo(model, path: str | os.PathLike, record: dict[str, Any] | None = None) -> Path:
    """``model.save_to`` a .nemo file and write its model card beside it (``model_card``, from the
    run ``record``), as one set (``atomic_files.write_together``, the card last): a crash leaves
    the previous pair, or the new .nemo without a card, never a card describing another model."""
    path = Path(path)
    text = render(record or {}, model, path.name)
    write_together(
        {
            path: lambda tmp: model.save_to(tmp),
            card_path(path): lambda tmp: Path(tmp).write_text(text, encoding="utf-8"),
        },
        f"{os.getpid()}",
    )
    return path
