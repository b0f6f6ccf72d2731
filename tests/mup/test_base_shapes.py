"""Base shapes: save_base_shapes writes the file, base_shapes_file reads it back onto a wider model, and a file
that is missing, malformed or another model's gives one clear error; muP's config rules."""

import pytest
import yaml

from megatron.mpu import SingleProcessState
from megatron.mup.parametrization import INFSHAPE_ATTR, named_parameters, set_base_shapes
from megatron.training.mup_run import prepare_model, save_base_shapes
from megatron.mup.shapes import BaseShapesError, read_base_shapes
from megatron.errors import ConfigError
from megatron.model.gpt2_model import build_model
from tests.model.helpers import tiny_config
from tests.neox_arguments.helpers import problems_of, tiny

QKV = "sequential.2.attention.query_key_value.weight"


def test_save_base_shapes_round_trip_onto_a_wider_model_and_mismatches_are_named(tmp_path):
    path = str(tmp_path / "shapes" / "base.yml")
    args = tiny(use_mup=True, save_base_shapes=True, base_shapes_file=path, mup_width_scale=2)
    config = tiny_config(hidden_size=32, use_mup=True, mup_output_temp=2.0)
    written = save_base_shapes(args, config, SingleProcessState())
    assert written == path
    shapes = read_base_shapes(path)
    # width dimensions hold the base size, the vocabulary and the positions are finite (null)
    assert shapes[QKV] == [96, 32] and shapes["sequential.0.word_embeddings.weight"] == [None, 32]
    assert shapes["sequential.0.position_embeddings.weight"] == [None, 32]
    assert yaml.safe_load(open(path)) == shapes

    wide = build_model(tiny_config(hidden_size=128), SingleProcessState())
    infshapes = set_base_shapes(wide, shapes, path)
    assert infshapes[QKV].ninf == 2 and infshapes[QKV].width_mult == 4.0
    assert infshapes["sequential.0.word_embeddings.weight"].ninf == 1
    assert getattr(dict(named_parameters(wide))[QKV], INFSHAPE_ATTR).width_mult == 4.0

    # another architecture: a third layer's parameters are not in the file
    deeper = build_model(tiny_config(hidden_size=128, num_layers=3), SingleProcessState())
    with pytest.raises(BaseShapesError, match=r"does not describe this model: \d+ of this model's parameters are not "
                                              r"in it \(sequential\.4\..*save_base_shapes: true"):
        set_base_shapes(deeper, shapes, path)
    # through train.py's step the same problem is the ConfigError train.py prints
    with pytest.raises(ConfigError, match="does not describe this model"):
        prepare_model(tiny(use_mup=True, base_shapes_file=path, num_layers=3), deeper, SingleProcessState())

    with pytest.raises(BaseShapesError, match="does not exist: write it first .* save_base_shapes: true"):
        read_base_shapes(str(tmp_path / "missing.yml"))
    (tmp_path / "bad.yml").write_text("a: [1, x]\n")
    with pytest.raises(BaseShapesError, match="is not a base shapes file"):
        read_base_shapes(str(tmp_path / "bad.yml"))


def test_mup_settings_are_checked_with_the_key_and_the_fix(tmp_path):
    assert "use_mup needs base_shapes_file" in problems_of(use_mup=True)
    missing = str(tmp_path / "none.yml")
    assert "does not exist: write it first" in problems_of(use_mup=True, base_shapes_file=missing)
    assert "mup_width_scale=4 only applies with save_base_shapes: true" in problems_of(
        use_mup=True, base_shapes_file=missing, mup_width_scale=4)
    assert "coord_check=True is a muP setting and only takes effect with use_mup: true" in problems_of(coord_check=True)
    assert "mup_attn_temp=2.0 is a muP setting" in problems_of(mup_attn_temp=2.0)
    assert "mup_width_scale=1 must be an integer >= 2" in problems_of(
        use_mup=True, save_base_shapes=True, base_shapes_file=missing, mup_width_scale=1)
    assert "use_mup with optimizer.type='Lion' is not supported" in problems_of(
        use_mup=True, save_base_shapes=True, base_shapes_file=missing, optimizer={"type": "Lion", "params": {}})
    assert "pos_emb='rotary' has none" in problems_of(
        use_mup=True, save_base_shapes=True, base_shapes_file=missing, pos_emb="rotary", mup_rp_embedding_mult=2.0)
    assert "use_mup with mamba layers is not supported yet" in problems_of(
        use_mup=True, save_base_shapes=True, base_shapes_file=missing, attention_config=[[["mamba"], "all"]])
    # a valid muP config: the base width read from the file gives the model's width multiplier
    path = str(tmp_path / "base.yml")
    save_base_shapes(tiny(use_mup=True, save_base_shapes=True, base_shapes_file=path), tiny_config(hidden_size=16),
                     SingleProcessState())
    args = tiny(use_mup=True, base_shapes_file=path, mup_attn_temp=0.5, mup_output_temp=2.0)
    from megatron.model.config import ModelConfig

    config = ModelConfig.from_neox_args(args)
    assert config.use_mup and config.mup_width_mult == 64 / 16 and config.mup_attn_temp == 0.5
