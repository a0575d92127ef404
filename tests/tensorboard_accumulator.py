#!/usr/bin/env python3
"""tensorboard_accumulator.py - ampc-train's event files read by TensorBoard itself.

    python3 tests/tensorboard_accumulator.py RUN_DIR

RUN_DIR is a run's folder (--step-log yes, the default): its event files are loaded with
TensorBoard's EventAccumulator, the reader behind `tensorboard --logdir`, after the run was
stopped and resumed (or killed and resumed) any number of times. Checked: every tag ampc-train
documents is there; train/loss has exactly one point per row of steps.csv (TensorBoard dropped
what a stopped run wrote past its checkpoint), at the same steps, with the same values to
float32 precision; the epoch/* tags equal metrics.csv's rows. Exit 0 when all hold, 1 otherwise,
2 when the `tensorboard` package is missing (not on Debian: run where pip's TensorBoard is, such
as the GPU machine, by scripts/gpu/session.sh).
"""
import csv
import math
import sys

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    print("SKIP: no tensorboard package in this Python")
    sys.exit(2)

STEP_TAGS = ["train/loss", "train/lr", "train/skipped_steps", "train/samples_per_s"]
EPOCH_TAGS = {"epoch/train_loss": "train_loss", "epoch/val_loss": "val_loss", "epoch/train_accuracy": "train_acc",
              "epoch/val_accuracy": "val_acc", "epoch/samples_per_s": "samples_per_s",
              "epoch/skipped_steps": "skipped_steps"}


def close(a, b):
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 2 ** -23 * max(abs(a), abs(b), 1e-30) * 2


def main(run):
    ea = EventAccumulator(run, size_guidance={"scalars": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    fails = []
    steps = list(csv.DictReader(open(run + "/steps.csv")))
    metrics = list(csv.DictReader(open(run + "/metrics.csv")))
    scaler = any(float(r["scale"]) != 1 for r in steps)
    want = STEP_TAGS + list(EPOCH_TAGS) + (["train/loss_scale"] if scaler else [])
    missing = [t for t in want if t not in tags]
    if missing:
        fails.append("tags missing: %s (have %s)" % (missing, sorted(tags)))
    loss = ea.Scalars("train/loss") if "train/loss" in tags else []
    got = [(e.step, e.value) for e in loss]
    ref = [(int(r["step"]), float(r["loss"])) for r in steps]
    if [s for s, _ in got] != [s for s, _ in ref]:
        fails.append("train/loss steps %s... differ from steps.csv's %s... (%d vs %d points)"
                     % ([s for s, _ in got][:12], [s for s, _ in ref][:12], len(got), len(ref)))
    else:
        bad = [(s, a, b) for (s, a), (_, b) in zip(got, ref) if not close(a, b)]
        if bad:
            fails.append("train/loss differs from steps.csv at %d steps, first %s" % (len(bad), bad[0]))
    for tag, col in EPOCH_TAGS.items():
        if tag not in tags:
            continue
        vals = [e.value for e in ea.Scalars(tag)]
        ref = [float(r[col]) for r in metrics]
        if len(vals) != len(ref) or not all(close(a, b) for a, b in zip(vals, ref)):
            fails.append("%s %s differs from metrics.csv's %s %s" % (tag, vals, col, ref))
    for f in fails:
        print("FAIL: " + f)
    print("tensorboard_accumulator: %d scalar tags, %d steps, %d epochs, %d failure(s)"
          % (len(tags), len(got), len(metrics), len(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
