"""runtime.cuda_graphs.GraphedInference (per-signature graphs with static input buffers) and the ViT's
``use_cuda_graphs``. Off CUDA the graph cache runs the same static buffers eagerly, which is what the CPU tests
check (bookkeeping, copies, clones); the real capture is the gpu-marked test."""

import pytest
import torch

import flash_models as fm
from flash_models.runtime.cuda_graphs import GraphedInference, WeightsWatch, replays_graph

from test_vit import images, timm_vit


class _Recorder:
    """fn(x, y) -> (x * 2 + y, None, x.sum()), counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, y):
        self.calls += 1
        return x * 2 + y, None, x.sum()


def test_outputs_follow_each_call_and_are_fresh_tensors():
    fn = _Recorder()
    graphed = GraphedInference(fn, torch.nn.Linear(1, 1))
    for seed in range(3):
        x, y = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed)), torch.randn(5)
        out, nothing, total = graphed(x, y)
        assert torch.equal(out, x * 2 + y) and nothing is None and torch.equal(total, x.sum())
        out.zero_()  # a caller's change must not reach the graph's buffers
    assert len(graphed.graphs) == 1
    out, _, _ = graphed(x, y)
    assert torch.equal(out, x * 2 + y)


def test_one_graph_per_signature_and_the_oldest_dropped():
    graphed = GraphedInference(_Recorder(), torch.nn.Linear(1, 1), max_graphs=2)
    for rows in (1, 2, 1, 3):
        graphed(torch.ones(rows, 5), torch.ones(5))
    assert [sig[0][0] for sig in graphed.graphs] == [(1, 5), (3, 5)]  # (2, 5) was the least recently used
    graphed(torch.ones(1, 5, dtype=torch.float64), torch.ones(5, dtype=torch.float64))
    assert [sig[0][1] for sig in graphed.graphs] == [torch.float32, torch.float64]


def test_weights_watch_notices_a_move_once():
    layer = torch.nn.Linear(5, 3)
    watch = WeightsWatch(layer)
    assert not watch.moved()
    layer.load_state_dict({k: v * 2 for k, v in layer.state_dict().items()})  # in place: graphs stay valid
    assert not watch.moved()
    layer.half()
    assert watch.moved() and not watch.moved()


def test_moving_the_weights_drops_the_graphs():
    """Graphs read the weights at their capture-time addresses: after model.to()/.half() they are captured anew.
    (Off CUDA a kept graph would recompute into its old float32 buffers: the output's dtype tells them apart.)"""
    layer = torch.nn.Linear(5, 3)
    graphed = GraphedInference(lambda x: (layer(x.to(layer.weight.dtype)),), layer)
    x = torch.randn(2, 5)
    assert graphed(x)[0].dtype == torch.float32
    layer.to(torch.float64)
    (out,) = graphed(x)
    assert out.dtype == torch.float64 and len(graphed.graphs) == 1
    torch.testing.assert_close(out, layer(x.double()))


def test_max_graphs_must_be_positive():
    with pytest.raises(ValueError, match="max_graphs must be at least 1"):
        GraphedInference(_Recorder(), torch.nn.Linear(1, 1), max_graphs=0)


def test_vit_use_cuda_graphs_toggles_and_keeps_cpu_and_training_eager():
    model = fm.from_timm(timm_vit(seed=2)).eval()
    assert model.use_cuda_graphs() is model and model.graphed is not None
    x = images(seed=2)
    with torch.inference_mode():
        out = model(x)
    assert len(model.graphed.graphs) == 0  # CPU input: eager
    assert model.use_cuda_graphs(False).graphed is None
    with torch.inference_mode():
        assert torch.equal(model(x).logits, out.logits)


def test_vit_labels_without_a_head_raise_before_any_work():
    model = fm.from_timm(timm_vit(num_classes=0))
    with pytest.raises(ValueError, match="no classification head"):
        model(images(), labels=torch.tensor([0, 1]))


@pytest.mark.gpu
def test_vit_graphed_inference_equals_eager_on_cuda():
    model = fm.from_timm(timm_vit(seed=3)).to("cuda", torch.bfloat16).eval()
    batches = [images(batch, seed).to("cuda", torch.bfloat16) for batch, seed in ((4, 0), (4, 1), (3, 2))]
    with torch.inference_mode():
        eager = [model(x) for x in batches]
        model.use_cuda_graphs()
        graphed = [model(x) for x in batches]
    assert len(model.graphed.graphs) == 2  # batch 4 (twice, one graph) and batch 3
    for e, g in zip(eager, graphed):
        for name in ("logits", "last_hidden_state", "pooler_output"):
            torch.testing.assert_close(getattr(g, name), getattr(e, name))
    with torch.no_grad():  # no_grad takes the graphs too; clones are ordinary tensors
        out = model(batches[0], labels=torch.tensor([0, 1, 2, 3], device="cuda"))
    assert not out.logits.is_inference() and out.loss is not None
    torch.testing.assert_close(out.logits, eager[0].logits)
    model.float()  # moving the weights drops the bf16 graphs; the next call captures an fp32 one
    with torch.inference_mode():
        out = model(batches[0].float())
    assert out.logits.dtype == torch.float32 and len(model.graphed.graphs) == 1
    torch.testing.assert_close(out.logits, eager[0].logits.float(), atol=0.1, rtol=0.05)


class _CudaLike:
    """Stands in for a CUDA tensor in the decision below (only ``is_cuda`` is read)."""

    is_cuda = True


def test_graphs_are_taken_only_in_eval_mode_without_autograd_on_cuda_and_not_while_compiling(monkeypatch):
    module, graphed = torch.nn.Linear(1, 1).eval(), object()
    assert not replays_graph(module, graphed, _CudaLike())  # grad mode on
    with torch.no_grad():
        assert replays_graph(module, graphed, _CudaLike())
        assert not replays_graph(module, None, _CudaLike())
        assert not replays_graph(module, graphed, torch.zeros(1))  # CPU input
        assert not replays_graph(module.train(), graphed, _CudaLike())
        module.eval()
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not replays_graph(module, graphed, _CudaLike())
