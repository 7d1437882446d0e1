"""spec/fixtures/tensorboard/: an events file written by PyTorch's SummaryWriter (torch.utils.tensorboard) with known
scalars, which spec/run_spec.lua reads with engine.tensorboard.read (CRCs, framing, Event/Summary fields).
tools/.venv/bin/python tools/gen_tensorboard_fixture.py   (needs torch and tensorboard in tools/.venv)"""
import glob, os, shutil, tempfile
from torch.utils.tensorboard import SummaryWriter

out = os.path.join(os.path.dirname(__file__), "..", "spec", "fixtures", "tensorboard")
tmp = tempfile.mkdtemp()
w = SummaryWriter(tmp)
for step, (loss, lr) in enumerate([(5.5, 1e-3), (4.25, 2e-3), (3.125, 3e-3)], start=1):
    w.add_scalar("train/loss", loss, step, walltime=1795800000.5 + step)
    w.add_scalar("train/lr", lr, step, walltime=1795800000.5 + step)
w.add_scalar("val/loss", 3.0, 300, walltime=1795800100.25)
w.close()
os.makedirs(out, exist_ok=True)
src = glob.glob(os.path.join(tmp, "events.out.tfevents.*"))[0]
shutil.copy(src, os.path.join(out, "torch_events.tfevents"))
print("wrote", os.path.join(out, "torch_events.tfevents"), os.path.getsize(src), "bytes")
