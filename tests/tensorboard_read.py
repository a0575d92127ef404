#!/usr/bin/python3
"""tensorboard_read.py - reads ampc-train's TensorBoard event files independently of ampc: the
TFRecord framing parsed here (both masked CRC32Cs checked with a CRC written here from its
definition) and each Event parsed by protobuf's own Python runtime (python3-protobuf) from the
.proto files compiled by protoc --python_out into a temporary folder.

    tensorboard_read.py dump PROTO_DIR FILE...
        every record: "step S file_version V", "step S session_log START", "step S TAG VALUE"
    tensorboard_read.py check PROTO_DIR RUN_DIR --steps-csv F --metrics-csv F [--scaler yes|no]
                              [--starts "S ..."]
        reads the run's event files in name order, as TensorBoard does, drops what a SessionLog
        START at step S makes TensorBoard drop (earlier events with step >= S), and asserts:
        the tags; per optimizer step train/loss, train/lr, train/loss_scale and
        train/skipped_steps equal to steps.csv's loss, lr, scale and running sum of skipped, to
        float precision, at its step; per epoch the epoch/ tags equal to metrics.csv's row, at
        the step of the epoch's last row in steps.csv; steps strictly increasing in every file
        and in the run; --starts: the START steps of the files, in order.
Exit 0 when every check holds, 1 (with FAIL lines) otherwise, 2 for a file that can't be read.
"""
import csv
import glob
import math
import os
import struct
import subprocess
import sys
import tempfile

# ---------------------------------------------------------------------------------------------
# CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) and TFRecord's mask


def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283   # the check value


class BadFile(Exception):
    pass


def records(path):
    """The serialized Events of one file. A record cut short at the end (a killed writer's last
    buffer) ends the file, as TensorBoard reads it; a wrong CRC is an error."""
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        if at + 12 > len(data):
            print(f"note: {os.path.basename(path)} ends in a partial record header ({len(data) - at} bytes)")
            return
        (n,) = struct.unpack_from("<Q", data, at)
        (hcrc,) = struct.unpack_from("<I", data, at + 8)
        if hcrc != masked(crc32c(data[at:at + 8])):
            raise BadFile(f"{path}: byte {at}: the length's CRC is {hcrc:#010x}, not {masked(crc32c(data[at:at + 8])):#010x}")
        if at + 12 + n + 4 > len(data):
            print(f"note: {os.path.basename(path)} ends in a partial record ({len(data) - at} of {n + 16} bytes)")
            return
        body = data[at + 12:at + 12 + n]
        (dcrc,) = struct.unpack_from("<I", data, at + 12 + n)
        if dcrc != masked(crc32c(body)):
            raise BadFile(f"{path}: byte {at}: the record's CRC is {dcrc:#010x}, not {masked(crc32c(body)):#010x}")
        yield body
        at += 12 + n + 4


def load_protos(proto_dir):
    """event_pb2, compiled from proto_dir's event.proto and summary.proto by protoc."""
    out = tempfile.mkdtemp(prefix="tb_proto_")
    subprocess.run(["protoc", "-I", proto_dir, "--python_out", out, "event.proto", "summary.proto"], check=True)
    sys.path.insert(0, out)
    import event_pb2   # noqa: E402 (generated above)
    return event_pb2


def events(pb, path):
    for body in records(path):
        ev = pb.Event()
        ev.ParseFromString(body)
        yield ev


def describe(pb, ev):
    what = ev.WhichOneof("what")
    if what == "file_version":
        return [f"step {ev.step} file_version {ev.file_version}"]
    if what == "session_log":
        return [f"step {ev.step} session_log {pb.SessionLog.SessionStatus.Name(ev.session_log.status)}"]
    if what == "summary":
        return [f"step {ev.step} {v.tag} {v.simple_value!r}" for v in ev.summary.value]
    return [f"step {ev.step} {what}"]


# ---------------------------------------------------------------------------------------------
# check


def f32(x):
    """x as TensorBoard's simple_value holds it (a float, rounded to nearest)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in r.items()} for r in rows]


def check(pb, run_dir, steps_csv, metrics_csv, scaler, starts):
    fails = []

    def bad(msg):
        fails.append(msg)
        print("FAIL: " + msg)

    files = sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    if not files:
        bad(f"no event file in {run_dir}")
        return 1
    series = {}        # tag -> [(step, value)], what TensorBoard shows
    start_steps = []
    dropped = 0        # points a START made TensorBoard drop
    for path in files:
        name = os.path.basename(path)
        evs = list(events(pb, path))
        if not evs or evs[0].WhichOneof("what") != "file_version" or evs[0].file_version != "brain.Event:2":
            bad(f"{name}: the first event is not file_version brain.Event:2")
        last = {}
        for i, ev in enumerate(evs[1:], 1):
            what = ev.WhichOneof("what")
            if what == "session_log":
                if ev.session_log.status != pb.SessionLog.START or i != 1:
                    bad(f"{name}: event {i}: a session_log other than START as the second event")
                start_steps.append(ev.step)
                for tag in series:   # TensorBoard's purge of a restarted run's orphans
                    kept = [(s, v) for s, v in series[tag] if s < ev.step]
                    dropped += len(series[tag]) - len(kept)
                    series[tag] = kept
            elif what == "summary":
                for v in ev.summary.value:
                    if v.WhichOneof("value") != "simple_value":
                        bad(f"{name}: step {ev.step}: {v.tag} is not a simple_value")
                    if v.tag in last and ev.step <= last[v.tag]:
                        bad(f"{name}: {v.tag}: step {ev.step} after step {last[v.tag]}")
                    last[v.tag] = ev.step
                    series.setdefault(v.tag, []).append((ev.step, v.simple_value))
            else:
                bad(f"{name}: event {i}: unexpected {what}")
        print(f"{name}: {len(evs)} events")
    for tag, pts in series.items():
        if any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
            bad(f"{tag}: the steps TensorBoard shows are not strictly increasing: {[s for s, _ in pts]}")

    step_tags = ["train/loss", "train/lr", "train/skipped_steps", "train/samples_per_s"] + (["train/loss_scale"] if scaler else [])
    epoch_tags = ["epoch/train_loss", "epoch/val_loss", "epoch/train_accuracy", "epoch/val_accuracy", "epoch/lr",
                  "epoch/samples_per_s", "epoch/skipped_steps"]
    if sorted(series) != sorted(step_tags + epoch_tags):
        bad(f"tags {sorted(series)}, expected {sorted(step_tags + epoch_tags)}")
    if starts is not None and start_steps != starts:
        bad(f"SessionLog START steps {start_steps}, expected {starts}")

    steps = read_csv(steps_csv)
    want = {"train/loss": [], "train/lr": [], "train/loss_scale": [], "train/skipped_steps": []}
    skipped = 0.0
    for r in steps:
        skipped += r["skipped"]
        for tag, v in (("train/loss", r["loss"]), ("train/lr", r["lr"]), ("train/loss_scale", r["scale"]),
                       ("train/skipped_steps", skipped)):
            want[tag].append((int(r["step"]), f32(v)))
    for tag, pts in want.items():
        if tag not in step_tags:
            continue
        got = series.get(tag, [])
        if len(got) != len(pts) or any(a[0] != b[0] or not same(a[1], b[1]) for a, b in zip(got, pts)):
            diff = next(((a, b) for a, b in zip(got, pts) if a[0] != b[0] or not same(a[1], b[1])), None)
            bad(f"{tag}: {len(got)} points, steps.csv {len(pts)}; first difference (step, value) {diff}")
    sps = series.get("train/samples_per_s", [])
    if [s for s, _ in sps] != [int(r["step"]) for r in steps] or not all(math.isfinite(v) and v > 0 for _, v in sps):
        bad("train/samples_per_s: not a positive throughput at every step of steps.csv")

    metrics = read_csv(metrics_csv)
    end_of = {}
    for r in steps:
        end_of[int(r["epoch"])] = r
    cols = {"epoch/train_loss": "train_loss", "epoch/val_loss": "val_loss", "epoch/train_accuracy": "train_acc",
            "epoch/val_accuracy": "val_acc", "epoch/samples_per_s": "samples_per_s", "epoch/skipped_steps": "skipped_steps"}
    for tag in epoch_tags:
        pts = []
        for m in metrics:
            last = end_of.get(int(m["epoch"]))
            if last is None:
                bad(f"epoch {int(m['epoch'])} of metrics.csv has no row in steps.csv")
                continue
            pts.append((int(last["step"]), f32(last["lr"] if tag == "epoch/lr" else m[cols[tag]])))
        got = series.get(tag, [])
        if len(got) != len(pts) or any(a[0] != b[0] or not same(a[1], b[1]) for a, b in zip(got, pts)):
            bad(f"{tag}: TensorBoard shows {got}, metrics.csv says {pts}")
    if not fails:
        print(f"ok: {len(files)} file(s); {len(steps)} optimizer steps and {len(metrics)} epochs as steps.csv and metrics.csv "
              f"say, {len(series)} tags, START steps {start_steps} ({dropped} earlier points dropped)")
    return 1 if fails else 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "dump":
        pb = load_protos(argv[2])
        for path in argv[3:]:
            print(path)
            for ev in events(pb, path):
                for line in describe(pb, ev):
                    print("  " + line)
        return 0
    if len(argv) >= 4 and argv[1] == "check":
        opts = dict(zip(argv[4::2], argv[5::2]))
        if len(argv[4:]) % 2 or not {"--steps-csv", "--metrics-csv"} <= set(opts) or set(opts) - {"--steps-csv", "--metrics-csv", "--scaler", "--starts"}:
            print(__doc__, file=sys.stderr)
            return 2
        starts = [int(s) for s in opts["--starts"].split()] if "--starts" in opts else None
        return check(load_protos(argv[2]), argv[3], opts["--steps-csv"], opts["--metrics-csv"],
                     opts.get("--scaler", "no") == "yes", starts)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except BadFile as e:
        print(f"FAIL: {e}")
        sys.exit(2)
