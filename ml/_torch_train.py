"""TorchEstimator's training loop, on every rank (horovod/spark/torch/remote.py's, on sparkhvd).

Each rank loads the model and optimizer from the run's directory (the newest checkpoint's state
on top: the one the fit resumes, or one written since, after a restart), wraps the optimizer in
``hvd.DistributedOptimizer``, and trains: with restarts under ``hvd.elastic.run``, where the state
(weights, optimizer, epoch, batch, the epoch's running sums) is committed every
``batches_per_commit`` steps, and a relaunched rank resumes the reader at the committed batch.
Rank 0 writes a checkpoint after every epoch where a later fit of the run or a relaunch may resume from it (a
``run_id``, ``max_restarts``), else after the last only (``FitSpec.checkpoints``). The tensor helpers here are shared with the
driver's dry run (``_torch.py``), which imports this module, never the reverse.
"""

from __future__ import annotations

import types

import numpy as np

from ._batches import epoch_batches, steps
from ._checkpoints import RunDir
from ._spec import FitSpec

INITIAL = "initial.pt"  # the model and optimizer as given, pickled together (the optimizer holds the parameters)
CHECKPOINT = "checkpoint.pt"  # in each checkpoint directory: the state dicts, the epoch, the history
MODEL = "model.pt"  # the fitted model, whole, in a save; a fit writes model-<digest>.pt (RunDir.write_model)


def column_tensor(values, dtype, shape, torch, device=None):
    """``values`` (a column of a batch) as a ``(rows, *shape)`` tensor of ``dtype``; read-only Arrow memory is copied."""
    array = np.ascontiguousarray(values, dtype=dtype)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array.reshape((len(array), *shape))).to(device)


def feature_tensors(batch: dict, features, input_shapes, torch, device=None) -> list:
    """The model's inputs from a batch of columns: float32, each reshaped to ``(rows, *shape)``."""
    return [column_tensor(batch[column.name], np.float32, shape, torch, device)
            for column, shape in zip(features, input_shapes)]


def label_tensors(batch: dict, labels, torch, device=None) -> list:
    """The labels: integer columns as int64 (class indices), others as float32, each ``(rows, *shape)``."""
    return [column_tensor(batch[column.name], np.int64 if column.integer else np.float32, column.shape, torch, device)
            for column in labels]


def as_outputs(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def matched(outputs: list, labels: list) -> list:
    """Labels reshaped to their output's shape where they hold as many values (horovod.spark's rule)."""
    return [label.reshape(output.shape) if output.shape.numel() == label.shape.numel() and output.shape != label.shape
            else label for output, label in zip(outputs, labels)]


def _device(use_gpu: bool, hvd, torch):
    if use_gpu and torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())  # the rank's own GPU (the runner pins it)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load(spec: FitSpec, device, torch):
    run = RunDir(spec.store, spec.run_id)
    fs = spec.store.filesystem
    with fs.open_input_file(spec.store.path_of(run.file_url(INITIAL))) as f:
        initial = torch.load(f, map_location="cpu", weights_only=False)
    model, optimizer = initial["model"], initial["optimizer"]
    model.to(device)
    epoch, history = 0, []
    newest = run.newest()  # after a restart, this fit's own newest
    if newest is not None:
        with fs.open_input_file(spec.store.path_of(f"{newest[1]}/{CHECKPOINT}")) as f:
            state = torch.load(f, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, history = state["epoch"], state["history"]
    return run, model, optimizer, epoch, history


def scaled_lr(state: dict, factor: float) -> dict:
    """An optimizer state dict with every group's learning rate times ``factor``: horovod.spark trains with the lr
    times the ranks, and keeps the lr as given in its checkpoints (so a run resumed on other ranks rescales)."""
    groups = [{**group, "lr": group["lr"] * factor} if "lr" in group else group for group in state["param_groups"]]
    return {**state, "param_groups": groups}


def _loss(losses, weights, outputs, labels, sample_weights):
    """horovod.spark's loss: the weighted sum of each label's loss; with sample weights, each row's loss weighted."""
    total = 0
    for loss_fn, weight, output, label in zip(losses, weights, outputs, labels):
        if sample_weights is None:
            value = loss_fn(output, label)
        else:
            value = (loss_fn(output, label, reduction="none") * sample_weights.reshape(-1)).mean()
        total = total + weight * value
    return total


class _Fit:
    """One rank's fit: the model, its optimizer, the loss and metrics, and the loop that ``hvd.elastic.run`` runs."""

    def __init__(self, spec: FitSpec, framework: dict, hvd, torch, device, run: RunDir, model, optimizer):
        self.spec, self.data, self.hvd, self.torch, self.device, self.run = spec, spec.data, hvd, torch, device, run
        self.model, self.optimizer = model, optimizer
        self.losses = framework["losses"]
        self.loss_weights = framework["loss_weights"] or [1.0 / len(self.losses)] * len(self.losses)
        self.metrics = framework["metrics"]
        self.transform = framework["transformation_fn"]
        self.input_shapes = framework["input_shapes"]
        self.names = ["loss"] + [metric.__name__ if len(self.data.labels) == 1 else f"{metric.__name__}_{column.name}"
                                 for metric in self.metrics for column in self.data.labels]

    def tensors(self, batch):
        """A batch's inputs, labels and sample weights (or None), as tensors on the rank's device."""
        if self.transform is not None:
            batch = self.transform(batch)
        data, torch, device = self.data, self.torch, self.device
        inputs = feature_tensors(batch, data.features, self.input_shapes, torch, device)
        labels = label_tensors(batch, data.labels, torch, device)
        weights = None
        if data.weight is not None:
            weights = torch.as_tensor(batch[data.weight.name], dtype=torch.float32, device=device)
        return inputs, labels, weights

    def add(self, sums: dict, rows: int, loss, outputs, labels) -> dict:
        """``sums`` with a batch of ``rows`` rows added: its loss and metrics, weighted by rows."""
        values = [float(loss)] + [float(metric(output, label)) for metric in self.metrics
                                  for output, label in zip(outputs, labels)]
        added = {"rows": sums.get("rows", 0) + rows}
        added.update({name: sums.get(name, 0.0) + value * rows for name, value in zip(self.names, values)})
        return added

    def averaged(self, sums: dict) -> dict:
        """The epoch's loss and metrics per row, over every rank's rows (the same names on every rank)."""
        torch, hvd, names = self.torch, self.hvd, self.names
        values = torch.tensor([float(sums.get("rows", 0))] + [float(sums.get(name, 0.0)) for name in names],
                              dtype=torch.float64)
        totals = hvd.allreduce(values, op=hvd.Sum, name="sparkhvd.ml.epoch_sums")
        rows = max(totals[0].item(), 1.0)
        return {name: totals[i + 1].item() / rows for i, name in enumerate(names)}

    def validate(self, epoch: int) -> dict:
        """The validation loss and metrics, averaged over the ranks; empty without validation data."""
        data, spec, hvd, model = self.data, self.spec, self.hvd, self.model
        if data.val_url is None:
            return {}
        sums: dict = {}
        model.eval()
        with self.torch.no_grad():
            batches = epoch_batches(data.val_url, data.val_rows, rank=hvd.rank(), ranks=hvd.size(), epoch=0,
                                    batch_size=spec.val_batch_size, shuffle=False, seed=0, equal_steps=False,
                                    decode=data.decode)
            for step, (_, batch) in enumerate(batches):
                if spec.validation_steps_per_epoch is not None and step >= spec.validation_steps_per_epoch:
                    break
                inputs, labels, weights = self.tensors(batch)
                outputs = as_outputs(model(*inputs))
                labels = matched(outputs, labels)
                loss = _loss(self.losses, self.loss_weights, outputs, labels, weights)
                sums = self.add(sums, len(inputs[0]), loss, outputs, labels)
        return self.averaged(sums)

    def checkpoint(self, state, epoch: int) -> None:
        """Rank 0's checkpoint after ``epoch`` epochs: the state dicts (the lr as given), the epoch, the history."""
        torch, model, optimizer, hvd = self.torch, self.model, self.optimizer, self.hvd

        def write(out):
            torch.save({"model": model.state_dict(), "optimizer": scaled_lr(optimizer.state_dict(), 1 / hvd.size()),
                        "epoch": epoch, "history": state.history}, out)

        self.run.write_checkpoint(epoch, {CHECKPOINT: write})

    def loop(self, state):
        """The epochs left, from the state's epoch and batch (``hvd.elastic.run`` runs it again after a reset)."""
        spec, hvd = self.spec, self.hvd
        per_epoch = steps(self.data.train_rows, hvd.size(), spec.batch_size)
        if spec.train_steps_per_epoch is not None:
            per_epoch = min(per_epoch, spec.train_steps_per_epoch)
        if state.rank_sums is not None:  # resumed mid-epoch: this rank's own running sums
            state.sums = state.rank_sums[hvd.rank()] if len(state.rank_sums) == hvd.size() else {}
        for epoch in range(state.epoch, spec.epochs):
            self._train_epoch(state, epoch, per_epoch)
            self._end_epoch(state, epoch)
        return state.history

    def _train_epoch(self, state, epoch: int, per_epoch: int) -> None:
        """The epoch's steps from the state's on; with restarts, a commit every ``batches_per_commit`` steps."""
        spec, hvd, model, optimizer, data = self.spec, self.hvd, self.model, self.optimizer, self.data
        model.train()
        done = state.steps
        batches = epoch_batches(data.train_url, data.train_rows, rank=hvd.rank(), ranks=hvd.size(), epoch=epoch,
                                batch_size=spec.batch_size, shuffle=spec.shuffle, seed=spec.seed, skip=state.batch,
                                decode=data.decode)
        for consumed, batch in batches:
            if done >= per_epoch:
                break
            inputs, labels, weights = self.tensors(batch)
            outputs = as_outputs(model(*inputs))
            labels = matched(outputs, labels)
            loss = _loss(self.losses, self.loss_weights, outputs, labels, weights)
            (loss / spec.backward_passes_per_step if spec.backward_passes_per_step > 1 else loss).backward()
            done += 1
            if done % spec.backward_passes_per_step == 0:
                optimizer.step()
                optimizer.zero_grad()
            state.sums = self.add(state.sums, len(inputs[0]), loss.detach(), [o.detach() for o in outputs], labels)
            state.steps, state.batch = done, state.batch + consumed
            if spec.batches_per_commit and done % spec.batches_per_commit == 0 \
                    and done % spec.backward_passes_per_step == 0:
                # every rank's sums (the committed state is rank 0's): a collective, at the same step on every rank
                state.rank_sums = hvd.allgather_object(state.sums, name="sparkhvd.ml.commit_sums")
                state.commit()

    def _end_epoch(self, state, epoch: int) -> None:
        """The epoch's history entry and line; the state at the next epoch, checkpointed (rank 0) and committed."""
        spec, hvd = self.spec, self.hvd
        entry = {"epoch": epoch, "train": self.averaged(state.sums)}
        val = self.validate(epoch)
        if val:
            entry["validation"] = val
        state.history = [*state.history, entry]
        if spec.verbose and hvd.rank() == 0:
            shown = ", ".join(f"{k} {v:.6g}" for k, v in entry["train"].items())
            if val:
                shown += ", " + ", ".join(f"val_{k} {v:.6g}" for k, v in val.items())
            print(f"epoch {epoch + 1}/{spec.epochs}: {shown}", flush=True)
        state.epoch, state.batch, state.steps, state.sums, state.rank_sums = epoch + 1, 0, 0, {}, None
        if hvd.rank() == 0 and spec.checkpoints(epoch + 1):
            self.checkpoint(state, epoch + 1)
        if spec.batches_per_commit:
            state.commit()


def train(spec: FitSpec, framework: dict):
    """Fit the run's model on this rank's shards; rank 0 returns the history, the others None."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    if spec.random_seed is not None:
        torch.manual_seed(spec.random_seed)
    device = _device(spec.use_gpu, hvd, torch)
    run, model, optimizer, start_epoch, history = _load(spec, device, torch)
    optimizer.load_state_dict(scaled_lr(optimizer.state_dict(), hvd.size()))  # horovod.spark's scaling rule
    compression = framework["compression"] or hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                         backward_passes_per_step=spec.backward_passes_per_step)
    fields = dict(model=model, optimizer=optimizer, epoch=start_epoch, batch=0, steps=0, history=history, sums={},
                  rank_sums=None)
    fit = _Fit(spec, framework, hvd, torch, device, run, model, optimizer)
    if spec.batches_per_commit:  # restarts: the state is committed, and a relaunched rank resumes from it
        history = hvd.elastic.run(fit.loop)(hvd.elastic.TorchState(**fields))
    else:  # nothing to resume or sync: every rank loaded the same files
        history = fit.loop(types.SimpleNamespace(**fields))
    return history if hvd.rank() == 0 else None
