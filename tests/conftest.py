"""Shared test set-up: single-threaded torch (the CI machine has 2 cores; tests run one at a time),
and the tiny tokenizer the dataset and training-cache tests share."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from manifest_schema import lang_tag, tagged_text  # noqa: E402

# Test files that hold a test of minutes, started first. make test runs each file on one of two
# workers (pytest-xdist, --dist loadfile, --no-loadscope-reorder to keep this order): a file that
# starts last and runs five minutes leaves the other worker idle for them; started first, it runs
# while the other works through the short files. Longest first.
LONG_FILES = (
    "test_air_gapped.py",
    "test_gpu_acceptance.py",
    "test_tdt_loss_kernels.py",
    "test_demo.py",
    "test_resume.py",
    "test_job_faults.py",
    "test_run_timeline.py",
    "test_entry_points.py",
    "test_preflight.py",
    "test_full_size_model.py",
    "test_build_wheelhouse.py",
)


def pytest_collection_modifyitems(config, items):
    first = {name: rank for rank, name in enumerate(LONG_FILES)}
    items.sort(
        key=lambda item: first.get(item.path.name, len(first))
    )  # stable: the rest as collected


LANGS = ("hi", "en", "mr")
WORDS = ("नमस्ते", "भारत", "आज", "कल", "मराठी", "hello", "world", "speech", "data", "test")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A tiny SentencePiece model with the language tags as user-defined symbols, wrapped by NeMo."""
    import sentencepiece
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    workdir = tmp_path_factory.mktemp("tokenizer")
    rng = np.random.default_rng(0)
    lines = [
        tagged_text(rng.choice(LANGS), " ".join(rng.choice(WORDS, size=8))) for _ in range(400)
    ]
    (workdir / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(workdir / "corpus.txt"),
        model_prefix=str(workdir / "tokenizer"),
        vocab_size=60,
        hard_vocab_limit=False,
        character_coverage=1.0,
        user_defined_symbols=[lang_tag(lang) for lang in LANGS],
        minloglevel=2,
    )
    return SentencePieceTokenizer(str(workdir / "tokenizer.model"))
