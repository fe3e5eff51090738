"""Reads a run directory's TensorBoard event files with the `tensorboard` package from PyPI (its
EventAccumulator, as `tensorboard --logdir` does) and prints JSON:
{"scalars": {tag: [[step, value, wall_time], ...]}, "files": n, "records": n,
 "file_version": "...", "corrupt_detected": bool}
"records" counts the TFRecord records of the files read by TensorBoard's own record reader,
which checks both masked CRC-32Cs of every record; "corrupt_detected" says that a copy of the
first file with one byte of its last record changed is refused by that reader. Without the
package: {"skip": "..."} (the test then skips, saying so)."""
import glob
import json
import os
import shutil
import sys
import tempfile

try:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow
except ModuleNotFoundError as e:
    print(json.dumps({"skip": f"{e}: install it with .venv/bin/pip install tensorboard"}))
    sys.exit(0)


def records(path):
    """Every record of the file, as TensorBoard's reader returns them (CRCs checked)."""
    reader = pywrap_tensorflow.PyRecordReader_New(path)
    out = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return out
        out.append(reader.record())


def corrupt_detected(path):
    data = bytearray(open(path, "rb").read())
    data[-6] ^= 0x01  # a byte of the last record's event (its CRC is the last 4 bytes)
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, os.path.basename(path))
        open(bad, "wb").write(bytes(data))
        try:
            records(bad)
        except errors.DataLossError:
            return True
    return False


def main(run_dir):
    files = sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    n_records = 0
    file_version = ""
    for f in files:
        recs = records(f)
        n_records += len(recs)
        first = event_pb2.Event.FromString(recs[0])
        file_version = first.file_version
    acc = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    scalars = {
        tag: [[e.step, e.value, e.wall_time] for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }
    print(json.dumps({
        "scalars": scalars,
        "files": len(files),
        "records": n_records,
        "file_version": file_version,
        "corrupt_detected": corrupt_detected(files[0]) if files else False,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
