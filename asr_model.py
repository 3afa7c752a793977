"""The model seam: what training, validation, evaluation and export need from a model, whatever its family.

A model family (``ModelFamily``) is a NeMo model class and its loss: how a fresh one is built, how it
takes our vocabulary and loss (``change_vocabulary``, ``attach_loss``), the loss of one micro-batch
from the encoder's output, greedy decoding, the start-up check of its loss on the training device
and a line that describes the loss. ``TDT`` (Parakeet-TDT: EncDecRNNTBPEModel with the TDT loss) is
the family this app trains by default; ``FAMILIES`` lists them all, ``family`` finds a model's and
``family_of_config`` a fresh model's (the YAML's ``target``, NeMo's own key for the model class).
Another family is a new ``ModelFamily`` here plus a model config.

Around it, what holds for every family: building a model (``build_model``: INIT_MODEL, MODEL_CONFIG,
TOKENIZER_DIR), giving it our vocabulary (``use_tokenizer``), checking that it agrees with the data
pipeline's settings (``check_frontend``), reaching its encoder (``encoder``,
``set_encoder_trainable``), the loss of one micro-batch (``training_loss``), greedy decoding auto
or with the language given (``greedy_texts``, ``decode_batch``), checking the loss on the training device
(``check_loss_on_device``), describing a model so that a checkpoint rebuilds it alone
(``portable_description``, ``model_from_description``) and loading a trained model for inference
(``load_trained_model``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import logging
import math
import os
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

import config
import tdt_loss
from checkpoints import PORTABLE_KEY, CheckpointError, read_checkpoint

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
    )
    if not torch.cuda.is_available():
        # CUDA graphs for greedy decoding cannot apply without CUDA; on a GPU the note stays (it
        # says decoding will be slower when cuda-python is missing).
        harmless += ("No conditional node support for Cuda",)
    nemo_logger = logging.getLogger("nemo_logger")
    if not any(isinstance(f, _DropMessages) for f in nemo_logger.filters):
        nemo_logger.addFilter(_DropMessages(harmless))
        nemo_logger.addFilter(_SummarizeVocabulary())
    # NeMo's OneLogger telemetry is off in this app: its notes ("no exporters", "skipping ...
    # because OneLogger is not enabled", on every rank) say nothing to a user. A level on the parent
    # is not enough: once OneLogger is set up, its get_logger gives each module's logger a level of
    # its own (INFO), which wins. So nothing of it propagates to the run's log at all.
    one_logger = logging.getLogger("nv_one_logger")
    one_logger.setLevel(logging.ERROR)
    one_logger.propagate = False
    if not one_logger.handlers:
        one_logger.addHandler(logging.NullHandler())
    # NeMo's prediction network is a 1-layer LSTM built with its dropout argument; PyTorch warns
    # that the LSTM's inter-layer dropout then does nothing, while NeMo applies dropout itself.
    warnings.filterwarnings(
        "ignore",
        message="dropout option adds dropout after all but last recurrent layer",
        category=UserWarning,
    )


quiet_harmless_messages()


def _spm_pieces(model_file: Path) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def model_pieces(model) -> list[str] | None:
    """The pieces of the model's SentencePiece tokenizer in id order, or None for another kind."""
    inner = getattr(model.tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "id_to_piece"):
        return None
    return [inner.id_to_piece(i) for i in range(inner.get_piece_size())]


def tokenizer_matches(model, tokenizer_dir: Path) -> bool:
    """True when the model's SentencePiece pieces are exactly those of ``tokenizer_dir/tokenizer.model``."""
    ours = model_pieces(model)
    return ours is not None and ours == _spm_pieces(tokenizer_dir / "tokenizer.model")


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

    def greedy_texts_of_encoded(
        self,
        model,
        encoded,
        encoded_len,
        first_pieces: list[int | None] | None = None,
        kept: list[torch.Tensor | None] | None = None,
    ) -> list[str]:
        """Greedy transcripts from the encoder's output; where ``first_pieces`` gives an utterance a
        piece id, its decoding starts from that piece as if it had emitted it (the language given)
        and writes after it only the pieces ``kept`` marks True for it (None: any piece); None
        decodes it as it comes (auto)."""
        raise NotImplementedError

    def first_tokens_of_encoded(
        self, model, encoded, encoded_len
    ) -> list[tuple[int, float] | None]:
        """Per utterance, (piece id, probability) of the first piece greedy decoding emits, None
        when it emits none."""
        raise NotImplementedError

    def check_loss_on_device(self, model, device: torch.device) -> str | None:
        """Run the loss on a known problem on ``device``: a line for the log, None for no check."""
        return None

    def describe_loss(self, model) -> str:
        raise NotImplementedError

    def piece_rows(self, model) -> list[torch.nn.Parameter]:
        """The parameters with a row per piece, piece id i at row i (``new_piece_parameters``)."""
        raise NotImplementedError


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

        old_size, old_pieces = model.tokenizer.vocab_size, model_pieces(model)
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
            pieces = model_pieces(model)
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

    def greedy_texts_of_encoded(
        self,
        model,
        encoded,
        encoded_len,
        first_pieces: list[int | None] | None = None,
        kept: list[torch.Tensor | None] | None = None,
    ) -> list[str]:
        if first_pieces is None or all(p is None for p in first_pieces):
            return self.auto_decoding(model, encoded, encoded_len)[0]
        return self.started_texts(model, encoded, encoded_len, first_pieces, kept)

    def auto_decoding(self, model, encoded, encoded_len) -> tuple[list[str], list | None]:
        """Greedy transcripts decoded auto and the piece ids of each (None when the decoding
        does not give them)."""
        hyps = model.decoding.rnnt_decoder_predictions_tensor(
            encoder_output=encoded, encoded_lengths=encoded_len
        )
        ids = [getattr(hyp, "y_sequence", None) for hyp in hyps]
        if any(i is None for i in ids):
            return [hyp.text for hyp in hyps], None
        return [hyp.text for hyp in hyps], [[int(i) for i in seq] for seq in ids]

    def started_texts(
        self,
        model,
        encoded,
        encoded_len,
        first_pieces: list[int | None],
        kept: list[torch.Tensor | None] | None = None,
    ) -> list[str]:
        """Greedy transcripts of a batch in which utterance b writes ``first_pieces[b]`` where greedy
        decoding writes its first piece (None: the utterance decodes auto), and after it only the
        pieces ``kept[b]`` marks True (a bool tensor over the pieces; None: any piece).

        Greedy decoding walks the frames with the start state until a piece beats blank
        (``first_emissions``): there, at frame t with duration d, it writes the given piece
        instead of the one it chose, the prediction network reads it, and the search goes on from
        frame t + d. So an utterance whose language the model names right decodes exactly as auto;
        one it takes for another language is written from its own tag on. NeMo's label-looping
        greedy decoding (``greedy_batch``, its default for TDT, with or without CUDA graphs)
        continues a batch from such a state and frame, as it continues a stream chunk by chunk;
        the state is built for the whole batch at once and the search is auto decoding's loop.
        The piece is then put in front of each transcript. Pieces left out of ``kept`` lose every
        step of the search to blank or a kept piece (``_KeptPieces``); blank and the durations are
        always kept."""
        from nemo.collections.asr.parts.utils.rnnt_utils import batched_hyps_to_hypotheses

        infer = model.decoding.decoding
        computer = getattr(infer, "decoding_computer", None)
        if computer is None:
            raise config.ConfigError(
                "decoding with the language given needs NeMo's label-looping greedy decoding "
                "(decoding.strategy: greedy_batch with greedy.loop_labels: true, NeMo's default); "
                f"this model decodes with {type(infer).__name__}: set its "
                "decoding config (model.change_decoding_strategy) or decode without a language"
            )
        modes = (model.decoder.training, model.joint.training)
        model.decoder.eval()
        model.joint.eval()
        try:
            with torch.inference_mode():
                starts = self.first_emissions(model, encoded, encoded_len)
                frames = [
                    int(length) if first is None else first[2] + first[3]
                    for first, length in zip(starts, encoded_len.tolist())
                ]
                state = self.started_state(model, first_pieces, frames)
                keeping = kept is not None and any(k is not None for k in kept)
                if keeping:
                    _KeptPieces.install(computer, len(first_pieces)).keep(kept)
                try:
                    batched, _ = computer(
                        x=encoded.transpose(1, 2), out_len=encoded_len, prev_batched_state=state
                    )
                finally:
                    if keeping:
                        computer.joint.keep_all()
        finally:
            model.decoder.train(modes[0])
            model.joint.train(modes[1])
        hyps = batched_hyps_to_hypotheses(batched, batch_size=encoded.shape[0])
        emitted = {p: torch.tensor([int(p)]) for p in set(first_pieces) if p is not None}
        for hyp, piece in zip(hyps, first_pieces):
            if piece is not None:
                hyp.y_sequence = torch.cat((emitted[piece], hyp.y_sequence.to(torch.long)))
        return [hyp.text for hyp in model.decoding.decode_hypothesis(hyps)]

    def started_state(self, model, first_pieces: list[int | None], frames: list[int]):
        """NeMo's batched label-looping state after the prediction network read the start symbol
        and then ``first_pieces[b]`` (after the start symbol alone where it is None), at frame
        ``frames[b]`` (0 where the piece is None)."""
        from nemo.collections.asr.parts.submodules.transducer_decoding.label_looping_base import (
            BatchedLabelLoopingState,
        )

        device = next(model.joint.parameters()).device
        size = len(first_pieces)
        blank = int(model.decoder.blank_idx)
        given = torch.tensor([p is not None for p in first_pieces], device=device)
        pieces = torch.tensor([blank if p is None else int(p) for p in first_pieces], device=device)
        # the start state is one for every utterance: read the start symbol once
        start_out, start = model.decoder.predict(
            torch.full((1, 1), blank, dtype=torch.long, device=device),
            None,
            add_sos=False,
            batch_size=1,
        )
        start = _states_for_batch(model.decoder, start, size)
        start_out = model.joint.project_prednet(start_out).expand(size, -1, -1)
        out, state = model.decoder.predict(
            pieces.unsqueeze(1), start, add_sos=False, batch_size=size
        )
        out = torch.where(given[:, None, None], model.joint.project_prednet(out), start_out)
        model.decoder.batch_replace_states_mask(src_states=start, dst_states=state, mask=~given)
        return BatchedLabelLoopingState(
            predictor_states=state,
            predictor_outputs=out.contiguous(),
            labels=pieces,
            decoded_lengths=torch.zeros(size, dtype=torch.long, device=device),
            time_jumps=torch.tensor(
                [0 if p is None else int(f) for p, f in zip(first_pieces, frames)],
                dtype=torch.long,
                device=device,
            ),
        )

    def first_tokens_of_encoded(
        self, model, encoded, encoded_len
    ) -> list[tuple[int, float] | None]:
        return [
            None if first is None else first[:2]
            for first in self.first_emissions(model, encoded, encoded_len)
        ]

    def first_emissions(
        self, model, encoded, encoded_len, chunk: int = 32
    ) -> list[tuple[int, float, int, int] | None]:
        """Per utterance, (piece id, probability, frame, duration) of the first piece greedy
        decoding emits, None when it emits none; the probability is the softmax over the pieces
        and blank of the joint's output at that step, the duration the frames greedy decoding
        then moves on by (the best duration there; 0 for a model without durations).

        Until its first piece, greedy decoding feeds the prediction network its start state
        alone, so the joint of each frame with that one state decides it: from frame 0, a blank
        moves on by its predicted duration (at least one frame, as NeMo's greedy TDT does), the
        first piece ends the walk. The joint runs over ``chunk`` frames at a time, from the
        earliest frame an unfinished utterance has reached, so a walk that ends early (the usual
        case: the language tag comes first) costs a few frames' joint, on any device and
        precision: the joint's log-softmax on CPU shifts every output by one constant, which
        changes neither the argmaxes nor the softmax over the pieces and blank."""
        blank = int(model.decoder.blank_idx)
        durations = list(getattr(model.decoding.decoding, "durations", None) or [])
        frames = encoded.transpose(1, 2)  # [B, T, D]
        size = frames.shape[0]
        start, _ = model.decoder.predict(None, None, add_sos=False, batch_size=size)
        lengths = [int(n) for n in encoded_len.tolist()]
        out: list[tuple[int, float, int, int] | None] = [None] * size
        at = [0] * size
        walking = [b for b in range(size) if lengths[b] > 0]
        while walking:
            low = min(at[b] for b in walking)
            rows = torch.tensor(walking, device=frames.device)
            logits = model.joint.joint(frames[rows, low : low + chunk], start[rows])[:, :, 0]
            logits = logits.float()
            best, tokens = logits[..., : blank + 1].softmax(-1).max(-1)
            steps = (
                logits[..., blank + 1 : blank + 1 + len(durations)].argmax(-1)
                if durations
                else torch.zeros_like(tokens)
            )
            # one copy to the host for the three (each a sync on a GPU); ids are exact in float64
            host = torch.stack((tokens.double(), best.double(), steps.double())).cpu()
            tokens = host[0].long().tolist()
            best = host[1].tolist()
            steps = host[2].long().tolist() if durations else None
            still = []
            for k, b in enumerate(walking):
                end = min(lengths[b], low + len(tokens[k]))
                while at[b] < end:
                    j = at[b] - low
                    duration = durations[steps[k][j]] if durations else 0
                    if tokens[k][j] != blank:
                        out[b] = (int(tokens[k][j]), float(best[k][j]), at[b], duration)
                        break
                    at[b] += max(1, duration)
                if out[b] is None and at[b] < lengths[b]:
                    still.append(b)
            walking = still
        return out

    def check_loss_on_device(self, model, device: torch.device) -> str | None:
        """The CUDA TDT loss against ``tdt_loss.tdt_loss`` (``tdt_loss.check_cuda_loss``)."""
        diff = tdt_loss.check_cuda_loss(model.loss._loss, device)
        return (
            f"TDT loss on {device} (TDT_LOSS={config.TDT_LOSS}) agrees with tdt_loss.py on a "
            f"known problem (largest difference {diff:.2g})"
        )

    def describe_loss(self, model) -> str:
        return f"TDT loss {model.loss._loss}"


def _states_for_batch(decoder, state, size: int):
    """One utterance's prediction-network ``state`` as the state of ``size`` utterances. An LSTM
    prediction network's (h, c), each [layers, 1, hidden], is expanded along its batch dimension
    with no loop; any other kind goes through the decoder's split and unsplit, one copy per
    utterance."""
    if isinstance(state, (tuple, list)) and all(
        isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == 1 for t in state
    ):
        return type(state)(t.expand(-1, size, -1).contiguous() for t in state)
    return decoder.batch_unsplit_states(decoder.batch_split_states(state) * size)


class _KeptPieces:
    """The joint as NeMo's label-looping search calls it, with one additive row per utterance on
    its pieces' outputs (0 for a piece kept, -inf for one left out; blank and the durations as
    they are).

    Installed once in a decoding computer (``install``) and left there, with every row 0 except
    while a search with kept pieces runs (``keep``, then ``keep_all``), so auto decoding through
    the same computer is unchanged. The rows live in one buffer that the CUDA graphs of the search
    read by address: ``keep`` writes into it in place, and the buffer grows (and the computer's
    graphs are captured again) only when a batch larger than every one before it comes."""

    def __init__(self, joint, rows: int, pieces: int, device):
        self.joint = joint
        self.pieces = pieces
        # as wide as the joint's output (pieces, blank, durations): one contiguous add per step
        width = max(int(getattr(joint, "num_classes_with_blank", pieces + 1)), pieces + 1)
        with torch.inference_mode(False):  # written in place by every later search
            self.bias = torch.zeros(rows, width, device=device)

    def __getattr__(self, name):
        return getattr(self.joint, name)

    @classmethod
    def install(cls, computer, size: int) -> _KeptPieces:
        """The computer's ``_KeptPieces`` (installed now if it has none) with room for ``size``
        rows and for the batch its CUDA graphs were captured for."""
        joint = computer.joint
        state = getattr(computer, "state", None)
        rows = max(size, int(getattr(state, "batch_size", 0) or 0))
        if isinstance(joint, cls) and joint.bias.shape[0] >= rows:
            return joint
        inner = joint.joint if isinstance(joint, cls) else joint
        device = next(inner.parameters()).device
        computer.joint = cls(inner, rows, int(computer._blank_index), device)
        computer.reset_cuda_graphs_state()  # captured graphs read the joint without these rows
        return computer.joint

    def keep(self, kept: list[torch.Tensor | None]) -> None:
        """Row b keeps the pieces ``kept[b]`` marks True (None: every piece); rows past the batch
        keep every piece."""
        every = torch.ones(self.pieces, dtype=torch.bool)
        rows = torch.stack([every if mask is None else mask.cpu() for mask in kept])
        self.bias.zero_()
        self.bias[: len(kept), : self.pieces].masked_fill_(
            ~rows.to(self.bias.device), float("-inf")
        )

    def keep_all(self) -> None:
        self.bias.zero_()

    def joint_after_projection(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        out = self.joint.joint_after_projection(f, g)
        if out.shape[0] <= self.bias.shape[0]:
            bias = self.bias[: out.shape[0], None, None, :]
            if out.shape[-1] == bias.shape[-1]:
                out += bias
            else:
                out[..., : self.pieces] += bias[..., : self.pieces]
        return out


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


class ModelNotFetched(config.ConfigError):
    """INIT_MODEL names a pretrained model that cannot be downloaded here."""


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
):
    """The NeMo model to train, on CPU, with TOKENIZER_DIR's vocabulary and its family's loss.

    ``init_model``: a .nemo path (restore_from), a train.py step checkpoint (the model it describes,
    with its weights) or a pretrained name (from_pretrained); empty means a fresh model from the
    ``model_config`` YAML (its ``model:`` section; its ``target`` names the family, TDT without one)
    with ``tokenizer.dir`` set to ``tokenizer_dir``.
    Defaults come from INIT_MODEL, MODEL_CONFIG, TOKENIZER_DIR, DECODER_INIT and NEW_PIECE_BIAS.
    ``model.vocabulary_change`` holds what ``use_tokenizer`` did to the parts sized by the vocabulary;
    ``model.base_model`` the base's identity (``base_identity``; None for a fresh model).
    """
    from nemo.collections.asr.models import ASRModel
    from omegaconf import OmegaConf, open_dict

    init_model = config.INIT_MODEL if init_model is None else init_model
    model_config = Path(model_config or config.MODEL_CONFIG)
    tokenizer_dir = Path(tokenizer_dir or config.TOKENIZER_DIR)
    check_model_inputs(init_model, model_config, tokenizer_dir)

    if init_model:
        if init_model.endswith(".ckpt"):
            log.info("restoring the model of the step checkpoint %s", init_model)
            model = load_trained_model(init_model).train()
        elif is_local_model(init_model):
            log.info("restoring %s", init_model)
            model = ASRModel.restore_from(init_model, map_location="cpu")
        else:
            log.info("downloading pretrained %s (needs network access)", init_model)
            try:
                model = ASRModel.from_pretrained(init_model, map_location="cpu")
            except Exception as exc:  # NeMo and huggingface_hub raise many kinds, never naming it
                raise ModelNotFetched(
                    f"INIT_MODEL={init_model} cannot be fetched ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200] if str(exc) else ''}). On a node without "
                    f"internet, download the .nemo where there is (huggingface.co/{init_model}) and "
                    f"set INIT_MODEL=/path/to/model.nemo"
                ) from None
    else:
        cfg = OmegaConf.load(model_config)
        cfg = cfg.model if "model" in cfg else cfg
        with open_dict(cfg):
            cfg.tokenizer.dir = str(tokenizer_dir)
            cfg.tokenizer.type = "bpe"
        kind = family_of_config(cfg)
        log.info("building a fresh %s model from %s", kind.name, model_config)
        model = kind.new_model(cfg)

    base_pieces = model_pieces(model) if init_model else None
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
        warn_unless_extension(base_pieces, model_pieces(model) or [], tokenizer_dir, init_model)
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
    if not tokenizer_matches(model, tokenizer_dir):
        counts = kind.change_vocabulary(model, tokenizer_dir, decoder_init, new_piece_bias)
    kind.attach_loss(model)
    return counts


def new_piece_prior(tokenizer_dir: Path, pieces: list[str], new_rows: list[int]):
    """The log share of each new piece (``new_rows``, in that order) among the new pieces'
    occurrences in the text the tokenizer was trained on (``training_cache.read_piece_counts``: the
    training language mix), add-one smoothed, so the shares sum to 1; None when
    ``tokenizer_dir`` holds no counts for its tokenizer (one made before pieces were counted):
    the new pieces then start with equal shares."""
    from training_cache import read_piece_counts

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
    """Frozen: no gradients and eval mode (BatchNorm statistics and dropout stay still); else trains.

    Eval mode must be re-imposed after anything that puts the whole model into train mode."""
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


class LanguageNotInModel(config.ConfigError):
    """A language given for decoding whose tag is no single piece of the model's vocabulary."""


def language_tag_pieces(model, languages) -> list[int | None]:
    """The piece id of each language's tag ``<|lang|>`` in ``model``'s vocabulary, None where the
    language is None or empty (decoded auto); LanguageNotInModel naming the language and the
    tags the model has when one has no single piece."""
    from manifest_schema import lang_tag, leading_lang
    from training_cache import tag_piece_id

    known: dict[str, int | None] = {}
    out: list[int | None] = []
    for lang in languages:
        if not lang:
            out.append(None)
            continue
        if lang not in known:
            known[lang] = tag_piece_id(model.tokenizer, lang)
        if known[lang] is None:
            tags = sorted({leading_lang(p) for p in (model_pieces(model) or []) if leading_lang(p)})
            raise LanguageNotInModel(
                f"the model has no tag {lang_tag(lang)} for the language {lang!r} given to "
                f"decode with (its tags: {', '.join(tags) or 'none'}); give one of those, or "
                "no language to let the model guess it"
            )
        out.append(known[lang])
    return out


# Pieces that are no language's own writing, kept for every language: SentencePiece's special
# pieces and its byte pieces (<0xE0>: a byte of a character the vocabulary lacks).
_SPECIAL_PIECES = frozenset({"<unk>", "<s>", "</s>", "<pad>"})


def always_kept(piece: str) -> bool:
    """True for a special or byte piece, which decoding with any language given may write."""
    return piece in _SPECIAL_PIECES or (
        len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
    )


# Per tokenizer object (a new vocabulary is a new one): each piece's (special, scripts, is a tag),
# and the masks built from them, per (language, scripts).
_PIECE_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def language_piece_masks(model, languages) -> list[torch.Tensor | None]:
    """Per utterance, which pieces decoding with its language given may write after the tag: a
    bool tensor over ``model``'s pieces, True for a piece whose letters are all of the scripts the
    model records that language written in (``model_languages.language_scripts``), for a piece
    without letters (digits, punctuation, the word boundary) and for ``always_kept`` pieces;
    False for every language tag. None (any piece) where the language is None or empty, where
    the model records no scripts for it (or none: a language whose texts had no letters), or for
    a tokenizer that is not SentencePiece."""
    import model_languages
    from manifest_schema import lang_tag, leading_lang
    from script_languages import scripts_of

    recorded = model_languages.language_scripts(model)
    wanted = {lang for lang in languages if lang and recorded.get(lang)}
    if not wanted:
        return [None] * len(languages)
    known = _PIECE_MASKS.setdefault(model.tokenizer, {})
    if "pieces" not in known:
        pieces = model_pieces(model)
        known["pieces"] = (
            None
            if pieces is None
            else [
                (
                    always_kept(piece),
                    scripts_of(piece),
                    leading_lang(piece) is not None and piece == lang_tag(leading_lang(piece)),
                )
                for piece in pieces
            ]
        )
    if known["pieces"] is None:
        return [None] * len(languages)
    masks = {}
    for lang in wanted:
        key = (lang, recorded[lang])
        if key not in known:
            known[key] = torch.tensor(
                [
                    not tag and (special or written <= recorded[lang])
                    for special, written, tag in known["pieces"]
                ]
            )
        masks[lang] = known[key]
    return [masks.get(lang) if lang else None for lang in languages]


def kept_scripts_phrase(model, languages) -> str:
    """How decoding with ``languages`` given writes after the tag, for a report's heading: in the
    scripts the model records for each (LANGUAGE_GIVEN_SCRIPTS=1), or from the tag alone."""
    import model_languages

    if config.LANGUAGE_GIVEN_SCRIPTS != "1":
        return "the tag alone (LANGUAGE_GIVEN_SCRIPTS=0)"
    recorded = model_languages.language_scripts(model)
    asked = sorted({lang for lang in languages if lang and lang != "und"})
    kept = [f"{lang} {'+'.join(sorted(recorded[lang]))}" for lang in asked if recorded.get(lang)]
    alone = [lang for lang in asked if not recorded.get(lang)]
    parts = [f"then only pieces of its scripts ({', '.join(kept)})"] if kept else []
    if alone:
        parts.append(f"the tag alone for {', '.join(alone)} (the model records no scripts for it)")
    return "; ".join(parts) or "the tag alone"


def greedy_texts(
    model, signal: torch.Tensor, signal_len: torch.Tensor, languages=None
) -> list[str]:
    """Greedy transcripts (tags included, as the model emits them) of a padded batch of audio.
    ``languages``, one per utterance: decode starting from that language's tag (the language
    given); None (for all or for one) decodes as the model guesses."""
    if languages is None:
        return decode_batch(model, signal, signal_len).texts
    return decode_batch(model, signal, signal_len, auto=False, languages=languages).given_texts


def greedy_texts_and_first_tokens(
    model, signal: torch.Tensor, signal_len: torch.Tensor
) -> tuple[list[str], list[tuple[int, float] | None]]:
    """Greedy transcripts of a padded batch of audio (as ``greedy_texts``) and, per utterance,
    (piece id, probability) of the first piece the decoding emits (the language tag of a model of
    this project), None when it emits none; from one encoder forward."""
    decoded = decode_batch(model, signal, signal_len, first_tokens=True)
    return decoded.texts, decoded.first_tokens


def greedy_texts_and_loss(model, batch) -> tuple[list[str], float]:
    """Greedy transcripts of a non-empty AsrBatch and its loss (the training loss's reduction),
    from one encoder forward."""
    decoded = decode_batch(model, batch.signal, batch.signal_len, loss_batch=batch)
    return decoded.texts, decoded.loss


@dataclasses.dataclass
class BatchDecoding:
    """What ``decode_batch`` returns, one entry per utterance where a list: ``texts``, greedy
    transcripts decoded auto (the model names the language); ``given_texts``, decoded from the
    given language's tag (decoded auto where no language was given for that utterance);
    ``first_tokens``,
    (piece id, probability) of the first piece auto decoding emits, None where it emits none;
    ``loss``, the batch's loss (the training loss's reduction). A part not asked for is None."""

    texts: list[str] | None = None
    given_texts: list[str | None] | None = None
    first_tokens: list[tuple[int, float] | None] | None = None
    loss: float | None = None


@torch.no_grad()
def decode_batch(
    model,
    signal: torch.Tensor,
    signal_len: torch.Tensor,
    *,
    auto: bool = True,
    languages=None,
    scripts: bool | None = None,
    first_tokens: bool = False,
    loss_batch=None,
) -> BatchDecoding:
    """Every decoding asked for of one padded batch of audio, from one encoder forward: auto
    (``auto``), with the language given (``languages``: one per utterance, None or "" for an
    utterance decodes it auto there too; ``scripts``, default LANGUAGE_GIVEN_SCRIPTS=1: after the
    tag, only the pieces of ``language_piece_masks``), the first piece of auto decoding
    (``first_tokens``) and the loss of ``loss_batch`` (the AsrBatch of this audio, with its
    tokens)."""
    encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=signal_len)
    return decode_encoded(
        model,
        encoded,
        encoded_len,
        auto=auto,
        languages=languages,
        scripts=scripts,
        first_tokens=first_tokens,
        loss_batch=loss_batch,
    )


@torch.no_grad()
def decode_encoded(
    model,
    encoded: torch.Tensor,
    encoded_len: torch.Tensor,
    *,
    auto: bool = True,
    languages=None,
    scripts: bool | None = None,
    first_tokens: bool = False,
    loss_batch=None,
) -> BatchDecoding:
    """``decode_batch`` from the encoder's output of the batch."""
    kind = family(model)
    out = BatchDecoding()
    auto_ids = None
    if auto:
        out.texts, auto_ids = kind.auto_decoding(model, encoded, encoded_len)
    if languages is not None:
        firsts = language_tag_pieces(model, languages)
        if scripts is None:
            scripts = config.LANGUAGE_GIVEN_SCRIPTS == "1"
        kept = language_piece_masks(model, languages) if scripts else [None] * len(firsts)
        rows = list(range(len(firsts)))
        if auto:
            # Where auto decoding wrote the given tag first and then only kept pieces, the search
            # with the language given takes every step auto's took: its text is auto's.
            rows = [
                b
                for b in rows
                if firsts[b] is not None
                and (auto_ids is None or not _auto_is_given(auto_ids[b], firsts[b], kept[b]))
            ]
        out.given_texts = list(out.texts) if auto else [None] * len(firsts)
        if rows:
            at = torch.tensor(rows, device=encoded.device)
            texts = kind.greedy_texts_of_encoded(
                model,
                encoded if len(rows) == len(firsts) else encoded[at],
                encoded_len if len(rows) == len(firsts) else encoded_len[at],
                [firsts[b] for b in rows],
                [kept[b] for b in rows],
            )
            for b, text in zip(rows, texts):
                out.given_texts[b] = text
    if first_tokens:
        out.first_tokens = kind.first_tokens_of_encoded(model, encoded, encoded_len)
    if loss_batch is not None:
        out.loss = float(kind.loss_of_encoded(model, encoded, encoded_len, loss_batch))
    return out


def _auto_is_given(ids: list[int], tag: int, kept: torch.Tensor | None) -> bool:
    """True when auto decoding's pieces ``ids`` start with ``tag`` and go on in ``kept`` pieces
    alone (None: any), so that decoding from ``tag`` would write them too."""
    if not ids or ids[0] != tag:
        return False
    if kept is None or len(ids) == 1:
        return True
    return bool(kept[ids[1:]].all())


@contextlib.contextmanager
def decoding_graphs(model):
    """Greedy decoding with NeMo's CUDA graphs for as long as the block lasts.

    NeMo's own model hooks rebuild the decoder's CUDA graphs before each validation (a graph
    captured under another precision or batch layout decodes wrong: NeMo's fix for erratic
    validation WER) and release them after (they hold their memory otherwise, for the rest of the
    run). Lightning calls the hooks of our TrainingModule, not NeMo's, so validation and
    evaluation do it here. A model without these methods (or a CPU, where there are no graphs)
    is left as it is."""
    enable = getattr(model, "maybe_enable_cuda_graphs", None)
    disable = getattr(model, "disable_cuda_graphs", None)
    if callable(enable):
        enable(force_reinit=True)
    try:
        yield model
    finally:
        if callable(disable):
            disable()


def release_decoding_graphs(model) -> None:
    """Drop the decoder's CUDA graphs (training holds none: NeMo's on_train_epoch_start does the same)."""
    disable = getattr(model, "disable_cuda_graphs", None)
    if callable(disable):
        disable()


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
    plain data, and the bytes of the tokenizer files of ``tokenizer_dir`` (TOKENIZER_DIR, whose pieces
    ``use_tokenizer`` made the model's). A few hundred kB; a step checkpoint carries it."""
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
        "config": OmegaConf.to_container(model.cfg, resolve=True),
        "tokenizer": files,
    }


def model_from_description(description: dict[str, Any]):
    """The model ``portable_description`` describes (fresh weights), on CPU, ready for its weights:
    the tokenizer files go to a directory that lives as long as this process (a .nemo export copies
    them from there), and the loss and the encoder settings are those ``build_model`` gives."""
    from omegaconf import OmegaConf, open_dict

    tokenizer_dir = Path(tempfile.mkdtemp(prefix="asr-tokenizer-"))
    atexit.register(shutil.rmtree, tokenizer_dir, True)
    for name, data in description["tokenizer"].items():
        (tokenizer_dir / name).write_bytes(data)
    cfg = OmegaConf.create(description["config"])
    with open_dict(cfg):
        cfg.tokenizer = {"dir": str(tokenizer_dir), "type": "bpe"}
    module, _, name = description["class"].rpartition(".")
    model = getattr(importlib.import_module(module), name)(cfg=cfg)
    family(model).attach_loss(model)
    ensure_validation_ds(model)
    make_encoder_forward_rank_local(model)
    return model


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
        model = model_from_description(portable)
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
