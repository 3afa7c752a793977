"""Finetuning a base model onto new languages: the ablation of where the decoder and joint start and
of each lever that keeps the base's languages or speeds up the new ones, side by side in one run.

Usage:
    python benchmarks/bench_finetune_init.py                  # about 75 minutes on 2 idle cores (CPU)
    python benchmarks/bench_finetune_init.py --work /tmp/ft --base-steps 400 --steps 300
    python benchmarks/bench_finetune_init.py --only extended,defaults   # some variants (again)
    python benchmarks/bench_finetune_init.py --set new_lr:NEW_PIECE_LR_SCALE=30   # a variant's knob
    python benchmarks/bench_finetune_init.py --seeds 1234,7,42 --only defaults   # over seeds

What it runs, with the commands a user runs (scripts/*.py, torchrun train.py with 2 CPU processes,
the demo's model configs/demo_tdt.yaml), all under ``--work``:
1. A base model, the stand-in for a pretrained Parakeet that cannot be downloaded here: a corpus of
   English and Telugu speech spoken by espeak-ng (scripts/make_demo_corpus.py), its own 256-piece
   tokenizer, ``--base-steps`` optimizer steps from scratch.
2. A finetuning corpus of another seed (other sentences combined, other voices) in Hindi, Tamil,
   Bengali and Urdu (new: four scripts the base never saw) and English (the base's).
3. Finetunes of the base on it, the same data, steps, seed and LR schedule each (``variants``):
     fresh_decoder  a new 512-piece tokenizer, NeMo's new decoder and joint (DECODER_INIT=fresh)
     new_tokenizer  the same tokenizer, the base's rows of shared pieces carried (TOKENIZER_MODE=new)
     extended       the base tokenizer extended to 512 pieces, every lever off: new pieces' biases
                    at equal shares, no LR scale, no replay floor
     prior          extended, NEW_PIECE_BIAS=frequency: new pieces' output biases from their share
                    of the training text
     new_lr         extended, NEW_PIECE_LR_SCALE=10: the new pieces' rows take larger steps
     new_lr_30      the same at 30
     encoder_lr     extended, ENCODER_LR_SCALE=0.3: the encoder moves less in phase 2
     replay         extended, BASE_LANGUAGE_SHARE=0.4: English kept at a floor of the mix
     prior_new_lr, new_lr_encoder_lr, all_levers   pairs of levers, and all three at once
     defaults       what a user gets today: the extended tokenizer and every knob at this
                    project's default (a checkpoint at every validation: their mean is the
                    stand-in for an EMA of the weights)
   For each: WER and CER per language at step 0 (train.py validates the base as the finetune
   received it) and every ``--eval-every`` steps, the training loss, the largest insertion rate of
   a new language, the steps to reach stated WERs, and the issue's targets checked against
   new_tokenizer (the fresh-tokenizer run). Then, on the defaults' run,
   ``scripts/export_nemo.py --blend-sweep`` (weight-space interpolation with the base, for a few A)
   of its final checkpoint and of the mean of its last checkpoints.
With ``--seeds``, each chosen variant runs once per SEED (model init of the new rows, sampler
plan, workers) and the table is decoding with the language given against auto decoding: WER per
language at every validation (train.py's ``val/wer_given/<lang>`` beside ``val/wer/<lang>``) and
language identification (``val/lid_acc/<lang>``), as mean, min and max over the seeds, with the
check that English with the language given stays within 0.05 WER of the base at every validation.
The printed tables and PNGs of the curves go to ``--work``. Reruns reuse what is built.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def languages(sizes: str) -> tuple[str, ...]:
    """The languages of a ``LANG=COUNT,...`` corpus, in its order."""
    return tuple(item.split("=")[0].strip() for item in sizes.split(",") if item.strip())


@dataclass(frozen=True)
class Base:
    """A base model this project trains from scratch on its own espeak corpus (``sizes``,
    make_demo_corpus.py's LANG=COUNT), with a ``vocab_size``-piece tokenizer and the demo's model
    at encoder width ``d_model``, and the corpus of another seed it is finetuned on
    (``finetune_sizes``), whose tokenizers (extended and fresh) hold ``finetune_vocab_size`` pieces."""

    name: str
    sizes: str
    seed: int
    vocab_size: int
    finetune_sizes: str
    finetune_seed: int
    finetune_vocab_size: int
    d_model: int = 128  # configs/demo_tdt.yaml's

    @property
    def base_langs(self) -> tuple[str, ...]:
        """The base's languages the finetuning corpus holds: those it must keep."""
        return tuple(lang for lang in languages(self.finetune_sizes) if lang in self.sizes_langs)

    @property
    def new_langs(self) -> tuple[str, ...]:
        return tuple(
            lang for lang in languages(self.finetune_sizes) if lang not in self.sizes_langs
        )

    @property
    def sizes_langs(self) -> tuple[str, ...]:
        return languages(self.sizes)


# English and Telugu, finetuned onto Hindi, Tamil, Bengali, Urdu (four scripts it never saw) and English.
EN_TE = Base(
    name="en_te",
    sizes="en=300,te=200",
    seed=11,
    vocab_size=256,
    finetune_sizes="hi=200,ta=120,bn=100,ur=100,en=150",
    finetune_seed=22,
    finetune_vocab_size=512,
)
BASE_LANGS = EN_TE.base_langs
NEW_LANGS = EN_TE.new_langs
BASE_SIZES = EN_TE.sizes
FINETUNE_SIZES = EN_TE.finetune_sizes
BLENDS = (0.1, 0.2, 0.3, 0.5)
AVERAGE = 4  # checkpoints (one per validation) averaged as the stand-in for an EMA
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
# Every lever off: what "extended" and each lever's own variant start from.
LEVERS_OFF = {
    "NEW_PIECE_BIAS": "equal",
    "NEW_PIECE_LR_SCALE": "1",
    "ENCODER_LR_SCALE": "1",
    "BASE_LANGUAGE_SHARE": "0",
}
REFERENCE = "new_tokenizer"


def variants(steps: int) -> dict[str, dict[str, str]]:
    """name -> {"tokenizer": new | extended, knob: value, ...}."""
    unfreeze = {"UNFREEZE_STEP": str(max(1, steps // 6))}
    off = {"tokenizer": "extended", **unfreeze, **LEVERS_OFF}
    return {
        "fresh_decoder": {**off, "tokenizer": "new", "DECODER_INIT": "fresh"},
        "new_tokenizer": {**off, "tokenizer": "new", "DECODER_INIT": "carry"},
        "extended": off,
        "prior": {**off, "NEW_PIECE_BIAS": "frequency"},
        "new_lr": {**off, "NEW_PIECE_LR_SCALE": "10"},
        "new_lr_30": {**off, "NEW_PIECE_LR_SCALE": "30"},
        "encoder_lr": {**off, "ENCODER_LR_SCALE": "0.3"},
        "replay": {**off, "BASE_LANGUAGE_SHARE": "0.4"},
        "prior_new_lr": {**off, "NEW_PIECE_BIAS": "frequency", "NEW_PIECE_LR_SCALE": "10"},
        "new_lr_encoder_lr": {**off, "NEW_PIECE_LR_SCALE": "10", "ENCODER_LR_SCALE": "0.3"},
        "all_levers": {
            **off,
            "NEW_PIECE_LR_SCALE": "10",
            "ENCODER_LR_SCALE": "0.3",
            "BASE_LANGUAGE_SHARE": "0.25",
        },
        "defaults": {"tokenizer": "extended", **unfreeze},
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


@dataclass(frozen=True)
class Prepared:
    """A base trained and its finetuning corpus built, under ``root``."""

    base: Base
    root: Path
    base_nemo: Path
    base_tokenizer: Path
    data: Path  # the finetuning corpus (DATA_DIR of every finetune)

    @property
    def val(self) -> Path:
        return self.data / "val_manifest_v2.parquet"

    def tokenizer(self, mode: str, vocab_size: int | None = None) -> Path:
        """The finetuning corpus's tokenizer of ``mode`` (new | extend) and size (default the
        base's ``finetune_vocab_size``), trained on first use."""
        size = vocab_size or self.base.finetune_vocab_size
        name = "tokenizer_" + ("new" if mode == "new" else "extended")
        if size != self.base.finetune_vocab_size:
            name += f"_{size}"
        base = str(self.base_nemo) if mode == "extend" else ""
        return tokenizer(self.data, self.root / name, size, mode, base)


def model_config(base: Base, root: Path) -> Path:
    """configs/demo_tdt.yaml, or a copy of it under ``root`` with the encoder ``base.d_model`` wide."""
    demo = REPO / "configs" / "demo_tdt.yaml"
    if base.d_model == 128:
        return demo
    import yaml

    spec = yaml.safe_load(demo.read_text())
    spec["model"]["encoder"]["d_model"] = base.d_model
    path = root / f"demo_tdt_d{base.d_model}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def prepare_base(root: Path, base: Base, base_steps: int) -> Prepared:
    """``base``'s corpus, tokenizer and model (``base_steps`` optimizer steps from scratch) and its
    finetuning corpus, under ``root``; what is there already is reused."""
    root.mkdir(parents=True, exist_ok=True)
    base_data = build_data(root, "base_data", base.sizes, seed=base.seed)
    base_tok = tokenizer(base_data, base_data / "tokenizer", base.vocab_size, "new")
    base_run = root / "base_run"
    train(
        base_data,
        base_run,
        base_steps,
        base_steps,
        TOKENIZER_DIR=str(base_tok),
        UNFREEZE_STEP="0",
        INIT_MODEL="",
        MODEL_CONFIG=str(model_config(base, root)),
    )
    data = build_data(root, "finetune_data", base.finetune_sizes, seed=base.finetune_seed)
    return Prepared(
        base=base,
        root=root,
        base_nemo=base_run / "checkpoints" / f"step_{base_steps:08d}.nemo",
        base_tokenizer=base_tok,
        data=data,
    )


def train_env(
    data: Path, run_dir: Path, steps: int, eval_every: int, checkpoint_every: int = 0, **knobs: str
) -> dict:
    """The environment ``train`` runs train.py in."""
    return clean_env(
        DATA_DIR=str(data),
        CHECKPOINT_DIR=str(run_dir / "checkpoints"),
        WANDB_LOG_DIR=str(run_dir / "wandb_logs"),
        WANDB_RUN_NAME="run",
        MAX_STEPS=str(steps),
        CHECKPOINT_EVERY=str(checkpoint_every or steps),
        KEEP_CHECKPOINTS="100",
        EVAL_EVERY_STEPS=str(eval_every),
        **knobs,
    )


def finished(run_dir: Path, steps: int) -> bool:
    """Whether ``train`` ran to the end in ``run_dir`` (its final .nemo is there)."""
    return (run_dir / "checkpoints" / f"step_{steps:08d}.nemo").exists()


def train(
    data: Path, run_dir: Path, steps: int, eval_every: int, checkpoint_every: int = 0, **knobs: str
) -> Path:
    """torchrun train.py (2 CPU processes) into run_dir, a checkpoint every ``checkpoint_every``
    steps (0: at the end only); its metrics.jsonl. A run that finished there is reused."""
    metrics = run_dir / "wandb_logs" / "run" / "metrics.jsonl"
    if finished(run_dir, steps):
        return metrics
    if run_dir.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(run_dir)
    env = train_env(data, run_dir, steps, eval_every, checkpoint_every, **knobs)
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


def curves(metrics: Path) -> dict[str, dict]:
    """{"wer"|"cer"|"ins"|"wer_given"|"cer_given"|"lid": {step: {lang: value}}, "loss": {step:
    train loss}}, the last record of each step winning."""
    prefixes = {
        "wer": "val/wer/",
        "cer": "val/cer/",
        "ins": "val/wer_ins/",
        "wer_given": "val/wer_given/",
        "cer_given": "val/cer_given/",
        "lid": "val/lid_acc/",
    }
    out: dict[str, dict] = {key: {} for key in prefixes} | {"loss": {}}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        step = record.get("step")
        if "train/loss" in record:
            out["loss"][step] = record["train/loss"]
        for key, prefix in prefixes.items():
            found = {k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix)}
            if found:
                out[key][step] = found
    return out


def base_model_scores(
    init_model: Path, tokenizer_dir: Path, val: Path, tags_from: Path, given: tuple[str, ...] = ()
) -> dict:
    """{"wer": {lang: WER}, "cer": {...}} of the base model itself, with its own tokenizer, on the
    finetune's validation set, and with ``given`` (languages the base has tags for)
    "wer_given": {lang: WER} of their utterances decoded with the language given, scored as
    train.py's validation scores them. The audio is read through a dataset tokenized by
    ``tags_from`` (a tokenizer with every language's tag: the base's lacks the new ones)."""
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    import asr_model
    import evaluation
    from dataset import LocalShardDataset

    model = asr_model.build_model(str(init_model), None, tokenizer_dir).eval()
    reader = SentencePieceTokenizer(str(tags_from / "tokenizer.model"))
    dataset = LocalShardDataset(val, reader, progress=False)
    indices = list(range(len(dataset)))
    texts = evaluation.manifest_texts(dataset)
    names, codes = dataset.lang_names, dataset.lang_codes
    decoded = evaluation.decode(
        model,
        dataset,
        indices,
        max_batch_seconds=40.0,
        languages=(lambda i: names[codes[i]] if names[codes[i]] in given else None)
        if given
        else None,
    )
    hyps = decoded.texts
    done = [i for i in indices if hyps[i] is not None]
    langs = [names[codes[i]] for i in done]
    results = evaluation.corpus_error_rates(
        [texts[i] for i in done], [hyps[i] for i in done], langs
    )
    out = {
        "wer": {lang: c.wer for lang, c in results.items()},
        "cer": {lang: c.cer for lang, c in results.items()},
    }
    if given:
        mine = [i for i in done if names[codes[i]] in given]
        results = evaluation.corpus_error_rates(
            [texts[i] for i in mine],
            [decoded.given_texts[i] for i in mine],
            [names[codes[i]] for i in mine],
        )
        out["wer_given"] = {lang: c.wer for lang, c in results.items() if lang in given}
    return out


def export_sweep(
    run_dir: Path, data: Path, steps: int, blends, knobs: dict, average: int = 1
) -> list[dict]:
    """``export_nemo.py --blend-sweep`` of the run's final checkpoint (with ``average`` N: the mean
    of its newest N step checkpoints, the stand-in for an EMA of the weights) blended with the base
    by each A of ``blends``, scored on the validation set: [{"blend", "wer", "cer"}]."""
    name = f"sweep_avg{average}" if average > 1 else "sweep"
    out_json = run_dir / f"{name}.json"
    if out_json.exists():
        return json.loads(out_json.read_text())
    env = clean_env(DATA_DIR=str(data), CHECKPOINT_DIR=str(run_dir / "checkpoints"), **knobs)
    ckpt = run_dir / "checkpoints" / f"step_{steps:08d}.ckpt"
    cmd = [
        sys.executable,
        "scripts/export_nemo.py",
        str(ckpt),
        "--blend-sweep",
        ",".join(f"{a:g}" for a in blends),
        "--sweep-json",
        str(out_json),
    ]
    if average > 1:
        cmd += ["--average", str(average)]
    run(cmd, env, run_dir / f"{name}.log")
    return json.loads(out_json.read_text())


def first_step_at_or_below(table: dict[int, dict[str, float]], lang: str, target: float):
    return next((s for s in sorted(table) if table[s].get(lang, 1e9) <= target), None)


def mean_over(row: dict[str, float], langs) -> float:
    values = [row[lang] for lang in langs if lang in row]
    return sum(values) / len(values) if values else float("nan")


def target_checks(results: dict, base_own: dict, steps: int, eval_every: int) -> list[str]:
    """The issue's targets for every variant, against the base and REFERENCE (the fresh-tokenizer
    run): one line per variant, each target as ok/MISS with the figure behind it."""
    lines = []
    ref = results.get(REFERENCE)
    checkpoints = [s for s in (steps // 2, steps) if s % eval_every == 0]
    for name, r in results.items():
        parts = []
        wer = r["wer"]
        for lang in BASE_LANGS:
            if lang not in base_own["wer"]:
                continue
            base = base_own["wer"][lang]
            at0 = wer.get(0, {}).get(lang, float("nan"))
            worst = max((wer[s][lang] for s in wer if lang in wer[s]), default=float("nan"))
            parts.append(
                f"{lang} step 0 {at0 - base:+.3f} {'ok' if at0 - base <= 0.02 else 'MISS'}"
            )
            parts.append(
                f"{lang} worst {worst - base:+.3f} {'ok' if worst - base <= 0.05 else 'MISS'}"
            )
        if ref is not None and name != REFERENCE:
            behind = []
            for s in checkpoints:
                for lang in NEW_LANGS:
                    dw = wer.get(s, {}).get(lang, 9) - ref["wer"].get(s, {}).get(lang, 9)
                    dc = r["cer"].get(s, {}).get(lang, 9) - ref["cer"].get(s, {}).get(lang, 9)
                    if dw > 0.01 and dc > 0.03:
                        behind.append(f"{lang}@{s} {dc:+.3f} CER")
            parts.append(
                "new langs " + ("ok" if not behind else "MISS (" + ", ".join(behind) + ")")
            )
            late = [s for s in wer if s >= min(150, steps // 4) and s in ref["wer"]]
            worse = [
                f"{s}: {wer[s]['all']:.3f} vs {ref['wer'][s]['all']:.3f}"
                for s in sorted(late)
                if wer[s].get("all", 9) > ref["wer"][s].get("all", 9) + 1e-9
            ]
            parts.append("all " + ("ok" if not worse else "MISS (" + "; ".join(worse) + ")"))
            mine, theirs = largest_insertion(r)[0], largest_insertion(ref)[0]
            parts.append(
                f"insertions {mine:.3f} vs {theirs:.3f} {'ok' if mine <= theirs + 1e-9 else 'MISS'}"
            )
        lines.append(f"{name:<14} " + " | ".join(parts))
    return lines


def largest_insertion(r: dict) -> tuple[float, str, int | str]:
    return max(
        (
            (v, lang, s)
            for s, row in r["ins"].items()
            for lang, v in row.items()
            if lang in NEW_LANGS
        ),
        default=(float("nan"), "-", "-"),
    )


def seeds_report(runs: dict[str, dict[int, dict]], base_own: dict) -> list[str]:
    """Per variant, over its seeds: WER auto and with the language given per language at every
    validation, and language identification, as mean [min, max]; then whether English with the
    language given stayed within 0.05 WER of the base (the base itself, auto) at every one."""
    langs = list(BASE_LANGS) + list(NEW_LANGS) + ["all"]

    def spread(values: list[float]) -> str:
        if not values:
            return f"{'-':>19}"
        mean = sum(values) / len(values)
        return f"{mean:.3f} [{min(values):.3f},{max(values):.3f}]"

    lines = []
    for name, by_seed in runs.items():
        seeds = sorted(by_seed)
        steps = sorted(set.intersection(*(set(r["wer"]) for r in by_seed.values())))
        lines += [
            "",
            f"{name}: WER auto / with the language given, mean [min, max] over seeds "
            f"{', '.join(map(str, seeds))}; LID = val/lid_acc (auto decoding)",
            f"{'step':>5} {'lang':<4} {'auto':>19} {'given':>19} {'given - auto':>12} {'LID':>19}",
        ]
        for step in steps:
            for lang in langs:
                auto = [r["wer"][step][lang] for r in by_seed.values() if lang in r["wer"][step]]
                given = [
                    r["wer_given"][step][lang]
                    for r in by_seed.values()
                    if lang in r["wer_given"].get(step, {})
                ]
                lid = [
                    r["lid"][step][lang] for r in by_seed.values() if lang in r["lid"].get(step, {})
                ]
                gap = (
                    f"{(sum(given) - sum(auto)) / len(auto):>+12.3f}"
                    if given and len(given) == len(auto)
                    else f"{'-':>12}"
                )
                lines.append(
                    f"{step:>5} {lang:<4} {spread(auto)} {spread(given)} {gap} {spread(lid)}"
                )
        for lang in BASE_LANGS:
            if lang not in base_own["wer"]:
                continue
            base = base_own["wer"][lang]
            worst = [
                max(r["wer_given"][s][lang] for s in r["wer_given"] if lang in r["wer_given"][s])
                for r in by_seed.values()
                if r["wer_given"]
            ]
            worst_auto = [
                max(r["wer"][s][lang] for s in r["wer"] if lang in r["wer"][s])
                for r in by_seed.values()
            ]
            verdict = "ok" if worst and max(worst) - base <= 0.05 else "MISS"
            lines.append(
                f"{lang} with the language given within 0.05 of the base ({base:.3f}) at every "
                f"validation: {verdict} (worst per seed {', '.join(f'{w:.3f}' for w in worst)}; "
                f"auto: {', '.join(f'{w:.3f}' for w in worst_auto)})"
            )
    return lines


def parse_sets(items: list[str]) -> dict[str, dict[str, str]]:
    """--set VARIANT:KNOB=VALUE (repeatable) -> {variant: {knob: value}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, assignment = item.partition(":")
        knob, eq, value = assignment.partition("=")
        if not sep or not eq:
            raise SystemExit(f"--set {item!r}: expected VARIANT:KNOB=VALUE")
        out.setdefault(name, {})[knob] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, default=REPO / "data" / "bench_finetune_init")
    parser.add_argument(
        "--base-steps", type=int, default=800, help="optimizer steps of the base model"
    )
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of every finetune")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="VARIANT:KNOB=VALUE",
        help="change one knob of one variant (its run directory is named after the change)",
    )
    parser.add_argument("--no-blend", action="store_true", help="skip the --blend-base sweep")
    parser.add_argument(
        "--seeds",
        default="",
        help="comma-separated SEEDs: run each chosen variant once per seed and report the "
        "language given against auto over them",
    )
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    print(
        "== base model: English and Telugu, its own tokenizer, from scratch; the finetuning "
        f"corpus: {FINETUNE_SIZES}, another seed"
    )
    prepared = prepare_base(work, EN_TE, args.base_steps)
    base_nemo, data, val = prepared.base_nemo, prepared.data, prepared.val
    extended = prepared.tokenizer("extend")
    toks = {"new": prepared.tokenizer("new"), "extended": extended}
    ext_summary = json.loads((extended / "summary.json").read_text())
    base_own = base_model_scores(base_nemo, prepared.base_tokenizer, val, extended)

    changes = parse_sets(args.set)
    chosen = [v for v in variants(args.steps) if not args.only or v in args.only.split(",")]
    if args.seeds:
        seeds = [int(x) for x in args.seeds.split(",")]
        runs: dict[str, dict[int, dict]] = {}
        for name in chosen:
            spec = {**variants(args.steps)[name], **changes.get(name, {})}
            tok = toks[spec.pop("tokenizer")]
            for seed in seeds:
                print(f"== {name}, SEED={seed}: {spec}", flush=True)
                metrics = train(
                    data,
                    work / f"{name}_seed{seed}",
                    args.steps,
                    args.eval_every,
                    TOKENIZER_DIR=str(tok),
                    INIT_MODEL=str(base_nemo),
                    SEED=str(seed),
                    **spec,
                )
                runs.setdefault(name, {})[seed] = curves(metrics)
        lines = [
            f"base model: {base_nemo.name} ({args.base_steps} steps on {BASE_SIZES}); finetunes: "
            f"{args.steps} steps on {FINETUNE_SIZES}, validation {val.name}",
            "the base model itself on the finetune's validation (its own tokenizer, auto): "
            + ", ".join(
                f"{lang} WER {base_own['wer'][lang]:.3f}"
                for lang in BASE_LANGS
                if lang in base_own["wer"]
            ),
            *seeds_report(runs, base_own),
            f"\ntotal {time.monotonic() - started:.0f} s",
        ]
        text = "\n".join(lines)
        print(text)
        (work / "seeds.txt").write_text(text + "\n")
        print(f"wrote {work / 'seeds.txt'}")
        return 0
    results = {}
    for name in chosen:
        spec = {**variants(args.steps)[name], **changes.get(name, {})}
        tok = toks[spec.pop("tokenizer")]
        suffix = "".join(f"_{k}={v}" for k, v in sorted(changes.get(name, {}).items()))
        print(f"== {name}{suffix}: {spec}", flush=True)
        run_dir = work / f"{name}{suffix}"
        metrics = train(
            data,
            run_dir,
            args.steps,
            args.eval_every,
            # the defaults' run keeps a checkpoint at every validation, for the average of the last
            checkpoint_every=args.eval_every if name == "defaults" else 0,
            TOKENIZER_DIR=str(tok),
            INIT_MODEL=str(base_nemo),
            **spec,
        )
        results[f"{name}{suffix}"] = {**curves(metrics), "spec": spec, "dir": run_dir}

    langs = list(BASE_LANGS) + list(NEW_LANGS) + ["all"]
    lines = [
        f"base model: {base_nemo.name} ({args.base_steps} steps on {BASE_SIZES}); finetunes: "
        f"{args.steps} steps on {FINETUNE_SIZES}, validation {val.name}, "
        f"UNFREEZE_STEP {max(1, args.steps // 6)}",
        f"extended tokenizer: {ext_summary['extension']['base_pieces']} base pieces + "
        f"{ext_summary['extension']['appended_pieces']} appended + "
        f"{ext_summary['extension']['appended_tags']} tags",
        "variants: "
        + "; ".join(
            f"{n}: {r['spec'].get('DECODER_INIT', 'carry')}, "
            + ", ".join(f"{k}={v}" for k, v in r["spec"].items() if k != "DECODER_INIT")
            for n, r in results.items()
        ),
        "",
        "the base model itself on the finetune's validation (its own tokenizer): "
        + ", ".join(
            f"{lang} WER {base_own['wer'][lang]:.3f}"
            for lang in BASE_LANGS
            if lang in base_own["wer"]
        ),
    ]
    for metric in ("wer", "cer"):
        lines += [
            "",
            f"validation {metric.upper()} per language (step 0 = the base as the finetune received it)",
            f"{'variant':<24} {'step':>5} "
            + " ".join(f"{lang:>6}" for lang in langs)
            + f" {'new':>6}",
        ]
        for name, r in results.items():
            for step in sorted(r[metric]):
                row = r[metric][step]
                lines.append(
                    f"{name:<24} {step:>5} "
                    + " ".join(f"{row.get(lang, float('nan')):>6.3f}" for lang in langs)
                    + f" {mean_over(row, NEW_LANGS):>6.3f}"
                )
    eval_steps = list(range(args.eval_every, args.steps + 1, args.eval_every))
    lines += [
        "",
        "training loss (mean of the 10 steps up to each)",
        f"{'variant':<24} " + " ".join(f"{s:>6}" for s in eval_steps),
    ]
    for name, r in results.items():
        means = []
        for s in eval_steps:
            window = [v for k, v in r["loss"].items() if s - 10 < k <= s]
            means.append(sum(window) / len(window) if window else float("nan"))
        lines.append(f"{name:<24} " + " ".join(f"{m:>6.3f}" for m in means))
    lines += ["", "largest insertion rate of a new language over the validations (val/wer_ins)"]
    for name, r in results.items():
        v, lang, s = largest_insertion(r)
        lines.append(f"{name:<24} {v:.3f} ({lang} at step {s})")
    targets = {lang: base_own["wer"][lang] + 0.05 for lang in BASE_LANGS if lang in base_own["wer"]}
    final_all = {name: r["wer"][max(r["wer"])]["all"] for name, r in results.items() if r["wer"]}
    targets["all"] = min(final_all.values()) + 0.05 if final_all else 1.0
    lines += [
        "",
        "first validation at or below: "
        + ", ".join(f"{k} WER {t:.3f}" for k, t in targets.items()),
    ]
    for name, r in results.items():
        reach = [first_step_at_or_below(r["wer"], k, t) for k, t in targets.items()]
        lines.append(f"{name:<24} " + " ".join(f"{'never' if s is None else s:>6}" for s in reach))
    lines += [
        "",
        f"targets: {', '.join(BASE_LANGS)} within 0.02 WER of the base at step 0 and 0.05 at every "
        f"validation; each new language at {args.steps // 2} and {args.steps} steps at most 0.01 WER "
        f"or 0.03 CER behind {REFERENCE}; all-language WER no worse than {REFERENCE}'s from step "
        f"{min(150, args.steps // 4)}; largest new-language insertion rate no higher than its",
    ]
    lines += target_checks(results, base_own, args.steps, args.eval_every)

    if not args.no_blend and "defaults" in results:
        r = results["defaults"]
        knobs = {"TOKENIZER_DIR": str(toks["extended"]), "INIT_MODEL": str(base_nemo), **r["spec"]}
        sweeps = [
            ("final checkpoint", export_sweep(r["dir"], data, args.steps, (0.0, *BLENDS), knobs))
        ]
        if len(list((r["dir"] / "checkpoints").glob("step_*.ckpt"))) >= AVERAGE:
            sweeps.append(
                (
                    f"mean of the last {AVERAGE} checkpoints (an EMA's stand-in)",
                    export_sweep(r["dir"], data, args.steps, (0.0, 0.2), knobs, average=AVERAGE),
                )
            )
        lines += [
            "",
            "export_nemo.py --blend-sweep on the defaults' run: (1 - A) x finetuned + A x the base "
            "(WER; new CER: the new languages' mean CER)",
            f"{'weights':<44} {'A':>5} "
            + " ".join(f"{lang:>6}" for lang in langs)
            + f" {'new CER':>8}",
        ]
        for what, sweep in sweeps:
            for row in sweep:
                lines.append(
                    f"{what:<44} {row['blend']:>5.2f} "
                    + " ".join(f"{row['wer'].get(lang, float('nan')):>6.3f}" for lang in langs)
                    + f" {mean_over(row['cer'], NEW_LANGS):>8.3f}"
                )
    lines.append(f"\ntotal {time.monotonic() - started:.0f} s")
    text = "\n".join(lines)
    print(text)
    (work / "results.txt").write_text(text + "\n")
    plot(results, base_own, work / "finetune_curves.png")
    print(f"wrote {work / 'results.txt'} and {work / 'finetune_curves.png'}")
    return 0


def plot(results: dict, base_own: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("wer", "en (the base's)", list(BASE_LANGS)),
        ("cer", "hi, ta, bn, ur (new), mean CER", list(NEW_LANGS)),
        ("wer", "all languages", ["all"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (metric, title, group) in zip(axes, panels):
        for name, r in results.items():
            steps = sorted(r[metric])
            ax.plot(steps, [mean_over(r[metric][s], group) for s in steps], marker=".", label=name)
        if group == list(BASE_LANGS):
            ax.axhline(mean_over(base_own["wer"], group), color="k", ls=":", label="the base")
        ax.set_ylim(0, 1.2)  # a fresh decoder's step 0 (several insertions per word) is off the top
        ax.set_title(f"validation {metric.upper()}, {title}")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
