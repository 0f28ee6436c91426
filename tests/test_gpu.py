"""CUDA tensors over NCCL. Needs a GPU: skipped cleanly without one (CI has none)."""

from __future__ import annotations

import pytest
import torch

from sparkhvd import HorovodRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cuda_ops():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    out = {"device": torch.cuda.current_device(), "visible": torch.cuda.device_count()}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64):
        x = (torch.arange(6, device="cuda") + 1 + hvd.rank()).to(dtype)
        out[("sum", str(dtype))] = hvd.allreduce(x, op=hvd.Sum).cpu()
        out[("avg", str(dtype))] = hvd.allreduce(x).cpu()
        out[("bcast", str(dtype))] = hvd.broadcast(x, root_rank=0).cpu()
        out[("gather", str(dtype))] = hvd.allgather(x[: hvd.rank() + 1]).cpu()
    model = torch.nn.Linear(4, 1).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model(torch.ones(2, 4, device="cuda")).sum().backward()
    opt.step()
    out["weight"] = model.weight.detach().cpu()
    return out


def test_nccl_ops_and_optimizer_on_one_gpu():
    v = HorovodRunner(np=-1).run(_cuda_ops)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64):
        x = (torch.arange(6) + 1).to(dtype)
        assert torch.equal(v[("sum", str(dtype))], x)
        assert torch.equal(v[("avg", str(dtype))], x)
        assert torch.equal(v[("bcast", str(dtype))], x)
        assert torch.equal(v[("gather", str(dtype))], x[:1])
    assert v["weight"].shape == (1, 4)
