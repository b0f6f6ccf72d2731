"""TrainState (megatron.training.state): the run's state as the checkpoint keeps it (GPT-NeoX's client-state keys),
restored from ours, from GPT-NeoX's (which record no samples) and for fine-tuning; and through a real save and load
of the checkpoint (megatron.checkpoint.engine) with the curriculum's state beside it."""
from megatron.data.curriculum import STATE_KEY, SeqlenCurriculum
from megatron.training.state import TrainState, run_state
from tests.checkpoint.test_engine import FakeEngine, args_for, load, save

CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": 16,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 4}}


def test_the_state_dict_holds_gpt_neox_keys_and_restores_the_same_state():
    state = TrainState(iteration=7, consumed_train_samples=60, consumed_valid_samples=16)
    saved = state.state_dict()
    assert saved == {"iteration": 7, "consumed_train_samples": 60, "consumed_valid_samples": 16}
    # 60 samples in 7 steps: a ramped batch size; the recorded count wins over iterations x batch
    assert TrainState.from_checkpoint(saved, 7, train_batch_size=8) == state


def test_a_gpt_neox_checkpoint_without_sample_counts_resumes_at_iterations_times_batch():
    assert TrainState.from_checkpoint({"iteration": 3}, 3, train_batch_size=8) == TrainState(3, 24, 0)
    assert TrainState.from_checkpoint({}, 0, train_batch_size=8) == TrainState()  # nothing loaded


def test_a_fine_tuning_run_starts_its_data_at_the_beginning():
    """DPO from an SFT checkpoint that consumed 4800 samples of another dataset starts at sample 0 (it used to
    start at 4800 and, with a smaller preference set, found no batches)."""
    saved = {"iteration": 300, "consumed_train_samples": 4800, "consumed_valid_samples": 64}
    assert TrainState.from_checkpoint(saved, 0, train_batch_size=16, finetune=True) == TrainState()


def test_a_checkpoint_saves_and_restores_the_state_and_the_curriculum(tmp_path):
    args = args_for(tmp_path)
    curriculum = SeqlenCurriculum(CURRICULUM)
    for step in (1, 2, 3):
        curriculum.seqlen_for_step(step)
    state = TrainState(iteration=3, consumed_train_samples=40, consumed_valid_samples=8)
    assert run_state(state) == state.state_dict()
    save(args, state.iteration, FakeEngine(), run_state(state, curriculum))
    iteration, client_state, _ = load(args, FakeEngine())
    assert TrainState.from_checkpoint(client_state, iteration, args.train_batch_size) == state
    assert client_state[STATE_KEY] == curriculum.state_dict()
