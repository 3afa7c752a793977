"""demo_base_split.py: the base model's rows of a train/val split, or one line that says what is missing."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from scripts import demo_base_split


def write_split(directory, langs_train, langs_val):
    directory.mkdir(parents=True, exist_ok=True)
    for name, langs in zip(demo_base_split.NAMES, (langs_train, langs_val)):
        table = pa.table({"id": [f"{lang}-{i}" for i, lang in enumerate(langs)], "lang": langs})
        pq.write_table(table, directory / name)


def test_the_rows_of_the_languages_of_both_manifests_are_kept_in_order(tmp_path):
    write_split(tmp_path / "split", ["en", "ta", "hi", "en"], ["ta", "hi", "en"])
    rows = demo_base_split.split_languages(tmp_path / "split", tmp_path / "base", ["en", "hi"])
    assert rows == dict(zip(demo_base_split.NAMES, (3, 2)))
    train = pq.read_table(tmp_path / "base" / demo_base_split.NAMES[0])
    assert train["id"].to_pylist() == ["en-0", "hi-2", "en-3"]


def test_a_missing_manifest_names_it_and_the_step_that_writes_it(tmp_path, capsys):
    code = demo_base_split.main(
        [str(tmp_path / "nowhere"), str(tmp_path / "base"), "--languages", "en"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "nowhere/train_manifest_v2.parquet does not exist" in err
    assert "make_train_val.py" in err
    assert not (tmp_path / "base").exists()


def test_a_language_the_split_lacks_writes_nothing(tmp_path, capsys):
    write_split(tmp_path / "split", ["en", "ta"], ["ta", "en"])
    code = demo_base_split.main(
        [str(tmp_path / "split"), str(tmp_path / "base"), "--languages", "hi"]
    )
    assert code == 2
    assert "has no row of hi (its languages: en, ta)" in capsys.readouterr().err
    assert not (tmp_path / "base").exists()
