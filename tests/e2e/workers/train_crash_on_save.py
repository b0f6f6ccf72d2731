"""train.py, except that the process dies in the middle of saving iteration $NEOX_CRASH_AT_SAVE: DeepSpeed
has written its files but the save has not finished. Used to show that `latest` stays on the previous
checkpoint."""

import os

import megatron.checkpointing as checkpointing
from megatron.neox_arguments import NeoXArgs
from megatron.training import pretrain

crash_at = int(os.environ["NEOX_CRASH_AT_SAVE"])
original_rng_states = checkpointing._rng_states


def dying_rng_states():
    if os.path.isdir(os.path.join(args.save, checkpointing.tag_for(crash_at))):
        os._exit(17)  # as abrupt as a kill: no cleanup, no exception handling
    return original_rng_states()


checkpointing._rng_states = dying_rng_states
args = NeoXArgs.consume_neox_args()
pretrain(args)
