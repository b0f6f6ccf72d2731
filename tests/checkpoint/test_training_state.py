"""megatron.checkpoint.training_state: parameter names and the refusal of checkpoints without the layout
record (reading every ZeRO layout is tested by training on in tests/checkpoint/test_resharding.py)."""
import pytest


def test_parameter_names_of_every_model_map_to_the_flat_names():
    from megatron.checkpoint.training_state import flat_name

    assert flat_name("tied_modules.embed.word_embeddings.weight", 2) == "embedding.word_embeddings.weight"
    assert flat_name("3.attention.dense.weight", 2) == "layers.1.attention.dense.weight"
    assert flat_name("sequential.5.norm.weight", 2) == "final_norm.norm.weight"
    assert flat_name("sequential.6.final_linear.weight", 2) == "head.final_linear.weight"


def test_a_checkpoint_saved_before_the_layout_record_names_the_way_out(tmp_path):
    import torch

    from megatron.checkpoint.training_state import read_training_state
    from megatron.errors import CheckpointError
    from megatron.model.config import ModelConfig
    from tests.neox_arguments.helpers import tiny

    torch.save({"module": {}, "optimizer": {"state": {}, "param_groups": []}, "iteration": 2},
               tmp_path / "mp_rank_00_model_states.pt")
    config = ModelConfig.from_neox_args(tiny(), padded_vocab_size=128)
    with pytest.raises(CheckpointError, match=r"saved before checkpoints recorded their optimizer's layout.*Resume it "
                                              r"with the layout it was saved with.*no_load_optim: true"):
        read_training_state(str(tmp_path), config, (2, 2))
