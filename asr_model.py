"""The model seam: what training, validation, evaluation and export need from a model, whatever its family.

A model family (``ModelFamily``) is a NeMo model class and its loss: how a fresh one is built, how it
takes our vocabulary and loss (``change_vocabulary``, ``attach_loss``), the loss of one micro-batch
from the encoder's output, the start-up check of its loss on the training device and a line that
describes the loss. ``TDT`` (Parakeet-TDT: EncDecRNNTBPEModel with the TDT loss) is the family this
app trains by default; ``FAMILIES`` lists them all, ``family`` finds a model's and
``family_of_config`` a fresh model's (the YAML's ``target``, NeMo's own key for the model class).
Another family is a new ``ModelFamily`` here plus a model config (and its greedy decoding in
``decoding.py``, which decodes the transducers of both families alike).

Around it, what holds for every family: building a model (``build_model``: INIT_MODEL, MODEL_CONFIG,
TOKENIZER_DIR), giving it our vocabulary (``use_tokenizer``), checking that it agrees with the data
pipeline's settings (``check_frontend``), reaching its encoder (``encoder``,
``set_encoder_trainable``), the loss of one micro-batch (``training_loss``), checking the loss on
the training device (``check_loss_on_device``), describing a model so that a checkpoint rebuilds it
alone (``portable_description``, ``model_from_description``) and loading a trained model for
inference (``load_trained_model``). Greedy decoding, auto or with the language given, is
``decoding.py``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

import config
import tdt_loss
import vocabulary
from checkpoints import PORTABLE_KEY, CheckpointError, read_checkpoint
from pretrained_models import ModelNotFetched, pretrained_nemo  # noqa: F401 (ModelNotFetched: for callers)

log = logging.getLogger("asr_model")


class _DropMessages(logging.Filter):
    """Drops the records whose message contains one of ``parts``."""

    def __init__(self, parts: tuple[str, ...]):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


class _SummarizeVocabulary(logging.Filter):
    """NeMo's ``change_vocabulary`` logs every piece of the new vocabulary in one line (hundreds of
    pieces at full size); it becomes their count and the first few."""

    PREFIX, SUFFIX, SHOWN = "Changed decoder to output to [", "] vocabulary.", 8

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.PREFIX) and message.endswith(self.SUFFIX):
            import ast

            try:
                pieces = ast.literal_eval(message[len(self.PREFIX) - 1 : -len(self.SUFFIX) + 1])
            except (ValueError, SyntaxError):
                return True
            shown = ", ".join(map(repr, pieces[: self.SHOWN]))
            record.msg = f"Changed decoder to output to {len(pieces)} pieces ({shown}, ...)"
            record.args = None
        return True


class _PassOnExcept(logging.Handler):
    """Hands each record of its logger's tree at ``level`` or above to the root logger's handlers,
    as propagation would, except those whose message contains one of ``parts``. A filter on the
    logger itself would see only the records logged on it, not those of its children."""

    def __init__(self, parts: tuple[str, ...], level: int):
        super().__init__(level)
        self.addFilter(_DropMessages(parts))

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


def quiet_harmless_messages() -> None:
    """Silence, each by its message, what NeMo and its telemetry print that does not apply here, so
    a run shows stages, progress, real warnings and results. Idempotent; called on import."""
    harmless = (
        # NeMo's model builds its own dataloaders from cfg.train_ds / validation_ds; this app feeds
        # the model from dataset.py instead, so those sections have no manifest, on purpose.
        "Could not load dataset as `manifest_filepath`",
        # Printed each time NeMo rebuilds the loss (a vocabulary change, tdt_loss.attach_tdt_loss);
        # describe() states the loss that runs, once.
        "Using RNNT Loss :",
        # decoding_graphs rebuilds and releases the decoder's CUDA graphs around every
        # validation: two lines each time, by design.
        "CUDA graphs enabled for",
        "CUDA graphs disabled for",
        # Validation is this app's (callbacks.PerLanguageWERCallback), not NeMo's validation_ds.
        "If you intend to do validation, please call the ModelPT.setup_validation_data()",
        # change_vocabulary registers the new tokenizer's files over the base's, as it should.
        "You tried to register an artifact under config key=tokenizer.",
        # The frozen-base mode turns its adapters off and on again around every decoding of a
        # base language (base_adapters.adapters_off); the start-up line states the mode once.
        "status : Enabled =",
        # NeMo's conformer layer offers attention adapters a place too; a LinearAdapter is not
        # one, and runs where it belongs (after the layer).
        "No adapter compatible with the current module",
    )
    if not torch.cuda.is_available():
        # CUDA graphs for greedy decoding cannot apply without CUDA; on a GPU the note stays (it
        # says decoding will be slower when cuda-python is missing).
        harmless += ("No conditional node support for Cuda",)
    nemo_logger = logging.getLogger("nemo_logger")
    if not any(isinstance(f, _DropMessages) for f in nemo_logger.filters):
        nemo_logger.addFilter(_DropMessages(harmless))
        nemo_logger.addFilter(_SummarizeVocabulary())
    # NeMo's OneLogger telemetry is off in this app: the notes it prints on every rank when NeMo is
    # imported or a trainer starts say only that, and its INFO lines count exporters. Its warnings
    # stay. A level or a filter on the parent logger is not enough: once OneLogger is set up, its
    # get_logger gives each module's logger a level of its own (INFO), and a logger's filters never
    # see its children's records; so the tree's records reach the run's log through _PassOnExcept.
    one_logger_notes = (
        "OneLogger: Setting error_handling_strategy to DISABLE_QUIETLY_AND_REPORT_METRIC_ERROR",
        "No exporters were provided. This means that no telemetry data will be collected.",
        "because OneLogger is not enabled.",
    )
    one_logger = logging.getLogger("nv_one_logger")
    if not any(isinstance(h, _PassOnExcept) for h in one_logger.handlers):
        one_logger.addHandler(_PassOnExcept(one_logger_notes, logging.WARNING))
        one_logger.propagate = False
    # NeMo's prediction network is a 1-layer LSTM built with its dropout argument; PyTorch warns
    # that the LSTM's inter-layer dropout then does nothing, while NeMo applies dropout itself.
    warnings.filterwarnings(
        "ignore",
        message="dropout option adds dropout after all but last recurrent layer",
        category=UserWarning,
    )


quiet_harmless_messages()


def ensure_validation_ds(model) -> None:
    """NeMo's transcribe() fails on a model whose cfg.validation_ds is None: give it a minimal one."""
    from omegaconf import open_dict

    if model.cfg.get("validation_ds") is None:
        with open_dict(model.cfg):
            model.cfg.validation_ds = {
                "manifest_filepath": None,
                "sample_rate": model.cfg.get("sample_rate", 16000),
                "batch_size": 4,
                "shuffle": False,
                "num_workers": 0,
                "pin_memory": False,
                "use_start_end_token": False,
            }


# ---- model families --------------------------------------------------------------------------


class ModelFamily:
    """What the app needs from one family of NeMo models; stateless, one instance per family.

    ``nemo_class`` is the name of the NeMo class a fresh model is built as and by which a restored
    model is recognised (its class or a base class of that name)."""

    name = "?"
    nemo_class = "?"

    def owns(self, model) -> bool:
        return any(cls.__name__ == self.nemo_class for cls in type(model).__mro__)

    def new_model(self, cfg):
        """A fresh model of this family from ``cfg`` (the YAML's ``model:`` section), on CPU."""
        import nemo.collections.asr.models as nemo_models

        return getattr(nemo_models, self.nemo_class)(cfg=cfg)

    def change_vocabulary(
        self, model, tokenizer_dir: Path, decoder_init: str, new_piece_bias: str | None = None
    ) -> dict:
        """Give ``model`` the pieces of ``tokenizer_dir``; the counts of carried, new and dropped rows."""
        raise NotImplementedError

    def attach_loss(self, model) -> None:
        """(Re)build the model's training loss for its current vocabulary."""
        raise NotImplementedError

    def loss_of_encoded(self, model, encoded, encoded_len, batch) -> torch.Tensor:
        """The loss of a non-empty AsrBatch from the encoder's output (the model's reduction)."""
        raise NotImplementedError

    def check_loss_on_device(self, model, device: torch.device) -> str | None:
        """Run the loss on a known problem on ``device``: a line for the log, None for no check."""
        return None

    def describe_loss(self, model) -> str:
        raise NotImplementedError

    def piece_rows(self, model) -> list[torch.nn.Parameter]:
        """The parameters with a row per piece, piece id i at row i (``new_piece_parameters``)."""
        raise NotImplementedError


@contextlib.contextmanager
def _logits_for_the_loss(joint):
    """The joint gives the loss its logits, not their log-softmax, within the block.

    NeMo's joint log-softmaxes its output on CPU when ``log_softmax`` is unset (for NeMo's own CPU
    decoders); the TDT loss normalizes the token and the duration logits itself, so on CPU that pass
    over the step's largest tensor, and its backward, only cost time. The loss is the same up to
    float rounding; a joint set to log-softmax explicitly, or with a temperature, is left as set."""
    if joint.log_softmax is not None or getattr(joint, "temperature", 1.0) != 1.0:
        yield
        return
    joint.log_softmax = False
    try:
        yield
    finally:
        joint.log_softmax = None


class TDT(ModelFamily):
    """Parakeet-TDT: a FastConformer encoder, an LSTM prediction network and a joint with token and
    duration outputs, trained with the TDT loss of ``tdt_loss.py`` (NeMo's numba kernel on CUDA)."""

    name = "TDT transducer"
    nemo_class = "EncDecRNNTBPEModel"

    def vocabulary_heads(self, model) -> dict[str, torch.nn.Module]:
        """The parts whose shape follows the vocabulary, by the names the log and the model card use."""
        return {"decoder": model.decoder, "joint": model.joint}

    def carry_heads(
        self,
        old: dict[str, torch.nn.Module],
        new: dict[str, torch.nn.Module],
        old_pieces,
        pieces,
        prior: torch.Tensor | None = None,
    ) -> dict[str, int]:
        """The base's weights of ``old`` (``vocabulary_heads`` before the change) in ``new``;
        ``prior``: the new pieces' log shares (``new_piece_prior``), None for equal shares."""
        return carry_decoder_and_joint(
            old["decoder"], old["joint"], old_pieces, new["decoder"], new["joint"], pieces, prior
        )

    def piece_rows(self, model) -> list[torch.nn.Parameter]:
        """The parameters with a row per piece (in piece-id order from row 0): the prediction
        network's embedding, the joint's output weight and bias."""
        out = model.joint.joint_net[-1]
        rows = [model.decoder.prediction["embed"].weight, out.weight]
        return rows + ([out.bias] if out.bias is not None else [])

    def change_vocabulary(
        self, model, tokenizer_dir: Path, decoder_init: str, new_piece_bias: str | None = None
    ) -> dict:
        """NeMo's ``change_vocabulary`` (new heads: ``vocabulary_heads``), then, with
        ``decoder_init`` "carry", the base model's weights in every one of them (``carry_heads``;
        ``new_piece_bias``, default NEW_PIECE_BIAS, says where the new pieces' biases start).
        ConfigError for "carry" when the base's tokenizer has no SentencePiece pieces to match by
        string. Returns the carried, new and dropped piece counts, ``decoder_init`` and ``heads``
        (the names of the parts the counts apply to)."""
        from omegaconf import open_dict

        old_size, old_pieces = model.tokenizer.vocab_size, vocabulary.model_pieces(model)
        if decoder_init == "carry" and old_pieces is None:
            raise config.ConfigError(
                f"DECODER_INIT=carry matches the base model's rows to the pieces of "
                f"TOKENIZER_DIR={tokenizer_dir} by their SentencePiece string, but the base's "
                f"tokenizer ({type(model.tokenizer).__name__}) has no SentencePiece pieces: set "
                f"DECODER_INIT=fresh (its {heads_phrase(self.vocabulary_heads(model))} then start "
                f"from random), or start from a base with a SentencePiece tokenizer"
            )
        old_heads = self.vocabulary_heads(model)
        # NeMo 3.0 replaces the TDT loss here with an RNN-T loss whose blank counts the durations:
        # attach_loss rebuilds it from cfg.loss. Its config is opened because NeMo sets
        # cfg.tokenizer.dir, a key an aggregate tokenizer's config (one per language) lacks.
        with open_dict(model.cfg):
            model.change_vocabulary(new_tokenizer_dir=str(tokenizer_dir), new_tokenizer_type="bpe")
        heads = self.vocabulary_heads(model)
        if decoder_init == "carry":
            pieces = vocabulary.model_pieces(model)
            new_rows = _PieceRows(old_pieces, pieces).new
            prior = None
            bias = config.NEW_PIECE_BIAS if new_piece_bias is None else new_piece_bias
            if bias == "frequency" and new_rows:
                prior = new_piece_prior(tokenizer_dir, pieces, new_rows)
                if prior is None:
                    log.warning(
                        "NEW_PIECE_BIAS=frequency, but TOKENIZER_DIR=%s holds no piece counts of "
                        "its tokenizer (made before scripts/train_tokenizer.py counted them): the "
                        "new pieces start at equal shares; train the tokenizer again to count them",
                        tokenizer_dir,
                    )
            counts = self.carry_heads(old_heads, heads, old_pieces, pieces, prior)
            model.new_piece_rows = new_rows
            log.info(
                "vocabulary changed from %d to %d pieces (TOKENIZER_DIR=%s): the base model's "
                "%s are kept, %d piece rows carried, %d new (their output biases %s), %d dropped",
                old_size,
                model.tokenizer.vocab_size,
                tokenizer_dir,
                heads_phrase(heads),
                counts["carried"],
                counts["new"],
                "from their share of the tokenizer's sampled text"
                if prior is not None
                else "equal, log(1/N)",
                counts["dropped"],
            )
            counts["new_piece_prior"] = "frequency" if prior is not None else "equal"
        else:
            counts = {"carried": 0, "new": model.tokenizer.vocab_size, "dropped": old_size}
            log.info(
                "vocabulary changed from %d to %d pieces (TOKENIZER_DIR=%s): %s are new "
                "(DECODER_INIT=%s)",
                old_size,
                model.tokenizer.vocab_size,
                tokenizer_dir,
                heads_phrase(heads),
                decoder_init,
            )
        counts["decoder_init"] = decoder_init
        counts["heads"] = list(heads)
        return counts

    def attach_loss(self, model) -> None:
        """A TDT loss whose blank matches the joint (``tdt_loss.attach_tdt_loss``; TDT_LOSS chooses
        what runs on CUDA)."""
        tdt_loss.attach_tdt_loss(model)

    def loss_of_encoded(self, model, encoded, encoded_len, batch) -> torch.Tensor:
        decoded, target_len, _ = model.decoder(targets=batch.tokens, target_length=batch.token_len)
        with _logits_for_the_loss(model.joint):
            return self._joint_loss(model, encoded, encoded_len, decoded, target_len, batch)

    def _joint_loss(self, model, encoded, encoded_len, decoded, target_len, batch) -> torch.Tensor:
        if model.joint.fuse_loss_wer:
            loss, _, _, _ = model.joint(
                encoder_outputs=encoded,
                decoder_outputs=decoded,
                encoder_lengths=encoded_len,
                transcripts=batch.tokens,
                transcript_lengths=batch.token_len,
                compute_wer=False,
            )
            return loss
        joint = model.joint(encoder_outputs=encoded, decoder_outputs=decoded)
        return model.loss(
            log_probs=joint,
            targets=batch.tokens,
            input_lengths=encoded_len,
            target_lengths=target_len,
        )

    def check_loss_on_device(self, model, device: torch.device) -> str | None:
        """The CUDA TDT loss against ``tdt_loss.tdt_loss`` (``tdt_loss.check_cuda_loss``)."""
        diff = tdt_loss.check_cuda_loss(model.loss._loss, device)
        return (
            f"TDT loss on {device} (TDT_LOSS={config.TDT_LOSS}) agrees with tdt_loss.py on a "
            f"known problem (largest difference {diff:.2g})"
        )

    def describe_loss(self, model) -> str:
        return f"TDT loss {model.loss._loss}"


class HybridTDTCTC(TDT):
    """NeMo's hybrid TDT-CTC: the TDT transducer plus a CTC decoder on the same encoder, trained on
    (1 - w) x TDT loss + w x CTC loss, w = ``cfg.aux_ctc.ctc_loss_weight``, as NeMo's own training
    step weighs them; greedy decoding uses the transducer. A vocabulary change carries the CTC
    decoder's rows as the joint's (``carry_ctc_decoder``), beside the transducer's."""

    name = "hybrid TDT-CTC"
    nemo_class = "EncDecHybridRNNTCTCBPEModel"

    def vocabulary_heads(self, model) -> dict[str, torch.nn.Module]:
        return {**super().vocabulary_heads(model), "CTC decoder": model.ctc_decoder}

    def carry_heads(
        self,
        old: dict[str, torch.nn.Module],
        new: dict[str, torch.nn.Module],
        old_pieces,
        pieces,
        prior: torch.Tensor | None = None,
    ) -> dict[str, int]:
        counts = super().carry_heads(old, new, old_pieces, pieces, prior)
        carry_ctc_decoder(old["CTC decoder"], old_pieces, new["CTC decoder"], pieces, prior)
        return counts

    def piece_rows(self, model) -> list[torch.nn.Parameter]:
        out = model.ctc_decoder.decoder_layers[-1]
        ctc = [out.weight] + ([out.bias] if out.bias is not None else [])
        return super().piece_rows(model) + ctc

    def loss_of_encoded(self, model, encoded, encoded_len, batch) -> torch.Tensor:
        loss = super().loss_of_encoded(model, encoded, encoded_len, batch)
        weight = model.ctc_loss_weight
        if weight <= 0:
            return loss
        ctc = model.ctc_loss(
            log_probs=model.ctc_decoder(encoder_output=encoded),
            targets=batch.tokens,
            input_lengths=encoded_len,
            target_lengths=batch.token_len,
        )
        return (1 - weight) * loss + weight * ctc

    def describe_loss(self, model) -> str:
        return f"{super().describe_loss(model)} + CTC loss (weight {model.ctc_loss_weight:g})"


def heads_phrase(heads) -> str:
    """ "decoder and joint", "decoder, joint and CTC decoder": the parts, for a log line."""
    names = list(heads)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


# The families, most specific first: a model belongs to the first that owns it.
FAMILIES: tuple[ModelFamily, ...] = (HybridTDTCTC(), TDT())


def family(model) -> ModelFamily:
    """The family of ``model``; ConfigError naming its class when no family owns it."""
    for kind in FAMILIES:
        if kind.owns(model):
            return kind
    raise config.ConfigError(
        f"a {type(model).__name__} is no model family this app trains "
        f"({', '.join(k.nemo_class for k in FAMILIES)}); check INIT_MODEL / MODEL_CONFIG"
    )


def family_of_config(cfg) -> ModelFamily:
    """The family a model config builds: its ``target`` (a NeMo class path), TDT without one."""
    target = str(cfg.get("target") or TDT.nemo_class).rpartition(".")[2]
    for kind in FAMILIES:
        if kind.nemo_class == target:
            return kind
    raise config.ConfigError(
        f"MODEL_CONFIG's target {target!r} is no model family this app trains "
        f"({', '.join(k.nemo_class for k in FAMILIES)})"
    )


def is_local_model(init_model: str) -> bool:
    """Whether INIT_MODEL names a file (a .nemo or .ckpt path) rather than a pretrained model's name."""
    return init_model.endswith((".nemo", ".ckpt")) or Path(init_model).exists()


def check_model_inputs(
    init_model: str | None = None,
    model_config: Path | None = None,
    tokenizer_dir: Path | None = None,
) -> None:
    """FileNotFoundError naming the variable when a file ``build_model`` needs is missing:
    TOKENIZER_DIR's tokenizer.model, an INIT_MODEL path, or MODEL_CONFIG when INIT_MODEL is empty.
    Cheap: train.py calls it before anything is built or downloaded."""
    init_model = config.INIT_MODEL if init_model is None else init_model
    model_config = Path(model_config or config.MODEL_CONFIG)
    tokenizer_dir = Path(tokenizer_dir or config.TOKENIZER_DIR)
    if not (tokenizer_dir / "tokenizer.model").exists():
        raise FileNotFoundError(
            f"TOKENIZER_DIR={tokenizer_dir} has no tokenizer.model; "
            "run scripts/train_tokenizer.py or point TOKENIZER_DIR at one"
        )
    if init_model and is_local_model(init_model) and not Path(init_model).is_file():
        raise FileNotFoundError(
            f"INIT_MODEL={init_model} does not exist; give a .nemo file, a step_*.ckpt or a "
            f"pretrained name such as nvidia/parakeet-tdt-0.6b-v2"
        )
    if not init_model and not model_config.is_file():
        raise FileNotFoundError(f"MODEL_CONFIG={model_config} does not exist (INIT_MODEL is empty)")


def build_model(
    init_model: str | None = None,
    model_config: Path | None = None,
    tokenizer_dir: Path | None = None,
    decoder_init: str | None = None,
    new_piece_bias: str | None = None,
    adapter_dim: int | None = None,
):
    """The NeMo model to train, on CPU, with TOKENIZER_DIR's vocabulary and its family's loss.

    ``init_model``: a .nemo path (restore_from), a train.py step checkpoint (the model it describes,
    with its weights) or a pretrained name (``pretrained_nemo``); empty means a fresh model from the
    ``model_config`` YAML (its ``model:`` section; its ``target`` names the family, TDT without one)
    with ``tokenizer.dir`` set to ``tokenizer_dir``.
    Defaults come from INIT_MODEL, MODEL_CONFIG, TOKENIZER_DIR, DECODER_INIT and NEW_PIECE_BIAS.
    ``model.vocabulary_change`` holds what ``use_tokenizer`` did to the parts sized by the vocabulary;
    ``model.base_model`` the base's identity (``base_identity``; None for a fresh model).
    ``adapter_dim`` (default BASE_ADAPTER_DIM) > 0: the frozen-base mode
    (``base_adapters.add_adapters``).
    """
    init_model = config.INIT_MODEL if init_model is None else init_model
    model_config = Path(model_config or config.MODEL_CONFIG)
    tokenizer_dir = Path(tokenizer_dir or config.TOKENIZER_DIR)
    check_model_inputs(init_model, model_config, tokenizer_dir)
    # Before NeMo is imported (tens of seconds): a base that cannot be fetched stops the job at once.
    pretrained = (
        pretrained_nemo(init_model) if init_model and not is_local_model(init_model) else None
    )

    from nemo.collections.asr.models import ASRModel
    from omegaconf import OmegaConf, open_dict

    if init_model:
        if init_model.endswith(".ckpt"):
            log.info("restoring the model of the step checkpoint %s", init_model)
            model = load_trained_model(init_model).train()
        elif is_local_model(init_model):
            log.info("restoring %s", init_model)
            model = ASRModel.restore_from(init_model, map_location="cpu")
        else:
            log.info("restoring pretrained %s from %s", init_model, pretrained)
            model = ASRModel.restore_from(str(pretrained), map_location="cpu")
    else:
        cfg = OmegaConf.load(model_config)
        cfg = cfg.model if "model" in cfg else cfg
        with open_dict(cfg):
            cfg.tokenizer.dir = str(tokenizer_dir)
            cfg.tokenizer.type = "bpe"
        kind = family_of_config(cfg)
        log.info("building a fresh %s model from %s", kind.name, model_config)
        model = kind.new_model(cfg)

    base_pieces = vocabulary.model_pieces(model) if init_model else None
    decoder_init = config.DECODER_INIT if decoder_init is None else decoder_init
    new_piece_bias = config.NEW_PIECE_BIAS if new_piece_bias is None else new_piece_bias
    # Hashed here, before the vocabulary change rewrites the decoder and joint: the only moment the
    # base's own weights are in hand (an export checks the model it blends with against it).
    model.base_model = (
        base_identity(init_model, model, decoder_init, new_piece_bias) if init_model else None
    )
    # What the model card says of the vocabulary change (None: the base's vocabulary as it was).
    model.vocabulary_change = use_tokenizer(model, tokenizer_dir, decoder_init, new_piece_bias)
    if base_pieces and model.vocabulary_change is not None:
        warn_unless_extension(
            base_pieces, vocabulary.model_pieces(model) or [], tokenizer_dir, init_model
        )
    adapter_dim = config.BASE_ADAPTER_DIM if adapter_dim is None else adapter_dim
    import base_adapters

    if adapter_dim <= 0 and base_adapters.record_of(model) is not None:
        raise config.ConfigError(
            f"INIT_MODEL={init_model} is a frozen-base model (trained with BASE_ADAPTER_DIM): "
            "training all of it would change the base its languages decode with the adapters "
            "off; finetune from the base it was made from instead, or resume its run "
            "(RESUME_FROM) with the same BASE_ADAPTER_DIM"
        )
    if adapter_dim > 0:
        if not init_model:
            raise config.ConfigError(
                f"BASE_ADAPTER_DIM={adapter_dim} keeps a base as it is, and this run has none "
                "(INIT_MODEL is empty): set BASE_ADAPTER_DIM=0 or give the base in INIT_MODEL"
            )
        import model_languages

        base_adapters.add_adapters(
            model,
            adapter_dim,
            model_languages.base_languages(init_model) or (),
            base_pieces or [],
            [p for p, _ in new_piece_parameters(model)],
        )
    ensure_validation_ds(model)
    make_encoder_forward_rank_local(model)
    check_frontend(model)
    return model


def weights_sha256(model) -> str:
    """SHA-256 of a model's weights: every tensor of its state_dict by name, dtype, shape and bytes,
    the same for the same weights whatever file (a .nemo, a copy, a pretrained download) held them.
    The preprocessor's buffers (mel filterbank, window) are left out: they are not learned but
    follow from its config, and where they are recomputed rather than read from the file, their
    last bits may differ between torch versions for the same model."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name.startswith("preprocessor."):
            continue
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def base_identity(init_model: str, model, decoder_init: str, new_piece_bias: str) -> dict[str, Any]:
    """What identifies the base a finetune starts from, recorded when the base is loaded: its path
    (absolute for a file, else the pretrained name), the SHA-256 of its weights (``weights_sha256``,
    before any vocabulary change) and the settings the base as received was built with."""
    local = init_model.endswith(".ckpt") or is_local_model(init_model)
    return {
        "path": os.path.abspath(init_model) if local else init_model,
        "weights_sha256": weights_sha256(model),
        "DECODER_INIT": decoder_init,
        "NEW_PIECE_BIAS": new_piece_bias,
    }


def warn_unless_extension(
    base_pieces: list[str], pieces: list[str], tokenizer_dir: Path, init_model: str
) -> bool:
    """Warn (global rank 0) when the tokenizer a finetune trains with is not an extension of its
    base's (the base's pieces first, each at its own id): the base then segments its own languages
    differently from how it learned them, and starts from a worse WER on them. True when warned."""
    if pieces[: len(base_pieces)] == base_pieces:
        return False
    if int(os.environ.get("RANK", "0")) == 0:
        kept = sum(1 for i, p in enumerate(base_pieces) if i < len(pieces) and pieces[i] == p)
        log.warning(
            "TOKENIZER_DIR=%s is not an extension of INIT_MODEL=%s's tokenizer (%d of its %d pieces "
            "keep their id): the base's own languages start from re-segmented text and lose accuracy "
            "at step 0 (measured here: English WER 0.000 with an extended tokenizer, 0.314 with a "
            "replaced one; docs/training.md). To keep them, train the tokenizer with INIT_MODEL set: "
            "INIT_MODEL=%s python scripts/train_tokenizer.py (TOKENIZER_MODE=auto extends it)",
            tokenizer_dir,
            init_model,
            kept,
            len(base_pieces),
            init_model,
        )
    return True


def use_tokenizer(
    model, tokenizer_dir: Path, decoder_init: str | None = None, new_piece_bias: str | None = None
) -> dict | None:
    """Give ``model`` the vocabulary of ``tokenizer_dir`` and its family's loss for that vocabulary.

    A model whose pieces already are those of ``tokenizer_dir`` keeps its decoder; any other gets
    its family's ``change_vocabulary`` (DECODER_INIT, ``decoder_init``, says whether the base's
    decoder weights are carried over; NEW_PIECE_BIAS, ``new_piece_bias``, where the new pieces'
    biases start). Either way the loss is rebuilt (``attach_loss``).
    Returns the counts of the carried, new and dropped rows, or None when nothing changed.
    """
    decoder_init = config.DECODER_INIT if decoder_init is None else decoder_init
    kind = family(model)
    counts = None
    if not vocabulary.tokenizer_matches(model, tokenizer_dir):
        counts = kind.change_vocabulary(model, tokenizer_dir, decoder_init, new_piece_bias)
    kind.attach_loss(model)
    return counts


def new_piece_prior(tokenizer_dir: Path, pieces: list[str], new_rows: list[int]):
    """The log share of each new piece (``new_rows``, in that order) among the new pieces'
    occurrences in the text the tokenizer was trained on (``vocabulary.read_piece_counts``: the
    training language mix), add-one smoothed, so the shares sum to 1; None when
    ``tokenizer_dir`` holds no counts for its tokenizer (one made before pieces were counted):
    the new pieces then start with equal shares."""
    from vocabulary import read_piece_counts

    counts = read_piece_counts(tokenizer_dir)
    if counts is None or len(counts) != len(pieces):
        return None
    smoothed = torch.tensor([float(counts[i]) + 1.0 for i in new_rows], dtype=torch.float64)
    return (smoothed / smoothed.sum()).log().float()


def new_piece_parameters(model) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, rows) for every row of a piece the base model lacked (``model.new_piece_rows``,
    set by a carried vocabulary change): the rows NEW_PIECE_LR_SCALE speeds up. Empty for a model
    built fresh, a base used with its own vocabulary, or DECODER_INIT=fresh (every row is new)."""
    rows = getattr(model, "new_piece_rows", None)
    if not rows:
        return []
    index = torch.tensor(rows, dtype=torch.long)
    return [(p, index.to(p.device)) for p in family(model).piece_rows(model)]


@torch.no_grad()
def carry_decoder_and_joint(
    old_decoder,
    old_joint,
    old_pieces: list[str],
    decoder,
    joint,
    pieces: list[str],
    prior: torch.Tensor | None = None,
) -> dict[str, int]:
    """Copy the base model's prediction network and joint into the ones ``change_vocabulary`` built.

    - Every weight whose shape does not depend on the vocabulary (the prediction LSTM, the joint's
      encoder and prediction projections, any other tensor of equal name and shape) is copied.
    - Rows of pieces both vocabularies hold (matched by piece string): the embedding row of the
      prediction network, the joint's output row and bias. Blank (the last embedding row, the
      output after the pieces) and the TDT duration outputs move to their new positions.
    - A new piece starts as the average base piece: its embedding row is the mean of the base's
      piece embeddings (an average context for the LSTM, not a random direction it never saw), its
      output row the mean of the base's piece output rows, and its bias their mean bias plus the
      log of its share among the new pieces: log(1/N) for N new pieces, or with ``prior``
      (NEW_PIECE_BIAS=frequency, ``new_piece_prior``) the log of its frequency among them in the
      training text. Every share is below 1,
      so a new piece's logit is below the mean of the base's piece logits, hence below the largest
      of them, for every input: at step 0 no new piece wins and the model decodes exactly as the
      base does. The shares sum to 1, so by Jensen's inequality all new pieces together hold at
      most 1/V of the base pieces' probability (V base pieces): the loss of the base's own text
      barely moves either. And every new row starts where the others are, not tens of nats below
      them, so the optimizer (whose steps are about the LR whatever the gradient, and
      NEW_PIECE_LR_SCALE times it for these rows) brings them into play within a few hundred steps;
      none starts as a random direction that could burst into insertions.
    Returns {"carried", "new", "dropped"} piece counts.
    """
    rows = _PieceRows(old_pieces, pieces)
    _copy_equal_shapes(decoder, old_decoder)
    _copy_equal_shapes(joint, old_joint)

    v_old, v_new = len(old_pieces), len(pieces)
    embed, old_embed = decoder.prediction["embed"].weight, old_decoder.prediction["embed"].weight
    embed[rows.dst] = old_embed[rows.src]
    if embed.shape[0] > v_new and old_embed.shape[0] > v_old:
        embed[v_new] = old_embed[v_old]  # blank (NeMo's blank_as_pad: the padding row)
    if rows.new:
        embed[rows.new] = old_embed[:v_old].mean(dim=0)

    out, old_out = joint.joint_net[-1], old_joint.joint_net[-1]
    # blank, then the TDT durations, after the pieces
    _carry_output_rows(out, old_out, rows, tail=1 + joint.num_extra_outputs, prior=prior)
    return rows.counts()


@torch.no_grad()
def carry_ctc_decoder(
    old_ctc, old_pieces: list[str], ctc, pieces: list[str], prior: torch.Tensor | None = None
) -> dict[str, int]:
    """Copy the base model's CTC decoder (NeMo's ConvASRDecoder: one 1x1 convolution with a row per
    piece, then blank) into the one ``change_vocabulary`` built, as ``carry_decoder_and_joint``
    does the joint's output: shared pieces by their string, blank moved to its new position, a new
    piece the mean base piece row with the mean bias plus its log share ``prior`` (log(1/N)
    without). Its greedy CTC output is then the base's before any update. Returns {"carried",
    "new", "dropped"} piece counts."""
    rows = _PieceRows(old_pieces, pieces)
    _copy_equal_shapes(ctc, old_ctc)
    _carry_output_rows(
        ctc.decoder_layers[-1], old_ctc.decoder_layers[-1], rows, tail=1, prior=prior
    )
    return rows.counts()


class _PieceRows:
    """Where each piece of a new vocabulary comes from: ``dst``/``src`` the new/old rows of the
    pieces both vocabularies hold (matched by string), ``new`` the rows of pieces the base lacks."""

    def __init__(self, old_pieces: list[str], pieces: list[str]):
        old_index = {piece: i for i, piece in enumerate(old_pieces)}
        shared = [(i, old_index[p]) for i, p in enumerate(pieces) if p in old_index]
        self.dst = torch.tensor([i for i, _ in shared], dtype=torch.long)
        self.src = torch.tensor([j for _, j in shared], dtype=torch.long)
        self.new = [i for i, p in enumerate(pieces) if p not in old_index]
        self.v_old, self.v_new = len(old_pieces), len(pieces)

    def counts(self) -> dict[str, int]:
        carried = len(self.dst)
        return {"carried": carried, "new": len(self.new), "dropped": self.v_old - carried}


def _copy_equal_shapes(module: torch.nn.Module, old_module: torch.nn.Module) -> None:
    """Every tensor of ``old_module`` whose name and shape ``module`` shares (those that do not
    depend on the vocabulary)."""
    old_state = old_module.state_dict()
    for name, tensor in module.state_dict().items():
        if name in old_state and old_state[name].shape == tensor.shape:
            tensor.copy_(old_state[name])


def _carry_output_rows(
    out, old_out, rows: _PieceRows, *, tail: int, prior: torch.Tensor | None = None
) -> None:
    """An output layer with a row per piece, then ``tail`` rows (blank, durations): shared rows by
    piece, the tail moved after the new pieces, each new piece the mean base piece row with the
    mean base bias plus its log share ``prior`` (equal shares without; ``carry_decoder_and_joint``)."""
    v_old, v_new = rows.v_old, rows.v_new
    for new_param, old_param in ((out.weight, old_out.weight), (out.bias, old_out.bias)):
        if new_param is None:
            continue
        new_param[rows.dst] = old_param[rows.src]
        new_param[v_new : v_new + tail] = old_param[v_old : v_old + tail]
    if rows.new:
        out.weight[rows.new] = old_out.weight[:v_old].mean(dim=0)
        if out.bias is not None:
            shares = (
                prior
                if prior is not None
                else torch.full((len(rows.new),), -math.log(len(rows.new)))
            )
            out.bias[rows.new] = old_out.bias[:v_old].mean() + shares.to(out.bias)


def make_encoder_forward_rank_local(model) -> None:
    """Stop NeMo's ConformerEncoder from all-reducing the batch's max length inside every forward.

    With ``sync_max_audio_length`` (NeMo's default) each encoder forward is a collective: a rank
    that skips one (an empty micro-batch, a rank-local evaluation) desynchronises every later
    all-reduce (gloo aborts with "Received data size doesn't match", NCCL hangs), and each forward
    pays a GPU sync. The sync only keeps the relative-position table the same length on every rank;
    the forward reads the table by relative position, whose sinusoidal entries do not depend on the
    table's length, the table is no DDP-synchronised buffer, and it already covers
    ``pos_emb_max_len`` (5000 feature frames = 50 s) from construction on.
    """
    enc = encoder(model)
    if hasattr(enc, "sync_max_audio_length"):
        enc.sync_max_audio_length = False


def check_frontend(model) -> None:
    """Raise ConfigError when TARGET_SAMPLE_RATE or ENCODER_FRAME_SECONDS disagree with ``model``.

    The data pipeline resamples audio to TARGET_SAMPLE_RATE and drops utterances with more tokens than
    encoder frames (duration / ENCODER_FRAME_SECONDS); the model's preprocessor decides both for real
    (its sample rate; its window stride times the encoder's subsampling factor). A mismatch would feed
    the model audio at the wrong rate, or keep utterances the TDT loss cannot align.
    """
    cfg = model.cfg
    sample_rate = int(cfg.preprocessor.get("sample_rate", cfg.get("sample_rate")))
    frame = float(cfg.preprocessor.window_stride) * int(cfg.encoder.subsampling_factor)
    problems = []
    if sample_rate != config.TARGET_SAMPLE_RATE:
        problems.append(
            f"TARGET_SAMPLE_RATE={config.TARGET_SAMPLE_RATE} but the model's preprocessor expects "
            f"{sample_rate} Hz: set TARGET_SAMPLE_RATE={sample_rate}"
        )
    if not math.isclose(frame, config.ENCODER_FRAME_SECONDS, rel_tol=1e-6):
        problems.append(
            f"ENCODER_FRAME_SECONDS={config.ENCODER_FRAME_SECONDS:g} but the model's encoder frame is "
            f"{frame:g} s (window_stride x subsampling_factor): set ENCODER_FRAME_SECONDS={frame:g}"
        )
    if problems:
        raise config.ConfigError("; ".join(problems))


def encoder(model) -> torch.nn.Module:
    """The acoustic encoder: the part phase 1 keeps frozen."""
    return model.encoder


def set_encoder_trainable(model, trainable: bool) -> None:
    """Frozen: no gradients and eval mode (BatchNorm statistics and dropout stay still); else trains
    (a frozen-base model: its encoder's adapters alone, ``base_adapters``).

    Eval mode must be re-imposed after anything that puts the whole model into train mode."""
    import base_adapters

    if base_adapters.record_of(model) is not None:
        base_adapters.set_encoder_adapters_trainable(model, trainable)
        return
    enc = encoder(model)
    for p in enc.parameters():
        if p.requires_grad != trainable:
            p.requires_grad_(trainable)
    enc.train(trainable)


def training_loss(model, batch, *, encoder_frozen: bool) -> torch.Tensor:
    """The training loss of one non-empty AsrBatch (the family's loss, with the model's reduction)."""
    # A frozen encoder needs no autograd graph: less memory and time; its outputs are constants.
    with torch.no_grad() if encoder_frozen else contextlib.nullcontext():
        encoded, encoded_len = model.forward(
            input_signal=batch.signal, input_signal_length=batch.signal_len
        )
    return family(model).loss_of_encoded(model, encoded, encoded_len, batch)


def check_loss_on_device(model, device: torch.device) -> str | None:
    """Run the model's loss once on ``device`` on a known problem; a line for the log saying how it
    agreed, or None when the family has nothing to check. Raises with the install line when the
    GPU install cannot run it (TDT: ``tdt_loss.TDTLossCheckFailed``)."""
    return family(model).check_loss_on_device(model, device)


def joint_memory_bytes(
    batch_durations,
    batch_tokens,
    *,
    outputs: int,
    frame_seconds: float,
    fused_batch_size: int = 4,
    half_precision: bool = True,
) -> tuple[float, float]:
    """(held, peak) bytes of the transducer joint of one micro-batch, NeMo's fused joint and numba
    TDT loss as they run on a GPU (padded as collated: T frames of the longest utterance, U + 1
    label positions of the longest transcript, ``outputs`` = vocabulary + blank + durations).

    held: the fp32 gradient of every sub-batch's logits, kept until backward (4 bytes a cell of all
    n utterances). peak: held, plus one sub-batch of ``fused_batch_size`` utterances in flight: its
    logits (2 bytes a cell under bf16-mixed, 4 in fp32), their fp32 cast for the loss (4, none in
    fp32) and the loss's contiguous copy of the token logits (4). An estimate read from NeMo's
    code (modules/rnnt.py, losses/rnnt.py, numba rnnt_loss), not a GPU measurement."""
    n = len(batch_durations)
    cells = math.ceil(max(batch_durations) / frame_seconds) * (max(batch_tokens) + 1)
    held = n * cells * outputs * 4
    per_cell_peak = (2 + 4 + 4) if half_precision else (4 + 4)
    peak = min(n, fused_batch_size) * cells * outputs * per_cell_peak
    return float(held), float(held + peak)


def describe(model) -> str:
    """One line for the start-up log: class, size, vocabulary and loss."""
    n_params = sum(p.numel() for p in model.parameters())
    return (
        f"model {type(model).__name__}: {n_params / 1e6:.1f} M parameters, "
        f"vocabulary {model.tokenizer.vocab_size}, {family(model).describe_loss(model)}"
    )


# A SentencePiece tokenizer directory as NeMo reads it (scripts/train_tokenizer.py writes all three).
# The tokenizer directory's files a step checkpoint carries: NeMo's three, and train_tokenizer.py's
# summary (which languages the base covers) and piece counts (the new pieces' starting biases), so
# the base as the finetune received it can be rebuilt from the checkpoint (export_nemo.py --blend-base).
TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.vocab",
    "vocab.txt",
    "summary.json",
    "piece_counts.json",
)


def portable_description(model, tokenizer_dir: Path | None = None) -> dict[str, Any]:
    """What rebuilds ``model`` without the environment it was trained in: its class, its config as
    plain data (enums by name), and the bytes of the tokenizer files of ``tokenizer_dir``
    (TOKENIZER_DIR, whose pieces ``use_tokenizer`` made the model's). A few hundred kB; a step
    checkpoint carries it."""
    from omegaconf import OmegaConf

    tokenizer_dir = Path(tokenizer_dir or config.TOKENIZER_DIR)
    files = {
        name: (tokenizer_dir / name).read_bytes()
        for name in TOKENIZER_FILES
        if (tokenizer_dir / name).is_file()
    }
    if "tokenizer.model" not in files:
        raise FileNotFoundError(f"TOKENIZER_DIR={tokenizer_dir} has no tokenizer.model")
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        # enum_to_str: NeMo's decoding enums by name, as a .nemo's YAML holds them, so that the
        # checkpoint is plain data (checkpoints.read_checkpoint loads nothing else)
        "config": OmegaConf.to_container(model.cfg, resolve=True, enum_to_str=True),
        "tokenizer": files,
    }


# What a model description may name, a closed set: its class is one of the families' NeMo model
# classes, found by name in NeMo's ASR model package; every ``_target_`` in its config is a class of
# NeMo's ASR module package or its submodules (what NeMo's own configs of these models hold, adapter
# twins included); its tokenizer files are TOKENIZER_FILES, by their plain names.
DESCRIPTION_CLASS_PACKAGE = "nemo.collections.asr.models"
DESCRIPTION_TARGET_PACKAGE = "nemo.collections.asr.modules"
# The adapter modules a frozen-base model's config names (base_adapters.ADAPTER_CLASS).
DESCRIPTION_ADAPTER_TARGETS = frozenset(
    {"nemo.collections.common.parts.adapter_modules.LinearAdapter"}
)


def _description_refusal(source: str, field: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"refusing the model description in {source}: {field} {problem}, which no checkpoint "
        f"train.py writes holds; use a checkpoint this project wrote"
    )


def _is_dotted_name(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def _config_targets(node: Any, where: str = "config") -> list[tuple[str, Any]]:
    """Every (place, value) of a ``_target_`` key in the nested config ``node``."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            place = f"{where}.{key}"
            if key == "_target_":
                found.append((place, value))
            else:
                found += _config_targets(value, place)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _config_targets(value, f"{where}[{i}]")
    return found


def check_description(description: Any, source: str | Path) -> dict[str, Any]:
    """``description`` (a step checkpoint's ``PORTABLE_KEY`` entry) when it names only what one
    ``portable_description`` writes may name; otherwise CheckpointError, one line naming ``source``
    and the field. Pure: nothing is written or imported, so a refused description has done nothing.

    Allowed: ``tokenizer`` maps names of TOKENIZER_FILES (plain file names, never a path) to bytes,
    tokenizer.model among them; ``class`` is ``nemo.collections.asr.models[.<module>].<Family>``,
    <Family> one of the families' classes (``FAMILIES``), resolved by name in that package; the
    config is a dict whose ``_target_`` entries (the classes NeMo constructs from it) are
    ``nemo.collections.asr.modules[.<module>].<Name>`` (or the adapter class the frozen-base
    mode adds, ``DESCRIPTION_ADAPTER_TARGETS``), and whose ``target`` (the model class) is
    as ``class``."""
    source = str(source)
    if not isinstance(description, dict):
        raise _description_refusal(source, "the description", f"is a {type(description).__name__}")
    tokenizer = description.get("tokenizer")
    if not isinstance(tokenizer, dict) or "tokenizer.model" not in tokenizer:
        raise _description_refusal(source, "'tokenizer'", "has no tokenizer.model")
    for name, data in tokenizer.items():
        if name not in TOKENIZER_FILES:
            raise _description_refusal(
                source, f"'tokenizer' file name {name!r}", f"is not one of {list(TOKENIZER_FILES)}"
            )
        if not isinstance(data, bytes):
            raise _description_refusal(
                source, f"'tokenizer' file {name!r}", f"holds a {type(data).__name__}, not bytes"
            )
    model_class_name(description.get("class"), source, "'class'")
    cfg = description.get("config")
    if not isinstance(cfg, dict):
        raise _description_refusal(source, "'config'", f"is a {type(cfg).__name__}, not a dict")
    if cfg.get("target") is not None:
        model_class_name(cfg["target"], source, "'config.target'")
    for place, target in _config_targets(cfg):
        package = str(target).rpartition(".")[0]
        if not (
            isinstance(target, str)
            and _is_dotted_name(target)
            and (
                package == DESCRIPTION_TARGET_PACKAGE
                or package.startswith(DESCRIPTION_TARGET_PACKAGE + ".")
                or target in DESCRIPTION_ADAPTER_TARGETS
            )
        ):
            raise _description_refusal(
                source, f"{place} {target!r}", f"is not a class of {DESCRIPTION_TARGET_PACKAGE}"
            )
    return description


def model_class_name(value: Any, source: str, field: str) -> str:
    """The family class name that ``value`` (a description's class path) names; CheckpointError
    (``check_description``'s) when it is not one of the families' classes in NeMo's ASR models."""
    families = sorted(k.nemo_class for k in FAMILIES)
    if isinstance(value, str) and _is_dotted_name(value):
        module, _, name = value.rpartition(".")
        in_package = module == DESCRIPTION_CLASS_PACKAGE or module.startswith(
            DESCRIPTION_CLASS_PACKAGE + "."
        )
        if in_package and name in families:
            return name
    raise _description_refusal(
        source, f"{field} {value!r}", f"is not one of {families} in {DESCRIPTION_CLASS_PACKAGE}"
    )


def model_from_description(description: dict[str, Any], source: str | Path = "a checkpoint"):
    """The model ``portable_description`` describes (fresh weights), on CPU, ready for its weights:
    the tokenizer files go to a directory that lives as long as this process (a .nemo export copies
    them from there), and the loss and the encoder settings are those ``build_model`` gives. The
    description is checked first (``check_description``): a refused one writes and imports nothing."""
    from omegaconf import OmegaConf, open_dict

    check_description(description, source)
    name = model_class_name(description["class"], str(source), "'class'")
    tokenizer_dir = Path(tempfile.mkdtemp(prefix="asr-tokenizer-"))
    atexit.register(shutil.rmtree, tokenizer_dir, True)
    write_tokenizer_files(description, tokenizer_dir)
    cfg = OmegaConf.create(description["config"])
    with open_dict(cfg):
        cfg.tokenizer = {"dir": str(tokenizer_dir), "type": "bpe"}
    model = getattr(importlib.import_module(DESCRIPTION_CLASS_PACKAGE), name)(cfg=cfg)
    family(model).attach_loss(model)
    ensure_validation_ds(model)
    make_encoder_forward_rank_local(model)
    return model


def write_tokenizer_files(description: dict[str, Any], directory: Path) -> None:
    """The tokenizer files of a checked description (``check_description``) into ``directory``."""
    for name in TOKENIZER_FILES:
        if name in description["tokenizer"]:
            (directory / name).write_bytes(description["tokenizer"][name])


def model_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's own state_dict inside a train.py step checkpoint (its ``model.`` keys)."""
    return {
        k[len("model.") :]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")
    }


def load_trained_model(path: str | Path, device: str = "cpu", weights: dict | None = None):
    """The model of a .nemo file, or of a train.py step checkpoint (.ckpt), on ``device``, in eval mode.

    A .ckpt carries its model's description (``PORTABLE_KEY``): the model is rebuilt from it alone,
    whatever INIT_MODEL, MODEL_CONFIG and TOKENIZER_DIR say now. A checkpoint without one is rebuilt
    as training built it (``build_model`` from those settings, which must then be as in training).
    ``weights`` replaces the checkpoint's own (an average of several, see export_nemo.py)."""
    path = Path(path)
    if path.suffix == ".nemo":
        from nemo.collections.asr.models import ASRModel

        try:
            model = ASRModel.restore_from(str(path), map_location="cpu")
        except Exception as exc:  # NeMo's own errors (tarfile, yaml, torch) never name the file
            raise CheckpointError(
                f"cannot load the .nemo {path}: {type(exc).__name__}: {exc}; it is truncated or "
                f"not a NeMo model: export it again (scripts/export_nemo.py) or use its .ckpt"
            ) from exc
        return model.to(device).eval()
    checkpoint = read_checkpoint(
        path, mmap=True
    )  # the weights only: the optimizer state stays on disk
    if "state_dict" not in checkpoint:
        raise CheckpointError(
            f"{path} has no 'state_dict': expected a Lightning checkpoint written by train.py"
        )
    portable = checkpoint.get(PORTABLE_KEY)
    if portable is not None:
        model = model_from_description(portable, path)
        source = f"the model description inside {path}"
    else:
        model = build_model()
        source = (
            f"INIT_MODEL={config.INIT_MODEL!r} / MODEL_CONFIG={config.MODEL_CONFIG} / "
            f"TOKENIZER_DIR={config.TOKENIZER_DIR} (the checkpoint carries no model description; "
            f"set them as in training)"
        )
    missing, unexpected = model.load_state_dict(
        model_weights(checkpoint) if weights is None else weights, strict=False
    )
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit the model built from {source}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    return model.to(device).eval()
