"""Kaldi data directories: wav.scp and text, with segments, utt2spk, utt2lang and utt2dur where
present."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from manifest_schema import ManifestError, text_start
from source_readers.standard_rows import (
    ROW_SCHEMA,
    RowIds,
    Shard,
    SourceRows,
    SourceSpec,
    _bad,
    _check_audio,
    _cut_recording,
    _file_name,
    _groups_by_directory,
    _in_processes,
    _strip_tags,
    _valid_segment,
    origin_order,
)


def _kaldi_lines(path: Path, undecodable: list) -> Iterator[tuple[int, str, str]]:
    """``(line number, key, rest of the line)`` of a Kaldi table file, fields split on any
    whitespace (Kaldi's tables take spaces and tabs alike), a byte-order mark read through. A line
    that is not UTF-8 goes into ``undecodable`` as ``(key, "file:line", why)``, its key read with
    surrogate escapes so that it still matches the same bytes in the other files."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1:
                raw = raw[text_start(path, raw[:4]) :]
            parts = raw.split(maxsplit=1)
            if not parts:
                continue
            try:
                key = parts[0].decode("utf-8")
                rest = parts[1].decode("utf-8").strip() if len(parts) > 1 else ""
            except UnicodeDecodeError as exc:
                key = parts[0].decode("utf-8", "surrogateescape")
                why = f"not UTF-8 ({exc.reason}, byte {exc.object[exc.start : exc.start + 1]!r})"
                undecodable.append(
                    (key, f"{path}:{number}", f"{why}: re-encode {path.name} as UTF-8")
                )
                continue
            yield number, key, rest


def _kaldi_table(
    path: Path, required: bool, undecodable: dict[str, tuple[str, str]]
) -> dict[str, tuple[str, int]]:
    """``key -> (rest of the line, line number)`` of a Kaldi table file (``key value...``); the
    keys of its lines that are not UTF-8 go into ``undecodable`` as ``key -> (file:line, why)``."""
    if not path.is_file():
        if required:
            raise ManifestError(f"{path} not found: a Kaldi data directory needs wav.scp and text")
        return {}
    lost: list = []
    table = {key: (rest, number) for number, key, rest in _kaldi_lines(path, lost)}
    for key, origin, why in lost:
        undecodable.setdefault(key, (origin, why))
    return table


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if np.isfinite(value) and value > 0 else None


def read_kaldi(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> SourceRows:
    """A Kaldi data directory: ``wav.scp`` (recording -> audio file; a command ending in "|" is not
    run: convert those first) and ``text``; optional ``segments`` (cut out once as FLAC),
    ``utt2spk``, ``utt2lang`` and ``utt2dur`` (a value that is not a positive number is ignored:
    the audio header gives the duration). Fields are separated by any whitespace. A line that is
    not UTF-8 makes the utterances it speaks of bad rows (``not_utf8``) with its file and line."""
    directory = spec.path
    segments_path = directory / "segments"
    segmented = segments_path.is_file()
    bad_recordings: dict[str, tuple[str, str]] = {}
    bad_utts: dict[str, tuple[str, str]] = {}
    wav = _kaldi_table(directory / "wav.scp", True, bad_recordings)
    texts = _kaldi_table(directory / "text", True, bad_utts)
    speakers = _kaldi_table(directory / "utt2spk", False, bad_utts)
    langs = _kaldi_table(directory / "utt2lang", False, bad_utts)
    durs = _kaldi_table(directory / "utt2dur", False, bad_utts)
    fixed = spec.options.get("lang")
    bad: list[dict] = []

    def lang_of(utt: str) -> str | None:
        return fixed or langs.get(utt, (None,))[0]

    utterances = []  # (utt, recording, start, end, line, origin)
    if segmented:
        listing: list = []
        for number, utt, rest in _kaldi_lines(segments_path, listing):
            origin = f"{segments_path}:{number}"
            parts = rest.split()
            try:
                recording, start, end = parts[0], float(parts[1]), float(parts[2])
            except (IndexError, ValueError):
                bad.append(_bad(origin, "audio_path_missing", f"{utt} {rest}"))
                continue
            problem = _valid_segment(start, None if end < 0 else end)
            if problem is not None:
                bad.append(_bad(origin, "segment_invalid", problem, lang_of(utt)))
                continue
            utterances.append((utt, recording, start, end, number, origin))
    else:
        listing = [(r, origin, why) for r, (origin, why) in bad_recordings.items()]
        bad_recordings = {}
        utterances = [
            (r, r, 0.0, -1.0, n, f"{directory / 'wav.scp'}:{n}") for r, (_, n) in wav.items()
        ]
    bad += [_bad(origin, "not_utf8", why) for _, origin, why in listing]
    kept, by_recording = [], {}
    for utt, recording, start, end, line, origin in utterances:
        undecodable = bad_utts.get(utt) or bad_recordings.get(recording)
        if undecodable is not None:
            bad.append(_bad(undecodable[0], "not_utf8", undecodable[1], lang_of(utt)))
        elif recording not in wav:
            bad.append(
                _bad(
                    origin, "audio_not_found", f"recording {recording} not in wav.scp", lang_of(utt)
                )
            )
        elif wav[recording][0].endswith("|"):
            bad.append(
                _bad(
                    origin,
                    "audio_command",
                    f"{recording}: wav.scp runs a command; write the "
                    f"audio to files first (e.g. wav-copy, sox)",
                    lang_of(utt),
                )
            )
        elif utt not in texts:
            bad.append(
                _bad(
                    origin, "transcript_missing", f"{utt} not in {directory / 'text'}", lang_of(utt)
                )
            )
        else:
            kept.append((utt, recording, start, end, line, origin))
            by_recording.setdefault(recording, []).append((utt, start, end))
    segment_ids = RowIds(spec.name).assign(
        pl.Series([u for u, *_ in kept], dtype=pl.String),
        pl.Series([line for *_, line, _ in kept], dtype=pl.UInt32),
    )

    def resolve(recording: str) -> str:
        audio = Path(wav[recording][0])
        return str(audio if audio.is_absolute() else (directory / audio).absolute())

    records: dict[str, dict] = {}
    if segmented:
        recordings = sorted(by_recording)
        folders = {r: str(out_dir / _file_name(r)) for r in recordings}
        tasks = [(resolve(r), folders[r], by_recording[r]) for r in recordings]
        from tqdm import tqdm

        with tqdm(
            total=len(tasks),
            desc=f"cutting {spec.name} segments",
            unit="recording",
            disable=not progress,
        ) as bar:
            for recording, record in zip(recordings, _in_processes(_cut_recording, tasks, workers)):
                records[recording] = record
                bar.update(1)
        shards = [
            Shard(f"{spec.name}/{r}", spec.name, "", Path(folders[r]), False) for r in recordings
        ]
        position = {r: k for k, r in enumerate(recordings)}
        rows = []
        for (utt, recording, start, end, line, origin), segment_id in zip(kept, segment_ids):
            record = records[recording]
            if "error" in record:
                bad.append(_bad(origin, record["error"], record["detail"], lang_of(utt)))
            elif utt in record["bad"]:
                bad.append(_bad(origin, "segment_past_end", record["bad"][utt], lang_of(utt)))
            else:
                rows.append(
                    (
                        position[recording],
                        segment_id,
                        texts[utt][0],
                        lang_of(utt),
                        speakers.get(utt, (None,))[0],
                        record["seconds"][utt],
                        None,
                        record["files"][utt],
                        origin,
                    )
                )
        frame = pl.DataFrame(rows, schema=ROW_SCHEMA, orient="row")
    else:
        paths = pl.Series([resolve(r) for r, *_ in kept], dtype=pl.String)
        given = pl.Series(
            [_seconds(durs[u][0]) if u in durs else None for u, *_ in kept], dtype=pl.Float64
        )
        origins = [o for *_, o in kept]
        seconds, keep, audio_bad = _check_audio(
            paths,
            given,
            lambda i: origins[i],
            pl.Series([lang_of(u) for u, *_ in kept], dtype=pl.String),
            spec.options.get("check", "header"),
            workers,
        )
        bad += audio_bad
        shard, names, shards = _groups_by_directory(paths, spec.name, "", False, directory)
        frame = pl.DataFrame(
            {
                "shard": shard,
                "segment_id": segment_ids,
                "transcription_native": [texts[u][0] for u, *_ in kept],
                "segment_language": [lang_of(u) for u, *_ in kept],
                "speaker_id": [speakers.get(u, (None,))[0] for u, *_ in kept],
                "duration_s": seconds,
                "tx_quality_score": pl.Series([None] * len(kept), dtype=pl.Float64),
                "tar_member_name": names,
                "origin": origins,
            },
            schema=ROW_SCHEMA,
        ).filter(pl.Series(keep))
    frame = frame.with_columns(
        pl.col("transcription_native").map_batches(_strip_tags, return_dtype=pl.String)
    )
    bad.sort(key=lambda b: origin_order(b["origin"]))
    return SourceRows(frame, shards, bad)
