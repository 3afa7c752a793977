"""A base named by its Hugging Face name (INIT_MODEL=org/model) on a node without internet: every
step that needs its style, tokenizer or weights stops in one line and within seconds, naming
INIT_MODEL and the path form to use instead, and nothing takes its place; a copy already in
Hugging Face's cache is used offline. Each test runs the real script as a user would, with the hub
made unreachable in its own environment (HF_HUB_OFFLINE, or HF_ENDPOINT at a port nobody serves)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
import sentencepiece as spm

from tests.shard_factory import write_shard
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import free_port, tiny_train_env

REPO = Path(__file__).resolve().parents[1]
HUB_NAME = "nvidia/parakeet-tdt-0.6b-v2"
SENTENCES = ["Is it raining? Yes, it is.", "क्या बारिश हो रही है? हाँ, हो रही है।"]


def hub_env(base: dict, tmp_path: Path, way: str) -> dict:
    """``base`` with INIT_MODEL a hub name, an empty Hugging Face cache of its own, and the hub
    unreachable ``way``: offline set (either variable), or its server refusing connections."""
    env = {k: v for k, v in base.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(INIT_MODEL=HUB_NAME, HF_HOME=str(tmp_path / "hf"), PYTHONDONTWRITEBYTECODE="1")
    if way == "HF_HUB_OFFLINE":
        env["HF_HUB_OFFLINE"] = "1"
    elif way == "TRANSFORMERS_OFFLINE":
        env["TRANSFORMERS_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    return env


def run_timed(args: list[str], env: dict, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - started


def start_seconds(script: str, env: dict, cwd: Path) -> float:
    """What ``script --help`` takes here (its imports, no work): the floor of its time to an error."""
    return run_timed([sys.executable, str(REPO / script), "--help"], env, cwd)[1]


def shard_tree(root: Path) -> Path:
    rows = [
        {"segment_id": f"en{i}", "transcription_native": SENTENCES[0], "speaker_id": f"s{i}"}
        for i in range(3)
    ]
    write_shard(root / "shards", "src", "en", "s0", rows)
    return root / "shards"


def assert_one_line_naming_the_path_form(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"INIT_MODEL={HUB_NAME} cannot be fetched" in errors[0]
    assert "set INIT_MODEL=/path/to/model.nemo" in errors[0]
    assert "Traceback" not in proc.stderr and "Retrying" not in proc.stderr
    return errors[0]


WAYS = ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "refused"]


@pytest.mark.parametrize("way", WAYS)
def test_build_manifest_with_a_hub_name_and_no_network_stops_in_one_line_and_writes_nothing(
    tmp_path, way
):
    env = hub_env(os.environ, tmp_path, way)
    env.update(SHARDS_DIR=str(shard_tree(tmp_path)), DATA_DIR=str(tmp_path / "data"))
    out = tmp_path / "master.parquet"
    proc, seconds = run_timed(
        [sys.executable, str(REPO / "build_manifest.py"), "--output", str(out), "--no-progress"],
        env,
        tmp_path,
    )
    error = assert_one_line_naming_the_path_form(proc)
    assert (way if way != "refused" else "does not answer") in error
    assert not out.exists()  # no manifest of a style the base does not write
    # huggingface_hub alone retries a refused connection for 24 s
    assert seconds < start_seconds("build_manifest.py", env, tmp_path) + 10


@pytest.mark.parametrize("way", WAYS)
def test_train_tokenizer_with_a_hub_name_and_no_network_stops_in_one_line(tmp_path, way):
    data = make_training_data(tmp_path, per_lang=4, vocab_size=64)
    env = hub_env(os.environ, tmp_path, way)
    env.update(
        TRAIN_MANIFEST_PATH=str(data["manifest"]),
        TOKENIZER_DIR=str(tmp_path / "extended"),
        DATA_DIR=str(tmp_path / "data"),
    )
    proc, seconds = run_timed(
        [sys.executable, str(REPO / "scripts" / "train_tokenizer.py")], env, tmp_path
    )
    assert_one_line_naming_the_path_form(proc)
    assert not (tmp_path / "extended").exists()
    assert seconds < start_seconds("scripts/train_tokenizer.py", env, tmp_path) + 10


@pytest.mark.parametrize("way", ["HF_HUB_OFFLINE", "refused"])
def test_train_with_a_hub_name_and_no_network_stops_in_one_line(tmp_path, way):
    data = make_training_data(tmp_path, per_lang=4, vocab_size=64)
    env = hub_env(tiny_train_env(data, DATA_DIR=str(tmp_path / "run")), tmp_path, way)
    proc, seconds = run_timed([sys.executable, str(REPO / "train.py")], env, tmp_path)
    assert_one_line_naming_the_path_form(proc)
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))
    assert seconds < start_seconds("train.py", env, tmp_path) + 15


class SilentHub:
    """A server at a local port that accepts connections and closes them unanswered (a proxy or
    firewall that cuts the hub off), counting them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self):
        self.sock.close()


def test_a_hub_that_does_not_answer_is_asked_once(tmp_path):
    hub = SilentHub()
    try:
        env = hub_env(os.environ, tmp_path, "refused")
        env.update(
            HF_ENDPOINT=f"http://127.0.0.1:{hub.port}",
            SHARDS_DIR=str(shard_tree(tmp_path)),
            DATA_DIR=str(tmp_path / "data"),
        )
        proc, _ = run_timed(
            [sys.executable, str(REPO / "build_manifest.py"), "--no-progress"], env, tmp_path
        )
    finally:
        hub.close()
    assert_one_line_naming_the_path_form(proc)
    assert hub.connections == 1


def cached_hub_model(hf_home: Path, name: str, tokenizer_model: bytes) -> Path:
    """A .nemo holding a SentencePiece tokenizer, where Hugging Face's cache keeps a download of
    ``name`` (hub/models--org--name/snapshots/<revision>/<name>.nemo, refs/main naming it)."""
    org, model = name.split("/")
    repo = hf_home / "hub" / f"models--{org}--{model}"
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    nemo = repo / "snapshots" / revision / f"{model}.nemo"
    nemo.parent.mkdir(parents=True)
    with tarfile.open(nemo, "w") as archive:
        for member, data in (
            ("./model_config.yaml", b"tokenizer:\n  type: bpe\n  model_path: tokenizer.model\n"),
            ("./tokenizer.model", tokenizer_model),
        ):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return nemo


def punctuated_tokenizer(tmp_path: Path) -> bytes:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 20),
        model_prefix=str(tmp_path / "punctuated"),
        vocab_size=40,
        character_coverage=1.0,
        hard_vocab_limit=False,
    )
    return (tmp_path / "punctuated.model").read_bytes()


def test_a_base_in_hugging_faces_cache_is_used_offline(tmp_path):
    cached_hub_model(tmp_path / "hf", HUB_NAME, punctuated_tokenizer(tmp_path))
    env = hub_env(os.environ, tmp_path, "HF_HUB_OFFLINE")
    env.update(SHARDS_DIR=str(shard_tree(tmp_path)), DATA_DIR=str(tmp_path / "data"))
    out = tmp_path / "master.parquet"
    proc, _ = run_timed(
        [sys.executable, str(REPO / "build_manifest.py"), "--output", str(out), "--no-progress"],
        env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"transcripts cleaned punctuated (TRANSCRIPT_STYLE=auto: INIT_MODEL={HUB_NAME}'s "
        f"tokenizer has punctuation pieces)" in proc.stdout
    )


def test_a_name_that_cannot_be_a_repository_names_the_path_form():
    import pretrained_models

    with pytest.raises(pretrained_models.ModelNotFetched) as refused:  # a path without its .nemo
        pretrained_models.pretrained_nemo("/models/parakeet")
    assert "INIT_MODEL=/models/parakeet is neither a file nor" in str(refused.value)
    assert "set INIT_MODEL=/path/to/model.nemo" in str(refused.value)
