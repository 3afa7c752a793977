"""Step checkpoints load as data, never as code: every reader of a .ckpt (resume, evaluate, export,
a finetune's INIT_MODEL, the tokenizer's base) loads it with torch's weights-only unpickler and
names, by the name its pickle gives, what it may hold besides tensors and plain containers. A
checkpoint that names anything else is refused in one line before any of it runs; the ones
train.py writes, now and before, load whole."""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import re
import shlex
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

import asr_model
import base_tokenizer
import checkpoints
import model_languages
import transcript_style
from tests.tiny_training_data import make_extension_tokenizers, write_manifest
from tests.torchrun_jobs import tiny_train_env

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_tdt.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint as train.py writes it: a 2-step finetune of a tiny English base .nemo on
    Hindi, Tamil and English with its tokenizer extended (the vocabulary changes, as in the usual
    finetune), validated at step 2 and saved there; its validation manifest."""
    root = tmp_path_factory.mktemp("trained")
    tokenizers = make_extension_tokenizers(root / "tokenizers")
    torch.manual_seed(0)
    asr_model.build_model("", TINY, tokenizers["base"]).save_to(str(root / "base.nemo"))
    langs = ("hi", "en", "ta")
    data = {"manifest": write_manifest(root, 6, langs=langs), "tokenizer": tokenizers["extended"]}
    val = write_manifest(root / "val", 2, langs=langs, seed=1, name="val.parquet")
    env = tiny_train_env(
        data,
        DATA_DIR=str(root / "run"),
        INIT_MODEL=str(root / "base.nemo"),
        BASE_LANGUAGES="en",
        VAL_MANIFEST_PATH=str(val),
        MAX_STEPS="2",
        CHECKPOINT_EVERY="2",
        EVAL_EVERY_STEPS="2",
        GRAD_ACCUM="1",
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py")],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        "ckpt": root / "run" / "checkpoints" / "step_00000002.ckpt",
        "val": val,
        "env": env,
        "root": root,
    }


def trusted_load(path: Path) -> dict:
    """The test's own full unpickling of a file it wrote (what the project never does)."""
    return torch.load(path, map_location="cpu", weights_only=False)


# ---- what train.py writes loads whole -----------------------------------------------------------


def test_a_checkpoint_train_py_writes_names_nothing_but_numpys_rng_array(trained):
    # numpy.random.get_state() is the one non-tensor, non-container object a step checkpoint holds
    assert set(torch.serialization.get_unsafe_globals_in_checkpoint(trained["ckpt"])) <= {
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
    }


def assert_same(loaded, expected, where="checkpoint"):
    assert type(loaded) is type(expected), where
    if isinstance(expected, dict):
        assert loaded.keys() == expected.keys(), where
        for key in expected:
            assert_same(loaded[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(loaded) == len(expected), where
        for i, (a, b) in enumerate(zip(loaded, expected)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor | np.ndarray):
        assert loaded.dtype == expected.dtype and (loaded == expected).all(), where
    else:
        assert loaded == expected, where


def test_a_checkpoint_train_py_writes_reads_back_whole(trained):
    assert_same(checkpoints.read_checkpoint(trained["ckpt"]), trusted_load(trained["ckpt"]))


def test_a_checkpoint_train_py_writes_rebuilds_its_model(trained):
    model = asr_model.load_trained_model(trained["ckpt"])
    expected = asr_model.model_weights(trusted_load(trained["ckpt"]))
    for name, tensor in model.state_dict().items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name


def nemo_decoding_enums() -> set[str]:
    """Every enum a field of NeMo's decoding configs (transducer, CTC) can hold, by its pickle name."""
    from nemo.collections.asr.parts.submodules.ctc_decoding import CTCDecodingConfig
    from nemo.collections.asr.parts.submodules.rnnt_decoding import RNNTDecodingConfig

    found, seen = set(), set()

    def walk(kind):
        for arg in typing.get_args(kind):
            walk(arg)
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            found.add(f"{kind.__module__}.{kind.__qualname__}")
        if dataclasses.is_dataclass(kind) and kind not in seen:
            seen.add(kind)
            hints = typing.get_type_hints(kind)
            for field in dataclasses.fields(kind):
                walk(hints.get(field.name, field.type))

    walk(RNNTDecodingConfig)
    walk(CTCDecodingConfig)
    return found


def test_every_enum_a_nemo_decoding_config_holds_is_allowed():
    assert set(checkpoints.NEMO_CONFIG_ENUMS) == nemo_decoding_enums()


def test_the_model_description_holds_nemos_enums_by_name_as_a_nemo_does(trained):
    from nemo.collections.asr.parts.utils.batched_beam_decoding_utils import (
        BlankLMScoreMode,
        PruningMode,
    )

    described = trusted_load(trained["ckpt"])[checkpoints.PORTABLE_KEY]["config"]
    beam = described["decoding"]["beam"]
    assert beam["blank_lm_score_mode"] in BlankLMScoreMode.__members__
    assert beam["pruning_mode"] in PruningMode.__members__


def test_a_checkpoint_whose_model_description_holds_nemos_enums_loads_whole(trained, tmp_path):
    """A model description holding NeMo's decoding enums as enums, not their names."""
    from nemo.collections.asr.parts.utils.batched_beam_decoding_utils import (
        BlankLMScoreMode,
        PruningMode,
    )

    checkpoint = trusted_load(trained["ckpt"])
    beam = checkpoint[checkpoints.PORTABLE_KEY]["config"]["decoding"]["beam"]
    beam["blank_lm_score_mode"] = BlankLMScoreMode[beam["blank_lm_score_mode"]]
    beam["pruning_mode"] = PruningMode[beam["pruning_mode"]]
    written = tmp_path / "step_00000002.ckpt"
    torch.save(checkpoint, written)
    assert set(torch.serialization.get_unsafe_globals_in_checkpoint(written)) >= set(
        checkpoints.NEMO_CONFIG_ENUMS
    )
    assert_same(checkpoints.read_checkpoint(written), checkpoint)
    model = asr_model.load_trained_model(written)
    assert model.cfg.decoding.beam.pruning_mode in (PruningMode.LATE, "LATE")


class NumPy1Pickler(pickle._Pickler):
    """Pickles as NumPy 1 did: its array constructor under ``numpy.core``, not ``numpy._core``."""

    def save_global(self, obj, name=None):
        if obj is np._core.multiarray._reconstruct:
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def test_a_checkpoint_written_under_numpy_1_loads(trained, tmp_path):
    checkpoint = trusted_load(trained["ckpt"])
    written = tmp_path / "step_00000002.ckpt"
    numpy1 = type(sys)("numpy1_pickle")
    numpy1.Pickler = NumPy1Pickler
    torch.save(checkpoint, written, pickle_module=numpy1)
    assert "numpy.core.multiarray._reconstruct" in (
        torch.serialization.get_unsafe_globals_in_checkpoint(written)
    )
    state = checkpoints.read_checkpoint(written)["rng_states"][0]["numpy"]
    assert (state[1] == checkpoint["rng_states"][0]["numpy"][1]).all()


# ---- anything else is refused before it runs ----------------------------------------------------


class RunsCode:
    """What a planted checkpoint holds: an object whose unpickling runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def planted_checkpoint(directory: Path, marker: Path) -> Path:
    """A step checkpoint that looks like train.py's but runs ``touch marker`` as it is unpickled."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "step_00000003.ckpt"
    torch.save({"global_step": 3, "state_dict": {}, "extra": RunsCode(marker)}, path)
    return path


def test_the_planted_checkpoint_runs_its_code_when_unpickled(tmp_path):
    """The premise of the tests below: a full unpickling of it does run the command."""
    marker = tmp_path / "ran"
    trusted_load(planted_checkpoint(tmp_path, marker))
    assert marker.exists()


READERS = {
    "read_checkpoint": checkpoints.read_checkpoint,
    "checkpoint_step": checkpoints.checkpoint_step,
    "resume (AtomicCheckpointIO)": lambda p: checkpoints.AtomicCheckpointIO().load_checkpoint(p),
    "resume settings": checkpoints.check_resume_settings,
    "evaluate / export (load_trained_model)": asr_model.load_trained_model,
    "INIT_MODEL's languages": lambda p: model_languages.recorded_languages(str(p)),
    "INIT_MODEL's style": transcript_style.recorded_style,
    "the tokenizer's base": lambda p: base_tokenizer.base_tokenizer_model(str(p)),
}


@pytest.mark.parametrize("reader", READERS, ids=list(READERS))
def test_a_checkpoint_whose_pickle_runs_code_is_refused_before_it_runs(tmp_path, reader):
    marker = tmp_path / "ran"
    path = planted_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(checkpoints.CheckpointError) as refused:
        READERS[reader](path)
    assert not marker.exists()
    message = str(refused.value)
    assert "\n" not in message
    assert f"refusing to load checkpoint {path}: its pickle names posix.system" in message


def test_a_type_refused_while_unpickling_is_named_in_one_line(tmp_path):
    # float64 arrays: their globals are allowed (numpy's RNG array is uint32), their dtype is not
    path = tmp_path / "step_00000001.ckpt"
    torch.save({"global_step": 1, "extra": np.zeros(3)}, path)
    with pytest.raises(checkpoints.CheckpointError) as refused:
        checkpoints.read_checkpoint(path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"refusing to load checkpoint {path}:")
    assert "numpy.dtypes.Float64DType" in message


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    "script", ["train.py", "scripts/evaluate.py", "scripts/export_nemo.py"], ids=str
)
def test_every_script_refuses_a_planted_checkpoint_in_one_line(trained, tmp_path, script):
    marker = tmp_path / "ran"
    run_dir = tmp_path / "run"
    planted = planted_checkpoint(run_dir / "checkpoints", marker)
    env = {**trained["env"], "DATA_DIR": str(run_dir)}
    if script == "train.py":
        args, env["RESUME_FROM"] = [], "last"
    elif script == "scripts/evaluate.py":
        args = [str(planted), "--manifest", str(trained["val"]), "--device", "cpu"]
    else:
        args = [str(planted)]
    proc = subprocess.run(
        [sys.executable, str(REPO / script), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "its pickle names posix.system" in one_error_line(proc)
    assert not marker.exists()


def test_lightning_resumes_through_the_same_refusal(tmp_path):
    """trainer.fit(ckpt_path=...) loads through the strategy's checkpoint IO, which the step
    checkpoint callback makes AtomicCheckpointIO (Lightning's own would unpickle it whole)."""
    from tests.test_callbacks import fit

    marker = tmp_path / "ran"
    planted = planted_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(checkpoints.CheckpointError, match="its pickle names posix.system"):
        fit(tmp_path, max_steps=6, ckpt_path=str(planted))
    assert not marker.exists()


# ---- a model description is data: what it may name is a closed set ------------------------------

PLANTED_MODULE = "planted_description_module"


def plant_module(directory: Path, marker: Path) -> Path:
    """A module that touches ``marker`` when imported, in ``directory`` (put on the import path)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{PLANTED_MODULE}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\nclass Model:\n"
        "    def __init__(self, cfg=None):\n        pass\n"
    )
    return directory


def description_with(trained_ckpt: Path, field: str, escape: Path) -> dict:
    """The real description of ``trained_ckpt`` with one field planted: a tokenizer file named by
    an absolute path and by ``../``, the class, or an encoder ``_target_`` naming the planted module."""
    description = dict(trusted_load(trained_ckpt)[asr_model.PORTABLE_KEY])
    if field == "tokenizer":
        description["tokenizer"] = {
            **description["tokenizer"],
            str(escape / "absolute.py"): b"written = True\n",
            "../escaped.py": b"written = True\n",
        }
    elif field == "class":
        description["class"] = f"{PLANTED_MODULE}.Model"
    else:
        cfg = dict(description["config"])
        cfg["encoder"] = {**cfg["encoder"], "_target_": f"{PLANTED_MODULE}.Model"}
        description["config"] = cfg
    return description


def planted_description_checkpoint(trained_ckpt: Path, path: Path, field: str, escape: Path):
    """A checkpoint of plain data (it passes the weights-only unpickler) whose description plants
    ``field``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = trusted_load(trained_ckpt)
    checkpoint[asr_model.PORTABLE_KEY] = description_with(trained_ckpt, field, escape)
    torch.save(checkpoint, path)
    checkpoints.read_checkpoint(path)  # the premise: the unpickler lets it through
    return path


DESCRIPTION_READERS = {
    "evaluate / export / transcribe / INIT_MODEL (load_trained_model)": asr_model.load_trained_model,
    "export --blend-base": lambda p: __import__("scripts.export_nemo").export_nemo.base_as_received(
        checkpoints.read_checkpoint(p)["run_record"],
        checkpoints.read_checkpoint(p)[asr_model.PORTABLE_KEY],
        checkpoint=str(p),
    ),
    "the tokenizer's base": lambda p: base_tokenizer.base_tokenizer_model(str(p)),
}
FIELD_NAMED = {
    "tokenizer": "'tokenizer' file name",
    "class": f"'class' '{PLANTED_MODULE}.Model'",
    "_target_": f"config.encoder._target_ '{PLANTED_MODULE}.Model'",
}


@pytest.mark.parametrize("field", list(FIELD_NAMED))
@pytest.mark.parametrize("reader", DESCRIPTION_READERS, ids=list(DESCRIPTION_READERS))
def test_a_description_naming_files_or_code_outside_its_closed_set_writes_and_runs_nothing(
    trained, tmp_path, monkeypatch, field, reader
):
    marker = tmp_path / "imported"
    monkeypatch.syspath_prepend(str(plant_module(tmp_path / "importable", marker)))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where "../" from a temp dir lands
    escape = tmp_path / "elsewhere"
    path = planted_description_checkpoint(
        trained["ckpt"], tmp_path / "ckpt" / "step_00000002.ckpt", field, escape
    )
    with pytest.raises(checkpoints.CheckpointError) as refused:
        DESCRIPTION_READERS[reader](path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"refusing the model description in {path}: {FIELD_NAMED[field]}")
    assert not marker.exists() and PLANTED_MODULE not in sys.modules
    assert not escape.exists() and not (tmp_path / "escaped.py").exists()
    assert list(scratch.iterdir()) == []  # not even an empty temporary directory


def test_evaluate_refuses_a_description_that_would_write_and_import_in_one_line(trained, tmp_path):
    """The reproduction as a user meets it: scripts/evaluate.py on a .ckpt of plain data whose
    description names a tokenizer file outside any directory and a class in a module on the path."""
    marker = tmp_path / "imported"
    importable = plant_module(tmp_path / "importable", marker)
    path = tmp_path / "ckpt" / "step_00000002.ckpt"
    checkpoint = trusted_load(trained["ckpt"])
    description = description_with(trained["ckpt"], "tokenizer", tmp_path / "elsewhere")
    description["class"] = f"{PLANTED_MODULE}.Model"
    checkpoint[asr_model.PORTABLE_KEY] = description
    path.parent.mkdir()
    torch.save(checkpoint, path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**trained["env"], "PYTHONPATH": str(importable), "TMPDIR": str(scratch)}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/evaluate.py"),
            str(path),
            "--manifest",
            str(trained["val"]),
            "--device",
            "cpu",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = one_error_line(proc)
    assert f"refusing the model description in {path}: 'tokenizer' file name" in line
    assert not marker.exists() and not (tmp_path / "elsewhere").exists()
    assert not (tmp_path / "escaped.py").exists()
    assert not [p for p in scratch.rglob("*") if p.suffix == ".py"]


def test_a_description_train_py_writes_passes_the_check_unchanged(trained):
    description = trusted_load(trained["ckpt"])[asr_model.PORTABLE_KEY]
    assert asr_model.check_description(description, trained["ckpt"]) is description
    assert description["class"].rpartition(".")[2] in {k.nemo_class for k in asr_model.FAMILIES}


def test_the_docs_name_exactly_what_a_model_description_may_name():
    """docs/operations.md's "What loading a checkpoint or a .nemo trusts" lists the closed set the
    check enforces: every tokenizer file, every family class and the module package."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("### What loading a checkpoint or a `.nemo` trusts", 1)[1].split("\n### ")[
        0
    ]
    listed = set(re.findall(r"`([\w.]+\.(?:model|vocab|txt|json))`", section))
    assert listed == set(asr_model.TOKENIZER_FILES)
    for family in asr_model.FAMILIES:
        assert f"`{family.nemo_class}`" in section
    assert f"`{asr_model.DESCRIPTION_CLASS_PACKAGE}`" in section
    assert f"`{asr_model.DESCRIPTION_TARGET_PACKAGE}`" in section
