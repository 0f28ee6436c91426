"""notebooks/06_estimators.ipynb runs top to bottom in a real Jupyter kernel (in a file of its own, so that the
suite's workers run it beside the other notebooks): fit, transform, save and load, a resume that trains only the
epochs left and writes no Parquet, and a mistake caught before the launch."""

from __future__ import annotations

import re

import pytest
from test_notebooks import _outputs, cell_with, execute, jupyter_env, losses, texts  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_estimators(jupyter_env):  # noqa: F811 - the fixture imported above
    nb, _ = execute("06_estimators.ipynb", jupyter_env)
    fit = texts(nb.cells[cell_with(nb, "model = estimator(epochs=3).fit(train_df)")])
    val_losses = losses(fit, r"^\[0\] epoch \d/3: loss \S+, val_loss (\S+)$")
    assert len(val_losses) == 3 and val_losses[-1] < val_losses[0], fit
    transform = texts(nb.cells[cell_with(nb, "predicted = model.transform(test_df)")])
    assert float(re.search(r"test MSE: (\S+)", transform).group(1)) < 0.5, transform  # y's variance is about 5
    assert "loaded model predicts the same: True" in texts(nb.cells[cell_with(nb, "TorchModel.load(path)")])
    resumed = texts(nb.cells[cell_with(nb, "longer = estimator(epochs=5)")])
    assert "[0] epoch 1/5" not in resumed and "[0] epoch 4/5" in resumed, resumed  # epochs 4 and 5 only
    assert "epochs in the history: [0, 1, 2, 3, 4]" in resumed and "Parquet written again: False" in resumed
    assert "the model's output for label 'y' has shape (2,) per row (2 values), but the label has shape () (1 " \
           "value)" in texts(nb.cells[cell_with(nb, "wrong = torch.nn.Linear(3, 2)")])
    assert "Traceback" not in _outputs(nb)
