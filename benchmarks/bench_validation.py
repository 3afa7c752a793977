"""What validation at every checkpoint costs: our validation batch against NeMo's own validation
step and against a training step, same model and batch, plus the audio loading, and the share of
training time this makes at the defaults.

Usage:
    python benchmarks/bench_validation.py                                             # MODEL_CONFIG (tiny)
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml MAX_BATCH_DURATION=20 python benchmarks/bench_validation.py
    python benchmarks/bench_validation.py --world-size 8 --val-utterances 2800 --repeats 5

Measured, in one process on one device (the median of ``--repeats`` after one warm-up each):
  train     one training micro-batch in phase 2: forward, backward and an AdamW step
  ours      ``decoding.greedy_texts_and_loss``: what the validation callback runs per batch (one
            encoder forward, greedy decoding and the TDT loss)
  nemo      NeMo's own ``validation_pass`` on the same batch with ``compute_eval_loss`` on (its loss
            and its WER decoding: the same work), and off (as NeMo's published configs have it)
  load      ``dataset.load_audio`` of ``--files`` FLAC files of 6 s (the validation loads audio in
            the training process, one file after another), in seconds per second of audio
The batch is the sampler's heaviest micro-batch at MAX_BATCH_DURATION (see max_batch.py).

The share of training time spent validating, at EVAL_EVERY_STEPS = CHECKPOINT_EVERY:
    share = (V / W) * (ours / A + load) / (CHECKPOINT_EVERY * GRAD_ACCUM * train)
with V the validation audio (``--val-utterances`` x ``--val-seconds``; default VAL_PER_LANG x 14
languages x 6 s), W ranks, A the batch's audio seconds. ``ours`` and ``train`` come from the same
device, so their ratio carries to a GPU roughly; ``load`` is CPU work on any machine. The share is
printed for this device, and the largest ``train`` (seconds per micro-batch) at which it stays
under 2% on a GPU where ``ours / train`` is as measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import soundfile as sf
import torch

import asr_model
import config
import decoding
import max_batch
from benchmarks import bench_train_step as bts


def timed(run, repeats: int, device: torch.device) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        max_batch.sync(device)
        started = time.perf_counter()
        run()
        max_batch.sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def load_seconds_per_audio_second(files: int, work_dir: Path) -> float:
    """``dataset.load_audio`` wall time per second of audio over ``files`` 6 s FLAC files."""
    from dataset import load_audio

    rng = np.random.default_rng(0)
    sr = config.TARGET_SAMPLE_RATE
    paths = []
    for i in range(files):
        path = work_dir / f"val_{i:04d}.flac"
        sf.write(
            path, (0.05 * rng.standard_normal(6 * sr)).astype(np.float32), sr, subtype="PCM_16"
        )
        paths.append(path)
    started = time.perf_counter()
    for path in paths:
        load_audio(str(path), expected_duration=6.0)
    return (time.perf_counter() - started) / (6.0 * files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each")
    parser.add_argument("--files", type=int, default=40, help="FLAC files for the load timing")
    parser.add_argument("--world-size", type=int, default=8, help="ranks sharing the validation")
    parser.add_argument(
        "--val-utterances",
        type=int,
        default=config.VAL_PER_LANG * 14,
        help="validation utterances (default VAL_PER_LANG x 14 languages)",
    )
    parser.add_argument("--val-seconds", type=float, default=6.0, help="mean validation duration")
    parser.add_argument(
        "--tokens-per-second", type=float, default=4.0, help="tokens per second of audio"
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="tokenizer and audio files")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_validation_"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(config.TOKENIZER_DIR)
    if not (tokenizer_dir / "tokenizer.model").exists():
        tokenizer_dir = bts.synthetic_tokenizer(config.VOCAB_SIZE, work)
    model = asr_model.build_model(tokenizer_dir=tokenizer_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    shape = max_batch.heaviest_batch_shape(config.MAX_BATCH_DURATION, args.tokens_per_second)
    batch = max_batch.make_batch(shape, model.tokenizer).on_device(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def train_micro_batch():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        asr_model.training_loss(model, batch, encoder_frozen=False).backward()
        optimizer.step()

    def ours():
        model.eval()
        decoding.greedy_texts_and_loss(model, batch)

    # validation_pass reads the trainer's step and logs it; outside a Trainer both are stand-ins.
    model._trainer = SimpleNamespace(global_step=0)
    model.log = lambda *args, **kwargs: None

    def nemo(with_loss: bool):
        model.eval()
        model.compute_eval_loss = with_loss
        with torch.no_grad():
            model.validation_pass(
                (batch.signal, batch.signal_len, batch.tokens, batch.token_len), 0
            )

    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {type(model).__name__} {n_params / 1e6:.1f} M parameters on {device}; batch "
        f"{shape.describe()}"
    )
    t_train = timed(train_micro_batch, args.repeats, device)
    t_ours = timed(ours, args.repeats, device)
    t_nemo = timed(lambda: nemo(True), args.repeats, device)
    t_nemo_wer = timed(lambda: nemo(False), args.repeats, device)
    t_load = load_seconds_per_audio_second(args.files, work)
    audio = shape.audio_seconds
    print(f"train micro-batch (fwd + bwd + AdamW)   {t_train:8.3f} s")
    print(
        f"validation batch, ours (decode + loss)  {t_ours:8.3f} s  = {t_ours / t_train:.2f}x train"
    )
    print(
        f"validation batch, NeMo validation_pass  {t_nemo:8.3f} s  ours/NeMo = {t_ours / t_nemo:.2f}"
    )
    print(
        f"  NeMo validation_pass without its loss   {t_nemo_wer:8.3f} s  (NeMo's published configs "
        f"set compute_eval_loss: false)"
    )
    print(f"audio loading                           {t_load * 1e3:8.3f} ms per audio second")

    val_audio = args.val_utterances * args.val_seconds
    per_rank = val_audio / args.world_size
    validation = per_rank * (t_ours / audio + t_load)
    between = config.CHECKPOINT_EVERY * config.GRAD_ACCUM * t_train
    print(
        f"\nshare = (V / W) * (ours / A + load) / (CHECKPOINT_EVERY * GRAD_ACCUM * train) with "
        f"V = {args.val_utterances} x {args.val_seconds:g} s = {val_audio / 3600:.2f} h, "
        f"W = {args.world_size}, A = {audio:.1f} s, CHECKPOINT_EVERY = {config.CHECKPOINT_EVERY}, "
        f"GRAD_ACCUM = {config.GRAD_ACCUM}"
    )
    print(
        f"on this device: one validation {validation:.1f} s per rank, training between two "
        f"{between:.0f} s: share {100 * validation / (validation + between):.3f}%"
    )
    # On a faster device with the same ours/train ratio: validation = model_term * train + fixed
    # and training between two = K * train; share <= 2% <=> train >= fixed / (r * K - model_term).
    ratio = t_ours / t_train
    model_term = per_rank * ratio / audio
    fixed = per_rank * t_load
    room = 0.02 / 0.98 * config.CHECKPOINT_EVERY * config.GRAD_ACCUM - model_term
    if room <= 0:
        print(f"with ours/train = {ratio:.2f} the share is above 2% at any speed")
    else:
        print(
            f"with ours/train = {ratio:.2f}: the share stays under 2% for any training micro-batch "
            f"slower than {1e3 * fixed / room:.2f} ms (audio loading is the only term that does "
            f"not shrink with a faster device)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
