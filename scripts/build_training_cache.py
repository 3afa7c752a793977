"""Build the training caches of the train and validation manifests, so train.py starts by mapping them.

Usage:
    python scripts/build_training_cache.py --help
    python scripts/build_training_cache.py                  # TRAIN_ and VAL_MANIFEST_PATH, TOKENIZER_DIR
    CACHE_DIR=/scratch/cache CACHE_BUILD_WORKERS=32 python scripts/build_training_cache.py
    python scripts/build_training_cache.py --manifest data/extra.parquet

Runs after scripts/train_tokenizer.py and before train.py. A training cache (training_cache.py) holds
what the dataset reads per utterance: durations, language, shard and directory codes, member names
and the transcripts' token ids, with the rows whose tokens do not fit their encoder frames already
dropped. It is keyed by the manifest's content, the tokenizer, ENCODER_FRAME_SECONDS and
MAX_TOKEN_LEN: rerunning this step with nothing changed maps the existing cache and returns at once,
and train.py finds the same cache. Without this step train.py builds the caches itself at start-up
(the same builder, the same parallelism); the ranks wait on a file lock, not on a collective.

Reads: TRAIN_MANIFEST_PATH, VAL_MANIFEST_PATH, TOKENIZER_DIR, ENCODER_FRAME_SECONDS, MAX_TOKEN_LEN,
CACHE_DIR, CACHE_BUILD_WORKERS (config.py). Prints per manifest: rows read, kept and dropped per
reason and language, the file listing every dropped row (the cache's dropped_rows.parquet, which
scripts/manifest_report.py shows), the cache's path and size, the build time, and the superseded
caches it removed or kept. For VAL_MANIFEST_PATH, one WARNING line per language that loses more
than a tenth of its rows, saying what to change.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import config
import training_cache
from manifest_schema import ManifestError, check_same_split

log = logging.getLogger("build_training_cache")


def load_tokenizer(tokenizer_dir: Path):
    """The tokenizer train.py gives the model: NeMo's SentencePieceTokenizer of TOKENIZER_DIR."""
    model = Path(tokenizer_dir) / "tokenizer.model"
    if not model.is_file():
        raise training_cache.CacheError(
            f"TOKENIZER_DIR={tokenizer_dir} has no tokenizer.model; run scripts/train_tokenizer.py "
            f"first or point TOKENIZER_DIR at a trained tokenizer"
        )
    import asr_model

    asr_model.quiet_harmless_messages()  # before NeMo's import prints its telemetry notes
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    return SentencePieceTokenizer(str(model))


def build_caches(manifests: list[Path], tokenizer, *, workers: int, progress: bool = True) -> list:
    """``training_cache.ensure`` for every manifest, in order; the list of CacheInfo."""
    return [
        training_cache.ensure(
            manifest,
            tokenizer,
            frame_seconds=config.ENCODER_FRAME_SECONDS,
            max_token_len=config.MAX_TOKEN_LEN,
            cache_dir=config.CACHE_DIR,
            workers=workers,
            progress=progress,
        )
        for manifest in manifests
    ]


def format_summary(manifest: Path, info: training_cache.CacheInfo) -> str:
    """What the build of ``manifest`` did, and a WARNING line per language of the validation
    manifest (VAL_MANIFEST_PATH) that loses more than ``VALIDATION_DROP_WARN_SHARE`` of its rows."""
    s = info.summary
    size = training_cache.directory_size(info.path)
    dropped = ", ".join(f"{n} {reason}" for reason, n in s["dropped"].items())
    how = (
        f"built in {s['build_seconds']:.1f} s by {s['build_workers']} worker(s)"
        if info.built
        else "already built: mapped"
    )
    lines = [
        f"{manifest}: {s['rows_read']} rows read, {s['rows_kept']} kept, dropped {dropped}; "
        f"{s['truncated_to_max_token_len']} truncated to {s['max_token_len']} tokens",
        f"  cache {info.path} ({size / 2**20:.1f} MiB), {how}",
    ]
    record = info.path / training_cache.DROPPED_FILE
    if any(s["dropped"].values()):
        by_lang = "; ".join(
            f"{lang} " + ", ".join(f"{n} {reason}" for reason, n in by_reason.items())
            for lang, by_reason in s["dropped_by_lang"].items()
        )
        lines.append(f"  dropped per language: {by_lang}; every dropped row is listed in {record}")
    if _is_validation(manifest):
        lines += [
            "  " + training_cache.validation_drop_warning(manifest, heavy, s, record)
            for heavy in training_cache.heavy_drops(s)
        ]
    lines += [f"  removed superseded {p} ({n / 2**20:.1f} MiB)" for p, n in info.removed]
    lines += [f"  kept {p} ({n / 2**20:.1f} MiB): {why}" for p, n, why in info.kept_others]
    return "\n".join(lines)


def _is_validation(manifest: Path) -> bool:
    return Path(manifest).resolve() == Path(config.VAL_MANIFEST_PATH).resolve()


def main(argv: list[str] | None = None) -> int:
    epilog = config.help_epilog("build_cache")
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        action="append",
        help="a manifest to cache (repeatable; default TRAIN_MANIFEST_PATH, and VAL_MANIFEST_PATH "
        "when it exists)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizing processes (default CACHE_BUILD_WORKERS; 0: every usable core)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    manifests = args.manifest or [config.TRAIN_MANIFEST_PATH] + (
        [config.VAL_MANIFEST_PATH] if Path(config.VAL_MANIFEST_PATH).is_file() else []
    )
    workers = config.CACHE_BUILD_WORKERS if args.workers is None else args.workers
    try:
        if len(manifests) == 2 and all(Path(m).is_file() for m in manifests):
            check_same_split(*manifests)
        tokenizer = load_tokenizer(config.TOKENIZER_DIR)
        infos = build_caches(manifests, tokenizer, workers=workers)
    except (training_cache.CacheError, ManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for manifest, info in zip(manifests, infos):
        print(format_summary(manifest, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
