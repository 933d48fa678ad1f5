"""Autograd multithreading on/off: BERT training step (bench bert's) and GPT-2 Trainer step, ours and HF.

    PYTHONPATH=.:kernels python scripts/profile/backward_thread.py   # on a CUDA GPU

The bench and the Trainer now choose the thread themselves; both choices are disabled here so that the outer
``set_multithreading_enabled`` decides (as when this first ran, before they made it).
"""
import contextlib
import statistics
import torch
import flash_models.bench.bert as bench_bert
from flash_models.bench.bert import build_pair, make_batch, _step_fns
from flash_models.bench.utils import time_fn
from flash_models.bench.train import CASES, trainer_for
dev = torch.device('cuda')
bench_bert.backward_on_this_thread = contextlib.nullcontext
hf, ours = build_pair('bert-base', dtype=torch.bfloat16, device=dev, dry_run=False)
for seq, pad in ((128, 0.0), (512, 0.0), (128, 0.5)):
    ids, mask = make_batch(16384 // seq, seq, pad, hf.config.vocab_size, dev)
    for name, m in (('hf', hf), ('ours', ours)):
        m.train()
        _, training = _step_fns(m, ids, mask, is_hf=name == 'hf')
        res = {}
        for mt in (True, False, True, False):
            with torch.autograd.set_multithreading_enabled(mt):
                res.setdefault(mt, []).append(time_fn(training, device=dev, warmup=5, repeats=20).median_ms)
        print(f"bert seq {seq} pad {pad} {name}: mt on {res[True]} off {res[False]}", flush=True)
del hf, ours
for side in ('ours', 'hf'):
    tr = trainer_for(side, CASES['gpt2'], dev)
    tr._backward_thread = contextlib.nullcontext
    tr.train_step()
    for mt in (True, False, True, False):
        with torch.autograd.set_multithreading_enabled(mt):
            recs = list(tr.iter_steps(tr.step + 8))[3:]
        print(f"gpt2 {side} mt {mt}: {statistics.median(r['seconds'] for r in recs) * 1e3:.2f} ms", flush=True)
    del tr
    torch.cuda.empty_cache()
