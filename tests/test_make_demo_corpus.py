"""scripts/make_demo_corpus.py: the demo's shard tree, its speech, its planted defects, and its reuse."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf

import config
from scripts import make_demo_corpus as mdc

REPO = Path(__file__).resolve().parents[1]

# The largest language takes five defects and the second two, so they need a few rows more.
TINY = {"hi": 6, "en": 3, "ta": 2, "te": 2, "kn": 2, "ml": 2, "bn": 2}
SCRIPT_BLOCKS = {
    "hi": (0x0900, 0x097F),
    "bn": (0x0980, 0x09FF),
    "ta": (0x0B80, 0x0BFF),
    "te": (0x0C00, 0x0C7F),
    "kn": (0x0C80, 0x0CFF),
    "ml": (0x0D00, 0x0D7F),
    "en": (0x41, 0x7A),
    "ur": (0x0600, 0x06FF),
}


def read_shards(root: Path) -> dict[str, dict]:
    """shard_id -> {"meta": rows, "index": rows, "members": {name: bytes}}."""
    shards = {}
    for meta_path in sorted(root.glob("*/*/*/metadata.parquet")):
        shard_dir = meta_path.parent
        with tarfile.open(shard_dir / "audio.tar") as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        shards[str(shard_dir.relative_to(root))] = {
            "meta": pq.read_table(meta_path).to_pylist(),
            "index": pq.read_table(shard_dir / "audio_index.parquet").to_pylist(),
            "members": members,
        }
    return shards


def high_band_share(flac: bytes) -> float:
    """Share of spectral energy above 3 kHz: speech has fricatives there, the tones have none."""
    signal, rate = sf.read(io.BytesIO(flac), dtype="float32")
    power = np.abs(np.fft.rfft(signal)) ** 2
    return float(power[np.fft.rfftfreq(signal.size, 1 / rate) > 3000].sum() / power.sum())


def defect_rows(marker: dict, name: str) -> list[dict]:
    return [d for d in marker["summary"]["defects"] if d["defect"] == name]


@pytest.fixture(scope="module")
def tones_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus") / "shards"
    marker = mdc.build_corpus(root, TINY, seed=7, shard_size=2, engine="tones", progress=False)
    return root, marker, read_shards(root)


def test_every_language_is_written_in_the_input_layout(tones_corpus):
    root, _, shards = tones_corpus
    langs = {shard_id.split("/")[1] for shard_id in shards}
    assert langs == set(TINY)
    for shard_id, shard in shards.items():
        source, lang, name = shard_id.split("/")
        assert source in mdc.SOURCES and name.startswith("shard_")
        meta = pq.read_table(root / shard_id / "metadata.parquet")
        assert meta.column_names == [
            "segment_id",
            "transcription_native",
            "duration_s",
            "tx_quality_score",
            "segment_language",
            "speaker_id",
        ]
        assert str(meta.schema.field("duration_s").type) == "double"
        assert str(meta.schema.field("tx_quality_score").type) == "double"
        # Every indexed member is in the tar, and every member is indexed.
        assert {r["tar_member_name"] for r in shard["index"]} == set(shard["members"])


def test_metadata_duration_is_the_decoded_audio_length(tones_corpus):
    _, marker, shards = tones_corpus
    corrupt = {d["segment_id"] for d in defect_rows(marker, "corrupt_flac")}
    checked = 0
    for shard in shards.values():
        member_of = {r["segment_id"]: r["tar_member_name"] for r in shard["index"]}
        for row in shard["meta"]:
            if row["segment_id"] in corrupt:
                continue
            info = sf.info(io.BytesIO(shard["members"][member_of[row["segment_id"]]]))
            assert info.samplerate == 16000 and info.channels == 1
            assert info.frames / info.samplerate == pytest.approx(row["duration_s"], abs=1e-6)
            checked += 1
    assert checked >= sum(TINY.values())


def test_forced_tones_engine_writes_tones_not_speech(tones_corpus):
    _, marker, shards = tones_corpus
    assert marker["summary"]["engine"] == "tones"
    some_member = next(iter(shards["news/en/shard_0000"]["members"].values()))
    assert high_band_share(some_member) < 0.002


def test_auto_engine_speaks_with_espeak_when_installed_else_falls_back_to_tones_with_a_warning(
    tmp_path,
):
    # `make test` installs espeak-ng so that the speech branch runs in CI; without it this checks the fallback.
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_demo_corpus.py"),
            "--out",
            str(tmp_path / "shards"),
            "--sizes",
            "en=2,hi=2",
            "--no-install",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    marker = json.loads((tmp_path / "shards" / mdc.MARKER_NAME).read_text())
    planted = {f"{d['segment_id']}.flac" for d in marker["summary"]["defects"]}
    plain = [
        flac
        for shard in read_shards(tmp_path / "shards").values()
        for name, flac in shard["members"].items()
        if name not in planted
    ]
    assert plain
    if shutil.which("espeak-ng"):
        assert marker["summary"]["engine"] == "espeak"
        assert min(high_band_share(flac) for flac in plain) > 0.005  # fricatives: real speech
    else:
        assert marker["summary"]["engine"] == "tones"
        assert "WARNING" in done.stderr and "apt-get install espeak-ng" in done.stderr


def test_auto_engine_without_espeak_warns_loudly_and_uses_tones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mdc.shutil, "which", lambda name: None)
    marker = mdc.build_corpus(
        tmp_path / "shards", {"en": 1}, engine="auto", allow_install=False, progress=False
    )
    assert marker["summary"]["engine"] == "tones"
    err = capsys.readouterr().err
    assert "WARNING" in err and "SYNTHETIC TONES" in err and "apt-get install espeak-ng" in err


def test_a_failed_install_attempt_falls_back_to_tones_and_names_the_command(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(mdc.shutil, "which", lambda name: None)
    monkeypatch.setattr(mdc, "_install_command", lambda: [["sh", "-c", "exit 3"]])
    marker = mdc.build_corpus(
        tmp_path / "shards", {"en": 1}, engine="auto", allow_install=True, progress=False
    )
    err = capsys.readouterr().err
    assert marker["summary"]["engine"] == "tones"
    assert "running: sh -c exit 3" in err and "exit 3" in err and "SYNTHETIC TONES" in err


def test_as_root_with_apt_the_install_command_is_apt_get_install(monkeypatch):
    monkeypatch.setattr(mdc.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        mdc.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "apt-get" else None
    )
    commands = mdc._install_command()
    assert commands[0] == ["apt-get", "install", "-y", "-q", "espeak-ng"]
    assert ["apt-get", "update", "-q"] in commands  # retried after an index update


def test_without_root_sudo_or_brew_nothing_is_installed(monkeypatch):
    monkeypatch.setattr(mdc.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(mdc.shutil, "which", lambda name: None)
    assert mdc._install_command() is None


def test_a_language_without_an_espeak_voice_is_named(monkeypatch):
    listing = (
        "Pty Language Age/Gender VoiceName File Other Languages\n"
        " 5  hi  --/M  Hindi  inc/hi\n 2  en-us  --/M  English_(America)  gmw/en-US\n"
    )
    monkeypatch.setattr(
        mdc.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, "")
    )
    assert mdc.missing_voices(["hi", "en", "kn"]) == ["en-gb", "kn"]


def test_install_espeak_only_reports_and_exits_1_when_it_cannot_be_had(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(mdc.shutil, "which", lambda name: None)
    monkeypatch.chdir(tmp_path)
    assert mdc.main(["--install-espeak", "--no-install"]) == 1
    assert "apt-get install espeak-ng" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # built nothing


def test_engine_espeak_fails_with_install_hint_when_espeak_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(mdc.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng"):
        mdc.build_corpus(
            tmp_path / "shards", {"en": 1}, engine="espeak", allow_install=False, progress=False
        )
    assert not (tmp_path / "shards").exists()


def test_sizes_are_skewed_over_english_and_at_least_four_indic_scripts():
    sizes = mdc.DEFAULT_SIZES
    indic = [lang for lang in sizes if lang != "en"]
    assert len(sizes) >= 6 and "en" in sizes and len(indic) >= 4
    assert len({SCRIPT_BLOCKS[lang] for lang in indic}) >= 4
    ordered = sorted(sizes.values(), reverse=True)
    assert ordered[0] >= 2 * ordered[1] and ordered[0] >= 8 * ordered[-1]


@pytest.mark.parametrize("lang", sorted(mdc.SENTENCES))
def test_sentences_are_written_in_their_own_script_and_nfc(lang):
    low, high = SCRIPT_BLOCKS[lang]
    for sentence in mdc.SENTENCES[lang]:
        assert unicodedata.normalize("NFC", sentence) == sentence
        letters = [ch for ch in sentence if unicodedata.category(ch)[0] in "LM"]
        assert letters and all(low <= ord(ch) <= high for ch in letters), sentence
    assert len(set(mdc.SENTENCES[lang])) >= 20


def test_corrupt_flac_cannot_be_decoded(tones_corpus):
    _, marker, shards = tones_corpus
    (defect,) = defect_rows(marker, "corrupt_flac")
    flac = shards[defect["shard_id"]]["members"][f"{defect['segment_id']}.flac"]
    assert flac[:4] == b"fLaC"  # it still looks like a FLAC
    with pytest.raises(sf.LibsndfileError):
        sf.read(io.BytesIO(flac))


def test_tag_only_transcript_is_planted(tones_corpus):
    _, marker, shards = tones_corpus
    (defect,) = defect_rows(marker, "tag_only_transcript")
    rows = [
        r for r in shards[defect["shard_id"]]["meta"] if r["segment_id"] == defect["segment_id"]
    ]
    assert [r["transcription_native"] for r in rows] == ["[music] [laugh]"]


def test_script_mislabels_contradict_the_path_and_the_segment_language(tones_corpus):
    _, marker, shards = tones_corpus
    (by_path,) = defect_rows(marker, "script_mislabel_path")
    assert by_path["shard_id"].split("/")[1] == "hi" and by_path["segment_language"] is None
    assert by_path["text"] and all(
        0x0B80 <= ord(ch) <= 0x0BFF for ch in by_path["text"] if unicodedata.category(ch)[0] in "LM"
    )  # Tamil letters only
    (by_tag,) = defect_rows(marker, "script_mislabel_tag")
    assert by_tag["shard_id"].split("/")[1] == "te" and by_tag["segment_language"] == "kn"


def test_duplicate_segment_id_has_two_metadata_rows_and_one_member(tones_corpus):
    _, marker, shards = tones_corpus
    defect = defect_rows(marker, "duplicate_segment_id")[0]
    shard = shards[defect["shard_id"]]
    assert [r["segment_id"] for r in shard["meta"]].count(defect["segment_id"]) == 2
    assert [r["segment_id"] for r in shard["index"]].count(defect["segment_id"]) == 1


def test_exact_duplicate_repeats_text_duration_and_audio_under_a_new_id(tones_corpus):
    _, marker, shards = tones_corpus
    (copy,) = defect_rows(marker, "exact_duplicate")
    rows = {r["segment_id"]: (sid, r) for sid, s in shards.items() for r in s["meta"]}
    twins = [
        (sid, r)
        for sid, r in rows.values()
        if r["transcription_native"] == rows[copy["segment_id"]][1]["transcription_native"]
        and r["segment_id"] != copy["segment_id"]
    ]
    assert len(twins) == 1
    (sid, original) = twins[0]
    assert original["duration_s"] == rows[copy["segment_id"]][1]["duration_s"]
    assert (
        shards[sid]["members"][f"{original['segment_id']}.flac"]
        == shards[copy["shard_id"]]["members"][f"{copy['segment_id']}.flac"]
    )


def test_no_exact_duplicates_besides_the_planted_one(tones_corpus):
    _, _, shards = tones_corpus
    keys = [
        (sid.split("/")[1], r["transcription_native"], r["duration_s"])
        for sid, s in shards.items()
        for r in s["meta"]
    ]
    # One planted copy, plus the duplicate_segment_id row, which repeats its original too.
    assert len(keys) - len(set(keys)) == 2


def test_too_long_and_too_short_utterances_fall_outside_the_duration_filter(tones_corpus):
    _, marker, _ = tones_corpus
    assert defect_rows(marker, "too_long")[0]["duration_s"] > config.MAX_DURATION
    assert defect_rows(marker, "too_short")[0]["duration_s"] < config.MIN_DURATION


def test_same_seed_gives_byte_identical_shards(tmp_path, tones_corpus):
    root, _, _ = tones_corpus
    again = tmp_path / "shards"
    mdc.build_corpus(again, TINY, seed=7, shard_size=2, engine="tones", progress=False)
    files = sorted(
        p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name != mdc.MARKER_NAME
    )
    assert files == sorted(
        p.relative_to(again) for p in again.rglob("*") if p.is_file() and p.name != mdc.MARKER_NAME
    )
    assert all((root / f).read_bytes() == (again / f).read_bytes() for f in files)


def test_rerun_with_the_same_arguments_reuses_the_tree_and_new_arguments_rebuild_it(
    tmp_path, capsys
):
    root = tmp_path / "shards"
    first = mdc.build_corpus(root, {"hi": 2, "en": 1}, seed=1, engine="tones", progress=False)
    tar = next(root.rglob("audio.tar"))
    tar.unlink()  # as extract_audio.py --delete-tars does: a reused tree is not rebuilt
    second = mdc.build_corpus(root, {"hi": 2, "en": 1}, seed=1, engine="tones", progress=False)
    assert "reusing" in capsys.readouterr().out and second == first and not tar.exists()
    third = mdc.build_corpus(root, {"hi": 2, "en": 1}, seed=2, engine="tones", progress=False)
    assert third["params"]["seed"] == 2 and tar.exists()
    assert not (tmp_path / "shards.building").exists()


def test_a_directory_that_is_not_a_demo_corpus_is_never_overwritten(tmp_path):
    (tmp_path / "shards" / "real" / "hi").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="not a demo corpus"):
        mdc.build_corpus(tmp_path / "shards", {"hi": 1}, engine="tones", progress=False)
    assert (tmp_path / "shards" / "real" / "hi").is_dir()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hi", "LANG=COUNT"),
        ("xx=3", "no sentences"),
        ("hi=0", "at least one"),
        ("hi=three", "LANG=COUNT"),
    ],
)
def test_bad_sizes_are_refused_with_the_item_named(spec, message):
    with pytest.raises(ValueError, match=message):
        mdc.parse_sizes(spec)
