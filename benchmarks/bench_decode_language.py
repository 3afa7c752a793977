"""Greedy decoding with the language given against auto decoding: the same model, the same batches,
side by side in one process, and the ratio of their times.

Usage:
    python benchmarks/bench_decode_language.py                       # a fresh demo model, CPU
    python benchmarks/bench_decode_language.py --model step_00000050.nemo --manifest val.parquet
    python benchmarks/bench_decode_language.py --model m.nemo --device cuda   # CUDA graphs

The model is ``--model`` (a .nemo or a train.py checkpoint) or a fresh one of MODEL_CONFIG with
TOKENIZER_DIR (default: configs/demo_tdt.yaml and data/acceptance/tokenizer, untrained). The audio
is ``--manifest`` (a parquet manifest of this pipeline, each row decoded from its own language)
or, without one, ``--utterances`` clips of noise of 2 to 12 s, each given one of the model's
languages in turn. The batches hold ``--batch-seconds`` of audio each (longest first).

Every batch is encoded once; then, in ``--rounds`` rounds (the order rotated each round), every
batch is decoded four ways (``decoding.decode_encoded``), inside the decoder's CUDA graphs on a
GPU (``decoding.decoding_graphs``, as validation and evaluate.py decode): auto; from its
languages' tags alone (LANGUAGE_GIVEN_SCRIPTS=0); from the tags keeping to each language's
scripts (the default; only for a model that records them); and both auto and given, as validation
decodes (given searched only where auto's text is not already the given one). Printed: the
decoding time of each (median over rounds), its ratio to auto (the median over rounds of each
round's ratio to that round's auto: paired, so that a round slowed as a whole cancels; the bound
for the language given is 1.05), the same with the encoder's time added (what a user of
evaluate.py or transcribe.py waits for), each round's ratio, the words each wrote, and on a GPU
the CUDA-graph mode NeMo used and whether each decoding with graphs writes the same texts as
without them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_model(args, device):
    import torch

    import asr_model
    import config
    import vocabulary

    if args.model:
        return asr_model.load_trained_model(Path(args.model), device).eval()
    config.INIT_MODEL = ""
    config.MODEL_CONFIG = Path(args.config)
    config.TOKENIZER_DIR = Path(args.tokenizer)
    torch.manual_seed(0)
    model = asr_model.build_model()
    vocabulary.record_language_scripts(model, config.TOKENIZER_DIR)  # as train.py does
    return model.to(device).eval()


def batches_of(args, model, device):
    """[(signal, lengths, languages)] on ``device``, longest batch first."""
    import numpy as np
    import torch

    import evaluation
    from dataset import LocalShardDataset, collate_asr_batch

    if args.manifest:
        dataset = LocalShardDataset(Path(args.manifest), model.tokenizer, progress=False)
        names, codes = dataset.lang_names, dataset.lang_codes
        indices = list(range(len(dataset)))[: args.utterances or None]
        out = []
        for batch in evaluation.pack_by_duration(indices, dataset.durations, args.batch_seconds):
            items = [(i, dataset[i]) for i in batch]
            items = [(i, item) for i, item in items if item is not None]
            if not items:
                continue
            collated = collate_asr_batch([item for _, item in items]).on_device(device)
            langs = [names[codes[i]] for i, _ in items]
            out.append((collated.signal, collated.signal_len, langs))
        if not out:
            raise SystemExit(f"{args.manifest}: no readable audio (are its audio paths here?)")
        return out[::-1]
    from manifest_schema import leading_lang

    pieces = asr_model_pieces(model)
    tags = sorted({leading_lang(p) for p in pieces if leading_lang(p)})
    rng = np.random.default_rng(0)
    durations = rng.uniform(2.0, 12.0, args.utterances or 64)
    rate = int(model.cfg.preprocessor.sample_rate)
    out = []
    order = evaluation.pack_by_duration(range(len(durations)), durations, args.batch_seconds)
    for batch in order[::-1]:
        lengths = torch.tensor([int(durations[i] * rate) for i in batch])
        signal = torch.from_numpy(
            rng.standard_normal((len(batch), int(lengths.max()))).astype("float32") * 0.1
        )
        langs = [tags[i % len(tags)] for i in batch]
        out.append((signal.to(device), lengths.to(device), langs))
    return out


def asr_model_pieces(model) -> list[str]:
    import vocabulary

    return vocabulary.model_pieces(model) or []


def ratio_lines(times: dict[str, list[float]], encoder_s: float) -> list[str]:
    """One line per decoding but auto from ``times`` (its seconds in each round, auto's among
    them, round r at index r): the median over rounds of its time over auto's in the same round,
    the same with ``encoder_s`` added to both, and each round's ratio. Paired by round, so that a
    round the machine ran slower as a whole cancels out, which a ratio of two medians (taken from
    different rounds) does not."""
    lines = []
    for name, took in times.items():
        if name == "auto":
            continue
        rounds = [t / a for t, a in zip(took, times["auto"])]
        whole = [(encoder_s + t) / (encoder_s + a) for t, a in zip(took, times["auto"])]
        lines.append(
            f"{name} / auto: decoding {statistics.median(rounds):.3f}, with the encoder "
            f"{statistics.median(whole):.3f}   per round: " + ", ".join(f"{x:.3f}" for x in rounds)
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="a .nemo or train.py checkpoint")
    parser.add_argument("--config", default=str(REPO / "configs" / "demo_tdt.yaml"))
    parser.add_argument("--tokenizer", default=str(REPO / "data" / "acceptance" / "tokenizer"))
    parser.add_argument("--manifest", default="", help="parquet manifest (default: noise)")
    parser.add_argument("--utterances", type=int, default=0, help="at most this many (0: all)")
    parser.add_argument("--batch-seconds", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there)")
    parser.add_argument(
        "--precision",
        choices=("32", "bf16"),
        default="32",
        help="bf16: everything under bf16 autocast, as a bf16-mixed run validates",
    )
    args = parser.parse_args(argv)

    import contextlib

    import torch

    import asr_model
    import decoding
    import vocabulary

    asr_model.quiet_harmless_messages()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    model = load_model(args, device)
    batches = batches_of(args, model, device)

    def autocast():
        if args.precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with torch.inference_mode(), autocast():
        sync()
        started = time.perf_counter()
        encoded = [model.forward(input_signal=s, input_signal_length=n) for s, n, _ in batches]
        sync()
        encoder_s = time.perf_counter() - started

    # name -> what decode_encoded is asked; "both" is what validation runs (auto, then the language
    # given where auto's text is not already the given one)
    ways = {
        "auto": {"auto": True},
        "given_tag": {"auto": False, "given": True, "scripts": False},
        "given_scripts": {"auto": False, "given": True, "scripts": True},
        "both": {"auto": True, "given": True, "scripts": True},
    }
    has_scripts = bool(vocabulary.language_scripts(model))
    if not has_scripts:
        del ways["given_scripts"]
        ways["both"]["scripts"] = False

    def decode_all(way: dict) -> tuple[float, list[str]]:
        texts: list[str] = []
        sync()
        started = time.perf_counter()
        with autocast():
            for (enc, enc_len), (_, _, langs) in zip(encoded, batches):
                out = decoding.decode_encoded(
                    model,
                    enc,
                    enc_len,
                    auto=way["auto"],
                    languages=langs if way.get("given") else None,
                    scripts=way.get("scripts"),
                )
                texts += out.given_texts if way.get("given") else out.texts
        sync()
        return time.perf_counter() - started, texts

    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    texts: dict[str, list[str]] = {}
    with decoding.decoding_graphs(model):
        for name in names:  # warm-up: graph capture, allocator
            decode_all(ways[name])
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                took, texts[name] = decode_all(ways[name])
                times[name].append(took)
        mode = getattr(
            getattr(model.decoding.decoding, "decoding_computer", None), "cuda_graphs_mode", None
        )
    median = {name: statistics.median(times[name]) for name in names}
    utterances = sum(len(langs) for _, _, langs in batches)
    audio_s = sum(float(n.sum()) for _, n, _ in batches) / int(model.cfg.preprocessor.sample_rate)

    def words(texts):  # words written, tags aside
        from manifest_schema import strip_lang_tag

        return sum(len(strip_lang_tag(t).split()) for t in texts)

    print(
        f"model {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
        f"parameters on {device}, precision {args.precision}; {utterances} utterances, "
        f"{audio_s:.0f} s of audio in {len(batches)} batches; {args.rounds} rounds"
    )
    if not has_scripts:
        print("the model records no scripts for its languages: given_scripts not measured")
    print(f"encoder (once)        {encoder_s:8.3f} s")
    what = {
        "auto": "auto decoding",
        "given_tag": "the language given, tag alone",
        "given_scripts": "the language given, its scripts kept (default)",
        "both": "auto and given, as validation decodes",
    }
    for name in names:
        print(f"{name:<14} {median[name]:8.3f} s   {words(texts[name]):6d} words   {what[name]}")
    for line in ratio_lines(times, encoder_s):
        print(line)
    if cuda:
        # NeMo's CUDA graphs decode in the weights' precision (autocast off), its torch loop under
        # autocast: in bf16 the two may part on near ties, auto and given alike
        with torch.inference_mode(), autocast():
            model.disable_cuda_graphs()
            differ = {
                name: sum(a != b for a, b in zip(decode_all(ways[name])[1], texts[name]))
                for name in names
                if name != "both"
            }
        print(
            f"CUDA graphs: {mode}; texts with graphs against without, differing: "
            + ", ".join(f"{name} {n}" for name, n in differ.items())
            + f" of {len(texts['auto'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
