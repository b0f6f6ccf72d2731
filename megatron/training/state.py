"""The training run's own state, the part of a checkpoint that is neither the model nor the optimizer: the step the
run is at and how far it has read its data (torchtitan keeps the same as one small TrainState object beside the
stateful objects its checkpointer saves).

The checkpoint keeps it as GPT-NeoX does, as top-level entries of the engine's client state (`iteration`,
`consumed_train_samples`, `consumed_valid_samples`), so that GPT-NeoX's tools read ours and ours read theirs. The
sequence-length curriculum is a stateful object of its own (megatron.data.curriculum): it saves beside the
TrainState (run_state) and restores itself from the same client state (SeqlenCurriculum.resume).
"""
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from megatron.data.curriculum import STATE_KEY, SeqlenCurriculum


@dataclass
class TrainState:
    """Where a run is: optimizer steps taken, and samples its train and validation streams have consumed (the
    streams of a resumed run start there, megatron.data.data_utils.make_data_loader)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0

    def state_dict(self) -> Dict[str, int]:
        """The client-state entries a checkpoint keeps (the same keys as GPT-NeoX's)."""
        return {"iteration": self.iteration, "consumed_train_samples": self.consumed_train_samples,
                "consumed_valid_samples": self.consumed_valid_samples}

    @classmethod
    def from_checkpoint(cls, client_state: Mapping[str, Any], iteration: int, train_batch_size: int,
                        finetune: bool = False) -> "TrainState":
        """The state a run continues from after loading a checkpoint whose client state is ``client_state`` and
        from which the checkpoint loader continues at ``iteration`` (0 when fine-tuning or when nothing was loaded).

        A resumed run starts its data where its checkpoint stopped (GPT-NeoX's checkpoints record no samples:
        iterations x batch); a fine-tuning run (finetune: true) at the start of its own data, whatever the
        checkpoint it starts from consumed of another dataset."""
        if finetune:
            return cls(iteration=iteration)
        samples = client_state.get("consumed_train_samples", iteration * train_batch_size)
        return cls(iteration=iteration, consumed_train_samples=samples,
                   consumed_valid_samples=client_state.get("consumed_valid_samples", 0))


def run_state(state: TrainState, curriculum: Optional[SeqlenCurriculum] = None) -> Dict[str, Any]:
    """What a checkpoint keeps of the run besides the engine: the TrainState and the curriculum's state."""
    return {**state.state_dict(), **({STATE_KEY: curriculum.state_dict()} if curriculum is not None else {})}
