"""A base model's SentencePiece tokenizer, from wherever the base is: ``base_tokenizer_model``.

The tokenizer step extends it and the transcript style is judged by it, both before any model is
built, so reading it imports neither torch nor NeMo's models unless the base is a step checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import vocabulary


def base_tokenizer_model(source: str, setting: str = "INIT_MODEL") -> tuple[bytes, str]:
    """The serialized SentencePiece model of ``source`` and a description of where it came from.

    ``source``: a tokenizer directory (tokenizer.model), a .nemo file, a train.py step checkpoint
    (.ckpt, which carries its tokenizer) or a pretrained model name (its .nemo, from Hugging Face's
    cache or downloaded: ``pretrained_models.pretrained_nemo``, whose ModelNotFetched names
    ``setting``)."""
    path = Path(source)
    if path.is_dir():
        model = path / "tokenizer.model"
        if not model.is_file():
            raise vocabulary.TokenizerError(f"base tokenizer {path} has no tokenizer.model")
        return model.read_bytes(), f"the tokenizer directory {path}"
    if path.is_file() and path.suffix == ".nemo":
        return _nemo_tokenizer_model(path), f"the tokenizer of {path}"
    if path.is_file() and path.suffix == ".ckpt":
        import asr_model  # a step checkpoint's description is checked as every reader checks it
        from checkpoints import read_checkpoint

        portable = read_checkpoint(path, mmap=True).get(asr_model.PORTABLE_KEY)
        if not portable:
            raise vocabulary.TokenizerError(
                f"{path} carries no tokenizer (a checkpoint of an older train.py)"
            )
        asr_model.check_description(portable, path)
        return portable["tokenizer"]["tokenizer.model"], f"the tokenizer of {path}"
    if path.exists() or source.endswith((".nemo", ".ckpt")):
        raise vocabulary.TokenizerError(
            f"base {source}: expected a .nemo file, a step_*.ckpt, a tokenizer directory or a "
            f"pretrained name"
        )
    from pretrained_models import pretrained_nemo

    downloaded = pretrained_nemo(source, setting)
    return _nemo_tokenizer_model(downloaded), f"the tokenizer of {source}"


def _nemo_tokenizer_model(path: Path) -> bytes:
    """tokenizer.model inside a .nemo archive; TokenizerError for a kind that cannot be extended."""
    import tarfile

    import yaml

    try:
        with tarfile.open(path) as archive:
            members = {Path(m.name).name: m for m in archive.getmembers() if m.isfile()}
            cfg = yaml.safe_load(archive.extractfile(members["model_config.yaml"]))
            tokenizer = (cfg or {}).get("tokenizer") or {}
            kind = tokenizer.get("type")
            if kind == "agg":
                raise vocabulary.TokenizerError(
                    f"{path} has an aggregate tokenizer (one per language): it cannot be extended "
                    f"as one SentencePiece model; use TOKENIZER_MODE=new"
                )
            if kind != "bpe":
                raise vocabulary.TokenizerError(
                    f"{path} has a {kind!r} tokenizer, not SentencePiece ('bpe'): a WordPiece "
                    f"vocabulary cannot be extended here; use TOKENIZER_MODE=new"
                )
            name = str(tokenizer.get("model_path", "")).rsplit(":", 1)[-1]
            name = Path(name).name if name else ""
            member = members.get(name) or next(
                (m for n, m in members.items() if n.endswith("tokenizer.model")), None
            )
            if member is None:
                raise vocabulary.TokenizerError(f"{path} holds no SentencePiece tokenizer.model")
            return archive.extractfile(member).read()
    except (tarfile.TarError, KeyError, OSError) as exc:
        raise vocabulary.TokenizerError(
            f"cannot read the tokenizer of {path}: {type(exc).__name__}: {exc}"
        )
