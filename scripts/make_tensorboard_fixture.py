"""Writes tests/fixtures/tensorboard/: event files made by TensorBoard's own writer (the `tensorboard`
package from PyPI), which streambp's reader must read as TensorBoard does, and which fix the field
numbers its writer uses. Run: .venv/bin/pip install tensorboard && .venv/bin/python this file.

A first run logs train/loss at steps 1..4 and eval/loss at 0 and 4; a second, resumed after step 2,
starts its file with SessionLog START at step 3 and logs train/loss 30, 40 at steps 3, 4: TensorBoard
shows steps 1, 2 of the first run and 3, 4 of the second, and eval/loss at 0 only.
"""
import os
import shutil

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "tensorboard")


def scalar(step, tag, value):
    value = summary_pb2.Summary.Value(tag=tag, simple_value=value)
    return event_pb2.Event(wall_time=1.0e9 + step, step=step, summary=summary_pb2.Summary(value=[value]))


def write(filename_suffix, events):
    w = EventFileWriter(OUT, filename_suffix=filename_suffix)
    for e in events:
        w.add_event(e)
    w.close()


shutil.rmtree(OUT, ignore_errors=True)
os.makedirs(OUT)
write(".1", [scalar(0, "eval/loss", 5.0)] + [scalar(s, "train/loss", float(s)) for s in range(1, 5)]
      + [scalar(4, "eval/loss", 1.5)])
start = event_pb2.Event(wall_time=1.0e9 + 10, step=3, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
write(".2", [start, scalar(3, "train/loss", 30.0), scalar(4, "train/loss", 40.0)])
# The file names sort in writing order (time, then the suffix); give them fixed names for the repo.
for i, name in enumerate(sorted(os.listdir(OUT))):
    os.rename(os.path.join(OUT, name), os.path.join(OUT, f"events.out.tfevents.100000000{i}.fixture"))

ea = EventAccumulator(OUT)
ea.Reload()
for tag in ("train/loss", "eval/loss"):
    print(tag, [(e.step, e.value) for e in ea.Scalars(tag)])
