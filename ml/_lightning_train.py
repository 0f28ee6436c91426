"""LightningEstimator's training, on every rank: Lightning's own ``Trainer`` with DDP over the runner's ranks.

Each rank loads the module from the run's directory and hands ``trainer.fit`` the newest
checkpoint (Lightning resumes its epoch, optimizer and loops from it). The loaders yield this
rank's batches of the epoch Lightning is in, every row once and the same number of steps on every
rank. After each epoch rank 0 writes Lightning's checkpoint, with the history so far, into the
store. With restarts, rank 0 also sends Lightning's checkpoint off the ranks as a commit
(``_common/commits.py``) every ``batches_per_commit`` steps and after each epoch; a relaunched
rank fetches the newest commit and resumes from it mid-epoch: the training loader is resumable
(Lightning keeps its ``state_dict``, the steps done, in the checkpoint), and skips those steps.
"""

from __future__ import annotations

import os
import tempfile

from .._common import commits, settings
from ._batches import epoch_batches, steps
from ._checkpoints import RunDir
from ._spec import FitSpec
from ._torch_train import INITIAL, column_tensor

CHECKPOINT = "checkpoint.ckpt"  # Lightning's own checkpoint (trainer.save_checkpoint), in each checkpoint directory
COMMIT = "sparkhvd.ml.lightning"  # the key of the fit's commits (Lightning's checkpoint, as bytes)


def lightning():
    """``lightning.pytorch``, or the sentence that says how to install it."""
    try:
        import lightning.pytorch as pl
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("Lightning isn't installed: pip install lightning") from exc
    return pl


class _Loader:
    """This rank's batches of the trainer's current epoch, as dicts of tensors: what training_step gets."""

    def __init__(self, spec: FitSpec, url: str, rows: int, batch_size: int, shuffle: bool, framework: dict, torch):
        self.spec, self.url, self.rows, self.batch_size, self.shuffle = spec, url, rows, batch_size, shuffle
        self.framework, self.torch = framework, torch
        self.trainer = None  # set by the callback at setup: the epoch, rank and size come from it
        self.epoch_offset = 0  # validation reads epoch 0 every time (no shuffle): the same rows each epoch

    def __len__(self) -> int:
        return steps(self.rows, self.trainer.world_size, self.batch_size)

    def __iter__(self):
        data, trainer, torch = self.spec.data, self.trainer, self.torch
        shapes = dict(zip((c.name for c in data.features), self.framework["input_shapes"]))
        transform = self.framework["transformation_fn"]
        epoch = trainer.current_epoch if self.shuffle else 0
        for _, batch in epoch_batches(self.url, self.rows, rank=trainer.global_rank, ranks=trainer.world_size,
                                      epoch=epoch, batch_size=self.batch_size, shuffle=self.shuffle,
                                      seed=self.spec.seed, skip=self._skip(), decode=data.decode):
            if transform is not None:
                batch = transform(batch)
            yield {name: _tensor(values, shapes.get(name), data, name, torch) for name, values in batch.items()}

    def _skip(self) -> int:
        return 0


class _TrainLoader(_Loader):
    """The training loader, resumable mid-epoch: Lightning keeps its ``state_dict`` (the epoch, the steps done) in a
    checkpoint and hands it back to ``load_state_dict`` when it resumes from one; the next epoch then starts that many
    steps in (a step reads one reader batch, except the last step of an epoch, after which the epoch is done)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.done = 0  # steps of the current epoch trained: set after each step by the callback
        self.resume: dict | None = None

    def state_dict(self) -> dict:
        return {"epoch": self.trainer.current_epoch, "steps": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.resume = state

    def _skip(self) -> int:
        resume, self.resume = self.resume, None
        return resume["steps"] if resume is not None and resume["epoch"] == self.trainer.current_epoch else 0


def _tensor(values, shape, data, name, torch):
    """A batch column as training_step gets it: labels int64 or float32 in their shape, others float32."""
    import numpy as np

    labels = {c.name: c for c in data.labels}
    if name in labels:
        return column_tensor(values, np.int64 if labels[name].integer else np.float32, labels[name].shape, torch)
    return column_tensor(values, np.float32, shape if shape is not None else (), torch)


class _StoreCheckpoint:
    """Hands the loaders the trainer; after each epoch, writes Lightning's checkpoint and the history to the store.

    The hooks of a ``pl.Callback``, mixed into one by ``_store_checkpoint`` (Lightning is imported in the ranks only).
    """

    def __init__(self, spec: FitSpec, run: RunDir, train_loader: _TrainLoader, val_loader: _Loader | None):
        self.spec, self.run, self.train_loader, self.val_loader = spec, run, train_loader, val_loader
        self.history = []
        self.commits = 0

    def setup(self, trainer, module, stage):
        self.train_loader.trainer = trainer
        if self.val_loader is not None:
            self.val_loader.trainer = trainer

    def on_save_checkpoint(self, trainer, module, checkpoint):
        checkpoint["sparkhvd_history"] = list(self.history)

    def on_load_checkpoint(self, trainer, module, checkpoint):
        self.history = list(checkpoint.get("sparkhvd_history", []))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train_loader.done = batch_idx + 1
        done, every = self.train_loader.done, self.spec.batches_per_commit
        # not inside a gradient accumulation: the gradients summed so far are in no checkpoint
        if every and done % every == 0 and done % trainer.accumulate_grad_batches == 0 \
                and done < trainer.num_training_batches:
            self._save(trainer, stored=False)

    def on_train_epoch_end(self, trainer, module):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        entry = {"epoch": trainer.current_epoch,
                 "train": {k: v for k, v in metrics.items() if not k.startswith("val")}}
        validation = {k: v for k, v in metrics.items() if k.startswith("val")}
        if validation:
            entry["validation"] = validation
        self.history.append(entry)
        if self.spec.verbose and trainer.is_global_zero:
            shown = ", ".join(f"{k} {v:.6g}" for k, v in metrics.items())
            print(f"epoch {trainer.current_epoch + 1}/{self.spec.epochs}: {shown}", flush=True)
        self._save(trainer, stored=self.spec.checkpoints(trainer.current_epoch + 1))

    def _save(self, trainer, stored: bool) -> None:
        """Lightning's checkpoint: into the store after an epoch (``stored``); with restarts, off the ranks too."""
        spec = self.spec
        if not (stored or spec.batches_per_commit):
            return
        with tempfile.TemporaryDirectory(prefix="sparkhvd-ckpt-") as folder:
            path = os.path.join(folder, CHECKPOINT)
            trainer.save_checkpoint(path, weights_only=False)  # every rank calls it; rank 0 writes; optimizer too
            if not trainer.is_global_zero:
                return
            with open(path, "rb") as f:
                blob = f.read()
        epoch = trainer.current_epoch + 1 if stored else trainer.current_epoch
        if stored:
            self.run.write_checkpoint(epoch, {CHECKPOINT: lambda out: out.write(blob)})
        if spec.batches_per_commit:
            self.commits += 1
            fields = {"epoch": epoch, "batch": 0 if stored else self.train_loader.done}
            commits.publish({"key": COMMIT, "seq": self.commits, "size": trainer.world_size, "fields": fields}, blob)


def _store_checkpoint(pl, *args) -> _StoreCheckpoint:
    """A ``_StoreCheckpoint`` that is a ``pl.Callback``: the class is made here, once Lightning is imported."""

    class StoreCheckpoint(_StoreCheckpoint, pl.Callback):
        """``_StoreCheckpoint`` as Lightning's callback."""

    return StoreCheckpoint(*args)


def _loaders(spec: FitSpec, framework: dict, torch) -> tuple[_TrainLoader, _Loader | None, int]:
    """The training loader, the validation one (None without validation data, or with fewer rows than ranks), the
    number of ranks."""
    data = spec.data
    train_loader = _TrainLoader(spec, data.train_url, data.train_rows, spec.batch_size, spec.shuffle, framework, torch)
    val_loader = None
    world = settings.WORLD_SIZE.get() or 1
    if data.val_url is not None and data.val_rows >= world:
        val_loader = _Loader(spec, data.val_url, data.val_rows, spec.val_batch_size, False, framework, torch)
    elif data.val_url is not None and spec.verbose and settings.RANK.get() in (None, 0):
        print(f"The validation data has {data.val_rows} row(s), fewer than the {world} ranks; training without "
              "validation: hold out more rows (a larger validation fraction) or use fewer processes.", flush=True)
    return train_loader, val_loader, world


def _resume_file(spec: FitSpec, fs, committed, newest, folder: str) -> str | None:
    """The checkpoint the fit resumes from (the last commit, else the newest stored one), as a file in ``folder``."""
    if committed is None and newest is None:
        return None
    resume = os.path.join(folder, CHECKPOINT)
    with open(resume, "wb") as out:
        if committed is not None:
            out.write(committed[1])
        else:
            with fs.open_input_stream(spec.store.path_of(f"{newest[1]}/{CHECKPOINT}")) as f:
                out.write(f.read())
    return resume


def _trainer(pl, torch, spec: FitSpec, framework: dict, world: int, folder: str, callbacks: list):
    """Lightning's Trainer: DDP over the runner's ranks, one device each, no logger, checkpoints by the callback."""
    gpu = spec.use_gpu and torch.cuda.is_available()
    return pl.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=1, num_nodes=world, strategy="ddp", max_epochs=spec.epochs,
        limit_train_batches=spec.train_steps_per_epoch, limit_val_batches=spec.validation_steps_per_epoch,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, use_distributed_sampler=False, default_root_dir=folder,
        callbacks=callbacks, **framework["trainer_args"])


def train(spec: FitSpec, framework: dict):
    """Fit the run's LightningModule with Lightning's Trainer on this rank; rank 0 returns the history."""
    import torch

    pl = lightning()
    run = RunDir(spec.store, spec.run_id)
    fs = spec.store.filesystem
    with fs.open_input_file(spec.store.path_of(run.file_url(INITIAL))) as f:
        module = torch.load(f, map_location="cpu", weights_only=False)["model"]
    if spec.random_seed is not None:
        pl.seed_everything(spec.random_seed, workers=True, verbose=False)
    train_loader, val_loader, world = _loaders(spec, framework, torch)
    saver = _store_checkpoint(pl, spec, run, train_loader, val_loader)
    newest = run.newest()
    committed = commits.fetch(COMMIT) if spec.batches_per_commit else None  # after a restart: the last commit
    with tempfile.TemporaryDirectory(prefix="sparkhvd-lightning-") as folder:
        resume = _resume_file(spec, fs, committed, newest, folder)
        trainer = _trainer(pl, torch, spec, framework, world, folder, [saver, *framework["callbacks"]])
        trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader, ckpt_path=resume)
        history = saver.history
        del trainer, module  # free the DDP model before its process group goes (torch 2.13 hangs otherwise)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return history if settings.RANK.get() in (None, 0) else None
