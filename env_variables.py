"""Which environment variables a step refuses as likely mistyped knobs (``unknown_variables``): a
name that is no knob, no variable the scripts read themselves (``SCRIPT_VARIABLES``) and no other
tool's (``FOREIGN_PREFIXES``, ``FOREIGN_NAMES``, W&B's own), said with the closest knob's name.
config.py asks it at import, with the knobs it registers."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

# What the shell entry points read besides the knobs (each script's header documents its own).
SCRIPT_VARIABLES = {
    "PY": "demo.sh, slurm_train.sh",
    "DEMO_DIR": "demo.sh",
    "DEMO_CLEAN": "demo.sh",
    "DEMO_UTTERANCES": "demo.sh",
    "DEMO_MAX_LOSS_RATIO": "demo.sh",
    "DEMO_BASE_LANGUAGES": "demo.sh",
    "DEMO_BASE_STEPS": "demo.sh",
    "DEMO_BASE_VOCAB_SIZE": "demo.sh",
    "NNODES": "slurm_train.sh",
    "NODE_RANK": "slurm_train.sh",
    "NPROC_PER_NODE": "slurm_train.sh",
    "RDZV_ID": "slurm_train.sh",
    "RDZV_TIMEOUT": "slurm_train.sh",
    "RDZV_READ_TIMEOUT": "slurm_train.sh",
    "MAX_RESTARTS": "slurm_train.sh",
    "TRAIN_SCRIPT": "slurm_train.sh",
    "REPO_DIR": "slurm_train.sh",
    "SHARED_DIR_TIMEOUT": "slurm_train.sh",
    "PREEMPT_SAVE_SECONDS": "slurm_train.sh",
    "JOB_ENV": "slurm_train.sh",
    "CONTAINER_RUNTIME": "slurm_train.sh",
    "CONTAINER_IMAGE": "slurm_train.sh",
    "CONTAINER_PYTHON": "slurm_train.sh",
    "CONTAINER_PACKAGES": "slurm_train.sh",
    "CONTAINER_MOUNTS": "slurm_train.sh",
}

# Other tools' variables, by prefix (``NAME`` or ``NAME_...``) or whole name: never a misspelt knob.
FOREIGN_PREFIXES = (
    "CUDA",
    "CUDNN",
    "CUBLAS",
    "NCCL",
    "GLOO",
    "UCX",
    "NVIDIA",
    "NV",
    "NVTE",
    "TORCH",
    "PYTORCH",
    "TORCHELASTIC",
    "TORCHINDUCTOR",
    "TORCHDYNAMO",
    "TRITON",
    "NUMBA",
    "OMP",
    "KMP",
    "MKL",
    "OPENBLAS",
    "GOTO",
    "SLURM",
    "SBATCH",
    "SRUN",
    "SALLOC",
    "PMI",
    "PMIX",
    "OMPI",
    "MPI",
    "I_MPI",
    "HF",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "NEMO",
    "LHOTSE",
    "LIGHTNING",
    "PL",
    "PT",
    "PYTHON",
    "PYTEST",
    "PIP",
    "UV",
    "CONDA",
    "VIRTUAL_ENV",
    "PYENV",
    "LC",
    "XDG",
    "SSH",
    "GIT",
    "GITHUB",
    "RUNNER",
    "ACTIONS",
    "CI",
    "DOCKER",
    "KUBERNETES",
    "AWS",
    "GOOGLE",
    "GCP",
    "AZURE",
    "CLOUDSDK",
    "TF",
    "JAX",
    "XLA",
    "LD",
    "DYLD",
    "MALLOC",
    "POLARS",
    "ARROW",
    "NUMPY",
    "SSL",
    "REQUESTS",
    "CURL",
    "HTTP",
    "HTTPS",
    "NO_PROXY",
    "GRPC",
    "RUST",
    "RUSTUP",
    "CARGO",
    "JAVA",
    "NODE_EXTRA",
    "NPM",
    "TERM",
    "COMP",
    "LSB",
    "MPLCONFIGDIR",
    "HYDRA",
    "OC",
    "TQDM",
    "SKLEARN",
)
FOREIGN_NAMES = frozenset(
    """PATH HOME LANG LANGUAGE SHELL USER USERNAME LOGNAME PWD OLDPWD SHLVL TMPDIR TMP TEMP HOSTNAME
    DISPLAY EDITOR VISUAL PAGER LESS MAIL TZ COLUMNS LINES COLORTERM NO_COLOR FORCE_COLOR
    MASTER_ADDR MASTER_PORT WORLD_SIZE RANK LOCAL_RANK GROUP_RANK ROLE_RANK LOCAL_WORLD_SIZE
    GROUP_WORLD_SIZE ROLE_WORLD_SIZE ROLE_NAME DEBIAN_FRONTEND CONTAINER_NAME IS_SANDBOX
    HTTP_PROXY HTTPS_PROXY ALL_PROXY SCRIPT_NAME SERVER_NAME""".split()
)
# Names of this project's tests' own probes.
FOREIGN_PREFIXES += ("PROBE",)


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with adjacent transpositions (optimal string alignment)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def _closest(name: str, candidates) -> tuple[str, int]:
    return min(((c, _edit_distance(name, c)) for c in candidates), key=lambda t: (t[1], t[0]))


def _wandb_variables() -> frozenset[str]:
    """Every WANDB_* variable W&B itself reads (its env module and its settings' fields)."""
    try:
        import wandb.env
        from wandb.sdk.wandb_settings import Settings
    except Exception:  # W&B missing or broken: treat every WANDB_ variable as W&B's
        return frozenset({"*"})
    names = {v for v in vars(wandb.env).values() if isinstance(v, str) and v.startswith("WANDB_")}
    names |= {"WANDB_" + f.upper() for f in Settings.model_fields}
    return frozenset(names)


def unknown_variables(env: Mapping[str, str], knob_names) -> list[str]:
    """One message per variable of ``env`` that looks like one of ours but is no knob.

    A variable is ours when it is within a typo of a knob (edit distance 1, or 2 for names of 8
    characters or more; any case) or written in our words (two or more ``_``-separated words, each a
    word of some knob's name, such as ``EVAL_EVERY`` or ``TRAIN_MANIFEST``). Never flagged: the
    knobs, the shell entry points' own variables (SCRIPT_VARIABLES), other tools' variables by prefix
    or name (FOREIGN_PREFIXES, FOREIGN_NAMES, and every WANDB_ variable W&B reads), and the names
    listed in IGNORE_UNKNOWN_ENV (comma-separated; ``*`` turns the check off).
    """
    knob_names = set(knob_names)
    ignore = {n.strip() for n in env.get("IGNORE_UNKNOWN_ENV", "").split(",") if n.strip()}
    if "*" in ignore:
        return []
    words = {w for k in knob_names for w in k.split("_")}
    wandb_names: frozenset[str] | None = None
    problems = []
    for name in sorted(env):
        if name in knob_names or name in SCRIPT_VARIABLES or name in ignore:
            continue
        upper = name.upper()
        if upper in FOREIGN_NAMES or any(
            upper == p or upper.startswith(p + "_") for p in FOREIGN_PREFIXES
        ):
            continue
        if not upper.replace("_", "").isalnum():
            continue
        closest, distance = _closest(upper, knob_names)
        typo = distance <= (2 if len(closest) >= 8 else 1)
        parts = [w for w in upper.split("_") if w]
        in_our_words = len(parts) >= 2 and all(w in words for w in parts)
        if not (typo or in_our_words):
            continue
        if upper.startswith("WANDB_"):
            # W&B reads many WANDB_ variables: only a typo of one of our WANDB_ knobs is ours.
            closest, distance = _closest(upper, [k for k in knob_names if k.startswith("WANDB_")])
            if distance > 2:
                continue
            wandb_names = _wandb_variables() if wandb_names is None else wandb_names
            if "*" in wandb_names or upper in wandb_names:
                continue
        if not typo:  # written in our words: the knob that reads most alike
            closest = difflib.get_close_matches(upper, knob_names, n=1, cutoff=0.0)[0]
        hint = f"did you mean {closest}?" if name != closest else "names are upper case"
        problems.append(
            f"{name} is not a setting; {hint} (`python config.py` lists them; "
            f"IGNORE_UNKNOWN_ENV={name} silences this)"
        )
    return problems
