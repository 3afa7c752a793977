"""Export a train.py step checkpoint (.ckpt), or the average of several, as a .nemo file with its
model card beside it.

Usage:
    python scripts/export_nemo.py data/checkpoints/step_00005000.ckpt        # -> step_00005000.nemo beside it
    python scripts/export_nemo.py data/checkpoints/step_00005000.ckpt --out parakeet-hi-en.nemo
    python scripts/export_nemo.py last                   # the newest step checkpoint in CHECKPOINT_DIR
    python scripts/export_nemo.py best                   # the one with the lowest validation WER
    python scripts/export_nemo.py last --average 3       # the mean of the newest 3 -> step_<newest>.avg3.nemo
    python scripts/export_nemo.py best --average 3       # the mean of the 3 with the lowest WER
    python scripts/export_nemo.py a.ckpt b.ckpt c.ckpt --out averaged.nemo    # the mean of these
    python scripts/export_nemo.py last --blend-sweep 0,0.1,0.2,0.3   # score blends with the base
    python scripts/export_nemo.py last --blend-base 0.2   # 0.8 x finetuned + 0.2 x base -> .blend0.2.nemo
    python scripts/export_nemo.py last --blend-base 0.2 --base-model /models/base.nemo  # base moved

A step checkpoint carries its model's description (class, config, tokenizer), so the model is
rebuilt from the checkpoint alone; an older checkpoint without one is rebuilt the way train.py
builds it (INIT_MODEL or MODEL_CONFIG, and TOKENIZER_DIR, set as in training).

Averaging (``--average N``, or several checkpoints given): every floating-point weight is the
mean of the checkpoints' weights (computed in float64); integer buffers (BatchNorm's
``num_batches_tracked``) come from the newest. The checkpoints must hold the same model. Only the
weights are read (the checkpoints are memory-mapped, so their optimizer states are not loaded).
``last --average N`` takes the newest N (icefall's and NeMo's usual last step); ``best --average N``
the N with the lowest validation WER (ESPnet's ``valid.acc.ave_Nbest``): with a cosine schedule the
newest are usually the best, and where validation is noisy or the run overfits late, the N best
leave out a worse checkpoint that "newest" would average in. Training keeps the
KEEP_BEST_CHECKPOINTS best whatever KEEP_CHECKPOINTS prunes: set it to N to average N.

An average is kept only when it scores better than the best single checkpoint (NeMo's own guidance
for checkpoint averaging): both are decoded greedily on the validation set (``--manifest``, default
the run's VAL_MANIFEST_PATH as its checkpoint records it), their WER is printed, and the better one
is exported, the single checkpoint on a tie; the model card says which was kept and both scores.
Without a validation manifest the average is exported unscored, with a warning; ``--no-compare``
keeps the average without the comparison.

Blending with the base (``--blend-base A``): every weight becomes (1 - A) x finetuned + A x the base
as the finetune received it, weight-space interpolation (WiSE-FT), which gives back part of what the
base knew of its own languages for part of what the finetune learned. The base is the one the run
recorded when it loaded it (its path, the SHA-256 of its weights, and the DECODER_INIT and
NEW_PIECE_BIAS it was built with), rebuilt through the run's own vocabulary change with the
tokenizer the checkpoint carries; the shell's INIT_MODEL and NEW_PIECE_BIAS play no part. Where the
base lives at another path on this machine, ``--base-model PATH`` names it; a model whose weights
hash otherwise than the recorded base is refused, whether named or found at the recorded path (a
checkpoint from before bases were hashed is checked by its vocabulary change alone, with a
warning). The rows of pieces the base lacked keep their finetuned values: the base had none, only
the start the run gave them. ``--blend-sweep 0,0.1,0.2,0.3`` scores each A on the validation set per
language, base languages (BASE_LANGUAGES, else those the base records it was trained on) apart
from the new ones, and exports nothing: choose A from its table, then export with
``--blend-base A``. A is in [0, 1): 0 is the finetune.

The model card (``<name>.model-card.md``: base model with its weights hash, hours per language,
tokenizer, settings, validation WER/CER and loss) comes from the newest checkpoint's run record; it
names the averaged checkpoints and the model blended with (path and weights hash). Its numbers are
those of the weights in the .nemo: a blend or an average is scored at export on the run's validation
utterances (``--device``); exported unscored (``--no-score``, or no validation manifest), its card
says that its numbers are the newest checkpoint's alone. NeMo's ``save_to`` writes the .nemo; the
.nemo and its card appear together.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from process_control import UserError


class AveragingError(UserError):
    """Checkpoints that cannot be averaged (different models, too few)."""


def checkpoints_to_average(given: list[str], average: int) -> list[Path]:
    """The checkpoints to export, oldest first: ``given`` (paths, 'last' or 'best'), or with
    ``average`` N and one given checkpoint, the newest N step checkpoints up to and including it;
    'best' with ``average`` N: the N with the lowest validation WER."""
    import checkpoints

    if given == ["best"] and average > 1:
        return sorted(checkpoints.best_checkpoints(average, strict=True))
    paths = [checkpoints.resolve_model_path(g) for g in given]
    for path in paths:
        if path.suffix != ".ckpt":
            raise AveragingError(
                f"{path}: expected a .ckpt step checkpoint (a .nemo file needs no export)"
            )
    if average <= 1:
        return paths
    if len(paths) != 1:
        raise AveragingError(
            "--average N takes one checkpoint (the newest to include, or 'last'); to average a list, "
            "give the checkpoints without --average"
        )
    newest = paths[0]
    steps = [p for p in checkpoints.step_checkpoints(newest.parent) if p.name <= newest.name]
    if len(steps) < average:
        raise AveragingError(
            f"--average {average}: only {len(steps)} step checkpoint(s) up to {newest.name} in "
            f"{newest.parent}"
        )
    return steps[-average:]


def selection(given: list[str], paths: list[Path]) -> str:
    """How the exported checkpoint(s) were chosen, for the model card."""
    import checkpoints

    n = len(paths)
    if given == ["best"]:
        scores = checkpoints.read_run_record(paths[0].parent).get("validation", {})
        wers = ", ".join(
            f"{p.name}: {scores[str(checkpoints.checkpoint_number(p))]['wer']:.4f}" for p in paths
        )
        which = "the step checkpoint" if n == 1 else f"the {n} step checkpoints"
        return f"{which} with the lowest validation WER of the run (val/wer/all {wers})"
    if given == ["last"]:
        return "the newest step checkpoint" if n == 1 else f"the newest {n} step checkpoints"
    return "the step checkpoint(s) given by path"


def average_weights(paths: list[Path]) -> dict:
    """The mean of the model weights of ``paths`` (see the module doc); AveragingError when they do
    not hold the same tensors."""
    import torch

    import asr_model
    import checkpoints

    total: dict[str, torch.Tensor] = {}
    newest: dict[str, torch.Tensor] = {}
    for n, path in enumerate(paths):
        checkpoint = checkpoints.read_checkpoint(path, mmap=True)
        weights = asr_model.model_weights(checkpoint)
        if n and weights.keys() != total.keys():
            raise AveragingError(
                f"{path} holds other tensors than {paths[0]} "
                f"({sorted(weights.keys() ^ total.keys())[:3]}...): average checkpoints of one run"
            )
        for key, value in weights.items():
            if n and value.shape != total[key].shape:
                raise AveragingError(
                    f"{path}: {key} has shape {tuple(value.shape)}, {paths[0]} "
                    f"{tuple(total[key].shape)}: average checkpoints of one run"
                )
            if value.is_floating_point():
                total[key] = total[key] + value.double() if n else value.double()
            else:
                total[key] = value
            newest[key] = value
        del checkpoint, weights
    return {
        key: (total[key] / len(paths)).to(newest[key].dtype)
        if newest[key].is_floating_point()
        else newest[key].clone()
        for key in total
    }


class BlendError(UserError):
    """A blend with the base that cannot be made (no base, a base that does not fit)."""


# The parts of a recorded vocabulary change a blend depends on: which rows of the base's decoder and
# joint became which rows of the finetune's. Where the new pieces' biases started (new_piece_prior,
# NEW_PIECE_BIAS) is left out: a blend keeps those rows as finetuned.
BLEND_VOCABULARY_KEYS = ("carried", "new", "dropped", "decoder_init", "heads")


def recorded_base(record: dict, named: str | None = None) -> dict:
    """The base the run of ``record`` (a step checkpoint's run record) started from, as the run
    recorded it when it loaded the base (``asr_model.base_identity``): path, ``weights_sha256`` and
    the DECODER_INIT and NEW_PIECE_BIAS it was built with. A record from before bases were hashed
    gives its settings' INIT_MODEL and a ``weights_sha256`` of None. BlendError for a run from
    scratch, a run that did not carry the base's decoder, or (without ``named``, a base given by
    the user) a checkpoint that records no base."""
    settings = record.get("settings") or {}
    base = record.get("base_model") or {
        "path": settings.get("INIT_MODEL", ""),
        "weights_sha256": None,
        "DECODER_INIT": settings.get("DECODER_INIT", "carry"),
        # The only start new pieces had before NEW_PIECE_BIAS existed.
        "NEW_PIECE_BIAS": settings.get("NEW_PIECE_BIAS", "equal"),
    }
    if not settings and not record.get("base_model"):
        if not named:
            raise BlendError(
                "the checkpoint records no base model (it has no run record): give the model it "
                "was finetuned from with --base-model PATH"
            )
        return {**base, "path": ""}
    if not base["path"]:
        raise BlendError(
            "the run trained from scratch (its INIT_MODEL is empty): there is no base to blend with"
        )
    if base["DECODER_INIT"] != "carry":
        raise BlendError(
            f"the run started its decoder and joint afresh (DECODER_INIT="
            f"{base['DECODER_INIT']}): the base's are not the start of the finetuned ones, so "
            f"the two cannot be blended"
        )
    return base


def _hash_phrase(digest: str | None) -> str:
    return f"weights sha256 {digest}" if digest else "no weights hash recorded"


def base_as_received(
    record: dict,
    portable: dict | None,
    named: str | None = None,
    checkpoint: str = "the checkpoint",
):
    """The model the finetune of ``record`` (a step checkpoint's run record) started from: its
    recorded base (``recorded_base``), or ``named`` (--base-model: where that base is on this
    machine), through the vocabulary change the run made, with the settings the run built it with
    and the tokenizer files the checkpoint carries (``portable``; TOKENIZER_DIR for a checkpoint
    without them). The shell's INIT_MODEL plays no part. Its ``base_model`` names the model used
    (path and weights hash), its ``new_piece_rows`` are the rows of pieces that base lacked and
    ``base_languages`` the languages it was trained on (``model_languages.base_languages``, else
    the run's BASE_LANGUAGES setting; None when neither says).

    BlendError when the recorded base is not on this machine (without ``named``), when the model's
    weights hash differs from the recorded one (a model other than the run's base is never blended),
    or when its vocabulary change differs from the recorded one in what a blend depends on
    (``BLEND_VOCABULARY_KEYS``). A record without a weights hash is blended after a warning.
    A description naming anything outside its closed set (``asr_model.check_description``) is
    refused as ``checkpoint``'s before anything is written."""
    import shutil
    import tempfile

    import asr_model
    import config
    import model_languages

    recorded = recorded_base(record, named)
    source = named or recorded["path"]
    where_now = (
        f"the run's base {recorded['path']} ({_hash_phrase(recorded['weights_sha256'])})"
        if recorded["path"]
        else "the run's base"
    )
    if asr_model.is_local_model(source) and not Path(source).is_file():
        if named:
            raise BlendError(f"--base-model {named} does not exist: give the path of {where_now}")
        raise BlendError(
            f"{where_now} is not at that path on this machine: give where it is now with "
            f"--base-model PATH"
        )
    if portable is not None:  # what it may name is checked before anything is written
        asr_model.check_description(portable, checkpoint)
    tokenizer_dir = Path(tempfile.mkdtemp(prefix="blend-tokenizer-"))
    try:
        if portable is None:  # a checkpoint without its tokenizer: TOKENIZER_DIR as in training
            shutil.rmtree(tokenizer_dir)
            shutil.copytree(config.TOKENIZER_DIR, tokenizer_dir)
        else:
            asr_model.write_tokenizer_files(portable, tokenizer_dir)
        base = asr_model.build_model(
            source, None, tokenizer_dir, "carry", recorded["NEW_PIECE_BIAS"], adapter_dim=0
        )
    except asr_model.ModelNotFetched:
        raise BlendError(
            f"{f'--base-model {named}' if named else where_now} cannot be downloaded here: "
            f"download its .nemo where there is network and give it with --base-model PATH"
        ) from None
    except (FileNotFoundError, config.ConfigError) as exc:
        given = f"--base-model {named}" if named else where_now
        raise BlendError(
            f"{given} cannot be rebuilt ({exc}); give the run's base with --base-model PATH"
        ) from None
    else:
        # The base's own record, else what the run was told (its BASE_LANGUAGES setting).
        ran_with = tuple((record.get("settings") or {}).get("BASE_LANGUAGES") or ())
        base.base_languages = model_languages.base_languages(source) or ran_with or None
    finally:
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
    digest = base.base_model["weights_sha256"]
    if recorded["weights_sha256"] and digest != recorded["weights_sha256"]:
        if named:
            raise BlendError(
                f"--base-model {named} is not the base the run started from: its weights hash "
                f"{digest}, {where_now}; give a copy of that model"
            )
        raise BlendError(
            f"{source} is not the base the run started from: it holds other weights now "
            f"(sha256 {digest}) than when the run loaded it ({recorded['weights_sha256']}); give "
            f"the original with --base-model PATH"
        )
    if not recorded["weights_sha256"]:
        print(
            f"export_nemo: warning: the checkpoint records no weights hash of its base (written "
            f"before bases were hashed): {source} is taken for the run's base, checked only by "
            f"its vocabulary change",
            file=sys.stderr,
        )
    # The same tensors by name and shape are not enough: a base that is itself a finetune with this
    # tokenizer (its export, a later run) fits exactly, yet needs no vocabulary change on the way.
    made = {k: (base.vocabulary_change or {}).get(k) for k in BLEND_VOCABULARY_KEYS}
    change = record.get("vocabulary_change", base.vocabulary_change)
    wanted = {k: (change or {}).get(k) for k in BLEND_VOCABULARY_KEYS}
    if (change is None) != (base.vocabulary_change is None) or made != wanted:
        raise BlendError(
            f"{source} is not the base the run started from: the run changed its vocabulary by "
            f"{change}, this model by {base.vocabulary_change}; give the run's base with "
            f"--base-model PATH"
        )
    return base


def blend_weights(finetuned: dict, base, amount: float) -> dict:
    """(1 - amount) x ``finetuned`` + amount x ``base``'s weights, for every floating-point tensor
    of both; the rows of pieces ``base`` lacked (its ``new_piece_rows``) and integer buffers stay
    the finetuned ones. BlendError when the two are not the same model."""

    import asr_model

    base_state = base.state_dict()
    if base_state.keys() != finetuned.keys():
        raise BlendError(
            f"the base holds other tensors than the checkpoint "
            f"({sorted(base_state.keys() ^ finetuned.keys())[:3]}...): is it the run's base?"
        )
    names = {id(p): name for name, p in base.named_parameters()}
    new_rows = {names[id(p)]: rows for p, rows in asr_model.new_piece_parameters(base)}
    out = {}
    for key, value in finetuned.items():
        other = base_state[key]
        if other.shape != value.shape:
            raise BlendError(
                f"{key} has shape {tuple(value.shape)} in the checkpoint, {tuple(other.shape)} in "
                f"the base: is it the run's base?"
            )
        if not value.is_floating_point():
            out[key] = value.clone()
            continue
        mixed = ((1 - amount) * value.double() + amount * other.double()).to(value.dtype)
        if key in new_rows:
            mixed[new_rows[key]] = value[new_rows[key]]
        out[key] = mixed
    return out


def blend_sweep(
    model, weights: dict, base, amounts: list[float], manifest: Path, device: str = "cpu"
) -> list[dict]:
    """``weights`` (the finetuned ones) blended with ``base`` by each of ``amounts``, loaded in turn
    into ``model`` (the finetuned model, left holding the last blend) and scored on ``manifest``:
    [{"blend", "wer", "cer"}] per language and "all"; printed as a table with the base languages
    (``base.base_languages``) apart from the new ones, when they are known."""
    from scripts import evaluate

    rows = []
    for amount in amounts:
        model.load_state_dict(blend_weights(weights, base, amount))
        model.to(device)
        results = evaluate.evaluate(model, manifest, device=device, progress=False, decode="auto")[
            0
        ]
        model.to("cpu")
        rows.append(
            {
                "blend": amount,
                "wer": {lang: c.wer for lang, c in results.items()},
                "cer": {lang: c.cer for lang, c in results.items()},
            }
        )
    langs = sorted({lang for row in rows for lang in row["wer"]} - {"all"})
    known = base.base_languages
    base_langs = [lang for lang in langs if known and lang in known]
    new_langs = [lang for lang in langs if known is not None and lang not in known]

    def mean(row: dict, group: list[str]) -> float:
        values = [row[lang] for lang in group]
        return sum(values) / len(values) if values else float("nan")

    groups = (
        f"base languages {', '.join(base_langs) or 'none'}, new {', '.join(new_langs) or 'none'}"
        if known is not None
        else "the base records no languages: set BASE_LANGUAGES to see its own apart"
    )
    print(f"blends with the base, scored on {manifest} (WER; {groups}):")
    print(
        f"{'A':>5} "
        + " ".join(f"{lang:>6}" for lang in langs)
        + f" {'all':>6} {'base':>6} {'new':>6}"
    )
    for row in rows:
        print(
            f"{row['blend']:>5.2f} "
            + " ".join(f"{row['wer'][lang]:>6.3f}" for lang in langs)
            + f" {row['wer']['all']:>6.3f} {mean(row['wer'], base_langs):>6.3f}"
            f" {mean(row['wer'], new_langs):>6.3f}"
        )
    return rows


def best_single(paths: list[Path]) -> Path:
    """The single checkpoint an average of ``paths`` must beat: the run's lowest validation WER
    among the step checkpoints of their directory (run.json), else the newest of ``paths``."""
    import checkpoints

    best = checkpoints.best_checkpoints(1, paths[-1].parent)
    return best[0] if best else paths[-1]


def score_weights(model, manifest: Path, settings: dict, device: str) -> dict:
    """The validation of ``model``'s weights in the form the run's own takes (``last_evaluation``:
    greedy word and character edit counts per language and ``all``, the loss, the rows left out),
    scored at export on ``manifest`` over the utterances the run validated on (its recorded
    EVAL_SAMPLES_PER_LANG per language, drawn with its SEED; all of them for 0), in float32 on
    ``device``. The loss needs a parquet manifest (a NeMo JSON one is scored without it)."""
    import dataclasses

    import numpy as np

    import config
    import evaluation
    from scripts import evaluate

    dataset, texts, langs, note = evaluate.scoring_set(manifest, model.tokenizer, progress=False)
    # The dataset's own codes: the run's draw of EVAL_SAMPLES_PER_LANG depends on their order.
    codes = getattr(dataset, "lang_codes", None)
    with_loss = codes is not None
    if codes is None:
        names = sorted(set(langs))
        codes = np.array([names.index(x) for x in langs], dtype=np.int64)
    per_lang = int(settings.get("EVAL_SAMPLES_PER_LANG") or 0)
    seed = int(settings.get("SEED", config.SEED))
    indices = (
        evaluation.select_eval_indices(codes, per_lang, seed=seed)
        if per_lang > 0
        else np.arange(len(dataset))
    )
    model.to(device)
    try:
        decoded = evaluation.decode(
            model,
            dataset,
            indices,
            max_batch_seconds=float(settings.get("MAX_BATCH_DURATION") or 60.0),
            device=device,
            with_loss=with_loss,
        )
    finally:
        model.to("cpu")
    done = [i for i in sorted(decoded.texts) if decoded.texts[i] is not None]
    if not done:
        raise evaluate.NothingToScore(
            f"no utterance of {manifest} could be scored ({note}): check that its audio exists "
            f"(DATA_DIR / SHARDS_DIR), or give another --manifest"
        )
    results = evaluation.corpus_error_rates(
        [texts[i] for i in done], [decoded.texts[i] for i in done], [langs[i] for i in done]
    )
    return {
        "loss": decoded.loss if decoded.loss_utterances else None,
        "results": {lang: dataclasses.asdict(c) for lang, c in results.items()},
        "excluded": evaluation.describe_excluded(evaluation.excluded_rows(dataset)),
        "scoring": evaluation.NORMALIZED_SCORING,
        "scored_at_export": True,
        "manifest": str(manifest),
    }


def validation_wer(evaluation: dict) -> float:
    """The ``all`` WER of a ``score_weights`` result."""
    counts = evaluation["results"]["all"]
    return counts["word_edits"] / counts["words"] if counts.get("words") else float("nan")


def main(argv: list[str] | None = None) -> int:
    import config

    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=config.help_epilog("export_nemo"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint",
        nargs="+",
        help="step_*.ckpt written by train.py, 'last' (newest) or 'best' (lowest validation WER); "
        "several: export their average",
    )
    parser.add_argument(
        "--average",
        type=int,
        default=1,
        metavar="N",
        help="average the newest N step checkpoints up to the one given, or with 'best' the N "
        "with the lowest validation WER (default 1: no averaging)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the .nemo path (default: the newest checkpoint's, .nemo; .avgN.nemo when averaging)",
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="the validation set an average or a blend is scored on (default: the run's "
        "VAL_MANIFEST_PATH, as its checkpoint records it)",
    )
    parser.add_argument(
        "--no-compare",
        action="store_true",
        help="keep the average without scoring it against the best single checkpoint (it is "
        "still scored for its model card)",
    )
    parser.add_argument(
        "--no-score",
        action="store_true",
        help="score nothing: an average is kept unscored, and the card of an average or a blend "
        "says that its numbers are those of the newest checkpoint alone",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="where averages and blends are scored: cpu or cuda (default cuda when available)",
    )
    parser.add_argument(
        "--blend-base",
        type=float,
        default=0.0,
        metavar="A",
        help="export (1 - A) x the finetuned weights + A x the base's (the run's recorded base as "
        "the run received it), A in [0, 1); default 0: the finetune as it is",
    )
    parser.add_argument(
        "--blend-sweep",
        default="",
        metavar="A,A,...",
        help="score each blend with the base on the validation set (--manifest) per language and "
        "print the table; exports nothing",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        metavar="PATH",
        help="where the run's base is on this machine, for --blend-base and --blend-sweep "
        "(default: the path the run recorded; its weights must hash as the run recorded)",
    )
    parser.add_argument(
        "--sweep-json", type=Path, default=None, help="also write --blend-sweep's scores here"
    )
    args = parser.parse_args(argv)
    try:
        sweep = [float(a) for a in args.blend_sweep.split(",") if a.strip()]
    except ValueError:
        parser.error(f"--blend-sweep {args.blend_sweep!r}: expected numbers such as 0,0.1,0.2")
    if any(not 0 <= a < 1 for a in [*sweep, args.blend_base]):
        parser.error("--blend-base and --blend-sweep take values A with 0 <= A < 1")
    if args.base_model and not (sweep or args.blend_base):
        parser.error("--base-model names the base of --blend-base or --blend-sweep")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import torch

    import asr_model
    import base_adapters
    import checkpoints
    import model_card
    import training_step

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        paths = checkpoints_to_average(args.checkpoint, args.average)
        newest = paths[-1]
        suffix = f".avg{len(paths)}.nemo" if len(paths) > 1 else ".nemo"
        out = args.out or newest.with_name(newest.stem + suffix)
        if out.suffix != ".nemo":
            raise AveragingError(f"--out {out}: expected a path ending in .nemo")
        weights = average_weights(paths) if len(paths) > 1 else None
        model = asr_model.load_trained_model(newest, "cpu", weights=weights)
        newest_checkpoint = checkpoints.read_checkpoint(newest, mmap=True)
        record = newest_checkpoint.get(training_step.RUN_RECORD_KEY, {})
    except UserError as exc:
        print(f"export_nemo: error: {exc}", file=sys.stderr)
        return 2
    selected = selection(args.checkpoint, paths)
    settings = record.get("settings") or {}
    run_validation = settings.get("VAL_MANIFEST_PATH") or config.VAL_MANIFEST_PATH
    manifest = Path(args.manifest or run_validation)
    if sweep or args.blend_base:
        try:
            if base_adapters.record_of(model) is not None:
                raise BlendError(
                    f"{newest} is a frozen-base model (BASE_ADAPTER_DIM): it decodes its base's "
                    f"languages as the base already and holds every base weight as it was, so a "
                    f"blend has nothing to add; export it without --blend-base / --blend-sweep"
                )
            base = base_as_received(
                record, newest_checkpoint.get(asr_model.PORTABLE_KEY), args.base_model, str(newest)
            )
            finetuned = weights or asr_model.model_weights(newest_checkpoint)
            if sweep:
                if not manifest.is_file():
                    raise BlendError(
                        f"--blend-sweep scores on {manifest}, which does not exist: give --manifest"
                    )
                rows = blend_sweep(model, finetuned, base, sweep, manifest, device)
                if args.sweep_json:
                    args.sweep_json.write_text(json.dumps(rows, indent=1) + "\n")
                return 0
            model.load_state_dict(blend_weights(finetuned, base, args.blend_base))
        except UserError as exc:
            print(f"export_nemo: error: {exc}", file=sys.stderr)
            return 2
        if args.out is None:
            out = out.with_name(out.name.removesuffix(".nemo") + f".blend{args.blend_base:g}.nemo")
        blended = base.base_model
        selected += (
            f", blended with its base: {1 - args.blend_base:g} x finetuned + "
            f"{args.blend_base:g} x {blended['path']} (weights sha256 {blended['weights_sha256']})"
        )
        record = {
            **record,
            "blend": {
                "amount": args.blend_base,
                "path": blended["path"],
                "weights_sha256": blended["weights_sha256"],
            },
        }
    # The card's numbers must be those of the weights in the .nemo: a blend or an average is not
    # the checkpoint whose validation its record carries, so it is scored here.
    what = "blend" if args.blend_base else "average" if len(paths) > 1 else None
    evaluation = None
    if what and not args.no_score:
        if not manifest.is_file():
            print(
                f"export_nemo: warning: no validation manifest at {manifest}: the {what} is "
                f"exported unscored (give --manifest to score it"
                + (
                    " and keep it only when it beats the best single checkpoint"
                    if what == "average" and not args.no_compare
                    else ""
                )
                + "); its card says that its numbers are those of "
                f"{newest.name} alone",
                file=sys.stderr,
            )
        else:
            try:
                evaluation = score_weights(model, manifest, settings, device)
                loss = evaluation["loss"]
                print(
                    f"scored on {manifest}: the {what} WER {validation_wer(evaluation):.4f}"
                    + (f", loss {loss:.4f}" if loss is not None else "")
                )
                # A blend is of the average itself: scoring it against a single unblended
                # checkpoint would compare two different choices.
                if what == "average" and not args.no_compare:
                    single = best_single(paths)
                    single_model = asr_model.load_trained_model(single, "cpu")
                    single_evaluation = score_weights(single_model, manifest, settings, device)
            except UserError as exc:
                print(f"export_nemo: error: scoring on {manifest}: {exc}", file=sys.stderr)
                return 2
            if what == "average" and not args.no_compare:
                average_wer = validation_wer(evaluation)
                single_wer = validation_wer(single_evaluation)
                print(
                    f"scored on {manifest}: the mean of {len(paths)} WER {average_wer:.4f}, the "
                    f"best single checkpoint {single.name} WER {single_wer:.4f}"
                )
                scores = (
                    f"validation WER {average_wer:.4f} for the mean of {len(paths)}, "
                    f"{single_wer:.4f} for {single.name}"
                )
                if average_wer < single_wer:
                    selected += f"; kept over the best single checkpoint ({scores})"
                    print(f"keeping the average: it beats {single.name}")
                else:
                    print(f"keeping {single.name}: the average of {len(paths)} does not beat it")
                    selected = (
                        f"{single.name}, the best single checkpoint, kept over the mean of "
                        f"{len(paths)} ({scores})"
                    )
                    model, paths, newest = single_model, [single], single
                    evaluation = single_evaluation
                    record = checkpoints.read_checkpoint(single, mmap=True).get(
                        training_step.RUN_RECORD_KEY, {}
                    )
                    out = args.out or single.with_suffix(".nemo")
    if evaluation is not None:
        record = {**record, "evaluation": {**evaluation, "step": record.get("step")}}
        if not _same_file(manifest, run_validation):
            # The run's step-0 validation of its base was on other utterances: no comparison.
            record = {**record, "base_evaluation": None}
    elif what:
        steps = (["averaging"] if len(paths) > 1 else []) + (
            ["blending"] if args.blend_base else []
        )
        record = {**record, "evaluation_of": f"{newest.name} alone, before {' and '.join(steps)}"}
    if len(paths) > 1:
        record = {**record, "averaged": [p.name for p in paths]}
    record = {**record, "selected": selected}
    model_card.export_nemo(model, out, record)
    what = f"the mean of {', '.join(p.name for p in paths)}" if len(paths) > 1 else str(newest)
    print(f"exported {what} -> {out} (and {out.name.removesuffix('.nemo')}.model-card.md)")
    return 0


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
