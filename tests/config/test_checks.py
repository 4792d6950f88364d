"""Rules across a config's fields (steer/config/checks.py) that the schema's types cannot say: each refused naming
its field, before any file or model is read."""

import pytest

from helpers import compose
from interleaver.select import Positions
from steer.config import checks
from steer.errors import ConfigError


@pytest.mark.parametrize("overrides,field,says", [
    (["prompts.pairs_file=p.jsonl", "prompts.positive_file=a.txt", "prompts.negative_file=b.txt"],
     "prompts.pairs_file", "both give the contrastive pairs"),
    (["prompts.positive_file=a.txt"], "prompts.negative_file", "the .txt pairs need both files"),
    (["prompts.negative_file=b.txt"], "prompts.positive_file", "the .txt pairs need both files"),
    (["edit.scale=nan"], "edit.scale", "must be a finite number"),
    (["edit=clamp", "edit.lo=2", "edit.hi=1"], "edit.lo", "clamp bounds are reversed"),
    (["edit=rescale", "edit.scale_by=unit"], "edit.scale_by", "leave scale_by=vector"),
])
def test_a_rule_across_fields_is_refused_naming_the_field(overrides, field, says):
    with pytest.raises(ConfigError) as e:
        checks.run(compose(*overrides), "hf")  # the files named here do not exist: no rule reads them
    assert e.value.field == field and says in str(e.value), e.value


@pytest.mark.parametrize("kind,rows,field,says", [
    ("add", None, "edit.vector", "needs a vector"),
    ("clamp", [[1.0, 0.0], [0.0, 1.0]], "edit.vector", "takes one vector [hidden], got 2 rows"),
    ("set", [[0.0, 0.0]], "edit.vector", "a direction of norm 0 has no direction"),
    ("add", [[3e38, 0.0]], "edit.scale", "beyond float32's range"),
])
def test_an_edits_vectors_must_fit_its_kind(kind, rows, field, says):
    import torch

    from steer.config.schema import EditKind

    vectors = None if rows is None else torch.tensor(rows)
    with pytest.raises(ConfigError) as e:
        checks.edit_vectors("edit", EditKind(kind), 2.0, vectors)
    assert e.value.field == field and says in str(e.value), e.value
    checks.edit_vectors("edit", EditKind.rescale, 2.0, None)  # rescale about 0 needs none
    checks.edit_vectors("edit", EditKind.ablate, 1.0, torch.eye(2))  # a subspace is ablate's


@pytest.mark.parametrize("value, want", [
    ("all", Positions()), ("last_prompt", Positions("last_prompt", 1)),
    ({"select": "last_prompt", "last_k": 3}, Positions("last_prompt", 3)),
    ({"select": "first_generated", "n": 5}, Positions("first_generated", 5)),
    ({"from": 2, "to": 7}, Positions("window", start=2, end=7)),
])
def test_positions_parse(value, want):
    assert checks.positions(value) == want


@pytest.mark.parametrize("value, field, says", [
    ("last", "edit.positions", "not one of"),
    ({"from": 5, "to": 2}, "edit.positions", "0 <= from <= to"),
    ({"from": 1}, "edit.positions", "a window is"),
    ({"select": "last_prompt", "last_k": 0}, "edit.positions.last_k", ">= 1"),
    ({"select": "first_generated", "last_k": 2}, "edit.positions.last_k", "not a setting of first_generated"),
    ({"select": "middle"}, "edit.positions.select", "not one of"),
])
def test_bad_positions_name_the_field(value, field, says):
    with pytest.raises(ConfigError) as e:
        checks.positions(value)
    assert e.value.field == field and says in str(e.value)
