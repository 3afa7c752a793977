"""A base model named on the Hugging Face hub (INIT_MODEL=org/model), as a local .nemo file.

``pretrained_nemo`` gives Hugging Face's cached copy, else downloads it; where neither can be had
it is one line (``ModelNotFetched``) naming the setting and the path form to use instead, at once:
with the hub offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE) or its server not answering a first
request, nothing is retried and nothing takes the model's place (a base's tokenizer and style
decide the training targets). Light to import: build_manifest.py and train_tokenizer.py ask it
before any model library is loaded.

Usage::

    nemo = pretrained_nemo("nvidia/parakeet-tdt-0.6b-v2")   # a Path, or ModelNotFetched
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import config


class ModelNotFetched(config.ConfigError):
    """A base named by a pretrained model's name that cannot be had here: not in Hugging Face's
    cache, and the hub offline, not answering, or refusing the download."""


# The variables that put the Hugging Face hub offline, read as huggingface_hub reads them.
HUB_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> str | None:
    """``NAME=value`` of the variable that puts the Hugging Face hub offline, or None."""
    for name in HUB_OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{name}={os.environ[name]}"
    return None


def pretrained_nemo(name: str, setting: str = "INIT_MODEL") -> Path:
    """The .nemo file of the pretrained model ``name`` (a Hugging Face repository ``org/model``
    holding ``<model>.nemo``, where NeMo's from_pretrained looks): Hugging Face's cached copy when it
    has one, else downloaded.

    ModelNotFetched, one line naming ``setting`` and the path form to use instead, when it cannot be
    had: not cached and the hub offline (``HUB_OFFLINE_VARIABLES``), or its server not answering a
    first request (no retries: a node without internet fails in seconds, never falls back), or the
    download failing. Nothing is ever used in its place."""
    from huggingface_hub import constants, hf_hub_download, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import get_session

    def refused(why: str) -> ModelNotFetched:
        return ModelNotFetched(
            f"{setting}={name} cannot be fetched ({why}). On a node without internet, download the "
            f".nemo where there is (huggingface.co/{name}) and set {setting}=/path/to/model.nemo"
        )

    def first_line(exc: Exception) -> str:
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__

    filename = f"{PurePosixPath(name).name}.nemo"
    try:
        cached = try_to_load_from_cache(name, filename)
    except Exception as exc:  # a name that cannot be a repository: HFValidationError
        raise ModelNotFetched(
            f"{setting}={name} is neither a file nor a pretrained model's name (org/model) "
            f"({first_line(exc)}); set {setting}=/path/to/model.nemo"
        ) from None
    if isinstance(cached, str):
        return Path(cached)
    offline = hub_offline()
    if offline:
        raise refused(f"{offline}, and Hugging Face's cache {constants.HF_HUB_CACHE} has no copy")
    # One request, never retried (huggingface_hub retries a refused connection for 24 s): any
    # answer, even an error status, says the hub is there, and the download's own error follows.
    try:
        get_session().head(
            hf_hub_url(name, filename),
            timeout=constants.HF_HUB_ETAG_TIMEOUT,
            follow_redirects=False,
        )
    except Exception as exc:
        raise refused(f"{constants.ENDPOINT} does not answer: {first_line(exc)}") from None
    try:
        return Path(hf_hub_download(name, filename))
    except Exception as exc:  # huggingface_hub raises many kinds, never naming the setting
        raise refused(first_line(exc)) from None
