"""Finetuning a base model onto new languages, side by side: where its decoder and joint start, and
how long the encoder stays frozen.

Usage:
    python benchmarks/bench_finetune_init.py                  # about 45 minutes on 2 idle cores (CPU)
    python benchmarks/bench_finetune_init.py --work /tmp/ft --base-steps 600 --steps 300
    python benchmarks/bench_finetune_init.py --only extended,extended_short   # some variants again

What it runs, with the commands a user runs (scripts/*.py, torchrun train.py with 2 CPU processes,
the demo's model configs/demo_tdt.yaml), all under ``--work``:
1. A base model, the stand-in for a pretrained Parakeet that cannot be downloaded here: a corpus of
   English and Telugu speech spoken by espeak-ng (scripts/make_demo_corpus.py), its own 256-piece
   tokenizer, ``--base-steps`` optimizer steps from scratch.
2. A finetuning corpus of another seed (other sentences combined, other voices) in Hindi, Tamil,
   Bengali, English and Telugu: the base's languages and three new ones.
3. Finetunes of the base on it, the same data, steps, seed and LR schedule each:
     fresh            a new 512-piece tokenizer, NeMo's new decoder and joint (DECODER_INIT=fresh)
     replaced         the same tokenizer, the base's decoder and joint carried (DECODER_INIT=carry)
     extended         the base tokenizer extended to 512 pieces (TOKENIZER_MODE=extend), carried
     extended_short   as extended, the encoder frozen for a tenth as long (UNFREEZE_STEP)
     extended_low_lr  as extended, PHASE2_LR a third: less drift of what the base knew
   The validation WER per language before any update (the model train.py builds, decoded in this
   process), at every ``--eval-every`` steps (train.py's own validation) and at the end; the
   training loss; the largest insertion rate of the new languages (a burst of insertions from new
   rows shows there); the steps each variant needs to reach the stated WERs.
The printed tables and a PNG of the WER curves go to ``--work``. Reruns reuse what is built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_LANGS = ("en", "te")
NEW_LANGS = ("hi", "ta", "bn")
BASE_SIZES = "en=300,te=200"
FINETUNE_SIZES = "hi=200,ta=120,bn=100,en=150,te=100"
# The demo's schedule and model (scripts/demo.sh): what trains visibly in minutes on a CPU.
COMMON = {
    "MODEL_CONFIG": str(REPO / "configs" / "demo_tdt.yaml"),
    "MIN_DURATION": "0.5",
    "MAX_DURATION": "12",
    "BUCKET_BOUNDARIES": "2,3,4,6",
    "MAX_BATCH_DURATION": "40",
    "VAL_PER_LANG": "15",
    "GRAD_ACCUM": "1",
    "WARMUP_STEPS": "10",
    "PHASE2_WARMUP": "30",
    "PHASE1_LR": "3e-3",
    "PHASE2_LR": "3e-3",
    "MIN_LR": "1e-4",
    "NUM_WORKERS": "1",
    "PRECISION": "32-true",
    "ACCELERATOR": "cpu",
    "WANDB_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
    "INIT_MODEL": "",
    "RESUME_FROM": "",
}


def variants(steps: int) -> dict[str, dict[str, str]]:
    unfreeze = max(1, steps // 5)
    return {
        "fresh": {"tokenizer": "new", "DECODER_INIT": "fresh", "UNFREEZE_STEP": str(unfreeze)},
        "replaced": {"tokenizer": "new", "DECODER_INIT": "carry", "UNFREEZE_STEP": str(unfreeze)},
        "extended": {
            "tokenizer": "extend",
            "DECODER_INIT": "carry",
            "UNFREEZE_STEP": str(unfreeze),
        },
        "extended_short": {
            "tokenizer": "extend",
            "DECODER_INIT": "carry",
            "UNFREEZE_STEP": str(max(1, unfreeze // 10)),
        },
        "extended_low_lr": {
            "tokenizer": "extend",
            "DECODER_INIT": "carry",
            "UNFREEZE_STEP": str(unfreeze),
            "PHASE2_LR": "1e-3",
        },
    }


def clean_env(**knobs: str) -> dict:
    """The caller's environment without any knob, plus ``knobs``."""
    import config

    env = {k: v for k, v in os.environ.items() if k not in config.KNOBS}
    env.update(COMMON)
    env.update(knobs)
    return env


def run(cmd: list[str], env: dict, log: Path) -> None:
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(
            f"{' '.join(cmd[:3])} failed ({proc.returncode}); {log}:\n{log.read_text()[-3000:]}"
        )
    print(f"  {log.name}: {time.monotonic() - started:.0f} s", flush=True)


def build_data(work: Path, name: str, sizes: str, seed: int) -> Path:
    """Corpus -> extraction -> master -> train/val split under work/name (reused when there)."""
    data = work / name
    if (data / "val_manifest_v2.parquet").exists():
        return data
    data.mkdir(parents=True, exist_ok=True)
    env = clean_env(DATA_DIR=str(data))
    py = sys.executable
    corpus = [py, "scripts/make_demo_corpus.py", "--sizes", sizes, "--seed", str(seed)]
    run(corpus, env, data / "corpus.log")
    run([py, "scripts/extract_audio.py"], env, data / "extract.log")
    run([py, "build_manifest.py", "--no-progress"], env, data / "build.log")
    run([py, "scripts/make_train_val.py"], env, data / "split.log")
    return data


def tokenizer(data: Path, out: Path, vocab_size: int, mode: str, base: str = "") -> Path:
    if not (out / "tokenizer.model").exists():
        env = clean_env(
            DATA_DIR=str(data), VOCAB_SIZE=str(vocab_size), TOKENIZER_MODE=mode, INIT_MODEL=base
        )
        run(
            [sys.executable, "scripts/train_tokenizer.py", "--output", str(out)],
            env,
            out.parent / f"{out.name}.log",
        )
    return out


def train(data: Path, run_dir: Path, steps: int, eval_every: int, **knobs: str) -> Path:
    """torchrun train.py (2 CPU processes) into run_dir; its metrics.jsonl."""
    metrics = run_dir / "wandb_logs" / "run" / "metrics.jsonl"
    final = run_dir / "checkpoints" / f"step_{steps:08d}.nemo"
    if final.exists():
        return metrics
    env = clean_env(
        DATA_DIR=str(data),
        CHECKPOINT_DIR=str(run_dir / "checkpoints"),
        WANDB_LOG_DIR=str(run_dir / "wandb_logs"),
        WANDB_RUN_NAME="run",
        MAX_STEPS=str(steps),
        CHECKPOINT_EVERY=str(steps),
        EVAL_EVERY_STEPS=str(eval_every),
        **knobs,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "train.py",
    ]
    run(cmd, env, run_dir / "train.log")
    return metrics


def curves(
    metrics: Path,
) -> tuple[dict[int, dict[str, float]], dict[int, float], dict[int, dict[str, float]]]:
    """({step: {lang: WER}}, {step: train loss}, {step: {lang: insertions per word}})."""
    wer, loss, ins = {}, {}, {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        step = record.get("step")
        if "train/loss" in record:
            loss[step] = record["train/loss"]
        found = {k.split("/")[-1]: v for k, v in record.items() if k.startswith("val/wer/")}
        if found:
            wer[step] = found
            ins[step] = {
                k.split("/")[-1]: v for k, v in record.items() if k.startswith("val/wer_ins/")
            }
    return wer, loss, ins


def initial_wer(
    init_model: Path, tokenizer_dir: Path, val: Path, decoder_init: str, tags_from: Path
) -> dict[str, float]:
    """WER per language of the model train.py would start from, before any update. The audio is
    read through a dataset tokenized by ``tags_from`` (a tokenizer with every language's tag: the
    base's lacks the new ones); greedy decoding uses the model's own tokenizer."""
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    import asr_model
    import evaluation
    from dataset import LocalShardDataset

    model = asr_model.build_model(
        str(init_model), None, tokenizer_dir, decoder_init=decoder_init
    ).eval()
    reader = SentencePieceTokenizer(str(tags_from / "tokenizer.model"))
    dataset = LocalShardDataset(val, reader, progress=False)
    indices = list(range(len(dataset)))
    texts = evaluation.manifest_texts(dataset)
    hyps = evaluation.greedy_transcribe(model, dataset, indices, max_batch_seconds=40.0)
    done = [i for i in indices if hyps[i] is not None]
    langs = [dataset.lang_names[dataset.lang_codes[i]] for i in done]
    results = evaluation.corpus_error_rates(
        [texts[i] for i in done], [hyps[i] for i in done], langs
    )
    return {lang: counts.wer for lang, counts in results.items()}


def first_step_at_or_below(
    wer: dict[int, dict[str, float]], lang: str, target: float
) -> int | None:
    return next((s for s in sorted(wer) if wer[s].get(lang, 1e9) <= target), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, default=REPO / "data" / "bench_finetune_init")
    parser.add_argument(
        "--base-steps", type=int, default=600, help="optimizer steps of the base model"
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every finetune")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    print("== base model: English and Telugu, its own tokenizer, from scratch")
    base_data = build_data(work, "base_data", BASE_SIZES, seed=11)
    base_tok = tokenizer(base_data, base_data / "tokenizer", 256, "new")
    base_run = work / "base_run"
    train(
        base_data,
        base_run,
        args.base_steps,
        args.base_steps,
        TOKENIZER_DIR=str(base_tok),
        UNFREEZE_STEP="0",
        INIT_MODEL="",
    )
    base_nemo = base_run / "checkpoints" / f"step_{args.base_steps:08d}.nemo"

    print("== finetuning corpus: hi, ta, bn (new) and en, te (the base's), another seed")
    data = build_data(work, "finetune_data", FINETUNE_SIZES, seed=22)
    val = data / "val_manifest_v2.parquet"
    toks = {
        "new": tokenizer(data, work / "tokenizer_new", 512, "new"),
        "extend": tokenizer(data, work / "tokenizer_extended", 512, "extend", str(base_nemo)),
    }
    ext_summary = json.loads((toks["extend"] / "summary.json").read_text())
    base_own = initial_wer(base_nemo, base_tok, val, "carry", toks["extend"])

    chosen = [v for v in variants(args.steps) if not args.only or v in args.only.split(",")]
    results = {}
    for name in chosen:
        spec = dict(variants(args.steps)[name])
        tok = toks[spec.pop("tokenizer")]
        print(f"== {name}: {spec}")
        metrics = train(
            data,
            work / name,
            args.steps,
            args.eval_every,
            TOKENIZER_DIR=str(tok),
            INIT_MODEL=str(base_nemo),
            **spec,
        )
        wer, loss, ins = curves(metrics)
        wer[0] = initial_wer(base_nemo, tok, val, spec["DECODER_INIT"], toks["extend"])
        results[name] = {"wer": wer, "loss": loss, "ins": ins, "spec": spec}

    langs = list(BASE_LANGS) + list(NEW_LANGS) + ["all"]
    lines = [
        f"base model: {base_nemo.name} ({args.base_steps} steps on {BASE_SIZES}); finetunes: "
        f"{args.steps} steps on {FINETUNE_SIZES}, validation {val.name}",
        f"extended tokenizer: {ext_summary['extension']['base_pieces']} base pieces + "
        f"{ext_summary['extension']['appended_pieces']} appended + "
        f"{ext_summary['extension']['appended_tags']} tags",
        "",
        "the base model itself on the finetune's validation (its own tokenizer): "
        + ", ".join(f"{lang} {base_own[lang]:.3f}" for lang in BASE_LANGS if lang in base_own),
        "",
        "validation WER per language (step 0 = before any update)",
        f"{'variant':<16} {'step':>5} " + " ".join(f"{lang:>6}" for lang in langs),
    ]
    for name, r in results.items():
        for step in sorted(r["wer"]):
            row = r["wer"][step]
            lines.append(
                f"{name:<16} {step:>5} "
                + " ".join(f"{row.get(lang, float('nan')):>6.3f}" for lang in langs)
            )
    lines += [
        "",
        "training loss (mean of the 10 steps up to each)",
        f"{'variant':<16} "
        + " ".join(f"{s:>6}" for s in range(args.eval_every, args.steps + 1, args.eval_every)),
    ]
    for name, r in results.items():
        means = []
        for s in range(args.eval_every, args.steps + 1, args.eval_every):
            window = [v for k, v in r["loss"].items() if s - 10 < k <= s]
            means.append(sum(window) / len(window) if window else float("nan"))
        lines.append(f"{name:<16} " + " ".join(f"{m:>6.3f}" for m in means))
    lines += ["", "largest insertion rate of a new language over the validations (val/wer_ins)"]
    for name, r in results.items():
        worst = max(
            (
                (v, lang, s)
                for s, row in r["ins"].items()
                for lang, v in row.items()
                if lang in NEW_LANGS
            ),
            default=(float("nan"), "-", "-"),
        )
        lines.append(f"{name:<16} {worst[0]:.3f} ({worst[1]} at step {worst[2]})")
    targets = {lang: base_own[lang] + 0.05 for lang in BASE_LANGS if lang in base_own}
    final_all = {name: r["wer"][max(r["wer"])]["all"] for name, r in results.items()}
    targets["all"] = min(final_all.values()) + 0.05 if final_all else 1.0
    lines += [
        "",
        "steps to reach: " + ", ".join(f"{lang} <= {t:.3f}" for lang, t in targets.items()),
    ]
    for name, r in results.items():
        reach = [first_step_at_or_below(r["wer"], lang, t) for lang, t in targets.items()]
        lines.append(f"{name:<16} " + " ".join(f"{'never' if s is None else s:>6}" for s in reach))
    lines.append(f"\ntotal {time.monotonic() - started:.0f} s")
    text = "\n".join(lines)
    print(text)
    (work / "results.txt").write_text(text + "\n")
    plot(results, work / "wer_curves.png", langs)
    print(f"wrote {work / 'results.txt'} and {work / 'wer_curves.png'}")
    return 0


def plot(results: dict, path: Path, langs: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {
        "en (base)": ["en"],
        "te (base)": ["te"],
        "hi, ta, bn (new, mean)": list(NEW_LANGS),
        "all": ["all"],
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), sharey=True)
    for ax, (title, group) in zip(axes, panels.items()):
        for name, r in results.items():
            steps = sorted(r["wer"])
            values = [
                sum(r["wer"][s].get(lang, float("nan")) for lang in group) / len(group)
                for s in steps
            ]
            ax.plot(steps, values, marker="o", label=name)
        ax.set_title(f"validation WER, {title}")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("WER")
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
