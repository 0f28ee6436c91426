"""CUDA tensors over NCCL, on one GPU (NCCL refuses two ranks on one device, so np=1).

Needs a GPU: skipped cleanly without one (CI has none). Each rank function tries every case and
records its result or its error, so that one run on a lent GPU shows every failure at once.
"""

from __future__ import annotations

import os

import pytest
import torch

from sparkhvd import HorovodRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# NCCL's own types, and the ones gloo widens on CPU (int16, bool): CUDA must take them too.
DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")
OPS = ("Sum", "Average", "Min", "Max", "Product")


def _failures(out: dict) -> list:
    return [f"{k}: {v}" for k, v in out.items() if isinstance(v, str) and v.startswith("ERROR")]


def _every_op_and_dtype(dtypes, ops, device="cuda"):
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    out = {"nccl": hvd.nccl_built()}

    def case(key, fn):
        try:
            value = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            out[key] = value.cpu() if isinstance(value, torch.Tensor) else [v.cpu() for v in value]
        except Exception as e:  # noqa: BLE001 - every case's error is the test's report
            out[key] = f"ERROR {type(e).__name__}: {e}"

    for name in dtypes:
        dtype = getattr(torch, name)
        x = (torch.arange(6, device=device) % 2 + 1).to(dtype)
        big = (torch.arange(1 << 18, device=device) % 3).to(dtype)  # past any small-op path
        for op in ops:
            case(("allreduce", name, op), lambda: hvd.allreduce(x, op=getattr(hvd, op), name=f"ar.{name}.{op}"))
            case(("allreduce_", name, op), lambda: hvd.allreduce_(x.clone(), op=getattr(hvd, op)))
        case(("allreduce_big", name), lambda: hvd.allreduce(big, op=hvd.Sum))
        case(("async", name), lambda: hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum)))
        case(("grouped", name), lambda: hvd.grouped_allreduce([x, x[:3], big], op=hvd.Sum))
        case(("bcast", name), lambda: hvd.broadcast(x, root_rank=0))
        case(("bcast_", name), lambda: hvd.broadcast_(x.clone(), root_rank=0))
        case(("gather", name), lambda: hvd.allgather(x.view(3, 2)))
        case(("grouped_gather", name), lambda: hvd.grouped_allgather([x, x[:2]]))
        case(("alltoall", name), lambda: hvd.alltoall(x))
        case(("alltoall_splits", name), lambda: hvd.alltoall(x, splits=torch.tensor([6]))[0])
        case(("reducescatter", name), lambda: hvd.reducescatter(x, op=hvd.Sum))
        case(("grouped_reducescatter", name), lambda: hvd.grouped_reducescatter([x, x[:4]], op=hvd.Sum))
    case(("prescale",), lambda: hvd.allreduce(torch.ones(4, device=device), op=hvd.Sum, prescale_factor=3.0,
                                              postscale_factor=0.5))
    case(("prescale_half",), lambda: hvd.allreduce(torch.full((4,), 3.0, device=device, dtype=torch.float16),
                                                   op=hvd.Sum, prescale_factor=0.1))
    case(("received_splits",), lambda: hvd.alltoall(torch.ones(2, device=device),
                                                    splits=torch.tensor([2], device=device))[1])
    out["received_splits_device"] = hvd.alltoall(torch.ones(2, device=device),
                                                 splits=torch.tensor([2], device=device))[1].device.type
    case(("fp16",), lambda: hvd.allreduce(torch.ones(4, device=device), compression=hvd.Compression.fp16))
    out["poll"] = hvd.poll(h := hvd.allreduce_async(torch.ones(1 << 20, device=device))) in (True, False)
    hvd.synchronize(h)
    out["join"] = hvd.join()
    hvd.barrier()
    out["object"] = hvd.broadcast_object({"t": torch.ones(2, device=device)}, root_rank=0)["t"].device.type
    out["objects"] = len(hvd.allgather_object({"rank": hvd.rank()}))
    return out


def test_nccl_every_op_and_dtype_on_one_gpu():
    out = HorovodRunner(np=-1).run(_every_op_and_dtype, dtypes=DTYPES, ops=OPS)
    assert out["nccl"] > 0, "nccl_built() must give NCCL's version where CUDA tensors travel over it"
    assert not _failures(out), "\n".join(_failures(out))
    for name in DTYPES:
        dtype = getattr(torch, name)
        x = (torch.arange(6) % 2 + 1).to(dtype)
        big = (torch.arange(1 << 18) % 3).to(dtype)
        for op in OPS:
            assert torch.equal(out[("allreduce", name, op)], x), (name, op)
            assert torch.equal(out[("allreduce_", name, op)], x), (name, op)
        assert torch.equal(out[("allreduce_big", name)], big), name
        assert torch.equal(out[("async", name)], x), name
        assert all(torch.equal(a, b) for a, b in zip(out[("grouped", name)], [x, x[:3], big])), name
        assert torch.equal(out[("bcast", name)], x) and torch.equal(out[("bcast_", name)], x), name
        assert torch.equal(out[("gather", name)], x.view(3, 2)), name
        assert all(torch.equal(a, b) for a, b in zip(out[("grouped_gather", name)], [x, x[:2]])), name
        assert torch.equal(out[("alltoall", name)], x) and torch.equal(out[("alltoall_splits", name)], x), name
        assert torch.equal(out[("reducescatter", name)], x), name
        assert all(torch.equal(a, b) for a, b in zip(out[("grouped_reducescatter", name)], [x, x[:4]])), name
    assert torch.equal(out[("prescale",)], torch.full((4,), 1.5))
    # Horovod's CUDA kernels scale half precision by the factor rounded to half (its test_horovod_allreduce_prescale)
    assert torch.equal(out[("prescale_half",)], torch.full((4,), 3.0, dtype=torch.float16) *
                       torch.tensor(0.1, dtype=torch.float16))
    assert torch.equal(out[("received_splits",)], torch.tensor([2])) and out["received_splits_device"] == "cuda"
    assert torch.equal(out[("fp16",)], torch.ones(4))
    assert out["poll"] and out["join"] == 0 and out["object"] == "cuda" and out["objects"] == 1


def _training_on_cuda(device="cuda"):
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    out = {}
    for label, kwargs in (("sgd", {}), ("fp16", {"compression": hvd.Compression.fp16}),
                          ("accumulate", {"backward_passes_per_step": 2})):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1)).to(device)
        reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 1)).to(device)
        reference.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), **kwargs)
        plain = torch.optim.Adam(reference.parameters(), lr=0.01)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        passes = kwargs.get("backward_passes_per_step", 1)
        for step in range(4):
            x = torch.randn(32, 8, device=device)
            for m, o in ((model, opt), (reference, plain)):
                for _ in range(passes):
                    m(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        out[label] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    bn = hvd.SyncBatchNorm(4).to(device)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    y = bn(x)
    y.sum().backward()
    plain_bn = torch.nn.BatchNorm1d(4).to(device)
    out["sync_bn"] = (y - plain_bn(x)).abs().max().item()
    out["sync_bn_grad"] = x.grad.abs().sum().item() >= 0
    return out


def test_distributed_optimizer_and_sync_batch_norm_on_cuda_match_plain_torch():
    out = HorovodRunner(np=-1).run(_training_on_cuda)
    assert out["sgd"] < 1e-5 and out["accumulate"] < 1e-5, out  # a job of one: what plain torch does
    assert out["fp16"] < 1e-2, out  # fp16 compression rounds the gradients
    assert out["sync_bn"] < 1e-5 and out["sync_bn_grad"], out


def _adasum_on_cuda():
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._core import _adasum

    hvd.init()
    out = {}
    for name in ("float16", "float32", "float64"):  # a job of one: Adasum of one tensor is itself (times the scales)
        x = torch.arange(1.0, 7.0, device="cuda").to(getattr(torch, name))
        out[("allreduce", name)] = hvd.allreduce(x, op=hvd.Adasum).cpu()
        out[("scaled", name)] = hvd.allreduce(x, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5).cpu()
        out[("grouped", name)] = [t.cpu() for t in hvd.grouped_allreduce([x, x[:2]], op=hvd.Adasum)]
        out[("async", name)] = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Adasum)).cpu()
    g = torch.Generator().manual_seed(0)  # the math itself on the GPU against the CPU, over 8 synthetic ranks
    vectors = [torch.randn(1000, generator=g, dtype=torch.float64) for _ in range(8)]
    counts = [1, 499, 0, 500]
    cuda = [v.cuda() for v in vectors]
    out["tree_diff"] = (_adasum.tree(cuda, counts).cpu() - _adasum.tree(vectors, counts)).abs().max().item()
    out["tree_same_bits"] = torch.equal(_adasum.tree(cuda, counts), _adasum.tree(cuda, counts))
    out["hier_diff"] = (_adasum.hierarchical(cuda, counts, 2).cpu() -
                        _adasum.hierarchical(vectors, counts, 2)).abs().max().item()
    half = [v.half() for v in cuda]
    out["half_diff"] = (_adasum.tree(half, counts).cpu().double() - _adasum.tree([h.cpu() for h in half], counts)
                        .double()).abs().max().item()
    return out


def test_adasum_on_cuda():
    out = HorovodRunner(np=-1).run(_adasum_on_cuda)
    for name in ("float16", "float32", "float64"):
        x = torch.arange(1.0, 7.0).to(getattr(torch, name))
        assert torch.equal(out[("allreduce", name)], x) and torch.equal(out[("async", name)], x), name
        assert torch.equal(out[("scaled", name)], x), name
        assert all(torch.equal(a, b) for a, b in zip(out[("grouped", name)], [x, x[:2]])), name
    # float64 sums added in another order (tests/_adasum_oracle.py's bound: 3 levels * 4 * 500 * eps * 8 |v| ~ 1e-10)
    assert out["tree_diff"] < 1e-10 and out["hier_diff"] < 1e-10, out
    assert out["tree_same_bits"], out  # no atomics: every rank works out the same bits
    assert out["half_diff"] <= 2 ** -8 * 8, out  # float16: at most an ulp or so of values of about 8


def _device_view():
    import json
    import os

    import torch

    import sparkhvd.collective.torch as hvd

    before = torch.cuda.is_initialized()
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())  # Horovod's idiom
    t = torch.ones(3, device="cuda")
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
            "current": torch.cuda.current_device(), "tensor_device": t.device.index, "local_rank": hvd.local_rank(),
            "cuda_before_init": before, "warm": os.environ.get("SPARKHVD_WARM"),
            "placement": json.loads(os.environ["SPARKHVD_PLACEMENT"])["local_rank"],
            "sum": hvd.allreduce(t, op=hvd.Sum).sum().item()}


def test_horovods_device_idiom_and_a_forked_rank_from_the_warm_process_use_the_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    monkeypatch.delenv("SPARKHVD_WARM", raising=False)
    first = HorovodRunner(np=-1).run(_device_view)
    from sparkhvd.runner._warm import client as _warm_client
    from sparkhvd.runner._warm.key import zygote_key

    key = zygote_key()
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the first run starts the warm process in the background
        try:
            _warm_client.connect(key, timeout=5.0).close()
            break
        except OSError:
            time.sleep(0.2)
    second = HorovodRunner(np=-1).run(_device_view)
    for v in (first, second):
        assert v["local_rank"] == 0 and v["current"] == 0 and v["tensor_device"] == 0, v
        assert v["visible"] == os.environ["CUDA_VISIBLE_DEVICES"], v
        assert v["cuda_before_init"] is False, v  # the warm process never initialises CUDA
        assert v["sum"] == 3.0, v
    assert second["warm"] == "forked", second


def _elastic_on_cuda(marks):
    import signal

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < 6:
            if state.step == 3 and not os.path.exists(os.path.join(marks, "killed")):
                _commits.flush(60)
                open(os.path.join(marks, "killed"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator(device="cuda").manual_seed(state.step)
            x = torch.randn(16, 4, device="cuda", generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            state.step += 1
            state.commit()
        return {k: v.cpu() for k, v in model.state_dict().items()}

    return loop(state)


def test_a_restart_resumes_cuda_state_from_its_commit(tmp_path):
    once = tmp_path / "once"
    once.mkdir()
    open(once / "killed", "w").close()  # the reference run is never killed
    reference = HorovodRunner(np=-1).run(_elastic_on_cuda, marks=str(once))
    runner = HorovodRunner(np=-1, max_restarts=1)
    weights = runner.run(_elastic_on_cuda, marks=str(tmp_path))
    assert len(runner.last_result.restarts) == 1
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def _ddp_on_nccl(steps=5):
    import os
    import time

    import torch
    import torch.distributed as dist

    from sparkhvd._common import torch_ops

    dist.init_process_group("nccl")  # env://, as under torchrun
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # DDP's idiom: the rank's own GPU
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4).cuda(), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(32, 16, device="cuda")).pow(2).mean().backward()
        opt.step()
    torch.cuda.synchronize()
    # The flight recorder (the stall report's view of torch's collectives) holds no finished op as unfinished,
    # once NCCL's watchdog has seen them end; otherwise a long healthy NCCL run would look stalled.
    deadline = time.monotonic() + 5
    while torch_ops.snapshot()[1] < steps and time.monotonic() < deadline:  # NCCL's own recorder counts them
        time.sleep(0.1)
    found = torch_ops.snapshot()  # no progress since: the unfinished ops are read
    weights = [p.detach().cpu() for p in model.parameters()]
    del model, opt  # torch 2.13 can deadlock freeing DDP after its group is destroyed (docs/performance.md)
    dist.destroy_process_group()
    return {"device": torch.cuda.current_device(), "unfinished": found[0], "done": found[1], "weights": weights}


def test_ddp_on_nccl_and_the_torch_distributor_drop_in_on_the_gpu():
    from sparkhvd import TorchDistributor

    plain = HorovodRunner(np=-1).run(_ddp_on_nccl)
    dropin = TorchDistributor(num_processes=1, local_mode=True, use_gpu=True).run(_ddp_on_nccl)
    for out in (plain, dropin):
        print("flight recorder after DDP on NCCL:", {k: v for k, v in out.items() if k != "weights"})
        assert out["device"] == 0 and out["unfinished"] == [] and out["done"] >= 5, out
    for a, b in zip(plain["weights"], dropin["weights"]):
        assert torch.equal(a, b)


def _lightning_on_gpu():
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = L.Trainer(accelerator="gpu", devices=1, num_nodes=1, strategy="ddp", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=16))
    return type(trainer.strategy.cluster_environment).__name__, str(trainer.strategy.root_device)


def test_lightning_ddp_on_the_gpu():
    pytest.importorskip("lightning")
    environment, device = HorovodRunner(np=-1).run(_lightning_on_gpu)
    assert environment == "TorchElasticEnvironment" and device == "cuda:0"


def test_transforms_model_loader_predicts_on_the_gpu_spark_assigned_as_on_the_cpu(tmp_path):
    """TorchModel.transform's executor side (ml/_torch_predict.py, no pyspark): a task Spark gave GPU 0 loads the
    model file onto cuda:0, once, and predicts what the CPU does (to float32 rounding)."""
    pytest.importorskip("pyarrow")
    import cloudpickle
    import numpy as np

    from sparkhvd.ml._predict import device_for
    from sparkhvd.ml._torch_predict import load_for_predict

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    path = tmp_path / "model.pt"
    torch.save(net, path, pickle_module=cloudpickle)
    x = np.random.default_rng(0).normal(size=(4096, 8)).astype(np.float32)
    on_cpu = load_for_predict(str(path), None, "cpu")([x])[0]
    before = torch.cuda.memory_allocated(0)
    predict = load_for_predict(str(path), None, device_for(["0"]))
    assert torch.cuda.memory_allocated(0) > before  # the weights went to the GPU
    on_gpu = predict([x])[0]
    assert on_gpu.shape == (4096, 2) and on_gpu.dtype == np.float32
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)
