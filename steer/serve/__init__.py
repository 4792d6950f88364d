"""`python -m steer.serve`: an OpenAI-compatible server that steers each request by preset name, at graph speed.

conf/serve.yaml (steer/serve/schema.py) -> presets read and checked before any engine loads (presets.py) ->
engine=hf: FastAPI on the HF engine (hf_app.py, requests.py) | engine=vllm: vLLM's own OpenAI server with the tap
worker, every preset's edits registered as stages at start (stages.py, vllm_server.py: the one module here that
imports vLLM), and a middleware that turns each request's steer arguments into its edits (middleware.py).
The steer arguments and errors both engines share are in protocol.py. docs/serving.md is the user's
page.
"""
