"""Counting, in a worker process, how often it builds a ModelConfig and hashes a checkpoint file: a worker builds
its ModelConfig once (megatron.initialize) and a resume hashes its checkpoint once, on rank 0
(megatron.checkpoint.engine.find_checkpoint)."""


class Counts:
    """ModelConfigs built and checkpoint files hashed (megatron.checkpoint.integrity.file_digest) by this process
    from here on: the two are wrapped for the rest of the process (a test worker's)."""

    def __init__(self):
        from megatron.checkpoint import integrity
        from megatron.model.config import ModelConfig

        self.configs = self.hashed = 0
        built, digest = ModelConfig.__post_init__, integrity.file_digest

        def count_config(config):
            self.configs += 1
            built(config)

        def count_digest(*args, **kwargs):
            self.hashed += 1
            return digest(*args, **kwargs)

        ModelConfig.__post_init__, integrity.file_digest = count_config, count_digest


def manifest_files(checkpoint_dir: str) -> int:
    """How many files the manifest of checkpoint ``checkpoint_dir`` lists (what a verification hashes)."""
    from megatron.checkpoint.integrity import read_manifest

    return len(read_manifest(checkpoint_dir) or {})
