"""Where a DPO / KTO run's precomputed reference log-probabilities live: torch-free, because the launcher checks
that they exist before any process starts (megatron.launch.prelaunch)."""
from typing import Any, List


def precomputed_path(data_prefix: str, model_name: str) -> str:
    return f"{data_prefix}_{model_name}"


def reference_paths(neox_args: Any) -> List[str]:
    """The data paths whose reference log-probabilities the run reads: every pos_* / neg_* path of pairwise data,
    else every {train,valid,test}_data_path (KTO); train then valid then test."""
    out: List[str] = []
    kinds = ("pos_", "neg_") if neox_args.dataset_impl == "pairwise" else ("",)
    for split in ("train", "valid", "test"):
        for kind in kinds:
            value = getattr(neox_args, f"{kind}{split}_data_paths") or []
            out += [value] if isinstance(value, str) else list(value)
    return out
