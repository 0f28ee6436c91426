"""What a fit hands its ranks: plain frozen dataclasses, light to import in a rank (no pyspark)."""

from __future__ import annotations

from dataclasses import dataclass

from ._columns import Column
from ._store import Store


@dataclass(frozen=True)
class DataSpec:
    """The training (and validation) data as the ranks read it: Parquet URLs, row counts and columns."""

    train_url: str
    train_rows: int
    val_url: str | None
    val_rows: int
    features: tuple[Column, ...]
    labels: tuple[Column, ...]
    weight: Column | None
    decode: dict | None = None  # {column: fn(cell bytes) -> array}: the readers decode those columns in their threads


@dataclass(frozen=True)
class FitSpec:
    """Everything the ranks need besides the framework's own objects: pickled into the run, a few KB."""

    data: DataSpec
    store: Store
    run_id: str
    epochs: int
    start_epoch: int  # epochs the run's newest checkpoint held when the fit began (the ranks look again: restarts)
    batch_size: int
    val_batch_size: int
    shuffle: bool
    seed: int
    random_seed: int | None
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    verbose: int
    use_gpu: bool
    backward_passes_per_step: int
    batches_per_commit: int  # 0: no commits (no restarts to use them)
    output_shapes: tuple[tuple[int, ...], ...]  # per label, per row, as the model's dry run gave them
    # a checkpoint after every epoch, where something may resume from one: a later fit of the run (run_id given) or a
    # relaunch (max_restarts); else only the last epoch's, from which the driver builds the fitted model
    every_epoch: bool = True

    def checkpoints(self, epochs_done: int) -> bool:
        """Whether rank 0 writes the checkpoint of ``epochs_done`` epochs."""
        return self.every_epoch or epochs_done == self.epochs


def metadata(spec: FitSpec) -> dict:
    """What a model needs to predict: the columns it was fitted on, and its outputs' per-row shapes."""
    data = spec.data
    return {"features": [c.to_dict() for c in data.features], "labels": [c.to_dict() for c in data.labels],
            "output_shapes": [list(shape) for shape in spec.output_shapes]}
