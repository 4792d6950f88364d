"""The bench's figure: each configuration's ratio to b per scenario, a panel per model and batch."""

import io
from typing import Dict, List

from steer.bench.schema import BenchConf


def bars(rows: List[Dict], cfg: BenchConf) -> bytes:
    """bench.png: per model and batch, each configuration's throughput over b's, scenario by scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, r, t) for m in cfg.run for r, t in cfg.batches]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    width = 0.8 / max(len(cfg.configs), 1)
    for ax, (model, req, tok) in zip(axes[0], panels):
        for k, c in enumerate(cfg.configs):
            ys = [next((r["vs_b"] for r in rows if (r["model"], r["requests"], r["new_tokens"], r["scenario"],
                                                      r["config"]) == (model, req, tok, s, c)), None) or 0.0
                  for s in cfg.scenarios]
            ax.bar([i + (k - (len(cfg.configs) - 1) / 2) * width for i in range(len(cfg.scenarios))], ys, width,
                   label=c)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(cfg.scenarios)), cfg.scenarios)
        ax.set_title(f"{model}, {req}x{tok}")
        ax.set_ylabel("output tok/s / b")
    axes[0][0].legend(title="config", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
