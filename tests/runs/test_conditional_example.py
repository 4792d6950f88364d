"""The committed conditional experiment (conf/experiment/smollm2_joy_food.yaml) on SmolLM2: its condition holds for
the four prompts about food and for none of the others, a prompt that meets it is steered and one that does not
generates its baseline token for token."""

import json


def test_joy_only_for_prompts_about_food(cli, tmp_path, smollm2_spec):
    res = cli(["+experiment=smollm2_joy_food", "gen.max_new_tokens=8", "hydra.run.dir=run"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [r["when_met"] for r in rows] == [True] * 4 + [False] * 4
    for r in rows:
        if r["when_met"]:
            assert r["steered_ids"] != r["baseline_ids"], r["prompt"]
        else:
            assert r["steered_ids"] == r["baseline_ids"], r["prompt"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["when_met"] == 4
