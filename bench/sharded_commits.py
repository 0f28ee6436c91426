"""Benchmark (not a test): what a sharded commit costs, against torch.distributed.checkpoint.save in the same run.

An FSDP2 model (``fully_shard`` on each of ``--layers`` Linear(4096, 4096) layers and the whole) with SGD and
momentum, so about 1 GB of state at the default 8 layers (536 MB of float32 weights, as much momentum), in
``hvd.elastic.TorchState`` under ``HorovodRunner(np=-N, run_id=, storage=)``: every rank holds 1/N of it.
Interleaved in the same ranks, ``--repeats`` times each (median reported, the slowest rank's time each time):

- ours: ``state.commit()``, the time it blocks the training loop (this rank's copy of its shard, every rank's
  ``dcp.save`` into the run's folder, the digests of the files), then the time until the commit is safe: rank 0's
  manifest entry has reached the driver (``commits.flush()``), so a new driver resumes from it;
- peers: ``dcp.save`` of the same model and optimizer state dicts (``get_model_state_dict``,
  ``get_optimizer_state_dict``) into a folder of its own, what a user of DCP writes by hand; and
  ``dcp.async_save`` of them (on a gloo group of its own, as ours), the time it blocks and the time until its
  future's result (written, but known to no driver: a new driver could not find it).

Also reported: the bytes rank 0 sent the driver for the newest commit (its pickled plain values and the meta
naming the shards' folder and digests; the shards never pass through it) against the bytes of the shards in the folder. Everything goes under one temp folder,
removed at the end.

    python bench/sharded_commits.py                 # np=2 and np=4, 1 GB of state
    python bench/sharded_commits.py --np 2 --layers 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile

WIDTH = 4096


def rank_main(layers: int, repeats: int, raw_root: str) -> dict:
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits

    dist.init_process_group("gloo")
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    model(torch.randn(4, WIDTH)).sum().backward()
    opt.step()  # the momentum buffers exist
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 2  # weights and momentum
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    def slowest(seconds: float) -> float:
        return max(hvd.allgather_object(seconds))

    times: dict = {"blocked": [], "safe": [], "raw": [], "async_blocked": [], "async_safe": []}
    group = dist.new_group(backend="gloo")  # async_save's collectives, off the default group (as ours)
    for i in range(repeats):
        for side in ("ours", "raw", "async") if i % 2 == 0 else ("async", "raw", "ours"):
            hvd.barrier()
            start = time.perf_counter()
            if side == "ours":
                state.step += 1
                state.commit()
                blocked = time.perf_counter() - start
                if hvd.rank() == 0:
                    commits.flush(600)
                safe = time.perf_counter() - start
                times["blocked"].append(slowest(blocked))
                times["safe"].append(slowest(safe))
            elif side == "async":
                future = dcp.async_save({"model": get_model_state_dict(model),
                                         "optimizer": get_optimizer_state_dict(model, opt)},
                                        checkpoint_id=os.path.join(raw_root, f"async-{i}"), process_group=group)
                blocked = time.perf_counter() - start
                future.result()
                times["async_blocked"].append(slowest(blocked))
                times["async_safe"].append(slowest(time.perf_counter() - start))
            else:
                dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
                         checkpoint_id=os.path.join(raw_root, f"raw-{i}"))
                times["raw"].append(slowest(time.perf_counter() - start))
    del model, opt, state
    dist.destroy_process_group()
    return dict(times, state_bytes=state_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="sparkhvd-bench-sharded-")
    os.environ["SPARKHVD_LOG_ROOT"] = os.path.join(root, "logs")
    from sparkhvd import HorovodRunner

    rows = []
    try:
        for np_ in args.np:
            storage, raw = os.path.join(root, f"storage-{np_}"), os.path.join(root, f"raw-{np_}")
            runner = HorovodRunner(np=-np_, run_id=f"bench-{np_}", storage=storage, keep_commits=1)
            got = runner.run(rank_main, layers=args.layers, repeats=args.repeats, raw_root=raw)
            [kept] = runner.last_result.commits
            rows.append((np_, got, kept))
            shutil.rmtree(storage, ignore_errors=True)
            shutil.rmtree(raw, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nsharded commits, {platform.node()}, {os.cpu_count()} CPUs, torch FSDP2 on gloo, "
          f"{args.layers} x Linear({WIDTH}, {WIDTH}) + SGD momentum, median of {args.repeats}")
    print(f"{'np':>3} {'state MB':>9} {'shards MB':>9} {'to driver':>10} | {'ours blocks':>11} {'safe':>7} | "
          f"{'dcp.save':>8} | {'async blocks':>12} {'written':>7} | {'blocks/dcp.save':>15} {'blocks/async':>12} "
          f"{'safe/dcp.save':>13}")
    for np_, got, kept in rows:
        m = {k: statistics.median(v) for k, v in got.items() if isinstance(v, list)}
        print(f"{np_:>3} {got['state_bytes'] / 1e6:>9.0f} {kept['shards']['bytes'] / 1e6:>9.0f} "
              f"{kept['bytes'] + len(json.dumps(kept)):>8} B | {m['blocked']:>9.2f} s {m['safe']:>5.2f} s | "
              f"{m['raw']:>6.2f} s | {m['async_blocked']:>10.2f} s {m['async_safe']:>5.2f} s | "
              f"{m['blocked'] / m['raw']:>15.2f} {m['blocked'] / m['async_blocked']:>12.2f} "
              f"{m['safe'] / m['raw']:>13.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
