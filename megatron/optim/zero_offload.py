"""ZeRO-Offload: the rules for DeepSpeed's ``zero_optimization.offload_optimizer`` / ``offload_param`` sections.

DeepSpeed does the offloading itself (the optimizer states and step on the CPU, or swapped to NVMe through its
async I/O op; ZeRO-3's parameters likewise). What this module adds is what DeepSpeed would only say late, or
never, as one message per problem naming the key and the fix:

* ``offload_problems`` (validation, before anything is launched): the device names, the ZeRO stages each section
  works at, ``nvme_path`` for NVMe, and the optimizer DeepSpeed insists on when the optimizer is offloaded
  (``CPU_Adam``, i.e. DeepSpeedCPUAdam, unless ``zero_force_ds_cpu_optimizer: false`` is passed to DeepSpeed
  through ``deepspeed_extra_args``);
* ``offload_device_problems`` (where the workers start): NVMe needs DeepSpeed's ``async_io`` op, which builds only
  where libaio is installed.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional

OFFLOAD_SECTIONS = {"offload_optimizer": 1, "offload_param": 3}
"""Each offload section of zero_optimization and the lowest ZeRO stage DeepSpeed offloads it at."""

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
LIBAIO_HINT = ("install libaio where the workers run (Debian/Ubuntu: apt-get install libaio-dev; RHEL: "
               "yum install libaio-devel), or offload to device 'cpu'")


def offload_devices(zero_optimization: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """{section: device} for the offload sections that move something off the accelerator."""
    devices = {}
    for section in OFFLOAD_SECTIONS:
        value = (zero_optimization or {}).get(section)
        if isinstance(value, Mapping) and value.get("device", "none") not in (None, "none"):
            devices[section] = value["device"]
    return devices


def offload_problems(zero_stage: Any, zero_optimization: Optional[Mapping[str, Any]], optimizer_type: str,
                     deepspeed_extra_args: Optional[Mapping[str, Any]]) -> List[str]:
    """What DeepSpeed would refuse (or silently ignore) in the offload sections of zero_optimization."""
    problems = []
    for section, lowest_stage in OFFLOAD_SECTIONS.items():
        value = (zero_optimization or {}).get(section)
        if value is None:
            continue
        key = f"zero_optimization.{section}"
        if not isinstance(value, Mapping):
            problems.append(f"{key}={value!r} must be a dict such as {{device: cpu, pin_memory: true}}")
            continue
        device = value.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            problems.append(f"{key}.device={device!r} must be one of {', '.join(OFFLOAD_DEVICES)}")
            continue
        if device == "none":
            continue
        if isinstance(zero_stage, int) and zero_stage < lowest_stage:
            stages = "ZeRO stage 3" if lowest_stage == 3 else "ZeRO stages 1, 2 and 3"
            problems.append(f"{key}.device={device!r} needs {stages} (DeepSpeed offloads nothing at stage "
                            f"{zero_stage}); set zero_optimization.stage to {lowest_stage if lowest_stage == 3 else 2}"
                            f" or remove {key}")
        if device == "nvme" and not value.get("nvme_path"):
            problems.append(f"{key}.device='nvme' needs {key}.nvme_path, a directory on the NVMe drive")
    forced = (deepspeed_extra_args or {}).get("zero_force_ds_cpu_optimizer", True)
    if "offload_optimizer" in offload_devices(zero_optimization) and optimizer_type != "cpu_adam" and forced:
        problems.append(f"zero_optimization.offload_optimizer runs the optimizer step on the CPU, which DeepSpeed "
                        f"does with its CPU Adam only: set optimizer.type to CPU_Adam (optimizer type "
                        f"{optimizer_type!r} is configured), or pass deepspeed_extra_args: "
                        f"{{zero_force_ds_cpu_optimizer: false}} to offload another optimizer (slow)")
    return problems


def _async_io_builds() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def offload_device_problems(zero_optimization: Optional[Mapping[str, Any]],
                            async_io_builds: Callable[[], bool] = _async_io_builds) -> List[str]:
    """What this worker cannot offload to: NVMe needs DeepSpeed's async_io op (checked only when asked for)."""
    nvme = [section for section, device in offload_devices(zero_optimization).items() if device == "nvme"]
    if not nvme or async_io_builds():
        return []
    keys = " and ".join(f"zero_optimization.{section}.device='nvme'" for section in nvme)
    return [f"{keys} needs DeepSpeed's async I/O op (async_io), which cannot be built on this worker because "
            f"libaio is missing; {LIBAIO_HINT}"]
