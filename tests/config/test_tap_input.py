"""`tap.input` and `tap.heads` that cannot run, and vectors that do not fit the tap's width: one line naming the
field, exit 2, before any engine (the tiny model: 4 heads of 64)."""

import pytest

from helpers import cli_here, refused

O_PROJ = "model.layers.1.self_attn.o_proj"


@pytest.mark.parametrize("args, field, says", [
    ([f"tap.path={O_PROJ}", "tap.input=true", "tap.heads=[4]"], "tap.heads", "[4] out of range"),
    ([f"tap.path={O_PROJ}", "tap.heads=[1]"], "tap.heads", "set tap.input=true"),
    (["tap.path=model.layers.1.mlp.down_proj", "tap.input=true", "tap.heads=[0]"], "tap.heads",
     "not an attention output projection"),
    ([f"tap.path={O_PROJ}", "tap.input=true", "tap.heads=[0]", "edit.vector.path=hidden.safetensors"],
     "edit.vector", "is 64, the vector's last dimension 256"),
    (["tap.layer=1", "edit.vector.path=head.safetensors"], "edit.vector",
     "the model's hidden size is 256, the vector's last dimension 64"),
    ([f"tap.path={O_PROJ}", "tap.input=true", "tap.heads=[0]", "edit=clamp"], "edit.vector.path",
     "takes a vector of head_dim (64)"),
    (["tap.layer=1", "tap.input=true"], "tap.path", "reads a module's input"),
])
def test_a_tap_that_cannot_run_is_one_line_and_exit_2(args, field, says, tmp_path, cache_dir, monkeypatch, capsys):
    import torch
    from safetensors.torch import save_file

    save_file({"direction": torch.ones(256)}, str(tmp_path / "hidden.safetensors"))
    save_file({"direction": torch.ones(64)}, str(tmp_path / "head.safetensors"))
    res = cli_here([*args, "hydra.run.dir=run"], tmp_path, monkeypatch, capsys)
    refused(res, field, says)
