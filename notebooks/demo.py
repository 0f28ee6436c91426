# %% [markdown]
# # sparkhvd demo: Horovod-style training, run by Spark
#
# A notebook in percent format (open it in Jupyter with jupytext, or run it as a script:
# `make demo`). It trains a small regression model on synthetic data with two ranks in a
# Spark barrier stage on an embedded `local[2]` session.

# %%
import time

from sparkhvd import HorovodRunner


def train(lr=0.05, epochs=5, rows=4096):
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # different initial weights on each rank...
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # ...made equal here
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    g = torch.Generator().manual_seed(0)  # the same synthetic data set on every rank
    x = torch.randn(rows, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(rows, 1, generator=g)
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]  # this rank's part

    for epoch in range(epochs):
        for i in range(0, len(x), 64):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[i:i + 64]), y[i:i + 64])
            loss.backward()
            opt.step()
        epoch_loss = hvd.allreduce(torch.nn.functional.mse_loss(model(x), y).detach())
        if hvd.rank() == 0:
            print(f"epoch {epoch} loss {epoch_loss:.4f}")  # appears live as "[0] epoch ..."
    return {k: v.tolist() for k, v in model.state_dict().items()} if hvd.rank() == 0 else None


# %%
if __name__ == "__main__":
    started = time.monotonic()
    weights = HorovodRunner(np=2).run(train, lr=0.05)
    print(f"rank 0 returned {len(weights)} tensors; last-layer bias = {weights['2.bias'][0]:.4f} "
          f"({time.monotonic() - started:.1f} s including Spark start-up)")
