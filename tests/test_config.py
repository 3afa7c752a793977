"""config.py: typed environment overrides, derived paths, and one clear error per bad value."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import config
import training_step

REPO = Path(config.__file__).resolve().parent


def test_defaults_match_the_documented_values():
    knobs = config.read_config({})
    values = {k: v.value for k, v in knobs.items()}
    assert values["TARGET_SAMPLE_RATE"] == 16000
    assert values["MAX_DURATION"] == 20.0
    assert values["MAX_TOKEN_LEN"] == 512
    assert values["BUCKET_BOUNDARIES"] == (3.0, 5.0, 8.0, 12.0, 16.0)
    assert values["MAX_BATCH_DURATION"] == 90.0
    assert values["TEMPERATURE"] == 0.3
    assert values["NUM_WORKERS"] == config.default_workers({})
    assert values["GRAD_ACCUM"] == 4
    assert values["MAX_STEPS"] == 600000
    assert values["CHECKPOINT_EVERY"] == 5000
    assert values["PHASE1_LR"] == 3e-4
    assert values["PHASE2_LR"] == 1e-4
    assert values["UNFREEZE_STEP"] == 40000
    assert values["WARMUP_STEPS"] == 5000
    assert values["PHASE2_WARMUP"] == 3000
    assert values["EVAL_EVERY_STEPS"] == 5000  # = CHECKPOINT_EVERY: every checkpoint is scored
    assert values["EVAL_SAMPLES_PER_LANG"] == 0  # the whole validation manifest
    assert values["PRECISION"] == "bf16-mixed"


def test_validation_follows_the_checkpoint_interval_unless_set():
    assert config.read_config({"CHECKPOINT_EVERY": "300"})["EVAL_EVERY_STEPS"].value == 300
    knobs = config.read_config({"CHECKPOINT_EVERY": "300", "EVAL_EVERY_STEPS": "0"})
    assert knobs["EVAL_EVERY_STEPS"].value == 0 and knobs["EVAL_EVERY_STEPS"].source == "env"


def test_every_knob_the_pipeline_documents_exists():
    names = set(config.read_config({}))
    required = """DATA_DIR SHARDS_DIR MASTER_MANIFEST_PATH TRAIN_MANIFEST_PATH VAL_MANIFEST_PATH TOKENIZER_DIR
    CHECKPOINT_DIR WANDB_LOG_DIR WANDB_PROJECT WANDB_MODE INIT_MODEL MODEL_CONFIG RESUME_FROM LANGUAGES
    TARGET_SAMPLE_RATE MIN_DURATION MAX_DURATION MIN_QUALITY MAX_TOKEN_LEN BUCKET_BOUNDARIES
    MAX_BATCH_DURATION TEMPERATURE NUM_WORKERS GRAD_ACCUM MAX_STEPS CHECKPOINT_EVERY PHASE1_LR PHASE2_LR
    MIN_LR UNFREEZE_STEP WARMUP_STEPS PHASE2_WARMUP EVAL_EVERY_STEPS EVAL_SAMPLES_PER_LANG SEED PRECISION""".split()
    assert set(required) <= names


def test_environment_values_are_typed():
    knobs = config.read_config(
        {
            "GRAD_ACCUM": "8",
            "TEMPERATURE": "0.5",
            "LANGUAGES": "hi, ta,en",
            "BUCKET_BOUNDARIES": "2,4.5,9",
            "PRECISION": "32-true",
        }
    )
    assert knobs["GRAD_ACCUM"].value == 8 and knobs["GRAD_ACCUM"].source == "env"
    assert knobs["TEMPERATURE"].value == 0.5
    assert knobs["LANGUAGES"].value == ("hi", "ta", "en")
    assert knobs["BUCKET_BOUNDARIES"].value == (2.0, 4.5, 9.0)
    assert knobs["PRECISION"].value == "32-true"
    assert knobs["SEED"].source == "default"


def test_auto_bucket_boundaries_are_accepted():
    assert (
        config.read_config({"BUCKET_BOUNDARIES": "auto:6"})["BUCKET_BOUNDARIES"].value == "auto:6"
    )


def test_derived_paths_follow_data_dir(tmp_path):
    knobs = config.read_config({"DATA_DIR": str(tmp_path)})
    assert knobs["TRAIN_MANIFEST_PATH"].value == tmp_path / "train_manifest_v2.parquet"
    assert knobs["CHECKPOINT_DIR"].value == tmp_path / "checkpoints"
    assert knobs["SHARDS_DIR"].source == "derived"


def test_a_derived_path_set_itself_wins_over_data_dir(tmp_path):
    knobs = config.read_config({"DATA_DIR": str(tmp_path), "CHECKPOINT_DIR": "/elsewhere/ckpt"})
    assert knobs["CHECKPOINT_DIR"].value == Path("/elsewhere/ckpt")
    assert knobs["CHECKPOINT_DIR"].source == "env"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"GRAD_ACCUM": "four"}, "GRAD_ACCUM='four': expected an integer"),
        ({"TEMPERATURE": "-1"}, "TEMPERATURE='-1': expected a value >= 0"),
        (
            {"BUCKET_BOUNDARIES": "5,3"},
            "BUCKET_BOUNDARIES='5,3': expected strictly increasing seconds",
        ),
        (
            {"MAX_DURATION": "3", "MIN_DURATION": "5"},
            "MAX_DURATION=3.0 with MIN_DURATION=5.0: expected MIN_DURATION < MAX_DURATION",
        ),
        ({"PRECISION": "fp13"}, "PRECISION='fp13': expected one of"),
        ({"MAX_STEPS": "0"}, "MAX_STEPS='0': expected a value > 0"),
        ({"BUCKET_BOUNDARIES": "auto:x"}, "BUCKET_BOUNDARIES='auto:x': expected 'auto:K'"),
        ({"WANDB_MODE": "sometimes"}, "WANDB_MODE='sometimes': expected one of"),
        ({"TDT_LOSS": "warp"}, "TDT_LOSS='warp': expected one of numba, torch"),
    ],
)
def test_bad_values_name_the_variable_value_and_expectation(env, message):
    with pytest.raises(config.ConfigError) as err:
        config.read_config(env)
    assert message in str(err.value)


def test_all_bad_values_are_reported_together():
    with pytest.raises(config.ConfigError) as err:
        config.read_config({"GRAD_ACCUM": "four", "PRECISION": "fp13"})
    assert "GRAD_ACCUM" in str(err.value) and "PRECISION" in str(err.value)


def _run_config(env_extra, *args):
    env = {k: v for k, v in os.environ.items() if k not in config.KNOBS}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, str(REPO / "config.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def test_a_bad_value_fails_at_import_as_one_line_and_exit_code_2():
    proc = _run_config({"GRAD_ACCUM": "four"})
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "error: invalid configuration: GRAD_ACCUM='four': expected an integer"
    )


def test_a_path_whose_bytes_are_not_utf8_is_refused_at_import_with_its_bytes_shown():
    # os.environ holds a Latin-1 byte as a surrogate escape; subprocess passes it on as the byte.
    proc = _run_config({"VAL_MANIFEST_PATH": "v\udce9.parquet"})
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line
    assert line.startswith(
        "error: invalid configuration: VAL_MANIFEST_PATH='v\\xe9.parquet': expected a path in UTF-8"
    )
    # the same name in UTF-8 is a path like any other
    assert config.read_config({"VAL_MANIFEST_PATH": "vé.parquet"})["VAL_MANIFEST_PATH"].value == (
        Path("vé.parquet")
    )


@pytest.mark.parametrize("name", ["INIT_MODEL", "RESUME_FROM", "WANDB_RUN_NAME"])
def test_a_text_setting_whose_bytes_are_not_utf8_is_refused_like_a_path(name):
    """INIT_MODEL and RESUME_FROM name files but are text (a pretrained name, 'last'); a run name
    names a directory. Each is written as text hours in, so each is refused at import."""
    raw = "base_\udce9.nemo"
    with pytest.raises(config.ConfigError) as refused:
        config.read_config({name: raw})
    message = str(refused.value)
    assert f"{name}='base_\\xe9.nemo': expected UTF-8 text" in message
    assert "\n" not in message.strip()
    assert config.read_config({name: "base_é.nemo"})[name].value == "base_é.nemo"


def test_every_setting_is_refused_when_its_bytes_are_not_utf8():
    """No setting passes a value that cannot be written as text (run records, hparams, W&B)."""
    passed = []
    for name, knob in config.read_config({}).items():
        if knob.source == "derived":
            continue
        try:
            config.read_config({name: "x\udce9"})
        except config.ConfigError as exc:
            assert f"{name}='x\\xe9'" in str(exc)
        else:
            passed.append(name)
    assert passed == []


def test_help_prints_usage_and_runs_nothing():
    proc = _run_config({}, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: config.py")
    assert "--update-docs" in proc.stdout and "DATA_DIR" not in proc.stdout


# ---- variables that look like knobs but are none ------------------------------------------------


@pytest.mark.parametrize(
    "name, closest",
    [
        ("MAX_STEP", "MAX_STEPS"),  # a letter missing
        ("GRAD_ACUM", "GRAD_ACCUM"),
        ("TEMPRATURE", "TEMPERATURE"),
        ("PHASE3_LR", "PHASE1_LR"),
        ("max_steps", "MAX_STEPS"),  # lower case
        ("WANDB_PROJCT", "WANDB_PROJECT"),
        ("EVAL_EVERY", "EVAL_EVERY_STEPS"),  # our words, no such knob
        ("TRAIN_MANIFEST", "TRAIN_MANIFEST_PATH"),
        ("RUN_NAME", "WANDB_RUN_NAME"),
    ],
)
def test_a_variable_that_looks_like_a_knob_is_refused_with_the_closest_knob(name, closest):
    with pytest.raises(config.ConfigError) as err:
        config.read_config({name: "10"})
    assert f"{name} is not a setting; did you mean {closest}?" in str(err.value)
    assert f"IGNORE_UNKNOWN_ENV={name}" in str(err.value)


@pytest.mark.parametrize(
    "name",
    [
        "LANGUAGE",  # gettext's, one letter from LANGUAGES
        "CUDA_VISIBLE_DEVICES",
        "NCCL_SOCKET_IFNAME",
        "SLURM_JOB_ID",
        "OMP_NUM_THREADS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "WANDB_API_KEY",  # W&B reads it
        "WANDB_NAME",
        "WANDB_CONFIG",
        "WANDB_ENTITY",
        "MASTER_ADDR",
        "LOCAL_WORLD_SIZE",
        "HF_HOME",
        "PYTHONHASHSEED",
        "UV_CACHE_DIR",
        "MAX_JOBS",
        "NODE_RANK",  # slurm_train.sh's
        "PREEMPT_SAVE_SECONDS",
        "DEMO_CLEAN",  # demo.sh's
        "PATH",
        "HOME",
    ],
)
def test_other_tools_variables_and_our_scripts_own_are_never_flagged(name):
    config.read_config({name: "1"})


def test_every_variable_other_libraries_read_passes():
    # Every os.environ name read by torch, Lightning, NeMo, W&B and the rest of the installed
    # packages (scanned from their sources) must pass, or a real job's environment would be refused.
    import re
    import site

    names: set[str] = set()
    pattern = re.compile(r"environ(?:\.get)?[\[(]\s*[\"']([A-Z][A-Z0-9_]*)[\"']")
    for root in site.getsitepackages():
        for package in (
            "torch",
            "lightning",
            "nemo",
            "wandb",
            "numba",
            "huggingface_hub",
            "lhotse",
        ):
            for path in Path(root, package).rglob("*.py"):
                names.update(pattern.findall(path.read_text(errors="ignore")))
    assert len(names) > 300
    assert config.unknown_variables({n: "1" for n in names}, config.KNOBS) == []


def test_ignore_unknown_env_lets_a_named_variable_pass_and_star_turns_the_check_off():
    config.read_config({"MAX_STEP": "10", "IGNORE_UNKNOWN_ENV": "MAX_STEP"})
    config.read_config({"MAX_STEP": "10", "EVAL_EVERY": "3", "IGNORE_UNKNOWN_ENV": "*"})
    with pytest.raises(config.ConfigError, match="EVAL_EVERY is not a setting"):
        config.read_config({"MAX_STEP": "10", "EVAL_EVERY": "3", "IGNORE_UNKNOWN_ENV": "MAX_STEP"})


def test_languages_are_lower_cased_and_deduplicated():
    assert config.read_config({"LANGUAGES": "hi, EN,en"})["LANGUAGES"].value == ("hi", "en")


def test_printing_shows_values_and_their_source():
    proc = _run_config({"TEMPERATURE": "0.7"})
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "0.7" in lines["TEMPERATURE"] and "(env)" in lines["TEMPERATURE"]
    assert "(default)" in lines["GRAD_ACCUM"]
    assert set(lines) == set(config.KNOBS)


def test_markdown_table_lists_every_knob():
    table = config.markdown_table(config.read_config({}))
    for name in config.KNOBS:
        assert f"| `{name}` |" in table


def test_wandb_defaults_to_offline_without_an_api_key(monkeypatch):
    monkeypatch.setattr(config, "WANDB_MODE", "")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert config.wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert config.wandb_mode() == "online"


def test_readme_opens_with_the_two_commands():
    head = (REPO / "README.md").read_text(encoding="utf-8").splitlines()[:6]
    commands = [line.split("#")[0].strip() for line in head if line.startswith("make ")]
    assert commands == ["make demo", "make test"]


def test_docs_variable_table_is_generated_from_config(tmp_path):
    page = tmp_path / "knobs.md"
    page.write_text((REPO / "docs" / "knobs.md").read_text(encoding="utf-8"), encoding="utf-8")
    assert not config.update_docs(page), "docs/knobs.md table is stale: run `make docs`"


def test_ci_runs_exactly_the_readme_test_command():
    lines = [l.strip() for l in (REPO / ".ci" / "run").read_text().splitlines()]
    assert [
        l for l in lines if l and not l.startswith("#") and not l.startswith(("set ", "cd "))
    ] == ["make test"]


# The modules a training run executes (train.py and what it imports from this project).
TRAINING_MODULES = (
    "train.py",
    "training_step.py",
    "asr_model.py",
    "callbacks.py",
    "checkpoints.py",
    "run_logging.py",
    "evaluation.py",
    "training_metrics.py",
    "collectives.py",
    "dataset.py",
    "sampler.py",
    "tdt_loss.py",
)
KNOB_READ = re.compile(
    r'\b_?config\.([A-Z][A-Z0-9_]+)\b|_default\([^()]*?,\s*"([A-Z][A-Z0-9_]+)"\)'
)


def knobs_read_by(paths) -> set[str]:
    found = set()
    for path in paths:
        for m in KNOB_READ.finditer((REPO / path).read_text(encoding="utf-8")):
            found.add(m.group(1) or m.group(2))
    return found & set(config.KNOBS)


def test_every_knob_read_by_training_is_tagged_train_and_shown_by_train_help(capsys):
    import train

    read = knobs_read_by(TRAINING_MODULES)
    assert {"GRAD_ACCUM", "BUCKET_SORT_JITTER", "TDT_LOSS", "TRAIN_MANIFEST_PATH"} <= read
    untagged = sorted(n for n in read if "train" not in config.KNOBS[n].steps)
    assert untagged == [], f"knobs read by training but not tagged steps=('train', ...): {untagged}"
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    assert sorted(n for n in read if f"\n  {n}=" not in out) == []


def test_every_step_tag_is_a_known_step_and_every_knob_has_one():
    for knob in config.KNOBS.values():
        assert knob.steps and set(knob.steps) <= set(config.STEPS), knob.name


def test_help_of_a_step_lists_exactly_its_knobs():
    text = config.describe_for_help("make_train_val")
    listed = {line.split("=")[0].strip() for line in text.splitlines()}
    assert listed == {n for n, k in config.KNOBS.items() if "make_train_val" in k.steps}
    with pytest.raises(ValueError, match="unknown step"):
        config.describe_for_help("tokenise")


def test_the_typed_names_are_exactly_the_knobs():
    annotated = {n for n in config.__annotations__ if n.isupper()}
    assert annotated == set(config.KNOBS)


@pytest.mark.parametrize(
    "cores, local_ranks, workers", [(64, 8, 4), (16, 8, 1), (2, 2, 1), (96, 8, 4), (24, 8, 2)]
)
def test_default_workers_share_the_nodes_cores_among_its_ranks(
    monkeypatch, cores, local_ranks, workers
):
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert config.default_workers({"LOCAL_WORLD_SIZE": str(local_ranks)}) == workers
    knobs = config.read_config({"LOCAL_WORLD_SIZE": str(local_ranks)})
    assert knobs["NUM_WORKERS"].value == workers and knobs["NUM_WORKERS"].source == "derived"
    assert config.read_config({"NUM_WORKERS": "6"})["NUM_WORKERS"].value == 6


def schedule(monkeypatch, **values):
    for name, value in values.items():
        monkeypatch.setattr(config, name, value)
    return training_step.schedule_warnings()


def test_a_schedule_that_fits_the_run_has_no_warning(monkeypatch):
    assert (
        schedule(monkeypatch, MAX_STEPS=1000, UNFREEZE_STEP=400, WARMUP_STEPS=40, PHASE2_WARMUP=60)
        == []
    )


def test_a_warmup_longer_than_phase_1_names_both_knobs_and_a_warmup_that_fits(monkeypatch):
    # UNFREEZE_STEP=0: there is no phase 1, so its warmup never runs
    assert (
        schedule(monkeypatch, MAX_STEPS=3, UNFREEZE_STEP=0, WARMUP_STEPS=5000, PHASE2_WARMUP=1)
        == []
    )
    lines = schedule(monkeypatch, MAX_STEPS=300, UNFREEZE_STEP=100, WARMUP_STEPS=5000)
    assert len(lines) == 1
    assert lines[0].startswith("WARMUP_STEPS=5000 is longer than phase 1 (100 optimizer steps")
    assert lines[0].endswith("set WARMUP_STEPS=10 (a tenth of phase 1)")


def test_a_phase_2_warmup_longer_than_phase_2_names_a_warmup_that_fits(monkeypatch):
    (line,) = schedule(
        monkeypatch, MAX_STEPS=150, UNFREEZE_STEP=100, WARMUP_STEPS=10, PHASE2_WARMUP=3000
    )
    assert line.startswith("PHASE2_WARMUP=3000 is longer than phase 2 (50 optimizer steps")
    assert line.endswith("set PHASE2_WARMUP=5 (a tenth of phase 2)")


def test_an_encoder_never_unfrozen_is_said_with_a_step_that_unfreezes_it(monkeypatch):
    lines = schedule(monkeypatch, MAX_STEPS=3, UNFREEZE_STEP=40000, WARMUP_STEPS=5000)
    assert any(line.startswith("WARMUP_STEPS=5000 is longer than phase 1 (3 ") for line in lines)
    assert any(
        line.startswith("UNFREEZE_STEP=40000 >= MAX_STEPS=3: the encoder stays frozen")
        and "set UNFREEZE_STEP=1" in line
        for line in lines
    )


def test_a_base_language_share_of_one_or_more_is_refused():
    with pytest.raises(
        config.ConfigError, match=r"BASE_LANGUAGE_SHARE='1': expected a share in \[0, 1\)"
    ):
        config.read_config({"BASE_LANGUAGE_SHARE": "1"})
