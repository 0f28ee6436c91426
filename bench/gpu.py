"""Benchmark (not a test): CUDA tensors on one GPU, ours against raw NCCL and plain torch.

One rank on the driver (``HorovodRunner(np=-1)``; NCCL refuses two ranks on one device), in
the same process and on the same NCCL group, timed alternately:
  allreduce  hvd.allreduce_(t, op=hvd.Sum)  against  dist.all_reduce(t), fp32, 4 KB to 256 MB
  resnet50   hvd.grouped_allreduce_ of ResNet-50's 161 gradient shapes  against  one
             dist.all_reduce per tensor
  training   Horovod's synthetic protocol (a fixed random batch, img/s) on torchvision's
             ResNet-50 when it is installed (else a small conv net): hvd.DistributedOptimizer
             against the plain optimizer, stepping the same model in turns
At np=1 the data op is NCCL's copy of one rank's buffer, so the ratios measure what sparkhvd
adds on the way (negotiation, handles, scaling). Needs a CUDA device.

    python bench/gpu.py [--reps 20] [--max-mb 256] [--iters 10]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _bench(max_mb: int, reps: int, iters: int, shapes: list) -> dict:
    import torch
    import torch.distributed as dist

    import sparkhvd.collective.torch as hvd

    hvd.init()
    assert torch.cuda.is_available(), "bench/gpu.py needs a CUDA device"

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def pair(ours, raw, n) -> tuple:
        ours(), raw()  # warm-up: NCCL's communicator, the engine's first op
        a, b = [], []
        for i in range(n):
            first, second = (ours, raw) if i % 2 == 0 else (raw, ours)
            t1, t2 = timed(first), timed(second)
            (a if first is ours else b).append(t1)
            (b if first is ours else a).append(t2)
        return statistics.median(a), statistics.median(b)

    rows = {"allreduce": [], "resnet50": None, "training": None, "device": torch.cuda.get_device_name(),
            "nccl": hvd.nccl_built(), "torch": torch.__version__}
    nbytes = 4096
    while nbytes <= max_mb << 20:
        t = torch.ones(nbytes // 4, device="cuda")
        ours, raw = pair(lambda: hvd.allreduce_(t, op=hvd.Sum), lambda: dist.all_reduce(t), reps)
        rows["allreduce"].append((nbytes, ours, raw))
        nbytes *= 8
    grads = [torch.ones(s, device="cuda") for s in shapes]
    rows["resnet50"] = pair(lambda: hvd.grouped_allreduce_(grads, op=hvd.Sum),
                            lambda: [dist.all_reduce(g) for g in grads], max(3, reps // 4))
    try:
        import torchvision
        model, shape, label = torchvision.models.resnet50().cuda(), (32, 3, 224, 224), "ResNet-50, batch 32"
    except ImportError:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                    torch.nn.Flatten(), torch.nn.Linear(64, 1000)).cuda()
        shape, label = (32, 3, 64, 64), "small conv net, batch 32"
    data, target = torch.randn(*shape, device="cuda"), torch.randint(0, 1000, (shape[0],), device="cuda")
    plain = torch.optim.SGD(model.parameters(), lr=0.01)
    ours = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    named_parameters=model.named_parameters())

    def step(opt):
        def run():
            for _ in range(5):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(data), target).backward()
                opt.step()
        return run

    t_ours, t_plain = pair(step(ours), step(plain), iters)
    rows["training"] = (label, 5 * shape[0] / t_ours, 5 * shape[0] / t_plain)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-mb", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    from allreduce import resnet50_shapes  # bench/allreduce.py, beside this script

    from sparkhvd import HorovodRunner

    r = HorovodRunner(np=-1).run(_bench, max_mb=args.max_mb, reps=args.reps, iters=args.iters,
                                 shapes=resnet50_shapes())
    print(f"{r['device']}, torch {r['torch']}, NCCL {r['nccl']}, np=1")
    print(f"{'allreduce fp32':>16} | {'ours ms':>9} | {'raw NCCL ms':>11} | ours/raw")
    for nbytes, ours, raw in r["allreduce"]:
        size = f"{nbytes >> 10} KB" if nbytes < 1 << 20 else f"{nbytes >> 20} MB"
        print(f"{size:>16} | {ours * 1e3:9.3f} | {raw * 1e3:11.3f} | {ours / raw:8.2f}")
    ours, raw = r["resnet50"]
    print(f"{'ResNet-50 grads':>16} | {ours * 1e3:9.3f} | {raw * 1e3:11.3f} | {ours / raw:8.2f}"
          "  (ours fused, raw one op per tensor)")
    label, ours, plain = r["training"]
    print(f"training {label}: ours {ours:.1f} img/s, plain torch {plain:.1f} img/s, ours/plain {ours / plain:.3f}")


if __name__ == "__main__":
    main()
