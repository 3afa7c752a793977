"""benchmarks/bench_finetune_grid.py: the targets of a run from its curves, their spread over seeds,
a lever against the defaults, which variants it runs, and which finished runs it reuses."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from benchmarks import bench_finetune_grid as grid
from benchmarks import bench_finetune_init as bench
from tests.tiny_training_data import make_extension_tokenizers

BASE = bench.Base(
    name="toy",
    sizes="en=10,te=10",
    seed=1,
    vocab_size=64,
    finetune_sizes="hi=10,ta=10,en=10",
    finetune_seed=2,
    finetune_vocab_size=128,
)


def curves(wer=None, wer_given=None, cer=None, cer_given=None) -> dict:
    """bench_finetune_init.curves' shape: {metric: {step: {lang: value}}}."""
    return {
        "wer": wer or {},
        "wer_given": wer_given or {},
        "cer": cer or {},
        "cer_given": cer_given or {},
        "ins": {},
        "lid": {},
        "loss": {},
    }


def test_a_base_knows_which_of_its_languages_the_finetune_keeps_and_which_are_new():
    assert BASE.base_langs == ("en",)
    assert BASE.new_langs == ("hi", "ta")
    assert grid.HI_EN.base_langs == ("hi", "en") and grid.HI_EN.new_langs == ("te", "kn", "ur")


def test_each_target_is_the_worst_margin_of_its_definition():
    # the base itself: en 0.10 auto, 0.08 with the language given
    base = {"wer": {"en": 0.10}, "wer_given": {"en": 0.08}}
    run = curves(
        wer={
            0: {"en": 0.10},
            50: {"en": 0.13},
            100: {"en": 0.18},
            150: {"en": 0.12},
            200: {"en": 0.1},
        },
        wer_given={0: {"en": 0.11}, 50: {"en": 0.10}, 100: {"en": 0.12}, 150: {"en": 0.16}},
        cer={
            0: {"all": 0.9, "hi": 1.0, "ta": 1.0},
            50: {"all": 0.7},
            100: {"all": 0.40},
            150: {"all": 0.30},
            200: {"all": 0.20, "hi": 0.15, "ta": 0.30},
        },
        cer_given={100: {"all": 0.35}, 200: {"all": 0.18, "hi": 0.12, "ta": 0.20}},
    )
    ref = curves(
        cer={
            50: {"all": 0.5},
            100: {"all": 0.38},
            150: {"all": 0.1},
            200: {"all": 0.21, "hi": 0.10, "ta": 0.31},
        },
        cer_given={100: {"all": 0.36}, 200: {"all": 0.18, "hi": 0.13, "ta": 0.25}},
    )
    got = grid.target_figures(run, ref, base, ("en",), ("hi", "ta"))
    # a: en auto after step 0, worst 0.18 at step 100, against the base's 0.10
    assert got["a"][0] == pytest.approx(0.08) and got["a"][1] == "en@100"
    # e: en given after step 0 (step 0's 0.11 does not count), worst 0.16 at 150, against the
    # base's given 0.08
    assert got["e"][0] == pytest.approx(0.08) and got["e"][1] == "en@150"
    # d: step 0 against the base, auto equal, given 0.03 off the base's given
    assert got["d auto"][0] == pytest.approx(0.0)
    assert got["d given"][0] == pytest.approx(0.03)
    # b: the middle validation of 50..200 is 100 (nearest to 200 / 2), the last 200; 150 and 50
    # do not count
    assert got["b auto"][0] == pytest.approx(0.02) and got["b auto"][1] == "@100"
    assert got["b given"][0] == pytest.approx(0.0)
    # c: each new language at the last validation, worst hi 0.15 - 0.10
    assert got["c auto"][0] == pytest.approx(0.05) and got["c auto"][1] == "hi@200"
    assert got["c given"][0] == pytest.approx(-0.01) and got["c given"][1] == "hi@200"


def test_the_reference_itself_has_no_figure_against_the_reference():
    run = curves(wer={0: {"en": 0.5}, 50: {"en": 0.4}}, cer={50: {"all": 0.3}})
    got = grid.target_figures(run, None, {"wer": {"en": 0.0}}, ("en",), ("hi",))
    assert set(got) == {"a", "e", "d auto", "d given"}
    assert got["a"][0] == pytest.approx(0.4)
    assert math.isnan(got["e"][0])  # nothing decoded with the language given


def test_a_target_is_met_in_a_cell_only_when_every_seed_meets_it():
    spread = grid.Spread([0.01, 0.06, 0.04], "en@100")
    assert spread.mean == pytest.approx(0.11 / 3)
    assert spread.range == pytest.approx(0.05)
    assert spread.verdict(0.05) == "MISSED 2/3"
    assert spread.verdict(0.06) == "met 3/3"
    assert spread.text() == "+0.037 [+0.010, +0.060]"
    assert grid.Spread([math.nan], "-").verdict(0.05) == "n/a"


def test_a_lever_helps_or_hurts_only_beyond_the_larger_seed_range():
    defaults = {
        "a": grid.Spread([0.10, 0.12, 0.14], ""),  # mean 0.12, range 0.04
        "b auto": grid.Spread([0.00, 0.01, 0.02], ""),  # mean 0.01, range 0.02
        "c auto": grid.Spread([0.05, 0.05, 0.05], ""),
    }
    lever = {
        "a": grid.Spread([0.06, 0.07, 0.08], ""),  # 0.05 lower, beyond 0.04: helps
        "b auto": grid.Spread([0.00, 0.06, 0.06], ""),  # 0.03 higher, within its own 0.06: same
        "c auto": grid.Spread([0.051, 0.051, 0.051], ""),  # no spread at all: 0.001 higher hurts
    }
    assert grid.compare_to_defaults(lever, defaults) == {
        "a": "helps",
        "b auto": "same",
        "c auto": "hurts",
    }


def test_a_lever_is_kept_where_it_helps_in_most_cells_and_hurts_in_none():
    helps, same, hurts = {"a": "helps"}, {"a": "same"}, {"a": "helps", "b auto": "hurts"}
    assert grid.lever_verdict({"1": helps, "2": helps, "3": same}) == (2, 0, True)
    assert grid.lever_verdict({"1": helps, "2": same, "3": same, "4": helps}) == (2, 0, False)
    assert grid.lever_verdict({"1": helps, "2": helps, "3": hurts}) == (2, 1, False)


def test_a_variant_is_the_defaults_plus_its_knobs_and_a_value_keeps_its_commas():
    table = grid.grid_variants(
        300,
        ["mix:BASE_LANGUAGES=en,hi", "mix:NEW_PIECE_WARMUP=100", "ext:VOCAB_SIZE=fresh"],
        ["new_tokenizer:NEW_PIECE_LR_SCALE=3"],
    )
    assert table["mix"] == {
        **bench.variants(300)["defaults"],
        "BASE_LANGUAGES": "en,hi",
        "NEW_PIECE_WARMUP": "100",
    }
    assert table["ext"]["VOCAB_SIZE"] == "fresh"
    assert table["new_tokenizer"]["NEW_PIECE_LR_SCALE"] == "3"


@pytest.mark.parametrize(
    "added, changed, says",
    [
        (
            ["x:NO_SUCH_KNOB=1"],
            [],
            "variant x: NO_SUCH_KNOB=1: NO_SUCH_KNOB is not a setting of config.py",
        ),
        (["x:PHASE2_LR=1e-3"], [], "the grid sets PHASE2_LR itself"),
        (["x:NEW_PIECE_WARMUP=-1"], [], "NEW_PIECE_WARMUP='-1': expected a value >= 0"),
        (["x:VOCAB_SIZE=half"], [], "expected N pieces, +N appended pieces, or fresh"),
        (["defaults:NEW_PIECE_WARMUP=5"], [], "--variant defaults: a variant of that name exists"),
        ([], ["nope:NEW_PIECE_WARMUP=5"], "--set nope: no such variant"),
        ([], ["new_tokenizer:VOCAB_SIZE=+5"], "a fresh tokenizer's VOCAB_SIZE is a number"),
        (["x y:NEW_PIECE_WARMUP=5"], [], "a name of letters, digits, _ and - is expected"),
    ],
)
def test_a_variant_the_grid_cannot_run_is_one_line_naming_it(added, changed, says):
    with pytest.raises(SystemExit) as stop:
        grid.grid_variants(300, added, changed)
    assert says in str(stop.value) and "\n" not in str(stop.value)


def test_a_tokenizers_new_language_pieces_are_those_holding_a_character_the_base_cannot_write(
    tmp_path,
):
    toks = make_extension_tokenizers(tmp_path, replaced=True)
    summary = json.loads((toks["extended"] / "summary.json").read_text())["extension"]
    new, normal = grid.new_language_pieces(toks["extended"], toks["base"])
    # every appended piece holds a new character and no base piece does
    assert new == summary["appended_pieces"] > 0
    # the base is English: a new character is one of the Devanagari or Tamil blocks
    import sentencepiece as spm

    fresh = spm.SentencePieceProcessor(model_file=str(toks["replaced"] / "tokenizer.model"))
    indic = sum(
        1
        for i in range(fresh.get_piece_size())
        if not (fresh.is_control(i) or fresh.is_unknown(i) or fresh.is_byte(i))
        and fresh.id_to_piece(i)[:2] != "<|"
        and any(
            0x0900 <= ord(c) <= 0x097F or 0x0B80 <= ord(c) <= 0x0BFF for c in fresh.id_to_piece(i)
        )
    )
    assert grid.new_language_pieces(toks["replaced"], toks["base"])[0] == indic > 0


def test_a_run_recorded_with_todays_settings_is_the_same_run():
    defaults = {"A": 1, "NEW": 0}
    assert grid.same_run({"A": 1, "B": "x"}, {"A": 1, "B": "x"}, defaults)
    assert not grid.same_run({"A": 1, "B": "x"}, {"A": 2, "B": "x"}, defaults)
    # a knob added since the run, at its default, does what the code did before it
    assert grid.same_run({"A": 1}, {"A": 1, "NEW": 0}, defaults)
    assert not grid.same_run({"A": 1}, {"A": 1, "NEW": 5}, defaults)
    # a knob the run had that no longer exists: not today's run
    assert not grid.same_run({"A": 1, "GONE": 3}, {"A": 1}, defaults)


def fake_training(monkeypatch, tmp_path):
    """bench_finetune_init.train replaced by one that writes a run's final checkpoint and curves
    (WER 0.1 x SEED at every validation) at once; returns the list of run directories it trained."""
    trained = []

    def train(data, run_dir, steps, eval_every, checkpoint_every=0, **knobs):
        metrics = run_dir / "wandb_logs" / "run" / "metrics.jsonl"
        if bench.finished(run_dir, steps):  # as the real one: a finished run is kept
            return metrics
        trained.append(run_dir)
        if run_dir.exists():  # as the real one does with an interrupted run
            shutil.rmtree(run_dir)
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{steps:08d}.nemo").write_text("")
        metrics.parent.mkdir(parents=True)
        value = 0.1 * int(knobs["SEED"])
        lines = [
            json.dumps({"step": s, "val/wer/en": value}) for s in range(0, steps + 1, eval_every)
        ]
        metrics.write_text("\n".join(lines) + "\n")
        return metrics

    monkeypatch.setattr(bench, "train", train)
    monkeypatch.setattr(
        grid,
        "variant_tokenizer",
        lambda prepared, spec: (
            tmp_path / "tok",
            {k: v for k, v in spec.items() if k != "tokenizer"},
        ),
    )
    prepared = bench.Prepared(
        BASE, tmp_path, tmp_path / "base.nemo", tmp_path / "btok", tmp_path / "data"
    )
    return trained, prepared


def test_a_finished_run_is_reused_while_its_settings_are_todays_and_trained_anew_when_not(
    monkeypatch, tmp_path
):
    trained, prepared = fake_training(monkeypatch, tmp_path)
    cell = tmp_path / "cell"
    spec = {"tokenizer": "extended", "UNFREEZE_STEP": "5"}
    first = grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    assert first.trained_now and first.curves["wer"][20] == {"en": pytest.approx(0.3)}
    record = json.loads((trained[0] / "run.json").read_text())
    assert record["settings"]["UNFREEZE_STEP"] == 5 and record["settings"]["PHASE2_LR"] == 1e-3
    again = grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    assert not again.trained_now and again.curves == first.curves and len(trained) == 1
    # another seed, another LR, another knob value: each a run of its own
    grid.run_once(prepared, cell, "defaults", spec, 4, "1e-3", 20, 10)
    grid.run_once(prepared, cell, "defaults", spec, 3, "3e-3", 20, 10)
    grid.run_once(prepared, cell, "defaults", {**spec, "UNFREEZE_STEP": "2"}, 3, "1e-3", 20, 10)
    assert len(trained) == 4 and len(set(trained)) == 4
    # the shell's own knobs play no part (bench_finetune_init.clean_env drops them)
    monkeypatch.setenv("NEW_PIECE_WARMUP", "7")
    grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    assert len(trained) == 4
    # a default changed since (today's NEW_PIECE_LR_SCALE 5): trained anew, the old run kept
    todays = grid.training_settings
    monkeypatch.setattr(
        grid, "training_settings", lambda env: {**todays(env), "NEW_PIECE_LR_SCALE": 5.0}
    )
    grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    assert len(trained) == 5 and trained[4] != trained[0] and trained[0].exists()


def test_an_interrupted_run_is_not_reused(monkeypatch, tmp_path):
    trained, prepared = fake_training(monkeypatch, tmp_path)
    cell = tmp_path / "cell"
    spec = {"tokenizer": "extended"}
    grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    (trained[0] / "checkpoints" / "step_00000020.nemo").unlink()  # killed before its end
    grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    assert len(trained) == 2


def test_the_report_gives_each_cells_verdicts_the_cells_met_and_each_levers_verdict():
    spread = grid.Spread
    cells = {
        "toy LR 1e-3": {
            "defaults": {"a": spread([0.02, 0.04], "en@50"), "c auto": spread([0.05, 0.01], "")},
            "fast": {"a": spread([0.00, 0.01], "en@100"), "c auto": spread([0.02, 0.03], "")},
        },
        "toy LR 3e-3": {
            "defaults": {"a": spread([0.06, 0.08], "en@50"), "c auto": spread([0.0, 0.0], "")},
            "fast": {"a": spread([0.01, 0.02], "en@50"), "c auto": spread([0.0, 0.0], "")},
        },
    }
    text = "\n".join(grid.report(cells, ["defaults", "fast"]))
    lines = text.splitlines()
    first = next(line for line in lines if line.strip().startswith("a ") and "+0.030" in line)
    assert "met 2/2" in first and "+0.030 [+0.020, +0.040]" in first and "en@50" in first
    assert any("MISSED 0/2" in line and "+0.070" in line for line in lines)
    assert any("MISSED 1/2" in line and "c auto" in line for line in lines)
    overall = next(line for line in lines if line.startswith("defaults "))
    assert overall.split()[1:] == ["1/2", "-", "-", "1/2", "-", "-", "-", "-"]
    assert "fast: helps in 2 of 2 cells, hurts a target in 0: keep" in text


def fake_grid(monkeypatch, tmp_path):
    """bench_finetune_grid.main with every heavy step faked: bases, their scores and tokenizers, and
    a training that writes curves at once (the defaults 0.01 CER above the reference per SEED
    unit); returns the run directories trained."""
    trained, _ = fake_training(monkeypatch, tmp_path)

    def prepare_base(root, base, base_steps):
        root.mkdir(parents=True, exist_ok=True)
        return bench.Prepared(base, root, root / "base.nemo", root / "btok", root / "data")

    def variant_tokenizer(prepared, spec):
        knobs = {k: v for k, v in spec.items() if k != "tokenizer"}
        return prepared.root / f"tok_{spec['tokenizer']}", knobs

    def train(data, run_dir, steps, eval_every, checkpoint_every=0, **knobs):
        trained.append(run_dir)
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{steps:08d}.nemo").write_text("")
        metrics = run_dir / "wandb_logs" / "run" / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        behind = 0.0 if knobs["TOKENIZER_DIR"].endswith("tok_new") else 0.01 * int(knobs["SEED"])
        record = {}
        for lang in ("en", "hi", "te", "kn", "ur", "ta", "bn", "all"):
            for key in ("wer", "wer_given", "cer", "cer_given"):
                record[f"val/{key}/{lang}"] = 0.1 + behind
        lines = [json.dumps({"step": s, **record}) for s in range(0, steps + 1, eval_every)]
        metrics.write_text("\n".join(lines) + "\n")
        return metrics

    monkeypatch.setattr(bench, "prepare_base", prepare_base)
    monkeypatch.setattr(bench, "train", train)
    monkeypatch.setattr(grid, "variant_tokenizer", variant_tokenizer)
    monkeypatch.setattr(
        grid,
        "base_scores",
        lambda prepared: {
            "wer": {lang: 0.1 for lang in prepared.base.base_langs},
            "wer_given": {lang: 0.1 for lang in prepared.base.base_langs},
        },
    )
    monkeypatch.setattr(grid, "tokenizer_lines", lambda prepared: [])
    return trained


def test_one_command_runs_every_cell_once_and_a_rerun_reuses_them(monkeypatch, tmp_path, capsys):
    trained = fake_grid(monkeypatch, tmp_path)
    work = tmp_path / "work"
    args = ["--work", str(work), "--lrs", "1e-3,3e-3", "--seeds", "1,2", "--steps", "20"]
    args += ["--eval-every", "10", "--variant", "ramp:NEW_PIECE_WARMUP=5"]
    assert grid.main(args) == 0
    # 2 bases x 2 LRs x 2 seeds x (the reference, the defaults, ramp)
    assert len(trained) == 24
    text = (work / "grid.txt").read_text()
    for cell in ("en_te LR 0.001", "en_te LR 0.003", "hi_en LR 0.001", "hi_en LR 0.003"):
        assert f"== {cell}" in text
    # the defaults are 0.01 x SEED above the reference: b met at seed 1 only, in every cell
    b_lines = [line for line in text.splitlines() if line.strip().startswith("b auto")]
    assert b_lines and all(
        "MISSED 1/2" in line and "+0.015 [+0.010, +0.020]" in line for line in b_lines
    )
    assert "ramp: helps in 0 of 4 cells, hurts a target in 0: do not keep" in text
    assert (work / "grid.png").read_bytes()[:4] == b"\x89PNG"
    assert (work / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert grid.main(args + ["--bases", "hi_en", "--lrs", "0.003", "--only", "defaults"]) == 0
    assert len(trained) == 24
    assert "0 runs trained now, 4 reused" in capsys.readouterr().out


def test_a_run_finished_but_unrecorded_is_kept_with_its_time_unknown(monkeypatch, tmp_path):
    trained, prepared = fake_training(monkeypatch, tmp_path)
    cell = tmp_path / "cell"
    spec = {"tokenizer": "extended"}
    grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    (trained[0] / "run.json").unlink()  # stopped between its end and its record
    again = grid.run_once(prepared, cell, "defaults", spec, 3, "1e-3", 20, 10)
    assert len(trained) == 1 and not again.trained_now and again.seconds is None
    assert json.loads((trained[0] / "run.json").read_text())["seconds"] is None
    cost = "\n".join(grid.cost_lines([("toy", again)], 2))
    assert "0 runs trained now, 1 reused" in cost and "no time recorded" in cost


@pytest.mark.parametrize(
    "args, says",
    [
        (["--seeds", "7,x"], "--seeds '7,x': expected integers"),
        (["--seeds", ","], "each needs at least one value"),
        (["--lrs", "inf"], "--lrs 'inf': expected learning rates > 0"),
        (["--lrs", "3e-3,0"], "--lrs '0': expected learning rates > 0"),
        (["--bases", "en_te,fr"], "--bases fr: no such base"),
        (["--only", "defaults,nope"], "--only nope: no such variant"),
    ],
)
def test_a_grid_it_cannot_run_is_one_line_naming_the_argument(args, says, tmp_path):
    with pytest.raises(SystemExit) as stop:
        grid.main(["--work", str(tmp_path), *args])
    assert says in str(stop.value) and "\n" not in str(stop.value)


def test_the_frontier_places_each_seed_at_its_new_languages_cer_and_its_base_drift():
    """x: the new languages' mean CER at the last validation (auto); y: a's and e's figures, the
    base languages' worst WER above the base after step 0, auto and given."""
    base_scores = {"wer": {"en": 0.10}, "wer_given": {"en": 0.08}}
    runs = {
        "defaults": {
            1: curves(
                wer={0: {"en": 0.10}, 10: {"en": 0.30}, 20: {"en": 0.20}},
                wer_given={0: {"en": 0.08}, 10: {"en": 0.10}, 20: {"en": 0.12}},
                cer={
                    0: {"hi": 1.0, "ta": 1.0},
                    10: {"hi": 0.8, "ta": 0.9},
                    20: {"hi": 0.5, "ta": 0.7},
                },
            ),
            2: curves(
                wer={0: {"en": 0.10}, 10: {"en": 0.12}, 20: {"en": 0.11}},
                wer_given={0: {"en": 0.08}, 10: {"en": 0.09}, 20: {"en": 0.08}},
                cer={0: {"hi": 1.0, "ta": 1.0}, 20: {"hi": 0.4, "ta": 0.4}},
            ),
        }
    }
    spreads = grid.cell_spreads(runs, base_scores, BASE)
    points = grid.frontier_points(runs, spreads, BASE)
    assert points["defaults"] == [
        pytest.approx((0.6, 0.20, 0.04)),
        pytest.approx((0.4, 0.02, 0.01)),
    ]
