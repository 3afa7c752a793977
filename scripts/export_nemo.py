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
VAL_MANIFEST_PATH), their WER is printed, and the better one is exported, the single checkpoint on a
tie; the model card says which was kept and both scores. Without a validation manifest the average is
exported unscored, with a warning; ``--no-compare`` skips the comparison.

The model card (``<name>.model-card.md``: base model, hours per language, tokenizer, settings, the
newest validation WER/CER) comes from the newest checkpoint's run record; it names the averaged
checkpoints. NeMo's ``save_to`` writes the .nemo; the .nemo and its card appear together.
"""

from __future__ import annotations

import argparse
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


def best_single(paths: list[Path]) -> Path:
    """The single checkpoint an average of ``paths`` must beat: the run's lowest validation WER
    among the step checkpoints of their directory (run.json), else the newest of ``paths``."""
    import checkpoints

    best = checkpoints.best_checkpoints(1, paths[-1].parent)
    return best[0] if best else paths[-1]


def validation_wer(model, manifest: Path, device: str) -> float:
    """The model's greedy WER over every utterance of ``manifest`` (the ``all`` row of evaluate.py)."""
    from scripts import evaluate

    results, _, _ = evaluate.evaluate(model, manifest, device=device, progress=False)
    return results["all"].wer


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
        help="the validation set an average is scored on against the best single checkpoint "
        "(default VAL_MANIFEST_PATH)",
    )
    parser.add_argument(
        "--no-compare",
        action="store_true",
        help="export the average without scoring it against the best single checkpoint",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import asr_model
    import checkpoints
    import model_card
    import training_step

    try:
        paths = checkpoints_to_average(args.checkpoint, args.average)
        newest = paths[-1]
        suffix = f".avg{len(paths)}.nemo" if len(paths) > 1 else ".nemo"
        out = args.out or newest.with_name(newest.stem + suffix)
        if out.suffix != ".nemo":
            raise AveragingError(f"--out {out}: expected a path ending in .nemo")
        weights = average_weights(paths) if len(paths) > 1 else None
        model = asr_model.load_trained_model(newest, "cpu", weights=weights)
        record = checkpoints.read_checkpoint(newest, mmap=True).get(
            training_step.RUN_RECORD_KEY, {}
        )
    except UserError as exc:
        print(f"export_nemo: error: {exc}", file=sys.stderr)
        return 2
    selected = selection(args.checkpoint, paths)
    manifest = Path(args.manifest or config.VAL_MANIFEST_PATH)
    if len(paths) > 1 and not args.no_compare:
        if not manifest.is_file():
            print(
                f"export_nemo: warning: no validation manifest at {manifest}: the average is "
                f"exported unscored (give --manifest to keep it only when it beats the best single "
                f"checkpoint, or --no-compare)",
                file=sys.stderr,
            )
        else:
            single = best_single(paths)
            try:
                single_model = asr_model.load_trained_model(single, "cpu")
                average_wer = validation_wer(model, manifest, "cpu")
                single_wer = validation_wer(single_model, manifest, "cpu")
            except UserError as exc:
                print(f"export_nemo: error: scoring on {manifest}: {exc}", file=sys.stderr)
                return 2
            print(
                f"scored on {manifest}: the mean of {len(paths)} WER {average_wer:.4f}, the best "
                f"single checkpoint {single.name} WER {single_wer:.4f}"
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
                record = checkpoints.read_checkpoint(single, mmap=True).get(
                    training_step.RUN_RECORD_KEY, {}
                )
                out = args.out or single.with_suffix(".nemo")
    if len(paths) > 1:
        record = {**record, "averaged": [p.name for p in paths]}
    record = {**record, "selected": selected}
    model_card.export_nemo(model, out, record)
    what = f"the mean of {', '.join(p.name for p in paths)}" if len(paths) > 1 else str(newest)
    print(f"exported {what} -> {out} (and {out.name.removesuffix('.nemo')}.model-card.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
