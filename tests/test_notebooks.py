"""The example notebooks (notebooks/*.ipynb) run top to bottom in a real Jupyter kernel.

Each test executes a copy of one notebook with nbclient in an ipykernel kernel that runs this
interpreter, with a temporary folder as its working directory, and checks what the cells
printed. The kernel's messages are recorded in the order they arrive, so that the quickstart's
test can show that the ranks' lines reached the cell while it was still running, not in one
burst when the run returned.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import struct
import sys
import tempfile

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
CHECK_INTERPRETER = "import sys; print(sys.executable)"


class RecordingClient(nbclient.NotebookClient):
    """A NotebookClient that keeps every message the kernel sent for each cell, in arrival order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages: dict[int, list[dict]] = {}
        self.on_cell_executed = self._keep_reply

    def process_message(self, msg, cell, cell_index):
        self.messages.setdefault(cell_index, []).append(msg)
        return super().process_message(msg, cell, cell_index)

    def _keep_reply(self, cell, cell_index, execute_reply):
        self.messages.setdefault(cell_index, []).append(execute_reply)


@pytest.fixture(scope="module")
def jupyter_env():
    """A kernel spec named python3 that runs this interpreter, and Jupyter's folders, all in one temp dir."""
    root = tempfile.mkdtemp(prefix="sparkhvd-notebooks-")
    # argv: [sys.executable, "-m", "ipykernel_launcher", ...]; found first, through JUPYTER_PATH
    kernelspec.write_kernel_spec(os.path.join(root, "share", "jupyter", "kernels", "python3"))
    env = {"JUPYTER_PATH": os.path.join(root, "share", "jupyter"),
           "JUPYTER_RUNTIME_DIR": os.path.join(root, "runtime"),  # connection files
           "JUPYTER_DATA_DIR": os.path.join(root, "data"),
           "IPYTHONDIR": os.path.join(root, "ipython"),  # the kernel's profile folder
           "PYSPARK_PYTHON": sys.executable}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # read here (kernel spec lookup) and inherited by the kernel
    yield root
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(root, ignore_errors=True)


def execute(name: str, jupyter_env: str):
    """Run a copy of notebooks/<name> in a fresh kernel; return the executed copy and the client."""
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_INTERPRETER))
    cwd = tempfile.mkdtemp(prefix="nb-cwd-", dir=jupyter_env)
    before = set(os.listdir(tempfile.gettempdir()))
    client = RecordingClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": cwd}})
    client.execute()
    assert os.listdir(cwd) == [], f"{name} left files in its working directory: {os.listdir(cwd)}"
    left = {entry for entry in set(os.listdir(tempfile.gettempdir())) - before
            if not entry.startswith(("sparkhvd-", "spark-", "blockmgr-", "liblz4", "libzstd", "snappy", "torchinductor_"))}
    assert not left, f"{name} left its own temporary folders behind: {sorted(left)}"
    assert texts(nb.cells[-1]).strip() == sys.executable  # the kernel ran this interpreter
    return nb, client


def texts(cell) -> str:
    """Everything a cell printed (stdout and stderr), in order."""
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.output_type == "stream")


def cell_with(nb, source_part: str) -> int:
    """The index of the one code cell whose source contains ``source_part``."""
    found = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and source_part in cell.source]
    assert len(found) == 1, (source_part, found)
    return found[0]


def losses(text: str, pattern: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text, re.M)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quickstart_torch(jupyter_env):
    nb, client = execute("01_quickstart_torch.ipynb", jupyter_env)

    debug = texts(nb.cells[cell_with(nb, "HorovodRunner(np=-1)")])
    assert len(losses(debug, r"^\[0\] epoch \d loss (\S+)$")) == 2
    assert "returned 4 tensors: ['0.weight', '0.bias', '2.weight', '2.bias']" in debug

    index = cell_with(nb, "runner.run(train, lr=0.05")
    out = texts(nb.cells[index])
    epoch_losses = losses(out, r"^\[0\] epoch \d loss (\S+)$")
    assert len(epoch_losses) == 5 and epoch_losses[-1] < epoch_losses[0] and epoch_losses[-1] < 0.05, out
    assert "[1] epoch" not in out  # rank 0 alone prints
    assert "checkpoints: ['checkpoint-0.pt', 'checkpoint-1.pt', 'checkpoint-2.pt', 'checkpoint-3.pt', " \
           "'checkpoint-4.pt']" in out

    # Live: the epoch lines came in separate stream messages, the first of them well before the
    # cell's execute_reply. Had the driver printed them all when the run returned, they would have
    # arrived in one message (two where a 0.2 s flush happened to fall between two prints).
    messages = client.messages[index]
    kinds = [m["msg_type"] for m in messages]
    carrying = [i for i, m in enumerate(messages)
                if m["msg_type"] == "stream" and re.search(r"^\[0\] epoch", m["content"]["text"], re.M)]
    reply = kinds.index("execute_reply")
    assert len(carrying) >= 3, [m["content"].get("text") for m in messages if m["msg_type"] == "stream"]
    first = messages[carrying[0]]
    assert "[0] epoch 0 loss" in first["content"]["text"] and "[0] epoch 4" not in first["content"]["text"]
    assert carrying[0] < carrying[-1] < reply
    assert first["header"]["date"] < messages[carrying[-1]]["header"]["date"] < messages[reply]["header"]["date"]
    last_output = max(i for i, kind in enumerate(kinds) if kind == "stream")
    assert "checkpoints:" in messages[last_output]["content"]["text"] and carrying[0] < last_output

    # The live view (runner/_policy/live.py): one output area of the cell, created while the run went on and
    # updated in place, a row per rank; its last state says the run finished.
    shown = [m for m in messages if m["msg_type"] in ("display_data", "update_display_data")
             and "sparkhvd run" in m["content"]["data"].get("text/plain", "")]
    assert shown and shown[0]["msg_type"] == "display_data", kinds
    display_id = shown[0]["content"]["transient"]["display_id"]
    updates = [m for m in shown[1:] if m["msg_type"] == "update_display_data"]
    assert len(updates) >= 2 and all(m["content"]["transient"]["display_id"] == display_id for m in updates)
    assert messages.index(updates[0]) < carrying[-1] < reply  # drawn before the last epoch's line: live
    final = shown[-1]["content"]["data"]
    table = final["text/plain"].splitlines()
    assert re.fullmatch(r"sparkhvd run \w+: 2 ranks, finished, \d+ s", table[0]), table
    assert table[1].split()[:4] == ["rank", "host", "steps", "steps/s"]
    assert [row.split()[0] for row in table[2:]] == ["0", "1"], table
    assert re.search(r"^0 .*\s160\s.*epoch 4 loss", table[2]), table  # 5 epochs of 32 steps; rank 0's last line
    assert "<table" in final["text/html"] and final["text/html"].count("<tr>") == 3
    assert not [out for out in nb.cells[index].outputs if out.output_type == "display_data"
                and "sparkhvd run" not in out["data"].get("text/plain", "")]

    metrics_cell = nb.cells[cell_with(nb, "sparkhvd.plot(result)")]
    summary = texts(metrics_cell)
    assert re.search(r"^rank 0: 160 steps, [\d.]+ CPU-s, \d+ MiB, \d+ heartbeats$", summary, re.M), summary
    assert re.search(r"^rank 1: 160 steps, ", summary, re.M), summary
    pngs = [out for out in metrics_cell.outputs if "image/png" in out.get("data", {})]
    assert len(pngs) == 1, metrics_cell.outputs
    png = base64.b64decode(pngs[0]["data"]["image/png"])
    width, height = struct.unpack(">II", png[16:24])  # sparkhvd.plot's 800x400, cropped to what it drew (inline)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 600 <= width <= 800 and 300 <= height <= 400 and len(png) > 10_000

    evaluation = texts(nb.cells[cell_with(nb, "model.load_state_dict(state)")])
    test_mse, baseline = map(float, re.search(r"test MSE (\S+) \(predicting the mean: (\S+)\)", evaluation).groups())
    assert test_mse < 0.05 and test_mse < baseline / 10, evaluation

    failure = texts(nb.cells[cell_with(nb, "except HorovodRunError as error")])
    assert re.search(r"failed: rank 1: ValueError: rank 1's part of the data has no rows", failure), failure
    # The first traceback in the cell is the cause's, in the error: each rank's output has one line.
    assert failure.count("Traceback (most recent call last)") == 1 and "[0] Traceback" not in failure, failure
    assert "[1] sparkhvd: rank 1 failed: ValueError: rank 1's part of the data has no rows (whole traceback in " \
           "rank-1.log)" in failure, failure
    # The cell's line is quoted: its source travels with the function (runner/_payload/payload.py).
    assert re.search(r"Traceback of rank 1 \(the first to fail\):\n.*\n  File .*, line \d+, in train_with_bad_data\n"
                     r"    raise ValueError\(\"rank 1's part of the data has no rows\"\)\nValueError: ", failure), failure


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_keras(jupyter_env):
    pytest.importorskip("tensorflow")
    nb, _ = execute("02_keras.ipynb", jupyter_env)
    fit = texts(nb.cells[cell_with(nb, "HorovodRunner(np=2).run(train)")])
    assert len(re.findall(r"^\[0\] Epoch \d/4$", fit, re.M)) == 4, fit  # Keras's progress, from rank 0
    # TensorFlow's start-up notices, printed by each rank (twice), show once (runner/_service/notices.py)
    assert fit.count("All log messages before absl::InitializeLog() is called") == 1, fit
    assert fit.count("oneDNN custom operations are on") <= 1, fit
    assert not re.search(r"^\[1\] Epoch", fit, re.M)

    result = texts(nb.cells[cell_with(nb, "enumerate(zip(history")])
    epoch_losses = losses(result, r"^epoch \d: loss (\S+)")
    assert len(epoch_losses) == 4 and epoch_losses[-1] < epoch_losses[0] / 5, result
    learning_rates = losses(result, r"lr (\S+)$")
    assert learning_rates[0] < learning_rates[1] == pytest.approx(0.04) == learning_rates[-1], result  # warm-up
    test_mse = float(re.search(r"test MSE (\S+)", result).group(1))
    assert test_mse < 0.2, result  # predicting the mean: about 15


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dataframe_to_training(jupyter_env):
    pytest.importorskip("tensorflow")
    nb, _ = execute("03_dataframe_to_training.ipynb", jupyter_env)
    rows = int(re.search(r"(\d+) training rows written", texts(nb.cells[cell_with(nb, "make_spark_converter(")])).group(1))
    assert 8_500 < rows < 9_500  # 90% of 10,000

    torch_out = texts(nb.cells[cell_with(nb, "HorovodRunner(np=2).run(train_torch)")])
    batches = {int(n) for n in re.findall(r"^\[0\] epoch \d: (\d+) batches per rank", torch_out, re.M)}
    assert batches == {-(-rows // 2 // 64)} or batches == {rows // 2 // 64}, torch_out  # each rank read half
    keras_out = texts(nb.cells[cell_with(nb, "HorovodRunner(np=2).run(train_keras)")])
    assert len(re.findall(r"^\[0\] Epoch \d/3$", keras_out, re.M)) == 3, keras_out

    scores = texts(nb.cells[cell_with(nb, "def mse(kernel, bias)")])
    for framework in ("torch", "keras"):
        test_mse = float(re.search(rf"^{framework}: weights .* test MSE (\S+)$", scores, re.M).group(1))
        assert test_mse < 0.01, scores  # the label's noise alone: 0.0025


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_elastic(jupyter_env):
    nb, _ = execute("04_elastic.ipynb", jupyter_env)
    run = texts(nb.cells[cell_with(nb, "HorovodRunner(np=2, max_restarts=1)")])
    assert "[1] killing myself with SIGKILL" in run
    assert "Traceback" not in run, run  # rank 0's MeshError after the kill is one line, its traceback in its log
    assert re.search(r"^\[sparkhvd\] run \w+: restart 1 of 1 after rank 1's process .*killed by signal 9.*"
                     r"training resumed .* from the last commit \(epoch=1 batch=[12]0\)\.$", run, re.M), run
    assert len(re.findall(r"^\[0\] epoch \d done", run, re.M)) == 4, run

    result = texts(nb.cells[cell_with(nb, "runner.last_result.restarts")])
    assert re.search(r"^restart 1: rank 1's process .*killed by signal 9", result, re.M), result
    assert re.search(r"resumed from \{'epoch': 1, 'batch': [12]0\}, np 2 -> 2", result), result
    weights = [float(w) for w in re.search(r"weights: \[(.*)\]", result).group(1).split(",")]
    assert len(weights) == 8 and all(0.5 < w < 1.5 for w in weights), result


NAMES = ["01_quickstart_torch.ipynb", "02_keras.ipynb", "03_dataframe_to_training.ipynb", "04_elastic.ipynb",
         "05_lightning_and_ddp.ipynb", "06_estimators.ipynb"]


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_carries_a_whole_run(name):
    """The committed file is valid and shows one top-to-bottom run (re-execute it after editing a cell)."""
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), name
    assert any(cell.outputs for cell in code)
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert all("execution" not in cell.metadata for cell in code)  # no timing metadata


def _outputs(nb) -> str:
    """Every output's text: streams, results, errors."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.extend(str(value) for value in out.get("data", {}).values())
            parts.extend(out.get("traceback", []))
    return "\n".join(parts)


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_name_no_folder_of_this_machine(name):
    """notebooks/execute.py runs the kernel in a temporary folder and writes it as $TMPDIR (see its docstring)."""
    text = _outputs(nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4))
    checkout = os.path.dirname(NOTEBOOKS)
    machine = {checkout + os.sep, sys.prefix + os.sep, os.path.realpath(sys.prefix) + os.sep,
               tempfile.gettempdir() + os.sep, os.path.expanduser("~") + os.sep, "/tmp/", "/home/", "/root/"}
    found = {path: text[text.index(path) - 40:text.index(path) + 80] for path in machine if path in text}
    assert not found, f"{name}'s outputs name folders of the machine that ran it (re-make it with " \
                      f"notebooks/execute.py): {found}"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_lightning_and_ddp(jupyter_env):
    pytest.importorskip("lightning")
    nb, _ = execute("05_lightning_and_ddp.ipynb", jupyter_env)
    ddp = texts(nb.cells[cell_with(nb, "HorovodRunner(np=2).run(train_ddp)")])
    ddp_losses = losses(ddp, r"^\[0\] epoch \d: loss (\S+)$")
    assert len(ddp_losses) == 3 and ddp_losses[-1] < ddp_losses[0] / 10, ddp
    assert "Traceback" not in ddp, ddp
    lightning = texts(nb.cells[cell_with(nb, "TorchDistributor(num_processes=2")])
    assert "Lightning found: TorchElasticEnvironment" in lightning, lightning  # it read torchrun's variables
    assert re.search(r"^\[1\] Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2$", lightning, re.M), lightning
    assert len(losses(lightning, r"^\[0\] epoch \d: loss (\S+)$")) == 3, lightning
    for cell in (ddp, lightning):  # y = x.sum(): every weight close to 1
        weights = [float(w) for w in re.search(r"weights: \[([^\]]+)\]", cell).group(1).split(",")]
        assert len(weights) == 8 and all(abs(w - 1) < 0.1 for w in weights), cell



CHROMIUM = shutil.which("chromium") or shutil.which("chromium-headless-shell") or shutil.which("google-chrome")
#: as root, on a closed network: no sandbox, no GPU, and none of Chromium's own connections
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")


def _cell_page(cell) -> str:
    """One code cell as a notebook page shows it: its source, then each output (a stream as text, HTML as itself,
    a PNG as an image)."""
    import html

    parts = [f"<pre style='background:#f5f5f5'>{html.escape(cell.source)}</pre>"]
    for out in cell.outputs:
        data = out.get("data", {})
        if out.output_type == "stream":
            parts.append(f"<pre>{html.escape(out.text)}</pre>")
        elif "text/html" in data:
            parts.append(data["text/html"])
        elif "image/png" in data:
            parts.append(f"<img src='data:image/png;base64,{data['image/png']}'>")
    return f"<!doctype html><html><body style='font-family:sans-serif'>{''.join(parts)}</body></html>"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get install chromium)")
def test_the_live_views_cell_renders_in_a_headless_chromium(tmp_path):
    """The quickstart's np=2 cell, as committed (notebooks/execute.py), rendered by a real headless Chromium: its DOM
    has the live view's table with a row per rank, and its screenshot shows it (not a blank page)."""
    import subprocess

    from matplotlib import image

    nb = nbformat.read(os.path.join(NOTEBOOKS, "01_quickstart_torch.ipynb"), as_version=4)
    page = tmp_path / "cell.html"
    page.write_text(_cell_page(nb.cells[cell_with(nb, "runner.run(train, lr=0.05")]))
    profile = tmp_path / "profile"

    def chromium(*args):
        return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()],
                              capture_output=True, text=True, timeout=90, cwd=tmp_path)

    dom = chromium("--dump-dom").stdout
    rows = re.findall(r"<tr>(.*?)</tr>", dom)
    assert len(rows) == 3 and re.search(r"<th[^>]*>steps/s</th>", rows[0]), dom[-2000:]  # the header, rank 0, rank 1
    cells = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in rows[1:]]
    assert [(c[0], c[2]) for c in cells] == [("0", "160"), ("1", "160")], rows  # rank, steps: 5 epochs of 32
    shot = tmp_path / "cell.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1000,420")
    assert shot.exists(), done.stderr[-2000:]
    pixels = image.imread(str(shot))
    assert pixels.shape[:2] == (420, 1000)
    ink = (pixels[..., :3].mean(axis=2) < 0.5).mean()  # the share of dark pixels: the text of the cell and table
    assert 0.005 < ink < 0.5, ink
