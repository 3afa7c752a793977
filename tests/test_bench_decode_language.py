"""benchmarks/bench_decode_language.py: each decoding's cost is the median over rounds of its time
over auto's in the same round, and gpu_acceptance.py reads what a whole run prints."""

from __future__ import annotations

import re
import statistics

import pytest

from benchmarks import bench_decode_language
from scripts import gpu_acceptance
from tests.tiny_training_data import make_training_data


def test_the_cost_is_the_median_of_each_rounds_ratio_to_that_rounds_auto():
    """Three rounds, the second slower as a whole for auto: paired by round the tag costs 10%
    (1.1, 0.667, 1.1), while the ratio of the two medians (2.0 / 2.0) would say nothing."""
    times = {"auto": [1.0, 3.0, 2.0], "given_tag": [1.1, 2.0, 2.2]}
    (line,) = bench_decode_language.ratio_lines(times, encoder_s=1.0)
    assert line.startswith("given_tag / auto: decoding 1.100, with the encoder 1.050 ")
    assert line.endswith("per round: 1.100, 0.667, 1.100")


def test_a_run_prints_paired_ratios_that_gpu_acceptance_reads(tmp_path, capsys):
    data = make_training_data(tmp_path, per_lang=2, vocab_size=64)
    argv = ["--config", str(bench_decode_language.REPO / "configs" / "tiny_tdt.yaml")]
    argv += ["--tokenizer", str(data["tokenizer"]), "--utterances", "4", "--rounds", "3"]
    assert bench_decode_language.main(argv + ["--batch-seconds", "30", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    printed = re.search(r"^given_tag / auto: decoding ([\d.]+), .* per round: (.*)$", out, re.M)
    rounds = [float(x) for x in printed.group(2).split(", ")]
    assert len(rounds) == 3
    assert float(printed.group(1)) == pytest.approx(statistics.median(rounds), abs=1e-3)
    verdict, figure = gpu_acceptance.decode_language_figure(out, 0)
    assert verdict in ("ok", "warn")
    assert f"given_tag {float(printed.group(1)):.3f} (" in figure
