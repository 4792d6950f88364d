"""examples/steer_smollm2.ipynb runs top to bottom in a real Jupyter kernel (nbclient, ipykernel) on SmolLM2: every
code cell runs without an error, and the steered text it prints is the text of the run directory it saves."""

import json
import os
from pathlib import Path


from helpers import ROOT

NOTEBOOK = ROOT / "examples" / "steer_smollm2.ipynb"


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output["text"]
    return "".join(output.get("data", {}).get("text/plain", ""))


def test_the_example_notebook_runs_in_a_kernel(smollm2_spec, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this environment: the checkout on its path, the tests' cache (STEER_CACHE, where SmolLM2
    # was converted), and the mark that lets the run find a process it left behind.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    printed = "\n".join(_text(o) for c in code for o in c.outputs)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:  # the text the notebook shows is what the run wrote, baseline and steered
        assert f"steered:  {r['steered']}" in printed and f"baseline: {r['baseline']}" in printed
    assert (tmp_path / "joy.safetensors").is_file()
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)  # the plot
    assert Path(tmp_path / "run" / "metrics.json").is_file()
