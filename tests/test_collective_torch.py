"""The first slice of the Horovod torch API, on real gloo process groups in real rank processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from sparkhvd import HorovodRunner


def _all_ops():
    """Every op, with inputs built from the rank; returns what each op gave on this rank."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"topology": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                        hvd.cross_size(), hvd.is_initialized())}
    for dtype in (torch.int32, torch.int64, torch.float32, torch.float64):
        for dims in (1, 2, 3):
            x = (torch.arange(4 ** dims) + 1 + 10 * r).to(dtype).reshape([4] * dims)
            before = x.clone()
            out[("sum", dtype, dims)] = hvd.allreduce(x, op=hvd.Sum)
            out[("avg", dtype, dims)] = hvd.allreduce(x)  # Average is the default
            assert torch.equal(x, before)  # allreduce leaves its input alone
    out["legacy_average_false"] = hvd.allreduce(torch.tensor([1.0 + r]), average=False)
    out["scaled"] = hvd.allreduce(torch.tensor([1.0 + r]), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    y = torch.tensor([float(r)] * 3)
    hvd.allreduce_(y, op=hvd.Sum)
    out["inplace"] = y
    out["broadcast"] = hvd.broadcast(torch.tensor([r, r + 1]), root_rank=n - 1)
    z = torch.full((2, 2), float(r))
    hvd.broadcast_(z, root_rank=0)
    out["broadcast_"] = z
    out["allgather"] = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int64))  # uneven first dims
    out["allgather_scalar"] = hvd.allgather(torch.tensor(float(r)))
    out["object"] = hvd.broadcast_object({"from": r, "list": list(range(r + 1))}, root_rank=n - 1)
    hvd.barrier()
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, float(r))
    hvd.broadcast_parameters(model.named_parameters(), root_rank=n - 1)
    out["params_named"] = model.weight.detach().clone()
    torch.nn.init.constant_(model.weight, float(r))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out["params_state_dict"] = model.weight.detach().clone()
    torch.nn.init.constant_(model.bias, float(r))
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=n - 1)
    out["params_list"] = model.bias.detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["opt_lr"] = opt.param_groups[0]["lr"]
    out["opt_state"] = opt.state_dict()["state"][0]["exp_avg"].clone()
    errors = {}
    for name, call in {
        "root": lambda: hvd.broadcast(torch.ones(1), root_rank=n),
        "op": lambda: hvd.allreduce(torch.ones(1), op=17),
        "both": lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum, average=True),
        "not_tensor": lambda: hvd.allreduce([1, 2]),
        "params": lambda: hvd.broadcast_parameters(42),
        "params_value": lambda: hvd.broadcast_parameters({"w": 3}),
        "opt": lambda: hvd.broadcast_optimizer_state("adam"),
        "allgather_dims": lambda: hvd.allgather(torch.ones([2] * (r + 1))),
    }.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
    out["errors"] = errors
    hvd.shutdown()
    out["after_shutdown"] = hvd.is_initialized()
    hvd.init()  # a second init in the same process gets fresh rendezvous keys
    out["reinit_sum"] = hvd.allreduce(torch.tensor([1]), op=hvd.Sum)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return HorovodRunner(np=-2).run_all(_all_ops).values


def test_topology(two_ranks):
    assert [v["topology"] for v in two_ranks] == [(0, 2, 0, 2, 0, 1, True), (1, 2, 1, 2, 0, 1, True)]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_allreduce_sum_and_average(two_ranks, dtype, dims):
    base = torch.arange(4 ** dims) + 1
    expected_sum = (2 * base + 10).to(dtype).reshape([4] * dims)
    expected_avg = (expected_sum // 2) if not dtype.is_floating_point else expected_sum / 2
    for v in two_ranks:
        assert v[("sum", dtype, dims)].dtype == dtype
        assert torch.equal(v[("sum", dtype, dims)], expected_sum)
        assert torch.equal(v[("avg", dtype, dims)], expected_avg.to(dtype))


def test_allreduce_variants(two_ranks):
    for v in two_ranks:
        assert torch.equal(v["legacy_average_false"], torch.tensor([3.0]))
        assert torch.equal(v["scaled"], torch.tensor([3.0]))  # (1*2 + 2*2) * 0.5
        assert torch.equal(v["inplace"], torch.tensor([1.0, 1.0, 1.0]))


def test_broadcast_allgather_object(two_ranks):
    for v in two_ranks:
        assert torch.equal(v["broadcast"], torch.tensor([1, 2]))
        assert torch.equal(v["broadcast_"], torch.zeros(2, 2))
        assert torch.equal(v["allgather"], torch.tensor([[0, 0], [1, 1], [1, 1]]))
        assert torch.equal(v["allgather_scalar"], torch.tensor([0.0, 1.0]))
        assert v["object"] == {"from": 1, "list": [0, 1]}


def test_broadcast_parameters_accepts_every_form(two_ranks):
    for v in two_ranks:
        assert torch.equal(v["params_named"], torch.ones(2, 3))
        assert torch.equal(v["params_state_dict"], torch.zeros(2, 3))
        assert torch.equal(v["params_list"], torch.ones(2))


def test_broadcast_optimizer_state(two_ranks):
    assert [v["opt_lr"] for v in two_ranks] == [0.01, 0.01]
    assert torch.equal(two_ranks[0]["opt_state"], two_ranks[1]["opt_state"])


def test_errors_name_the_values_and_the_fix(two_ranks):
    errors = two_ranks[0]["errors"]
    assert errors["root"] == "ValueError: root_rank=2 is outside the ranks 0..1 of this job."
    assert errors["op"].startswith("ValueError: op=17 is not a reduction; use hvd.Average")
    assert "pass only op=hvd.Average or op=hvd.Sum" in errors["both"]
    assert errors["not_tensor"] == "TypeError: allreduce takes a torch.Tensor, got list."
    assert "broadcast_parameters takes a state_dict" in errors["params"]
    assert "'w' is a int, not a tensor; broadcast non-tensor values with hvd.broadcast_object" in errors["params_value"]
    assert "broadcast_optimizer_state takes a torch.optim.Optimizer, got str" in errors["opt"]
    assert re.fullmatch(
        r"HorovodInternalError: ranks disagree on the \d+(st|nd|rd|th) unnamed allgather: rank 0: allgather\(float32\[\*\] "
        r"on cpu\); rank 1: allgather\(float32\[\*, 2\] on cpu\)\. Every rank must call the ops of a name \(unnamed ops "
        r"are matched in the order each rank calls them\) with the same dtype, device and dimensions after the first "
        r"\(and the same op and root_rank\)\.", errors["allgather_dims"])
    assert errors.keys() == two_ranks[1]["errors"].keys()


def test_shutdown_and_reinit(two_ranks):
    for v in two_ranks:
        assert v["after_shutdown"] is False
        assert torch.equal(v["reinit_sum"], torch.tensor([2]))


def _train(batches, rank=0, size=1, lr=0.1):
    """SGD on a fixed model; with size>1 inside a run, through DistributedOptimizer."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if size > 1:
        import sparkhvd.collective.torch as hvd

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _batches(seed=0, steps=5, rows=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(steps)]


def test_distributed_optimizer_matches_single_process_on_concatenated_batches():
    shards = [_batches(seed=1), _batches(seed=2)]

    def train(shards):
        import sparkhvd.collective.torch as hvd

        hvd.init()
        return _train(shards[hvd.rank()], hvd.rank(), hvd.size())

    values = HorovodRunner(np=-2).run_all(train, shards=shards).values
    together = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*shards)]
    expected = _train(together)
    for weights in values:
        for got, want in zip(weights, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_distributed_optimizer_errors():
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        model = torch.nn.Linear(2, 1)
        other = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        errors = []
        for call in (lambda: hvd.DistributedOptimizer("sgd"),
                     lambda: hvd.DistributedOptimizer(opt, named_parameters=other.named_parameters()),
                     lambda: hvd.DistributedOptimizer(opt, named_parameters=[("a", p) for p in model.parameters()]),
                     lambda: hvd.DistributedOptimizer(opt, op=hvd.Max)):
            try:
                call()
            except Exception as exc:  # noqa: BLE001
                errors.append(str(exc))
        wrapped = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        model(torch.ones(1, 2)).sum().backward()
        with wrapped.skip_synchronize():
            wrapped.step()
        return errors, type(wrapped).__name__, isinstance(wrapped, torch.optim.SGD)

    errors, name, is_sgd = HorovodRunner(np=-1).run(train)
    assert errors[0] == "DistributedOptimizer wraps a torch.optim.Optimizer, got str."
    assert "2 of the optimizer's 2 parameters are not in it" in errors[1]
    assert "named_parameters has duplicate names ['a']" in errors[2]
    assert "op=hvd.Average, hvd.Sum or hvd.Adasum, got Max" in errors[3]
    assert (name, is_sgd) == ("SGD", True)


def test_init_outside_the_runner_is_a_job_of_one():
    code = textwrap.dedent("""
        import torch, sparkhvd.collective.torch as hvd
        hvd.init()
        print(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.allreduce(torch.tensor([3.0])).item())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["0", "1", "0", "3.0"], out.stderr


def test_init_before_anything_is_a_clear_error():
    code = "import sparkhvd.collective.torch as hvd\ntry:\n    hvd.rank()\nexcept ValueError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "sparkhvd has not been initialized; call hvd.init() first."


@pytest.mark.timeout(180)
def test_init_joins_a_torchrun_job(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, sparkhvd.collective.torch as hvd
        hvd.init()
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
        print(f"RESULT {hvd.rank()} {hvd.size()} {hvd.local_rank()} {hvd.local_size()} {total.item()}")
    """))
    import socket

    with socket.socket() as s:  # torchrun needs a concrete port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             "--master-addr=127.0.0.1", f"--master-port={port}", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:  # leave no torchrun worker behind
            os.killpg(proc.pid, 9)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    import re

    results = sorted(re.findall(r"RESULT \d \d \d \d [\d.]+", out.stdout))  # ranks share one pipe
    assert results == ["RESULT 0 2 0 2 3.0", "RESULT 1 2 1 2 3.0"], out.stdout + out.stderr


def test_optimizer_wrapped_after_an_lr_scheduler_still_averages_and_stays_in_sync():
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(model.weight, 0.0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0 if hvd.rank() == 0 else 5.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # made before wrapping
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # load_state_dict on rank 1
        for _ in range(2):
            opt.zero_grad()
            (model(torch.ones(1, 1)) * (hvd.rank() + 1)).sum().backward()  # grads 1 and 2: average 1.5
            opt.step()
            sched.step()
        return model.weight.item(), opt.param_groups[0]["lr"], sched.get_last_lr()[0]

    values = HorovodRunner(np=-2).run_all(train).values
    assert values[0] == values[1] == (-1.5 * 1.0 - 1.5 * 0.5, 0.25, 0.25)


def test_wrapping_twice_or_a_patched_step_is_refused():
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        model = torch.nn.Linear(1, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        errors = []
        try:
            hvd.DistributedOptimizer(opt)
        except ValueError as exc:
            errors.append(str(exc))
        other = torch.optim.SGD(model.parameters(), lr=0.1)
        other.step = lambda closure=None: None
        try:
            hvd.DistributedOptimizer(other)
        except ValueError as exc:
            errors.append(str(exc))
        return errors, type(other).__name__

    errors, name = HorovodRunner(np=-1).run(train)
    assert errors[0] == "this optimizer is already a DistributedOptimizer; wrap the original optimizer once."
    assert "has its own step attribute" in errors[1] and "wrap the optimizer with DistributedOptimizer before" in errors[1]
    assert name == "SGD"  # a refused wrap leaves the optimizer as it was
