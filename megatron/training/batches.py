"""The batches a training run reads: the train / validation / test streams of the model's inputs (plain, pairwise,
precomputed reference log-probabilities), resumed from the TrainState's position, the sequence-length
curriculum that cuts them, and data_efficiency's difficulty sampler of the training split (megatron.data.difficulty)
with its logged bounds and checkpointed state."""
from typing import Any, Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from megatron.data import curriculum, data_efficiency
from megatron.data.data_utils import (build_online_datasets, build_train_valid_test_datasets, loader_over,
                                     make_data_loader, repeating_iterator)
from megatron.data.difficulty import STATE_KEY as SAMPLER_STATE_KEY, DifficultySampler, difficulty_sampler
from megatron.data.pairwise_dataset import as_text_and_labels
from megatron.errors import DataError
from megatron.initialize import RunContext
from megatron.model.batch import BatchOptions, causal_only_mask, get_batch, to_device, truncate_batch
from megatron.model.config import NO_PACKED_DOCUMENT_TYPES
from megatron.mpu import broadcast_data
from megatron.training_schedule import TrainingSchedule


def batch_streams(neox_args, ctx: RunContext, schedule: TrainingSchedule, consumed_train: int,
                   consumed_valid: int, reference=None,
                   train_sampler: Optional[Callable[[int], DifficultySampler]] = None):
    """(train, valid, test) streams of model batches, None for a split without data. Every rank builds the
    datasets (rank 0 builds the index maps, the others wait); only model-parallel rank 0 reads samples and
    broadcasts them to its tensor-parallel group. ``train_sampler`` (difficulty_sampling's): the training split's
    sampler from its number of samples, read in this process (the sampler's state is its position, which a
    worker process's prefetching would move ahead of the steps taken); the stream holds it as ``sampler``."""
    ps = ctx.parallel_state
    reads_data = ps.get_model_parallel_rank() == 0
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if neox_args.dataset_impl == "online":  # rollouts from a server, fetched as they are read
        datasets = build_online_datasets(neox_args, schedule.split_samples(), dp_rank)
    else:
        datasets = build_train_valid_test_datasets(neox_args, schedule.split_samples())
    streams = []
    for dataset, consumed, split in zip(datasets, (consumed_train, consumed_valid, 0), ("train", "valid", "test")):
        if dataset is None:
            streams.append(None)
            continue
        sampler = train_sampler(len(dataset)) if train_sampler is not None and split == "train" and reads_data \
            else None
        loader = loader_over(dataset, sampler) if sampler is not None else \
            make_data_loader(dataset, neox_args, dp_rank, dp_size, consumed)
        samples = repeating_iterator(loader) if reads_data else None
        source = dataset.source if neox_args.dataset_impl == "online" else data_source(neox_args, split)
        streams.append(ModelBatches(neox_args, ctx, samples, source=source,
                                     reference=reference))
        streams[-1].sampler = sampler
    return streams


def difficulty_sampling(neox_args, engine, ctx: RunContext, client_state: Dict[str, Any]
                        ) -> Optional[Callable[[int], DifficultySampler]]:
    """data_efficiency.data_sampling's curriculum: DeepSpeed's sampler of the training split (its config as
    DeepSpeed's engine parsed it), continued from the checkpoint's state unless fine-tuning; None when off."""
    if not data_efficiency.sampling_enabled(neox_args.data_efficiency):
        return None
    ps = ctx.parallel_state
    state = None if neox_args.finetune else client_state.get(SAMPLER_STATE_KEY)
    return lambda num_samples: difficulty_sampler(
        engine.data_efficiency_config(), num_samples, neox_args.train_micro_batch_size_per_gpu,
        ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group(),
        neox_args.gradient_accumulation_steps, dist.get_rank(), state)


def sampler_logs(batches: Optional["ModelBatches"]) -> Dict[str, int]:
    """What the logs say of the training stream's difficulty sampler: the bound of each metric for the last step."""
    sampler = getattr(batches, "sampler", None)
    if sampler is None:
        return {}
    return {f"data_efficiency_difficulty/{metric}": value for metric, value in sampler.difficulties().items()}


def sampler_state(batches: Optional["ModelBatches"]) -> Dict[str, Any]:
    """What a checkpoint keeps of the training stream's difficulty sampler (its state, taken only when saving)."""
    sampler = getattr(batches, "sampler", None)
    return {} if sampler is None else {SAMPLER_STATE_KEY: sampler.state_dict()}


def data_source(neox_args, split: str) -> str:
    """Names the files of one split, for messages about their contents."""
    paths = getattr(neox_args, f"{split}_data_paths") or ([neox_args.data_path] if neox_args.data_path else [])
    if neox_args.dataset_impl == "pairwise":
        paths = [*(getattr(neox_args, f"pos_{split}_data_paths") or []),
                 *(getattr(neox_args, f"neg_{split}_data_paths") or [])]
    return f"the {split} data ({', '.join(map(str, paths))})"


def batch_options(neox_args):
    """The batch-building settings of the config (megatron.model.batch.BatchOptions)."""
    return BatchOptions(labels=bool(neox_args.train_label_data_paths) or neox_args.dataset_impl in ("pairwise",
                                                                                                   "online"),
                        rewards=neox_args.train_impl == "kto", eod_mask_loss=neox_args.eod_mask_loss,
                        reset_position_ids=neox_args.reset_position_ids,
                        reset_attention_mask=neox_args.reset_attention_mask, documents=packs_documents(neox_args))


def packs_documents(neox_args) -> bool:
    """Whether batches carry packed documents that attend only to themselves (megatron.model.packed_attention):
    inter_document_attention_masking, or GPT-NeoX's reset_attention_mask with reset_position_ids (the same
    attention) where every layer is an attention layer (gmlp / amlp / mamba / rwkv layers keep the dense mask)."""
    if neox_args.inter_document_attention_masking:
        return True
    return bool(neox_args.reset_attention_mask and neox_args.reset_position_ids) and \
        not set(neox_args.attention_config or ()) & set(NO_PACKED_DOCUMENT_TYPES)


class ModelBatches:
    """Turns {'text': ...} samples into the model's batch format (shared inside the TP group).

    Pairwise samples ({'pos', 'neg', ...}) become one batch of the chosen rows then the rejected rows; the
    reference log-probabilities of each row (from the DPO / KTO `reference` model, or read from precomputed files)
    join the labels tuple (megatron.post_training). Online rollouts (dataset_impl 'online') add their advantages
    and raw rewards, float [b] each: (labels, loss_mask, rewards, raw_rewards[, reference log-probabilities])."""

    def __init__(self, neox_args, ctx: RunContext, samples: Optional[Iterator], source: str = "the data",
                 reference=None) -> None:
        self.options, self.ctx, self.samples, self.source = batch_options(neox_args), ctx, samples, source
        self.tokenizer_file = neox_args.vocab_file
        self.pairwise, self.reference = neox_args.dataset_impl == "pairwise", reference
        self.online = neox_args.dataset_impl == "online"
        self.precomputed = neox_args.train_impl in ("dpo", "kto") and bool(neox_args.precompute_model_name)
        self.pipelined = neox_args.is_pipe_parallel
        self.seqlen: Optional[int] = None  # the sequence-length curriculum's current length (set per step)
        self.sampler: Optional[DifficultySampler] = None  # data_sampling's curriculum (batch_streams)

    def __iter__(self):
        return self

    def _check_token_ids(self, tokens: torch.Tensor) -> None:
        """Data tokenized with another tokenizer holds ids past the embedding table, which would end in an
        IndexError deep inside the model (one max over CPU token ids per batch: no device sync)."""
        vocab = self.ctx.model_config.padded_vocab_size
        largest = int(tokens.max()) if tokens.numel() else 0
        if largest >= vocab:
            raise DataError(f"token id {largest} in {self.source} is beyond the model's vocabulary of {vocab} "
                            f"ids (the tokenizer {self.tokenizer_file or ''} padded to "
                            f"make_vocab_size_divisible_by): the data was tokenized with another tokenizer; "
                            f"preprocess it again with this one (tools/datasets/preprocess_data.py) or set the "
                            f"tokenizer it was made with")

    def __next__(self):

        data = next(self.samples) if self.samples is not None else None
        if data is not None and self.pairwise:
            data = as_text_and_labels(data)
        if data is not None:
            self._check_token_ids(data["text"])
            # the sample goes to the device first, asynchronously (pinned memory), and becomes the batch there
            data = {key: to_device(value, self.ctx.device) if torch.is_tensor(value) else value
                    for key, value in data.items()}
        inputs, labels = get_batch(self.options, data, self.ctx.parallel_state, eod_token=self.ctx.tokenizer.eod)
        if inputs[2] is None and self.pipelined:  # context parallelism: ring attention needs no mask, but
            inputs = (*inputs[:2], causal_only_mask())  # DeepSpeed's pipeline passes tensors only
        if self.online:
            rewards = broadcast_data(["reward", "raw_reward"], data, torch.float32, self.ctx.parallel_state)
            labels = labels + (rewards["reward"].reshape(-1), rewards["raw_reward"].reshape(-1))
        move = lambda t: None if t is None else to_device(t, self.ctx.device)  # no mask under CP
        inputs, labels = tuple(map(move, inputs)), tuple(map(move, labels))
        if self.reference is not None:
            if self.reference.holds:  # the last pipeline stage (the others do not read the labels)
                labels = labels + (self.reference.logps(inputs, labels[0], labels[1]),)
        elif self.precomputed:
            ref = broadcast_data(["ref"], data, torch.float32, self.ctx.parallel_state)["ref"].to(self.ctx.device)
            labels = labels + ((ref[:, 1:] * labels[1]).sum(dim=-1),)
        if self.seqlen is not None:
            inputs, labels = truncate_batch((inputs, labels), self.seqlen)
        return inputs, labels


def start_curriculum(neox_args, engine, iteration: int, client_state: Dict[str, Any]):
    """The sequence-length curriculum (megatron.data.curriculum) continued after `iteration` steps, None when off.
    DeepSpeed's pipeline engine caches the activation shapes it sends between stages after the first batch;
    with a curriculum the shapes change, so it exchanges them with every batch (its dynamic_shape mode)."""
    if not curriculum.enabled(neox_args.curriculum_learning):
        return None
    schedule = curriculum.SeqlenCurriculum(neox_args.curriculum_learning)
    schedule.resume(iteration, client_state.get(curriculum.STATE_KEY))
    if neox_args.is_pipe_parallel:
        engine.dynamic_shape = True
    return schedule


def curriculum_step(schedule, batches: ModelBatches, iteration: int) -> int:
    """Cut the training batches of step `iteration + 1` to the curriculum's length for it; returns that length."""
    batches.seqlen = schedule.seqlen_for_step(iteration + 1)
    return batches.seqlen
