"""DeepSpeed's communication log (config section ``comms_logger``), reported by the training loop.

DeepSpeed's comms logger times and counts every collective that goes through ``deepspeed.comm``: ZeRO's, the
pipeline engine's and, through ``megatron.mpu.deepspeed_comm.collectives``, the project's own tensor-parallel ones
(megatron.mpu). Nothing prints its summary unless asked; the training loop asks here, at the end of training and
every ``comms_logger.prof_interval`` iterations when that is set (a key of this project: DeepSpeed's schema has no
such key, so it is taken out of the dict DeepSpeed receives). The figures are cumulative since the start of the
run. Rank 0 prints DeepSpeed's table (op, message size, count, total and average latency, algorithm and bus
bandwidth) to the console and so to the rank logs, and the same figures go to metrics.jsonl as a ``comms`` record.
"""

from typing import Any, Dict, List, Mapping, Optional

DEEPSPEED_KEYS = ("enabled", "prof_all", "prof_ops", "verbose", "debug")
"""The keys of DeepSpeed's comms_logger section."""
INTERVAL_KEY = "prof_interval"
REPORTED_FIGURES = ("count", "total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps", "msg_size_str")


def comms_logger_problems(section: Optional[Mapping[str, Any]]) -> List[str]:
    """Unknown keys and a prof_interval that is not a positive integer."""
    if section is None:
        return []
    problems = []
    unknown = sorted(set(section) - set(DEEPSPEED_KEYS) - {INTERVAL_KEY})
    if unknown:
        problems.append(f"comms_logger has unknown keys {unknown}; allowed: {', '.join(DEEPSPEED_KEYS)} (DeepSpeed's) "
                        f"and {INTERVAL_KEY} (print the summary every N iterations)")
    interval = section.get(INTERVAL_KEY)
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
        problems.append(f"comms_logger.{INTERVAL_KEY}={interval!r} must be an integer >= 1 (iterations between "
                        f"summaries), or left out for a summary at the end of training only")
    return problems


def deepspeed_section(section: Mapping[str, Any]) -> Dict[str, Any]:
    """The section as DeepSpeed's schema takes it (without prof_interval)."""
    return {key: value for key, value in section.items() if key != INTERVAL_KEY}


class CommsReporter:
    """When to print the comms summary, and the summary as plain JSON-ready numbers."""

    def __init__(self, section: Optional[Mapping[str, Any]]) -> None:
        self.enabled = bool(section and section.get("enabled", False))
        self.interval: Optional[int] = (section or {}).get(INTERVAL_KEY) if self.enabled else None

    def due(self, iteration: int) -> bool:
        return bool(self.interval) and iteration % self.interval == 0

    def report(self) -> Dict[str, Dict[str, Dict[str, Any]]]:
        """DeepSpeed's summary, printed on rank 0; {op: {message bytes: figures}}. Every rank must call it (it
        synchronises the ranks)."""
        import deepspeed.comm as ds_comm

        result = ds_comm.log_summary(return_dict=True) or {}
        return {op: {str(size): {k: figures[k] for k in REPORTED_FIGURES} for size, figures in sizes.items()}
                for op, sizes in (result.get("summary") or {}).items()}
