"""TorchModel's side on the executors: load the model file once and predict NumPy batches on a device.

A module of its own, free of pyspark (``_predict.py`` imports pyspark only inside its functions), so that the GPU
check runs it on a machine that has CUDA but no Spark (tests/collective/test_gpu.py).
"""

from __future__ import annotations

from ._torch_train import as_outputs


def load_for_predict(source: str | None, blob: bytes | None, device: str):
    """Executor side: the model from its file (or bytes) on ``device``, as ``predict(list of arrays)``."""
    import io
    import warnings

    import torch

    from ..data._metadata import resolve_url

    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"  # Spark assigned a GPU this torch build cannot use
    if source is not None:
        fs, path = resolve_url(source)
        with fs.open_input_file(path) as f:
            model = torch.load(f, map_location=device, weights_only=False)
    else:
        model = torch.load(io.BytesIO(blob), map_location=device, weights_only=False)
    model.eval()

    def predict(inputs: list) -> list:
        with torch.inference_mode(), warnings.catch_warnings():
            # Arrow's zero-copy arrays are read-only; the model only reads its inputs, so they are not copied
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            outputs = as_outputs(model(*[torch.from_numpy(x).to(device) for x in inputs]))
        return [output.detach().float().cpu().numpy() for output in outputs]

    return predict
