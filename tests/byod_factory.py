"""Data in the layouts users bring (NeMo JSON plain and tarred, Hugging Face audio parquet, Kaldi
data directories), written from generated audio: noise at 44.1 kHz stereo and 16 kHz mono mixed."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

TEXTS = {
    "en": ["hello world", "good morning", "the cat sat", "open the door", "read a book"],
    "hi": ["नमस्ते दुनिया", "सुप्रभात", "बिल्ली बैठी", "दरवाज़ा खोलो", "किताब पढ़ो"],
    "ta": ["வணக்கம் உலகம்", "காலை வணக்கம்", "பூனை அமர்ந்தது", "கதவைத் திற", "புத்தகம் படி"],
}


def audio(seconds: float, k: int, fmt: str = "WAV") -> bytes:
    """Encoded noise of ``seconds``: 44.1 kHz stereo for odd ``k``, 16 kHz mono for even."""
    rate, channels = (44100, 2) if k % 2 else (16000, 1)
    rng = np.random.default_rng(k)
    samples = (0.05 * rng.standard_normal((int(seconds * rate), channels))).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=fmt, subtype="PCM_16")
    return buffer.getvalue()


def utterances(per_lang: int, langs=("en", "hi")) -> list[dict]:
    """``per_lang`` utterances per language: id, lang, text, seconds (1.0-2.2) and speaker (four
    per language)."""
    out = []
    for lang in langs:
        for i in range(per_lang):
            k = len(out)
            out.append(
                {
                    "id": f"{lang}{i:03d}",
                    "lang": lang,
                    "text": f"{TEXTS[lang][i % 5]} {i}" if lang == "en" else TEXTS[lang][i % 5],
                    "seconds": round(1.0 + 0.3 * (k % 5), 2),
                    "speaker": f"{lang}-spk{i % 4}",
                    "k": k,
                }
            )
    return out


def write_nemo_json(root: Path, utts: list[dict], relative: bool = True) -> Path:
    """WAV files under root/clips/ and root/manifest.json naming them (relative paths)."""
    (root / "clips").mkdir(parents=True, exist_ok=True)
    lines = []
    for u in utts:
        name = f"clips/{u['id']}.wav"
        (root / name).write_bytes(audio(u["seconds"], u["k"]))
        lines.append(
            {
                "audio_filepath": name if relative else str((root / name).absolute()),
                "duration": u["seconds"],
                "text": u["text"],
                "lang": u["lang"],
                "speaker_id": u["speaker"],
            }
        )
    manifest = root / "manifest.json"
    manifest.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    return manifest


def write_nemo_tarred(root: Path, utts: list[dict], n_tars: int = 2) -> tuple[Path, str]:
    """root/audio_<k>.tar holding WAV members and root/tarred_audio_manifest.json with NeMo's
    ``shard_id``; returns the manifest and the ``tars`` pattern."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    tars = [tarfile.open(root / f"audio_{k}.tar", "w") for k in range(n_tars)]
    for i, u in enumerate(utts):
        data = audio(u["seconds"], u["k"])
        info = tarfile.TarInfo(f"{u['id']}.wav")
        info.size = len(data)
        tars[i % n_tars].addfile(info, io.BytesIO(data))
        lines.append(
            {
                "audio_filepath": f"{u['id']}.wav",
                "duration": u["seconds"],
                "text": u["text"],
                "lang": u["lang"],
                "speaker_id": u["speaker"],
                "shard_id": i % n_tars,
            }
        )
    for tar in tars:
        tar.close()
    manifest = root / "tarred_audio_manifest.json"
    manifest.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    return manifest, str(root / f"audio_{{0..{n_tars - 1}}}.tar")


def write_hf_parquet(
    root: Path, utts: list[dict], files: int = 2, ids: list | None = None, locale: bool = True
) -> Path:
    """root/data/train-0000k-of-0000n.parquet as ``datasets`` writes them: an ``audio`` struct of
    bytes and path, ``sentence``, ``locale`` (unless not ``locale``) and ``client_id`` (Common
    Voice's names); with ``ids``, an ``id`` column holding them (one per utterance, in order)."""
    folder = root / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        part = utts[f::files]
        table = pa.table(
            {
                "audio": [
                    {
                        "bytes": audio(u["seconds"], u["k"], "FLAC" if u["k"] % 3 else "WAV"),
                        "path": f"{u['id']}.wav",
                    }
                    for u in part
                ],
                "sentence": [u["text"] for u in part],
                "locale": [u["lang"] for u in part],
                "client_id": [u["speaker"] for u in part],
                **({"id": ids[f::files]} if ids is not None else {}),
            }
        )
        if not locale:
            table = table.drop_columns(["locale"])
        pq.write_table(table, folder / f"train-{f:05d}-of-{files:05d}.parquet")
    return folder


def write_kaldi(root: Path, utts: list[dict]) -> Path:
    """A Kaldi data directory: one recording per speaker (WAV) holding its utterances back to back,
    with ``segments``, ``text``, ``utt2spk`` and ``utt2lang``."""
    root.mkdir(parents=True, exist_ok=True)
    by_speaker: dict[str, list[dict]] = {}
    for u in utts:
        by_speaker.setdefault(u["speaker"], []).append(u)
    wav, segments, text, utt2spk, utt2lang = [], [], [], [], []
    for n, (speaker, items) in enumerate(sorted(by_speaker.items())):
        rate, channels = (44100, 2) if n % 2 else (16000, 1)
        rng = np.random.default_rng(n)
        total = sum(u["seconds"] for u in items)
        samples = (0.05 * rng.standard_normal((int(total * rate) + 1, channels))).astype(np.float32)
        recording = f"rec_{speaker}"
        sf.write(root / f"{recording}.wav", samples, rate, subtype="PCM_16")
        wav.append(f"{recording} {recording}.wav")
        start = 0.0
        for u in items:
            utt = f"{speaker}-{u['id']}"
            segments.append(f"{utt} {recording} {start:.2f} {start + u['seconds']:.2f}")
            text.append(f"{utt} {u['text']}")
            utt2spk.append(f"{utt} {speaker}")
            utt2lang.append(f"{utt} {u['lang']}")
            start += u["seconds"]
    for name, lines in (
        ("wav.scp", wav),
        ("segments", segments),
        ("text", text),
        ("utt2spk", utt2spk),
        ("utt2lang", utt2lang),
    ):
        (root / name).write_text("".join(line + "\n" for line in sorted(lines)), encoding="utf-8")
    return root
