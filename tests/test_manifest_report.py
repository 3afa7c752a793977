"""scripts/manifest_report.py: plots and markdown for a manifest, readable and with the right numbers."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.image
import matplotlib.pyplot
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import config
from manifest_schema import SUMMARY_SUFFIX, tagged_text
from sampler import BatchingSettings, DurationBucketBatchSampler
from scripts import manifest_report as mr
from tests.conftest import WORDS

REPO = Path(__file__).resolve().parents[1]

COUNTS = {"hi": 240, "en": 120, "ta": 40, "bn": 12}
PLOTS = ["durations.png", "hours.png", "language_mix.png", "buckets.png", "dropped.png"]
MASTER_SUMMARY = {
    "rows_in": 430,
    "rows_out": 418,
    "dropped": {"duration_too_long": 7, "empty_after_cleaning": 5},
    "dropped_by_lang": {
        "hi": {"duration_too_long": 7, "empty_after_cleaning": 3},
        "ta": {"empty_after_cleaning": 2},
    },
    "kept_by_lang": {"hi": 246, "en": 120, "ta": 40, "bn": 12},
}
TRAIN_SUMMARY = {
    "rows_in": 418,
    "rows_out": 400,
    "val_rows": 12,
    "dropped": {"exact_duplicate": 6},
    "dropped_by_lang": {"hi": {"exact_duplicate": 6}},
    "kept_by_lang": {},
    "lang_corrections": {"hi->ta": 2, "kn->te": 1},
}


def write_manifest(
    path: Path, counts: dict[str, int], seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    langs = np.concatenate([[lang] * n for lang, n in counts.items()])
    durations = np.clip(rng.lognormal(np.log(5.0), 0.6, len(langs)), 0.5, 20.0)
    n = len(langs)
    pq.write_table(
        pa.table(
            {
                "segment_id": [f"seg{i}" for i in range(n)],
                "shard_id": ["src/hi/shard_0000"] * n,
                "text": [tagged_text(lang, "words") for lang in langs],
                "duration": durations,
                "lang": langs,
                "tar_member_name": [f"seg{i}.flac" for i in range(n)],
                "tar_path": ["/data/src/hi/shard_0000/audio.tar"] * n,
                "source": ["src"] * n,
            }
        ),
        path,
    )
    return durations, langs


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    durations, langs = write_manifest(data / "train_manifest_v2.parquet", COUNTS)
    (data / "master_manifest.summary.json").write_text(json.dumps(MASTER_SUMMARY))
    (data / "train_manifest_v2.summary.json").write_text(json.dumps(TRAIN_SUMMARY))
    (data / "tokenizer.summary.json").write_text(
        json.dumps({"vocab_size": 64})
    )  # not a build summary
    out = data / "report"
    result = mr.write_report(data / "train_manifest_v2.parquet", out)
    return {
        "out": out,
        "result": result,
        "markdown": (out / "report.md").read_text(),
        "durations": durations,
        "langs": langs,
        "data": data,
    }


def drawn_texts(fig: matplotlib.figure.Figure) -> list[matplotlib.text.Text]:
    """Every text the renderer draws: titles, axis labels, tick labels in view, bar labels, legends."""
    fig.canvas.draw()
    texts = list(fig.texts)
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            slack = (high - low) * 1e-9
            texts += [
                t.label1
                for t in axis.get_major_ticks()
                if low - slack <= t.get_loc() <= high + slack
            ]
        if ax.get_legend() is not None:
            texts += [ax.get_legend().get_title(), *ax.get_legend().get_texts()]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def report_figures(report) -> dict[str, matplotlib.figure.Figure]:
    durations, langs = report["durations"], report["langs"]
    table = mr.language_table(durations, langs)
    plan = mr.sampler_plan(durations, langs)
    steps = mr.read_summaries(mr.find_summaries(report["data"] / "train_manifest_v2.parquet"))
    return mr.build_figures(durations, langs, table, plan, steps, plan["edges"])


def test_every_plot_and_the_markdown_are_written(report):
    assert report["result"]["files"] == PLOTS + ["report.md"]
    for name in PLOTS:
        image = matplotlib.image.imread(report["out"] / name)
        assert image.shape[0] >= 300 and image.shape[1] >= 500, name
        assert image[..., :3].std() > 0.05, f"{name} looks blank"
    assert not list(report["out"].glob("*.tmp*"))


def test_markdown_has_a_section_per_plot_and_links_each_png(report):
    md = report["markdown"]
    for heading in (
        "## Hours per language",
        "## Duration per language",
        f"## Language mix at TEMPERATURE={config.TEMPERATURE:g}",
        "## Buckets and padding",
        "## Rows dropped",
    ):
        assert heading in md
    for name in PLOTS:
        assert f"]({name})" in md


def test_hours_and_counts_per_language_match_the_manifest(report):
    md = report["markdown"]
    for lang, n in COUNTS.items():
        hours = report["durations"][report["langs"] == lang].sum() / 3600
        assert f"| {lang} | {n:,} | {hours:.3f} |" in md


def test_language_mix_and_padding_come_from_the_configured_sampler(report):
    settings = BatchingSettings.from_config()
    stats = DurationBucketBatchSampler(report["durations"], report["langs"], settings).epoch_stats()
    md = report["markdown"]
    for lang in COUNTS:
        assert (
            f"| {lang} | {100 * stats['natural_share'][lang]:.1f}% | {100 * stats['target_share'][lang]:.1f}% | "
            f"{100 * stats['realized_share'][lang]:.1f}% |"
        ) in md
    assert f"**{stats['padding_efficiency']:.3f}**" in md
    # The smallest language is upsampled at T=0.3: the target share is above the natural one.
    assert stats["target_share"]["bn"] > stats["natural_share"]["bn"]


def test_bucket_table_counts_every_planned_batch_and_utterance(report):
    plan = mr.sampler_plan(report["durations"], report["langs"])
    stats = plan["stats"]
    assert plan["batches"] == list(stats["batches_per_bucket"].values())
    assert sum(plan["planned_utterances"]) == stats["utterances_in_plan"]
    assert sum(plan["corpus_utterances"]) == len(report["durations"])
    assert all(0 < e <= 1 for e, b in zip(plan["padding_efficiency"], plan["batches"]) if b)


def test_the_bucket_table_counts_the_seconds_the_batches_play_under_speed_perturbation(
    report, monkeypatch
):
    monkeypatch.setattr(config, "SPEED_PERTURB", (0.9, 1.0, 1.1))
    durations, langs = report["durations"], report["langs"]
    plan = mr.sampler_plan(durations, langs)
    # The reference, from the definition: each planned row lasts its duration over its factor.
    sampler = DurationBucketBatchSampler(durations, langs, BatchingSettings.from_config())
    played = [durations[list(b)] / np.asarray(b.speeds) for b in sampler]
    assert any(set(b.speeds) != {1.0} for b in sampler)
    real = sum(p.sum() for p in played)
    padded = sum(len(p) * p.max() for p in played)
    batches = np.asarray(plan["batches"], dtype=float)
    audio = np.asarray(plan["mean_batch_seconds"]) * batches
    assert audio.sum() == pytest.approx(real, rel=1e-9)
    with np.errstate(divide="ignore", invalid="ignore"):
        table_padded = np.where(batches > 0, audio / np.asarray(plan["padding_efficiency"]), 0)
    assert audio.sum() / table_padded.sum() == pytest.approx(real / padded, rel=1e-9)
    assert audio.sum() / table_padded.sum() == pytest.approx(
        plan["stats"]["padding_efficiency"], abs=1e-9
    )
    assert max(plan["mean_batch_seconds"]) <= config.MAX_BATCH_DURATION


def test_rows_dropped_are_read_from_every_build_summary_beside_the_manifest(report):
    md = report["markdown"]
    assert [Path(p).name for p in report["result"]["summaries"]] == [
        "master_manifest.summary.json",
        "train_manifest_v2.summary.json",
    ]
    assert "| duration_too_long | 7 | hi 7 |" in md
    assert "| empty_after_cleaning | 5 | hi 3, ta 2 |" in md
    assert "| exact_duplicate | 6 | hi 6 |" in md
    assert "430 rows in, 418 out, 12 dropped" in md
    assert "418 rows in, 400 out (+ 12 validation), 6 dropped" in md
    assert "Language tags corrected (given->corrected): hi->ta 2, kn->te 1." in md


def test_no_text_overlaps_and_every_text_stays_inside_the_image(report):
    for name, fig in report_figures(report).items():
        renderer = fig.canvas.get_renderer()
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
        overlapping = [
            (a, b)
            for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
            if box_a.overlaps(box_b)
        ]
        assert not overlapping, f"{name}: overlapping texts {overlapping[:5]}"
        outside = [
            t
            for t, box in boxes
            if box.x0 < -1 or box.y0 < -1 or box.x1 > fig.bbox.x1 + 1 or box.y1 > fig.bbox.y1 + 1
        ]
        assert not outside, f"{name}: texts cut off at the border {outside}"


def test_every_axis_is_labelled_with_its_unit(report):
    figures = report_figures(report)
    for name, fig in figures.items():
        for ax in fig.axes:
            if ax.get_visible() and ax.get_xlabel():
                assert ax.get_ylabel(), f"{name}: an axis without a label"
        assert fig.axes[0].get_title() or fig.texts, f"{name}: no title"
    assert any(ax.get_xlabel() == "duration (s)" for ax in figures["durations.png"].axes)
    assert figures["hours.png"].axes[0].get_xlabel() == "hours of audio"
    assert "(%)" in figures["language_mix.png"].axes[0].get_ylabel()


def test_the_overlap_check_catches_overlapping_text():
    fig = matplotlib.pyplot.figure(figsize=(4, 3))
    ax = fig.add_subplot()
    ax.text(0.5, 0.5, "first label")
    ax.text(0.52, 0.5, "second label")
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in drawn_texts(fig) if "label" in t.get_text()]
    assert boxes[0].overlaps(boxes[1])


def test_explicit_summaries_replace_the_ones_found_beside_the_manifest(report, tmp_path):
    result = mr.write_report(
        report["data"] / "train_manifest_v2.parquet",
        tmp_path,
        [report["data"] / "train_manifest_v2.summary.json"],
    )
    md = (tmp_path / "report.md").read_text()
    assert "exact_duplicate" in md and "duration_too_long" not in md
    assert len(result["summaries"]) == 1


def test_without_summaries_the_report_says_how_to_pass_them(tmp_path):
    write_manifest(tmp_path / "m.parquet", {"hi": 30, "en": 10})
    result = mr.write_report(tmp_path / "m.parquet", tmp_path / "out", with_sampler=False)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "--summary" in md and "dropped.png" not in result["files"]
    assert result["files"] == ["durations.png", "hours.png", "report.md"]


def test_a_summary_whose_name_is_not_utf8_is_reported_by_its_bytes(tmp_path):
    write_manifest(tmp_path / "m.parquet", {"hi": 30, "en": 10})
    # a build summary written on a Latin-1 system: "caf\xe9" is no UTF-8 name
    named = os.fsencode(tmp_path) + b"/caf\xe9" + SUMMARY_SUFFIX.encode()
    Path(os.fsdecode(named)).write_text(json.dumps(MASTER_SUMMARY))
    result = mr.write_report(tmp_path / "m.parquet", tmp_path / "out", with_sampler=False)
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "caf\\xe9" in md and "| duration_too_long | 7 | hi 7 |" in md
    assert result["summaries"] == [f"{tmp_path}/caf\\xe9{SUMMARY_SUFFIX}"]


def test_temperature_is_read_from_config_at_call_time(monkeypatch, report):
    monkeypatch.setattr(config, "TEMPERATURE", 1.0)
    plan = mr.sampler_plan(report["durations"], report["langs"])
    for lang in COUNTS:
        assert plan["stats"]["target_share"][lang] == pytest.approx(
            plan["stats"]["natural_share"][lang]
        )


def test_missing_manifest_or_columns_exit_non_zero_with_the_path(tmp_path):
    script = str(REPO / "scripts" / "manifest_report.py")
    done = subprocess.run(
        [sys.executable, script, str(tmp_path / "nope.parquet"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "nope.parquet does not exist" in done.stderr
    pq.write_table(pa.table({"segment_id": ["a"], "lang": ["hi"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['duration'\]"):
        mr.read_manifest(tmp_path / "bad.parquet")


def test_help_shows_an_example_and_the_config_defaults():
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "manifest_report.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    assert (
        "Example:" in done.stdout
        and "TRAIN_MANIFEST_PATH" in done.stdout
        and "--summary" in done.stdout
    )


# --- the training caches' drops ------------------------------------------------------------------


def cache_manifest(path: Path, langs: dict[str, int], short: dict[str, int]) -> Path:
    """A manifest of 5 s rows, the first ``short[lang]`` rows of each language 0.1 s long (one
    encoder frame, fewer than any transcript's tokens: the cache drops them)."""
    rows = []
    for lang, n in langs.items():
        for i in range(n):
            rows.append(
                {
                    "segment_id": f"{path.stem}-{lang}-{i}",
                    "shard_id": f"src/{lang}/shard_0000",
                    "text": tagged_text(lang, " ".join(WORDS[: 2 + i % 4])),
                    "duration": 0.1 if i < short.get(lang, 0) else 5.0,
                    "lang": lang,
                    "audio_filepath": f"/data/src/{lang}/shard_0000/{i}.flac",
                    "source": "src",
                }
            )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def cached(tmp_path, tokenizer, monkeypatch):
    """A train and a validation manifest with their training caches built, the configured paths
    pointing at them, and a build_manifest summary beside them."""
    import training_cache

    train = cache_manifest(tmp_path / "train.parquet", {"hi": 30, "en": 30}, {"hi": 2})
    val = cache_manifest(
        tmp_path / "val.parquet", {"hi": 10, "en": 10, "mr": 4}, {"mr": 3, "hi": 1}
    )
    (tmp_path / "master_manifest.summary.json").write_text(json.dumps(MASTER_SUMMARY))
    monkeypatch.setattr(config, "TRAIN_MANIFEST_PATH", train)
    monkeypatch.setattr(config, "VAL_MANIFEST_PATH", val)
    (tmp_path / "tokenizer").mkdir()
    model = tokenizer.tokenizer.serialized_model_proto()
    (tmp_path / "tokenizer" / "tokenizer.model").write_bytes(model)
    monkeypatch.setattr(config, "TOKENIZER_DIR", tmp_path / "tokenizer")
    monkeypatch.setattr(config, "CACHE_DIR", None)
    for path in (train, val):
        training_cache.ensure(
            path,
            tokenizer,
            frame_seconds=config.ENCODER_FRAME_SECONDS,
            max_token_len=config.MAX_TOKEN_LEN,
            progress=False,
        )
    return {"train": train, "val": val, "dir": tmp_path}


def test_the_report_shows_the_training_caches_drops_per_language_and_reason(cached):
    out = cached["dir"] / "report"
    result = mr.write_report(cached["train"], out, with_sampler=False)
    md = (out / "report.md").read_text()
    assert len(result["caches"]) == 2 and not result["cache_note"]
    assert "| build step | reason | rows | hi | mr | ta |" in md
    assert "| master_manifest | duration_too_long | 7 | 7 | 0 | 0 |" in md
    assert "| training cache of train | infeasible_tokens_gt_frames | 2 | 2 | 0 | 0 |" in md
    assert "| training cache of val | infeasible_tokens_gt_frames | 4 | 1 | 3 | 0 |" in md
    assert "24 rows in, 20 out" in md
    assert "| val-mr-0 | mr | infeasible_tokens_gt_frames |" in md
    assert "dropped_rows.parquet" in md
    assert "dropped.png" in result["files"]
    image = matplotlib.image.imread(out / "dropped.png")
    assert image[..., :3].std() > 0.05


def test_a_dropped_rows_listing_gives_its_tokens_and_frames(cached, tokenizer):
    out = cached["dir"] / "report"
    mr.write_report(cached["train"], out, with_sampler=False)
    md = (out / "report.md").read_text()
    tokens = 1 + len(tokenizer.text_to_ids(" ".join(WORDS[:2])))
    assert f"| val-mr-0 | mr | infeasible_tokens_gt_frames | {tokens} | 1 | 0.10 |" in md


def test_a_validation_language_losing_more_than_a_tenth_is_warned_once(cached, capsys):
    out = cached["dir"] / "report"
    result = mr.write_report(cached["train"], out, with_sampler=False)
    md = (out / "report.md").read_text()
    # mr loses 3 of 4 and hi 1 of 10 (not more than a tenth); the training manifest is not warned.
    assert len(result["warnings"]) == 1
    warning = result["warnings"][0]
    assert "val.parquet: mr loses 3 of its 4 rows (75%)" in warning
    assert "raise VOCAB_SIZE" in warning and "MAX_TOKEN_LEN" in warning
    assert f"> **{warning}**" in md
    assert mr.main([str(cached["train"]), "--out", str(out), "--no-sampler"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert printed == [f"  {warning}"]


def test_the_dropped_plot_names_every_language_without_overlaps(cached):
    steps = mr.read_summaries(mr.find_summaries(cached["train"]))
    caches, _ = mr.find_caches(cached["train"], cached["val"])
    steps += mr.read_cache_drops(caches, cached["val"])
    fig = mr.plot_dropped(steps)
    texts = [t.get_text() for t in drawn_texts(fig)]
    assert {"hi", "mr", "ta"} <= set(texts)
    assert any("75% of its validation rows" in t for t in texts)
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
    assert not [(a, b) for (a, x), (b, y) in itertools.combinations(boxes, 2) if x.overlaps(y)]
    assert all(box.x1 <= fig.bbox.x1 + 1 and box.x0 >= -1 for _, box in boxes)


def test_without_a_cache_the_report_says_how_to_build_it(cached, tmp_path, monkeypatch):
    other = cache_manifest(tmp_path / "other.parquet", {"hi": 5}, {})
    result = mr.write_report(other, tmp_path / "out", with_sampler=False)
    assert result["caches"] == [] and "scripts/build_training_cache.py" in result["cache_note"]
    assert result["cache_note"] in (tmp_path / "out" / "report.md").read_text()
