"""Finetuning defaults judged over a grid, not at one point: every variant over two bases, two
learning rates and three seeds, against the fresh tokenizer in every cell, with the finetuning
targets checked per cell and overall and each lever judged against the defaults.

Usage:
    python benchmarks/bench_finetune_grid.py --work data/finetune_grid     # the whole grid
    python benchmarks/bench_finetune_grid.py --work data/finetune_grid --bases en_te --lrs 3e-3 \\
        --seeds 7                                                  # a subset (reuses what is done)
    # a lever on the grid: a variant is the defaults plus its knobs (--variant NAME:KNOB=VALUE,
    # repeated for several knobs of one variant)
    python benchmarks/bench_finetune_grid.py --work data/finetune_grid \\
        --variant ramp:NEW_PIECE_WARMUP=30 --variant ramp:NEW_PIECE_DECAY=60 \\
        --variant short_frozen:UNFREEZE_STEP=6 --variant long_frozen:UNFREEZE_STEP=40 \\
        --variant fresh_ext:VOCAB_SIZE=fresh \\
        --variant aug:SPEED_PERTURB=0.9,1.0,1.1   # any knob of config.py; commas stay in the value
    python benchmarks/bench_finetune_grid.py --only defaults,encoder_lr   # bench_finetune_init's variants

The grid: BASES (each a base model this project trains from scratch on its own espeak corpus, and
the corpus of another seed it is finetuned on) x ``--lrs`` (PHASE1_LR = PHASE2_LR) x ``--seeds``
(SEED). A cell is one base at one LR; in it each chosen variant and the reference ``new_tokenizer``
(a fresh tokenizer of the same size, shared pieces' rows carried) run once per seed, with the
commands a user runs (bench_finetune_init.py's machinery: make_demo_corpus.py, train_tokenizer.py,
torchrun train.py with 2 CPU processes, the demo's model). By default a run is ``--steps`` 120
finetuning steps (UNFREEZE_STEP 20), validated every ``--eval-every`` 30 and at step 0, of a base
trained ``--base-steps`` 600: small enough that the whole grid (two bases, 24 finetunes) runs in
under two hours on 2 idle cores (docs/training.md, "The grid", has the measured time).
    en_te  English and Telugu (256 pieces, encoder 128 wide), onto Hindi, Tamil, Bengali, Urdu and
           English (512 pieces)
    hi_en  Hindi and English (320 pieces, encoder 192 wide), onto Telugu, Kannada, Urdu, Hindi and
           English (512 pieces)

The targets, checked for every variant in every cell (validation's normalized scoring as train.py
logs it; "auto" is val/wer and val/cer, "given" val/wer_given and val/cer_given, the language given;
"the base" is the base model itself on the finetune's validation, decoded the same way):
    a        each base language within 0.05 WER of the base at every validation after step 0, auto
    b auto   overall CER (val/cer/all) within 0.01 of the reference's at the middle and last
    b given  validation (the same seed's reference run)
    c auto   each new language's CER within 0.03 of the reference's at the last validation
    c given
    d auto   step 0 equal to the base: each base language's WER at step 0 within 0.005 of the base's
    d given
    e        each base language within 0.05 WER of the base at every validation after step 0, given
Each figure is the worst margin (a run's value minus its bound's reference: lower is better; met
when <= the bound); per cell it is given as mean [min, max] over the seeds, met when every seed
meets it. With variants besides the defaults, each is judged against the defaults per cell and
target: it helps (hurts) where its mean over the seeds is below (above) the defaults' by more than
the larger seed range of the two; a lever is kept where it helps in most cells and hurts in none.

VOCAB_SIZE in a variant sizes its extended tokenizer (the pieces appended for the new languages are
VOCAB_SIZE less the base's pieces and the new tags): N in all, +N appended pieces, or ``fresh``: as
many appended as the fresh tokenizer has pieces holding a character the base cannot write (its
share for the new languages, printed per base). Every finished run is kept under
``--work``/BASE/lr<LR>/<variant>_seed<SEED>_<settings hash> with run.json (its settings and time)
and reused while its settings are today's, so a rerun, a subset or a variant added later trains only
what is missing. Writes grid.txt, grid.png and frontier.png (per cell, each run's base drift
against its new languages' CER) to ``--work``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from atomic_files import atomic_write
from benchmarks import bench_finetune_init as bench

EN_TE = bench.EN_TE
# Hindi and English with a larger vocabulary and a wider encoder, onto three scripts it never saw
# (Urdu sounds as its Hindi does) and its own two languages.
HI_EN = bench.Base(
    name="hi_en",
    sizes="hi=300,en=200",
    seed=33,
    vocab_size=320,
    finetune_sizes="te=120,kn=100,ur=100,hi=150,en=100",
    finetune_seed=44,
    finetune_vocab_size=512,
    d_model=192,
)
BASES = {base.name: base for base in (EN_TE, HI_EN)}
REFERENCE = bench.REFERENCE
DEFAULTS = "defaults"
# What the grid sets itself for every run: a variant may not change it.
GRID_KNOBS = frozenset(
    {
        "PHASE1_LR",
        "PHASE2_LR",
        "SEED",
        "INIT_MODEL",
        "TOKENIZER_DIR",
        "TOKENIZER_MODE",
        "DATA_DIR",
        "MAX_STEPS",
        "EVAL_EVERY_STEPS",
        "CHECKPOINT_EVERY",
        "CHECKPOINT_DIR",
        "WANDB_LOG_DIR",
        "WANDB_RUN_NAME",
    }
)
# Targets: (column, what it checks, bound on the figure).
TARGETS = (
    ("a", "base languages auto: worst WER after step 0 - the base's", 0.05),
    ("b auto", "overall CER - the reference's, at the middle and last validation", 0.01),
    ("b given", "overall CER given - the reference's, at the middle and last validation", 0.01),
    ("c auto", "new languages' CER - the reference's, at the last validation", 0.03),
    ("c given", "new languages' CER given - the reference's, at the last validation", 0.03),
    ("d auto", "base languages auto at step 0: |WER - the base's|", 0.005),
    ("d given", "base languages given at step 0: |WER - the base's given|", 0.005),
    ("e", "base languages given: worst WER after step 0 - the base's given", 0.05),
)
BOUNDS = {column: bound for column, _, bound in TARGETS}
# The columns that compare a run with the reference: none for the reference itself.
AGAINST_REFERENCE = ("b auto", "b given", "c auto", "c given")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


# ---- variants ------------------------------------------------------------------------------------


def grid_variants(steps: int, added: list[str], changed: list[str]) -> dict[str, dict[str, str]]:
    """bench_finetune_init's variants at ``steps``, with each ``--variant NAME:KNOB=VALUE`` of
    ``added`` a new variant (the defaults plus its knobs) and each ``--set`` of ``changed`` a
    knob of an existing one; SystemExit with one line for a name or knob the grid cannot run."""
    table = bench.variants(steps)
    for name, knobs in bench.parse_sets(added).items():
        if name in table:
            raise SystemExit(
                f"--variant {name}: a variant of that name exists ({', '.join(table)}); "
                f"change its knobs with --set {name}:KNOB=VALUE or choose another name"
            )
        if not NAME.match(name):
            raise SystemExit(f"--variant {name!r}: a name of letters, digits, _ and - is expected")
        table[name] = {**table[DEFAULTS], **knobs}
    for name, knobs in bench.parse_sets(changed).items():
        if name not in table:
            raise SystemExit(f"--set {name}: no such variant (there are {', '.join(table)})")
        table[name] = {**table[name], **knobs}
    for name, spec in table.items():
        check_spec(name, spec)
    return table


def check_spec(name: str, spec: dict[str, str]) -> None:
    """SystemExit naming the variant and knob when ``spec`` sets a knob config.py does not have,
    a value it refuses, or one the grid sets itself."""
    import config

    for knob, value in spec.items():
        if knob == "tokenizer":
            continue
        where = f"variant {name}: {knob}={value}"
        if knob in GRID_KNOBS:
            raise SystemExit(f"{where}: the grid sets {knob} itself (--lrs, --seeds, --steps)")
        if knob not in config.KNOBS:
            raise SystemExit(f"{where}: {knob} is not a setting of config.py")
        if knob == "VOCAB_SIZE":
            if not re.fullmatch(r"\+?[0-9]+|fresh", value.strip()):
                raise SystemExit(f"{where}: expected N pieces, +N appended pieces, or fresh")
            if spec.get("tokenizer") == "new" and not value.strip().isdigit():
                raise SystemExit(f"{where}: a fresh tokenizer's VOCAB_SIZE is a number of pieces")
            continue
        try:
            config.read_config({knob: value})
        except config.ConfigError as exc:
            raise SystemExit(f"variant {name}: {exc}") from None


def new_language_pieces(tokenizer_dir: Path, base_tokenizer_dir: Path) -> tuple[int, int]:
    """(normal pieces of ``tokenizer_dir``'s model that hold a character no normal piece of the
    base's has, its normal pieces): how much of a tokenizer goes to the new languages' writing."""
    from scripts import train_tokenizer

    base = train_tokenizer._proto((base_tokenizer_dir / "tokenizer.model").read_bytes())
    covered = train_tokenizer.covered_characters(base)
    model = train_tokenizer._proto((tokenizer_dir / "tokenizer.model").read_bytes())
    normal = [p.piece for p in model.pieces if p.type == train_tokenizer.NORMAL]
    return sum(1 for p in normal if any(c not in covered for c in p)), len(normal)


def extension_size(prepared: bench.Prepared, asked: str) -> int:
    """VOCAB_SIZE of the extended tokenizer a variant asks for: N, +N (the base's pieces, N
    appended, the new tags) or fresh (as many appended as the fresh tokenizer's new-language
    pieces)."""
    asked = asked.strip()
    if asked.isdigit():
        return int(asked)
    summary = json.loads((prepared.tokenizer("extend") / "summary.json").read_text())
    extension = summary["extension"]
    if asked == "fresh":
        appended = new_language_pieces(prepared.tokenizer("new"), prepared.base_tokenizer)[0]
    else:
        appended = int(asked[1:])
    return extension["base_pieces"] + appended + extension["appended_tags"]


def variant_tokenizer(prepared: bench.Prepared, spec: dict[str, str]) -> tuple[Path, dict]:
    """The tokenizer directory of a variant and its knobs for train.py (without the tokenizer's)."""
    knobs = dict(spec)
    mode = "new" if knobs.pop("tokenizer") == "new" else "extend"
    asked = knobs.pop("VOCAB_SIZE", None)
    size = None
    if asked is not None:
        size = int(asked) if mode == "new" else extension_size(prepared, asked)
    return prepared.tokenizer(mode, size), knobs


# ---- runs, reused while their settings are today's -------------------------------------------------


def training_settings(env: dict) -> dict:
    """The effective value of every knob train.py reads under ``env``, as JSON types, less the run's
    own output paths and what is derived from the others."""
    import config

    knobs = config.read_config(env)
    kept = {
        name: knob
        for name, knob in knobs.items()
        if "train" in knob.steps
        and knob.source != "derived"
        and name not in ("CHECKPOINT_DIR", "WANDB_LOG_DIR")
    }
    return json.loads(json.dumps(config.run_settings(kept)))


def same_run(recorded: dict, now: dict, defaults: dict) -> bool:
    """Whether a run recorded with ``recorded`` settings is the run ``now`` asks for: every knob
    equal, except one added since, which must be at its default (``defaults``: name -> default),
    where it does what the code did before it existed."""
    if any(name not in now for name in recorded):
        return False
    return all(
        recorded[name] == value if name in recorded else value == defaults.get(name)
        for name, value in now.items()
    )


def knob_defaults() -> dict:
    import config

    return json.loads(json.dumps(config.run_settings(config.read_config({}))))


@dataclass
class Run:
    """One finetune of the grid: its curves (bench_finetune_init.curves) and wall-clock seconds."""

    variant: str
    seed: int
    curves: dict
    seconds: float | None
    trained_now: bool


def run_once(
    prepared: bench.Prepared,
    cell_dir: Path,
    variant: str,
    spec: dict[str, str],
    seed: int,
    lr: str,
    steps: int,
    eval_every: int,
) -> Run:
    """The finished run of ``variant`` at ``seed`` in ``cell_dir`` whose settings are today's, or a
    new one trained there."""
    tok, knobs = variant_tokenizer(prepared, spec)
    knobs = {
        **knobs,
        "TOKENIZER_DIR": str(tok),
        "INIT_MODEL": str(prepared.base_nemo),
        "SEED": str(seed),
        "PHASE1_LR": lr,
        "PHASE2_LR": lr,
    }
    placeholder = cell_dir / "RUN"
    now = training_settings(bench.train_env(prepared.data, placeholder, steps, eval_every, **knobs))
    defaults = knob_defaults()
    for done in sorted(cell_dir.glob(f"{variant}_seed{seed}_*/run.json")):
        record = json.loads(done.read_text())
        if bench.finished(done.parent, steps) and same_run(record["settings"], now, defaults):
            metrics = done.parent / "wandb_logs" / "run" / "metrics.jsonl"
            return Run(variant, seed, bench.curves(metrics), record.get("seconds"), False)
    digest = hashlib.sha256(json.dumps(now, sort_keys=True).encode()).hexdigest()[:8]
    run_dir = cell_dir / f"{variant}_seed{seed}_{digest}"
    # Finished but unrecorded (stopped between its end and run.json): its time is unknown.
    unrecorded = bench.finished(run_dir, steps)
    if not unrecorded:
        print(f"== {prepared.base.name} LR {lr} {variant} SEED={seed}: {spec}", flush=True)
    started = time.monotonic()
    metrics = bench.train(prepared.data, run_dir, steps, eval_every, **knobs)
    seconds = None if unrecorded else time.monotonic() - started
    record = {"variant": variant, "seed": seed, "lr": lr, "seconds": seconds, "settings": now}
    atomic_write(
        run_dir / "run.json", lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1))
    )
    return Run(variant, seed, bench.curves(metrics), seconds, not unrecorded)


# ---- the targets ------------------------------------------------------------------------------


def validation_steps(run: dict, ref: dict | None) -> tuple[int | None, int | None]:
    """(middle, last) validation after step 0 of ``run`` (and ``ref``, when given): the last, and
    the one nearest half of it (the earlier of two)."""
    steps = {s for s in run["cer"] if s > 0}
    if ref is not None:
        steps &= set(ref["cer"])
    if not steps:
        return None, None
    last = max(steps)
    return min(steps, key=lambda s: (abs(s - last / 2), s)), last


def worst(pairs) -> tuple[float, str]:
    """The (figure, where) of ``pairs`` with the largest figure; (nan, "-") when there is none."""
    pairs = [(v, w) for v, w in pairs if v is not None and not math.isnan(v)]
    return max(pairs, key=lambda p: p[0]) if pairs else (math.nan, "-")


def target_figures(
    run: dict,
    ref: dict | None,
    base_scores: dict[str, dict[str, float]],
    base_langs: tuple[str, ...],
    new_langs: tuple[str, ...],
) -> dict[str, tuple[float, str]]:
    """Each target column's figure of one run (its curves), worst case first: {column: (figure,
    where)}; the columns of AGAINST_REFERENCE only with ``ref``, the same seed's reference run.
    ``base_scores``: the base itself, "wer" auto and "wer_given" with the language given, per
    language (bench_finetune_init.base_model_scores)."""
    out = {}
    later = sorted(s for s in run["wer"] if s > 0)
    for column, key in (("a", "wer"), ("e", "wer_given")):
        base = base_scores.get(key, {})
        out[column] = worst(
            (run[key][s][lang] - base[lang], f"{lang}@{s}")
            for s in later
            if s in run[key]
            for lang in base_langs
            if lang in run[key][s] and lang in base
        )
    for decoding, key in (("auto", "wer"), ("given", "wer_given")):
        at0, base = run[key].get(0, {}), base_scores.get(key, {})
        out[f"d {decoding}"] = worst(
            (abs(at0[lang] - base[lang]), lang)
            for lang in base_langs
            if lang in at0 and lang in base
        )
    if ref is not None:
        middle, last = validation_steps(run, ref)
        for decoding, key in (("auto", "cer"), ("given", "cer_given")):
            mine, theirs = run[key], ref[key]
            out[f"b {decoding}"] = worst(
                (mine[s]["all"] - theirs[s]["all"], f"@{s}")
                for s in (middle, last)
                if "all" in mine.get(s, {}) and "all" in theirs.get(s, {})
            )
            out[f"c {decoding}"] = worst(
                (mine[last][lang] - theirs[last][lang], f"{lang}@{last}")
                for lang in new_langs
                if lang in mine.get(last, {}) and lang in theirs.get(last, {})
            )
    return out


@dataclass
class Spread:
    """One target column of one variant in one cell, over its seeds."""

    values: list[float]  # per seed, in seed order (nan: not measured)
    where: str  # where the worst seed is worst

    @property
    def measured(self) -> list[float]:
        return [v for v in self.values if not math.isnan(v)]

    @property
    def mean(self) -> float:
        return sum(self.measured) / len(self.measured) if self.measured else math.nan

    @property
    def range(self) -> float:
        return max(self.measured) - min(self.measured) if self.measured else math.nan

    def met(self, bound: float) -> int:
        return sum(1 for v in self.measured if v <= bound + 1e-9)

    def verdict(self, bound: float) -> str:
        """met (every seed) or MISSED with the seeds that meet it."""
        if not self.measured:
            return "n/a"
        n, total = self.met(bound), len(self.values)
        return f"met {n}/{total}" if n == total else f"MISSED {n}/{total}"

    def text(self) -> str:
        if not self.measured:
            return "-"
        low, high = min(self.measured), max(self.measured)
        return f"{self.mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def cell_spreads(
    runs: dict[str, dict[int, dict]],
    base_scores: dict[str, dict[str, float]],
    base: bench.Base,
) -> dict[str, dict[str, Spread]]:
    """{variant: {column: Spread over the seeds}} of one cell: ``runs`` is {variant: {seed:
    curves}}, the reference among them; each run is judged against the reference of its seed."""
    refs = runs.get(REFERENCE, {})
    out = {}
    for variant, by_seed in runs.items():
        figures = {
            seed: target_figures(
                curves,
                refs.get(seed) if variant != REFERENCE else None,
                base_scores,
                base.base_langs,
                base.new_langs,
            )
            for seed, curves in sorted(by_seed.items())
        }
        out[variant] = {}
        for column, _, _ in TARGETS:
            pairs = [figures[seed].get(column, (math.nan, "-")) for seed in figures]
            if all(math.isnan(v) for v, _ in pairs):
                continue
            where = max((p for p in pairs if not math.isnan(p[0])), key=lambda p: p[0])[1]
            out[variant][column] = Spread([v for v, _ in pairs], where)
    return out


def compare_to_defaults(variant: dict[str, Spread], defaults: dict[str, Spread]) -> dict[str, str]:
    """{column: helps | hurts | same} of a variant against the defaults in one cell: helps (hurts)
    where its mean over the seeds is lower (higher: every figure is lower-is-better) by more than
    the larger of the two seed ranges."""
    out = {}
    for column in variant:
        if column not in defaults or not variant[column].measured:
            continue
        mine, theirs = variant[column], defaults[column]
        noise = max(mine.range, theirs.range)
        difference = mine.mean - theirs.mean
        if difference < -noise - 1e-9:
            out[column] = "helps"
        elif difference > noise + 1e-9:
            out[column] = "hurts"
        else:
            out[column] = "same"
    return out


def lever_verdict(per_cell: dict[str, dict[str, str]]) -> tuple[int, int, bool]:
    """(cells where the lever helps some target and hurts none, cells where it hurts one, keep):
    kept when it helps in more than half of the cells and hurts in none."""
    helps = sum(1 for c in per_cell.values() if "helps" in c.values() and "hurts" not in c.values())
    hurts = sum(1 for c in per_cell.values() if "hurts" in c.values())
    return helps, hurts, helps * 2 > len(per_cell) and hurts == 0


# ---- the report --------------------------------------------------------------------------------


def cell_name(base: str, lr: str) -> str:
    return f"{base} LR {lr}"


def report(
    cells: dict[str, dict[str, dict[str, Spread]]],
    variants: list[str],
) -> list[str]:
    """Per cell, per variant, each target as met or missed with its figure's mean [min, max] over
    the seeds; then per target how many cells each variant meets it in; then each lever against the
    defaults. ``cells``: {cell: cell_spreads}; ``variants``: in the order to print."""
    lines = []
    for cell, spreads in cells.items():
        lines += ["", f"== {cell}"]
        for variant in variants:
            if variant not in spreads:
                continue
            lines.append(f"  {variant}{' (the reference)' if variant == REFERENCE else ''}")
            for column, what, bound in TARGETS:
                spread = spreads[variant].get(column)
                if spread is None:
                    continue
                lines.append(
                    f"    {column:<8} {what:<72} <= {bound:<5g} {spread.verdict(bound):<11} "
                    f"{spread.text():<28} worst {spread.where}"
                )
    columns = [column for column, _, _ in TARGETS]
    lines += [
        "",
        "== overall: cells where each target is met in every seed, of the cells measured",
        f"{'variant':<20} " + " ".join(f"{c:>8}" for c in columns),
    ]
    for variant in variants:
        row = []
        for column in columns:
            measured = [
                s[variant][column]
                for s in cells.values()
                if column in s.get(variant, {}) and s[variant][column].measured
            ]
            met = sum(1 for s in measured if s.met(BOUNDS[column]) == len(s.values))
            row.append(f"{met}/{len(measured)}" if measured else "-")
        lines.append(f"{variant:<20} " + " ".join(f"{r:>8}" for r in row))
    levers = [v for v in variants if v not in (DEFAULTS, REFERENCE)]
    if levers and any(DEFAULTS in s for s in cells.values()):
        lines += [
            "",
            "== levers against the defaults, per cell: helps / hurts where the means over the seeds "
            "differ by more than the larger seed range of the two (every figure lower is better)",
            f"{'variant':<20} {'target':<8} {'helps':>5} {'hurts':>5} {'same':>5}",
        ]
        for variant in levers:
            per_cell = {
                cell: compare_to_defaults(s[variant], s[DEFAULTS])
                for cell, s in cells.items()
                if variant in s and DEFAULTS in s
            }
            for column in columns:
                said = [c[column] for c in per_cell.values() if column in c]
                if said:
                    lines.append(
                        f"{variant:<20} {column:<8} {said.count('helps'):>5} "
                        f"{said.count('hurts'):>5} {said.count('same'):>5}"
                    )
            helps, hurts, keep = lever_verdict(per_cell)
            lines.append(
                f"{variant}: helps in {helps} of {len(per_cell)} cells, hurts a target in {hurts}: "
                + ("keep" if keep else "do not keep")
            )
    return lines


def plot(
    path: Path,
    cell_runs: dict[str, dict[str, dict[int, dict]]],
    cells: dict[str, dict[str, dict[str, Spread]]],
    bases: dict[str, tuple[bench.Base, dict]],
    variants: list[str],
) -> None:
    """One picture of the grid: per cell (a column), the base languages' WER and the overall CER
    per variant over the steps (mean over the seeds, their range shaded; auto solid, given
    dashed), and under them every target's verdict per variant and cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cell_runs)
    rows = [
        (v, c)
        for v in variants
        for c, _, _ in TARGETS
        if not (v == REFERENCE and c in AGAINST_REFERENCE)
    ]
    fig = plt.figure(figsize=(4.6 * len(names), 8 + 0.2 * len(rows)))
    grid = fig.add_gridspec(3, len(names), height_ratios=[1, 1, 0.2 + 0.045 * len(rows)])
    colors = variant_colors(variants)
    for i, cell in enumerate(names):
        base, base_wer = bases[cell]
        panels = [
            ("wer", "wer_given", list(base.base_langs), f"{', '.join(base.base_langs)} WER"),
            ("cer", "cer_given", ["all"], "overall CER"),
        ]
        for row, (auto_key, given_key, langs, title) in enumerate(panels):
            ax = fig.add_subplot(grid[row, i])
            for variant in variants:
                by_seed = cell_runs[cell].get(variant)
                if not by_seed:
                    continue
                for key, style in ((auto_key, "-"), (given_key, "--")):
                    steps = sorted(set.intersection(*(set(r[key]) for r in by_seed.values())))
                    if not steps:
                        continue
                    per_seed = [
                        [bench.mean_over(r[key][s], langs) for s in steps] for r in by_seed.values()
                    ]
                    mean = [sum(v) / len(v) for v in zip(*per_seed)]
                    ax.plot(
                        steps,
                        mean,
                        style,
                        color=colors[variant],
                        label=f"{variant}{' given' if style == '--' else ''}",
                    )
                    ax.fill_between(
                        steps,
                        [min(v) for v in zip(*per_seed)],
                        [max(v) for v in zip(*per_seed)],
                        color=colors[variant],
                        alpha=0.15,
                    )
            if row == 0:
                ax.axhline(
                    bench.mean_over(base_wer, langs) + BOUNDS["a"],
                    color="k",
                    ls=":",
                    label="the base + 0.05",
                )
            ax.set_ylim(0, 1.2)
            ax.set_title(f"{cell}: {title}", fontsize=9)
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
            if i == 0 and row == 0:
                ax.legend(fontsize=7)
    ax = fig.add_subplot(grid[2, :])
    shade = {"met": "#8fd18f", "some": "#f3d27a", "none": "#ec8f8f", "-": "#dddddd"}
    for r, (variant, column) in enumerate(rows):
        for c, cell in enumerate(names):
            spread = cells[cell].get(variant, {}).get(column)
            if spread is None or not spread.measured:
                state, label = "-", "-"
            else:
                met = spread.met(BOUNDS[column])
                state = "met" if met == len(spread.values) else "some" if met else "none"
                label = f"{spread.mean:+.3f} ({met}/{len(spread.values)})"
            ax.add_patch(plt.Rectangle((c, r), 1, 1, color=shade[state]))
            ax.text(c + 0.5, r + 0.5, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(names))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([c + 0.5 for c in range(len(names))], names, fontsize=8)
    ax.set_yticks(
        [r + 0.5 for r in range(len(rows))],
        [f"{v}: {c} <= {BOUNDS[c]:g}" for v, c in rows],
        fontsize=7,
    )
    ax.set_title("targets: mean over seeds (seeds met); green met in every seed", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)


def frontier_points(
    runs: dict[str, dict[int, dict]], spreads: dict[str, dict[str, Spread]], base: bench.Base
) -> dict[str, list[tuple[float, float, float]]]:
    """Per variant of one cell, per seed (in seed order): (the new languages' mean CER at the last
    validation, auto; target a's figure, the base languages' worst WER drift auto; target e's,
    with the language given): where each run lies between learning the new languages and keeping
    the base's. A seed missing a figure is left out."""
    out = {}
    for variant, by_seed in runs.items():
        drift = spreads.get(variant, {})
        a_values = drift["a"].values if "a" in drift else []
        e_values = drift["e"].values if "e" in drift else []
        points = []
        for k, (_, curves) in enumerate(sorted(by_seed.items())):
            later = [s for s in curves["cer"] if s > 0]
            if not later or k >= len(a_values) or k >= len(e_values):
                continue
            cer = bench.mean_over(curves["cer"][max(later)], base.new_langs)
            point = (cer, a_values[k], e_values[k])
            if not any(math.isnan(v) for v in point):
                points.append(point)
        if points:
            out[variant] = points
    return out


def variant_colors(variants: list[str]) -> dict[str, tuple]:
    """A distinct color per variant: matplotlib's ten-color cycle repeats past ten, so more
    variants take tab20's twenty."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if len(variants) <= 10 else "tab20"]
    return {v: palette(i % palette.N) for i, v in enumerate(variants)}


def plot_frontier(
    path: Path,
    cell_runs: dict[str, dict[str, dict[int, dict]]],
    cells: dict[str, dict[str, dict[str, Spread]]],
    bases: dict[str, tuple[bench.Base, dict]],
    variants: list[str],
) -> None:
    """The frontier of each cell (a panel): per variant, the base languages' worst drift (a: auto,
    filled; e: given, open) against the new languages' CER at the last validation, each seed a
    small mark and the mean over the seeds a large one, with the 0.05 bound of a and e."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cell_runs)
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 4.4), squeeze=False)
    colors = variant_colors(variants)
    for ax, cell in zip(axes[0], names):
        base, _ = bases[cell]
        points = frontier_points(cell_runs[cell], cells[cell], base)
        for variant in variants:
            if variant not in points:
                continue
            cer, a, e = zip(*points[variant])
            color = colors[variant]
            ax.scatter(cer, a, s=12, color=color, alpha=0.5)
            ax.scatter(cer, e, s=12, facecolors="none", edgecolors=color, alpha=0.5)
            mean_cer = sum(cer) / len(cer)
            ax.scatter([mean_cer], [sum(a) / len(a)], s=70, color=color, label=f"{variant} (a)")
            ax.scatter(
                [mean_cer], [sum(e) / len(e)], s=70, facecolors="none", edgecolors=color, lw=2
            )
        ax.axhline(BOUNDS["a"], color="k", ls=":", label="a, e bound (0.05)")
        ax.set_title(f"{cell}: the base's drift against the new languages' CER", fontsize=8)
        ax.set_xlabel("new languages' CER, last validation (auto)", fontsize=8)
        ax.set_ylabel("base languages' worst WER drift (a filled, e open)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)


# ---- the grid ------------------------------------------------------------------------------------


def base_scores(prepared: bench.Prepared) -> dict:
    """bench_finetune_init.base_model_scores of the base, auto and with its languages given, kept
    beside it."""
    path = prepared.root / f"base_scores_{prepared.base_nemo.stem}.json"
    if not path.exists() or "wer_given" not in json.loads(path.read_text()):
        scores = bench.base_model_scores(
            prepared.base_nemo,
            prepared.base_tokenizer,
            prepared.val,
            prepared.tokenizer("extend"),
            given=prepared.base.base_langs,
        )
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(scores)))
    return json.loads(path.read_text())


def tokenizer_lines(prepared: bench.Prepared) -> list[str]:
    """The extended tokenizer's appended pieces against the fresh tokenizer's share for the new
    languages (its pieces that hold a character the base cannot write)."""
    extended = json.loads((prepared.tokenizer("extend") / "summary.json").read_text())["extension"]
    fresh_new, fresh_all = new_language_pieces(prepared.tokenizer("new"), prepared.base_tokenizer)
    size = prepared.base.finetune_vocab_size
    return [
        f"  extended ({size}): {extended['base_pieces']} base + {extended['appended_pieces']} "
        f"appended ({extended['appended_pieces'] / size:.0%}) + {extended['appended_tags']} tags",
        f"  fresh ({size}): {fresh_new} pieces ({fresh_new / size:.0%}; {fresh_all} hold text) "
        f"hold a character the base cannot write: VOCAB_SIZE=fresh appends as many "
        f"({extension_size(prepared, 'fresh')} in all)",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, default=bench.REPO / "data" / "finetune_grid")
    parser.add_argument(
        "--bases", default=",".join(BASES), help=f"comma-separated, of {', '.join(BASES)}"
    )
    parser.add_argument(
        "--lrs", default="1e-3,3e-3", help="comma-separated PHASE1_LR = PHASE2_LR of each cell"
    )
    parser.add_argument("--seeds", default="1234,7,42", help="comma-separated SEEDs per cell")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated variants to run besides {REFERENCE} (the reference, always run); "
        f"default: {DEFAULTS} and every --variant",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KNOB=VALUE",
        help="a new variant NAME: the defaults with KNOB=VALUE (repeat for more knobs of it)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="VARIANT:KNOB=VALUE",
        help="change one knob of an existing variant",
    )
    parser.add_argument(
        "--base-steps", type=int, default=600, help="optimizer steps of each base model"
    )
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps of every finetune")
    parser.add_argument("--eval-every", type=int, default=30)
    args = parser.parse_args(argv)

    table = grid_variants(args.steps, args.variant, args.set)
    added = list(bench.parse_sets(args.variant))
    chosen = args.only.split(",") if args.only else [DEFAULTS, *added]
    unknown = [v for v in chosen if v not in table]
    if unknown:
        raise SystemExit(f"--only {','.join(unknown)}: no such variant ({', '.join(table)})")
    variants = [REFERENCE, *[v for v in dict.fromkeys(chosen) if v != REFERENCE]]
    bases = list(dict.fromkeys(b.strip() for b in args.bases.split(",") if b.strip()))
    wrong = [b for b in bases if b not in BASES]
    if wrong:
        raise SystemExit(f"--bases {','.join(wrong)}: no such base ({', '.join(BASES)})")
    lrs = []
    for lr in (lr.strip() for lr in args.lrs.split(",") if lr.strip()):
        try:
            if not math.isfinite(float(lr)) or float(lr) <= 0:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--lrs {lr!r}: expected learning rates > 0 such as 1e-3") from None
        lrs.append(f"{float(lr):g}")  # one spelling per rate: 3e-3 and 0.003 are one cell
    lrs = list(dict.fromkeys(lrs))
    try:
        seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",") if s.strip()))
    except ValueError:
        raise SystemExit(f"--seeds {args.seeds!r}: expected integers such as 1234,7,42") from None
    if not (bases and lrs and seeds):
        raise SystemExit("--bases, --lrs and --seeds: each needs at least one value")
    work = args.work.resolve()
    started = time.monotonic()

    header = [
        f"grid: {len(bases)} bases x {len(lrs)} LRs x {len(seeds)} seeds x {len(variants)} variants "
        f"({', '.join(variants)}); finetunes of {args.steps} steps, a validation every "
        f"{args.eval_every} and at step 0; bases of {args.base_steps} steps"
    ]
    cell_runs: dict[str, dict[str, dict[int, dict]]] = {}
    cells: dict[str, dict[str, dict[str, Spread]]] = {}
    cell_bases: dict[str, tuple[bench.Base, dict]] = {}
    runs: list[tuple[str, Run]] = []
    for name in bases:
        base = BASES[name]
        print(f"== base {name}: {base.sizes}, finetuned on {base.finetune_sizes}", flush=True)
        prepare_started = time.monotonic()
        prepared = bench.prepare_base(work / name, base, args.base_steps)
        scores = base_scores(prepared)
        prepare_seconds = time.monotonic() - prepare_started
        header += [
            f"{name}: base {base.sizes} ({base.vocab_size} pieces, encoder {base.d_model} wide), "
            f"finetuned on {base.finetune_sizes}: keeps {', '.join(base.base_langs)}, learns "
            f"{', '.join(base.new_langs)}; the base itself (auto): "
            + ", ".join(
                f"{lang} WER {scores['wer'][lang]:.3f} (given {scores['wer_given'][lang]:.3f})"
                for lang in base.base_langs
                if lang in scores["wer"] and lang in scores["wer_given"]
            )
            + f"; built or found in {prepare_seconds:.0f} s",
            *tokenizer_lines(prepared),
        ]
        for lr in lrs:
            cell = cell_name(name, lr)
            cell_dir = work / name / f"lr{lr}"
            cell_runs[cell] = {}
            for seed in seeds:
                for variant in variants:
                    run = run_once(
                        prepared,
                        cell_dir,
                        variant,
                        table[variant],
                        seed,
                        lr,
                        args.steps,
                        args.eval_every,
                    )
                    runs.append((name, run))
                    cell_runs[cell].setdefault(variant, {})[seed] = run.curves
            cells[cell] = cell_spreads(cell_runs[cell], scores, base)
            cell_bases[cell] = (base, scores["wer"])

    lines = [*header, *report(cells, variants), "", *cost_lines(runs, len(variants) * len(seeds))]
    lines.append(f"total {time.monotonic() - started:.0f} s")
    text = "\n".join(lines)
    print(text)
    atomic_write(work / "grid.txt", lambda tmp: Path(tmp).write_text(text + "\n"))
    plot(work / "grid.png", cell_runs, cells, cell_bases, variants)
    plot_frontier(work / "frontier.png", cell_runs, cells, cell_bases, variants)
    print(f"wrote {work / 'grid.txt'}, {work / 'grid.png'} and {work / 'frontier.png'}")
    return 0


def cost_lines(runs: list[tuple[str, Run]], runs_per_cell: int) -> list[str]:
    """What a finetune and a cell cost, per base: mean [min, max] wall-clock seconds per run, and
    the finetunes of the whole grid at that mean."""
    timed = [r.seconds for _, r in runs if r.seconds is not None]
    lines = [
        f"== cost: {sum(r.trained_now for _, r in runs)} runs trained now, "
        f"{sum(not r.trained_now for _, r in runs)} reused; the grid's {len(runs)} finetunes at "
        + (
            f"{sum(timed) / len(timed):.0f} s each: {sum(timed) / len(timed) * len(runs) / 60:.0f} min"
            if timed
            else "no time recorded"
        )
    ]
    for base in dict.fromkeys(b for b, _ in runs):
        seconds = [r.seconds for b, r in runs if b == base and r.seconds is not None]
        if not seconds:
            continue
        mean = sum(seconds) / len(seconds)
        lines.append(
            f"{base}: {mean:.0f} s per run [{min(seconds):.0f}, {max(seconds):.0f}] over "
            f"{len(seconds)} runs; a cell ({runs_per_cell} runs) {mean * runs_per_cell / 60:.1f} min"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
