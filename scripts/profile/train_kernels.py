"""GPT-2 124M training step (eager, ours), kernel by kernel: each kernel attributed to the op that launched it.

    PYTHONPATH=.:kernels python scripts/profile/train_kernels.py   # on a CUDA GPU
"""
import collections, torch
from torch.profiler import profile, ProfilerActivity
from flash_models.bench.train import CASES, trainer_for
case = CASES['gpt2']
tr = trainer_for('ours', case, torch.device('cuda'))
for _ in range(3): tr.train_step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as p:
    tr.train_step(); torch.cuda.synchronize()
evs = p.events()
agg = collections.defaultdict(lambda: [0, 0.0])
def frames(e):
    st = [f for f in (e.stack or []) if 'flash_models' in f or 'flash_kernels' in f]
    return ' < '.join(s.split('/')[-1] for s in st[:3])
def owner(e):
    # nearest ancestor that is not an aten:: op, to name the autograd node or module
    a = e
    while a is not None and a.name.startswith('aten::'):
        a = a.cpu_parent
    return a.name[:60] if a is not None else '-'
total = 0.0
for e in evs:
    if e.device_type.name != 'CPU' or not e.kernels:
        continue
    for kk in e.kernels:
        key = (kk.name[:70], e.name, str(e.input_shapes)[:80], owner(e), frames(e)[:200])
        agg[key][0] += 1; agg[key][1] += kk.duration
        total += kk.duration
print(f"total kernel time {total/1000:.2f} ms")
rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
for (kn, op, shp, own, fr), (n, us) in rows[:70]:
    print(f"{us/1000:7.3f} ms x{n:3d} | {kn} | {op} {shp} | {own} | {fr}")
