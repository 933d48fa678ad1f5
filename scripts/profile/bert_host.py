"""BERT-base training step (bench bert's, ours, seq 128, 51% padding): host time vs kernel time, then cProfile.

    PYTHONPATH=.:kernels python scripts/profile/bert_host.py   # on a CUDA GPU
"""
import cProfile, pstats, io, time
import torch
from flash_models.bench.bert import build_pair, make_batch, _step_fns
dev = torch.device('cuda')
hf, ours = build_pair('bert-base', dtype=torch.bfloat16, device=dev, dry_run=False)
ids, mask = make_batch(128, 128, 0.5, hf.config.vocab_size, dev)
ours.train()
_, training = _step_fns(ours, ids, mask, is_hf=False)
for _ in range(5): training()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(10): training()
t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"host per step {(t1 - t) * 100:.2f} ms, wall {(t2 - t) * 100:.2f} ms")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5): training()
    torch.cuda.synchronize()
print("kernel ms/step", sum(e.time_range.end - e.time_range.start for e in prof.events() if e.device_type.name == 'CUDA') / 5e3)
pr = cProfile.Profile(); pr.enable()
for _ in range(10): training()
pr.disable(); torch.cuda.synchronize()
for key in ('tottime', 'cumulative'):
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
    print(s.getvalue()[:9000])
