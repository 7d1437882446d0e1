"""Reads the TensorBoard events of a run folder with tensorboard's own EventAccumulator and prints every scalar
series: the check that the engine's events files (lua/engine/tensorboard.lua, --tensorboard=1) are what
TensorBoard reads.  tools/.venv/bin/python tools/check_tensorboard.py runs/x   (pip install tensorboard)"""
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ea = EventAccumulator(sys.argv[1])
ea.Reload()
tags = sorted(ea.Tags()["scalars"])
if not tags:
    sys.exit("check_tensorboard: no scalars in " + sys.argv[1])
for tag in tags:
    print(tag, [(e.step, round(e.value, 6)) for e in ea.Scalars(tag)])
