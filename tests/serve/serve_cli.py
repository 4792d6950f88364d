"""The CLI side of the server tests: a request's presets and steer_scale as the `python -m steer` run with the same
edits, run through steer.tasks.registry.main (what the CLI runs after Hydra composes its config)."""

import copy
import json

from rich.console import Console

from helpers import compose
from serve_common import MAX_TOKENS, PROMPTS


def cli_edits(steer, scale):
    """The TapEditConf list `python -m steer` runs for a request's presets (in order) and steer_scale."""
    from steer.serve import presets
    from steer.serve.schema import ServeOptions

    confs = presets.read(ServeOptions())
    out = []
    for name in steer.split(","):
        for te in confs[name].edits:
            te = copy.deepcopy(te)
            k = 1.0 if scale is None else scale
            te.edit.scale = 1.0 + k * (te.edit.scale - 1.0) if te.edit.kind.value == "rescale" else te.edit.scale * k
            out.append(te)
    return out


def cli_run(edits, out_dir, *overrides):
    """steer.tasks.registry.main (what `python -m steer engine=hf` runs) on PROMPTS with these edits as tap/edit and
    extra_edits; its results.jsonl rows."""
    from steer.tasks import registry

    quoted = ",".join("'" + p.replace("'", "\\'") + "'" for p in PROMPTS)
    cfg = compose("engine=hf", "progress=false", f"gen.max_new_tokens={MAX_TOKENS}", f"prompts.steer=[{quoted}]",
                  *overrides)
    cfg.tap, cfg.edit, cfg.extra_edits = edits[0].tap, edits[0].edit, list(edits[1:])
    out_dir.mkdir(parents=True, exist_ok=True)
    registry.main(cfg, out_dir, Console(quiet=True))
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
