"""Counting, in a worker process, how often it builds a ModelConfig, hashes a checkpoint file and works out which
kind of checkpoint a directory holds: a worker builds its ModelConfig once (megatron.initialize), and a resume
finds its checkpoint once, rank 0 hashing it (megatron.checkpoint.engine.find_checkpoint)."""


class Counts:
    """ModelConfigs built, checkpoint files hashed (megatron.checkpoint.integrity.file_digest) and checkpoint kinds
    worked out (megatron.checkpoint.files.checkpoint_kind, where the checkpoint modules call it) by this process
    from here on: they are wrapped for the rest of the process (a test worker's)."""

    def __init__(self):
        from megatron.checkpoint import engine, integrity, neox_checkpoint
        from megatron.model.config import ModelConfig

        self.configs = self.hashed = self.kinds = 0
        built, digest = ModelConfig.__post_init__, integrity.file_digest

        def count_config(config):
            self.configs += 1
            built(config)

        def count_digest(*args, **kwargs):
            self.hashed += 1
            return digest(*args, **kwargs)

        ModelConfig.__post_init__, integrity.file_digest = count_config, count_digest
        for module in (engine, neox_checkpoint):  # each calls the name it imported
            self._count_kinds(module)

    def _count_kinds(self, module) -> None:
        kind_of = module.checkpoint_kind

        def count_kind(path):
            self.kinds += 1
            return kind_of(path)

        module.checkpoint_kind = count_kind


def manifest_files(checkpoint_dir: str) -> int:
    """How many files the manifest of checkpoint ``checkpoint_dir`` lists (what a verification hashes)."""
    from megatron.checkpoint.integrity import read_manifest

    return len(read_manifest(checkpoint_dir) or {})
