"""GPT-2 124M train steps as fit runs them (Trainer.iter_steps): GPU idle gaps and what the host did in each.

    PYTHONPATH=.:kernels python scripts/profile/train_gaps.py [ours+graphs|ours|hf]   # on a CUDA GPU
"""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from flash_models.bench.train import CASES, trainer_for
side = sys.argv[1] if len(sys.argv) > 1 else 'ours+graphs'
tr = trainer_for(side, CASES['gpt2'], torch.device('cuda'))
list(tr.iter_steps(tr.step + 4))
torch.cuda.synchronize()
recs = list(tr.iter_steps(tr.step + 6))
print(side, "per-step ms:", [round(r["seconds"] * 1e3, 2) for r in recs])
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    list(tr.iter_steps(tr.step + 3)); torch.cuda.synchronize()
evs = p.events()
gpu = sorted([e for e in evs if e.device_type.name == 'CUDA'], key=lambda e: e.time_range.start)
cpu = [e for e in evs if e.device_type.name == 'CPU']
busy = sum(e.time_range.end - e.time_range.start for e in gpu)
span = gpu[-1].time_range.end - gpu[0].time_range.start
print(f"3 steps: GPU span {span/1e3:.2f} ms, kernel busy {busy/1e3:.2f} ms")
gaps = []
end = gpu[0].time_range.end
prev = gpu[0]
for e in gpu[1:]:
    if e.time_range.start - end > 15:
        gaps.append((e.time_range.start - end, end, e.time_range.start, prev.name[:50], e.name[:50]))
    if e.time_range.end > end:
        end, prev = e.time_range.end, e
gaps.sort(reverse=True)
print(f"gaps > 15 us: {len(gaps)}, total {sum(g[0] for g in gaps)/1e3:.2f} ms")
for g, a, b, na, nb in gaps[:8]:
    print(f"  {g/1e3:6.3f} ms after {na} | before {nb}")
    inside = [c for c in cpu if c.time_range.start < b and c.time_range.end > a and c.cpu_parent is None]
    inside.sort(key=lambda c: c.time_range.start)
    for c in inside[:8]:
        print(f"      host: {c.name[:60]} [{(c.time_range.start - a)/1e3:+.3f}, {(c.time_range.end - a)/1e3:+.3f}] ms thread {c.thread}")
