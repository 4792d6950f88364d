"""steer bench: steering at graph speed, measured side by side in one run (`python -m steer.bench`). The data flow:
conf/bench.yaml -> workload (prompts, per-request edits per scenario, model directories) -> runs (each engine
configuration in its own process, every scenario it serves, timed after a warm-up) -> report (markdown, CSV, PNG,
targets) in the run directory. `python -m steer.bench.cpu` is the CPU benchmark of the HF engine and server.
"""
