"""A tiny training set for model and training tests: FLACs, a train manifest, a tokenizer.

Example:
    from tests.tiny_training_data import make_training_data
    paths = make_training_data(tmp_path, per_lang=12)      # {"manifest": ..., "tokenizer": ...}
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from manifest_schema import OUTPUT_COLUMNS, tagged_text
from scripts import train_tokenizer

REPO = Path(__file__).resolve().parents[1]

TEXTS = {
    "hi": ["नमस्ते दुनिया", "मेरा नाम राम है", "यह एक परीक्षण है", "भारत एक बड़ा देश है", "आज मौसम अच्छा है"],
    "en": [
        "hello world",
        "my name is ram",
        "this is a test",
        "india is a large country",
        "the weather is nice",
    ],
    "ta": ["வணக்கம் உலகம்", "என் பெயர் ராம்", "இது ஒரு சோதனை"],
}


def write_manifest(
    root: Path,
    per_lang: int,
    *,
    langs=("hi", "en"),
    min_s: float = 1.0,
    max_s: float = 3.0,
    seed: int = 0,
    name: str = "train_manifest.parquet",
) -> Path:
    """FLACs of quiet noise under root/shards/src1/<lang>/shard_0000/ and a manifest of them (contract schema)."""
    rng = np.random.default_rng(seed)
    rows = {k: [] for k in OUTPUT_COLUMNS}
    for lang in langs:
        shard_id = f"src1/{lang}/shard_0000"
        shard_dir = root / "shards" / shard_id
        shard_dir.mkdir(parents=True, exist_ok=True)
        for i in range(per_lang):
            duration = round(float(rng.uniform(min_s, max_s)), 2)
            member = f"{lang}_{i:04d}.flac"
            signal = (0.05 * rng.standard_normal(int(duration * 16000))).astype(np.float32)
            sf.write(shard_dir / member, signal, 16000, format="FLAC", subtype="PCM_16")
            texts = TEXTS[lang]
            rows["segment_id"].append(f"{lang}-{i}")
            rows["shard_id"].append(shard_id)
            rows["text"].append(tagged_text(lang, texts[i % len(texts)]))
            rows["duration"].append(duration)
            rows["lang"].append(lang)
            rows["audio_filepath"].append(str((shard_dir / member).absolute()))
            rows["source"].append("src1")
    path = root / name
    pq.write_table(pa.table(rows), path)
    return path


def make_training_data(
    root: Path,
    per_lang: int = 12,
    *,
    langs=("hi", "en"),
    vocab_size: int = 64,
    seed: int = 0,
    min_s: float = 1.0,
    max_s: float = 3.0,
) -> dict[str, Path]:
    manifest = write_manifest(root, per_lang, langs=langs, seed=seed, min_s=min_s, max_s=max_s)
    tokenizer = root / "tokenizer"
    train_tokenizer.train_tokenizer(
        manifest,
        tokenizer,
        vocab_size=vocab_size,
        temperature=1.0,
        lang_weighting="count",
        seed=seed,
    )
    return {"manifest": manifest, "tokenizer": tokenizer}


def make_extension_tokenizers(root: Path, *, replaced: bool = False) -> dict[str, Path]:
    """Under ``root``: "base", an English tokenizer (40 pieces), and "extended", its extension to
    Hindi and Tamil (120 pieces, the base's first); with ``replaced`` also "replaced", a new
    tokenizer of that mix (100 pieces) sharing only some of the base's."""
    en = write_manifest(root / "en", 40, langs=("en",), name="en.parquet")
    mix = write_manifest(root / "mix", 30, langs=("hi", "en", "ta"), name="mix.parquet")
    common = dict(temperature=0.5, lang_weighting="count", seed=0)
    train_tokenizer.train_tokenizer(en, root / "base", vocab_size=40, mode="new", **common)
    train_tokenizer.train_tokenizer(
        mix, root / "extended", vocab_size=120, mode="extend", base=str(root / "base"), **common
    )
    names = ["base", "extended"]
    if replaced:
        train_tokenizer.train_tokenizer(
            mix, root / "replaced", vocab_size=100, mode="new", **common
        )
        names.append("replaced")
    return {name: root / name for name in names}
