"""The training loop reads tensor values on the host once per optimizer step, not per micro-batch.

On a GPU every read of a tensor's value (``.item()``, ``.tolist()``, ``float(t)``, ``if t:``) waits
for the queue of kernels to drain. The test runs train.main() in a process of its own (real
callbacks, a DataLoader worker, the metrics) at GRAD_ACCUM 1 and 4 over the same optimizer steps,
counts such reads whose caller is a project file, and requires the same count: the extra
micro-batches of GRAD_ACCUM 4 add none. Reads inside libraries (NeMo's decoder forward) are counted
apart and reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import tiny_train_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS = 6

PROBE = textwrap.dedent('''
    """train.main() with every host read of a tensor's value counted by its caller's file."""
    import collections, json, os, sys
    from pathlib import Path
    import torch

    REPO = os.environ["REPO"] + os.sep
    counts = {"project": collections.Counter(), "library": 0}
    training = {"on": False}

    def counting(name):
        original = getattr(torch.Tensor, name)
        def read(self, *args, **kwargs):
            if training["on"]:
                caller = sys._getframe(1)
                path = caller.f_code.co_filename
                if path.startswith(REPO) and os.sep + ".venv" + os.sep not in path:
                    counts["project"][f"{Path(path).name}:{caller.f_lineno}"] += 1
                else:
                    counts["library"] += 1
            return original(self, *args, **kwargs)
        setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        counting(name)

    import lightning.pytorch as pl
    import train

    class Window(pl.Callback):
        # From the first micro-batch to the end of the last optimizer step: the training loop.
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            training["on"] = True
        def on_train_end(self, trainer, module):
            training["on"] = False

    callbacks = train.build_callbacks
    train.build_callbacks = lambda: [Window()] + callbacks()
    code = train.main([])
    Path(os.environ["PROBE_OUT"]).write_text(json.dumps(
        {"project": dict(counts["project"]), "library": counts["library"]}))
    sys.exit(code)
''')


def host_reads(root: Path, data: dict, grad_accum: int) -> dict:
    out = root / f"reads_{grad_accum}.json"
    script = root / "count_reads.py"
    script.write_text(PROBE)
    env = tiny_train_env(
        data,
        DATA_DIR=str(root / f"run_{grad_accum}"),
        GRAD_ACCUM=str(grad_accum),
        MAX_STEPS=str(STEPS),
        UNFREEZE_STEP="3",
        EVAL_EVERY_STEPS="0",
        REPO=str(REPO),
        PROBE_OUT=str(out),
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads(out.read_text())


def test_extra_micro_batches_add_no_host_read_from_project_code(tmp_path):
    data = make_training_data(tmp_path, per_lang=16, vocab_size=64)
    one, four = host_reads(tmp_path, data, 1), host_reads(tmp_path, data, 4)
    extra_micro_batches = STEPS * (4 - 1)
    added = {
        site: four["project"].get(site, 0) - one["project"].get(site, 0)
        for site in set(one["project"]) | set(four["project"])
    }
    per_micro_batch = {site: n for site, n in added.items() if n}
    assert not per_micro_batch, (
        f"project code reads tensor values per micro-batch ({extra_micro_batches} extra "
        f"micro-batches): {per_micro_batch}"
    )
    # The loop does read once per optimizer step (the step's flags, the metrics' reduction).
    assert sum(one["project"].values()) >= STEPS
    # What the libraries read per micro-batch (NeMo's decoder forward), for the record.
    library = (four["library"] - one["library"]) / extra_micro_batches
    print(f"library host reads per extra micro-batch: {library:.1f}")
