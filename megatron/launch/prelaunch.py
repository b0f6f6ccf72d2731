"""What deepy.py checks on the launching machine before any worker starts, so that a wrong path or an
unreachable host is reported in a second instead of by every worker half a minute later.

- files the workers will open: the data (train.py), the tokenizer files and the `load` directory
  (train.py, generate.py, eval.py), generate.py's sample_input_file, the local task YAML files / directories
  of eval_tasks (eval.py, and train.py's in-loop evaluation), and that train.py can write in `save`; on several nodes the same paths must exist on every node, and this
  checks the launching one;
- hosts: every host of a pdsh / Open MPI / MVAPICH launch answers passwordless ssh; the address of rank 0
  is known (master_addr, MASTER_ADDR, or `hostname -I` on the first host, as DeepSpeed's runner finds it);
- the master port, where rank 0 runs on this machine: one that is taken is replaced by a free one;
- a run whose checkpoint is already at train_iters, or at the end of train_epochs (nothing to train);
- more CPU ranks than this machine has cores (a warning);
- a machine without CUDA whose ranks all run here: fp16 is refused (it needs a CUDA GPU; choosing bf16 or fp32
  changes the numbers, so it is the user's choice), distributed_backend nccl is replaced by gloo with one note
  (the transport changes, not what the model computes; configs are shared with GPU clusters). Both are said
  once, here, instead of by every rank (several nodes: this machine's hardware says nothing about theirs, so
  the workers check it, megatron.initialize);
- the optional packages the enabled features need (tensorboard_dir, use_wandb, use_comet, eval_tasks, the
  tokenizer's...), found without importing them;
- a model that cannot fit one rank's memory (megatron.neox_arguments.memory's lower bound against this machine's
  GPU memory, or the CPU ranks' share of its RAM).

Each check returns messages naming the key and the file or host, so that deepy.py reports them all at once."""

import errno
import os
import re
import socket
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple

import psutil

from megatron.checkpoint.format import resume_tag
from megatron.checkpoint.non_persistent import non_persistent_problem
from megatron.checkpoint.run_lock import lock_problem
from megatron.data.data_efficiency import analysis_file_problems
from megatron.data.indexed_dataset import MMapIndexedDataset, dataset_exists, dataset_path_problem
from megatron.errors import CheckpointError, DataError
from megatron.evaluation.tasks import EvalTaskError, resolve_tasks
from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.neox_arguments.hostfile import DEFAULT_HOSTFILE, is_local_launch
from megatron.neox_arguments.launcher import WORKER_ENV_PREFIXES, active_hosts, multi_node_launch
from megatron.neox_arguments.memory import memory_problem
from megatron.post_training.data_paths import precomputed_path, reference_paths
from megatron.tokenizer.build_tokenizer import tokenizer_file_problems
from megatron.utils.text_files import utf8_problem
from megatron.training_schedule import iterations_for_epochs, training_iterations
from megatron.utils.optional_deps import missing_feature_packages

TRAINING_SCRIPTS = ("train.py",)
MODEL_SCRIPTS = ("train.py", "generate.py", "eval.py")
"""Worker scripts that build the tokenizer and load checkpoints (others, e.g. a user's own, are not checked)."""
SSH_TIMEOUT_S = 30
SSH_LAUNCHERS = ("pdsh", "openmpi", "mvapich")
"""Launchers that reach the nodes over ssh (srun does not)."""


def script_name(args: NeoXArgsSchema) -> str:
    return os.path.basename(args.user_script or "")


# ---- files ---------------------------------------------------------------------------------------------------
def data_problems(args: NeoXArgsSchema) -> List[str]:
    """Every data path (data_path, {train,valid,test}_data_paths, their pos_/neg_ pairwise forms,
    *_label_data_paths, *_reward_data_paths) whose .bin/.idx is missing."""
    paths: List[Tuple[str, str]] = []
    if args.data_path:
        paths.append(("data_path", args.data_path))
    for split in ("train", "valid", "test"):
        for key in (f"{pair}{split}_{kind}" for kind in ("data_paths", "label_data_paths", "reward_data_paths")
                    for pair in ("", "pos_", "neg_")):
            value = getattr(args, key, None)
            for path in ([value] if isinstance(value, str) else value or []):
                paths.append((key, path))
    problems = [p for p in (dataset_path_problem(path, key) for key, path in paths) if p]
    problems += analysis_file_problems(args.data_efficiency)  # data_sampling's difficulty analysis
    return problems or precomputed_problems(args) + pairwise_length_problems(args)


def precomputed_problems(args: NeoXArgsSchema) -> List[str]:
    """DPO / KTO with precompute_model_name read the precomputed reference log-probabilities of every data path
    (megatron.post_training.precompute); missing ones are named with the command that writes them."""
    if args.train_impl not in ("dpo", "kto") or not args.precompute_model_name or args.text_gen_type == "precompute":
        return []

    name = args.precompute_model_name
    missing = [path for path in (precomputed_path(p, name) for p in reference_paths(args)) if not dataset_exists(path)]
    return [f"precompute_model_name={name!r}: '{path}' (.bin/.idx) not found; write the reference log-probabilities "
            f"first: python deepy.py generate.py with the same config and text_gen_type: precompute"
            for path in missing]


def pairwise_length_problems(args: NeoXArgsSchema) -> List[str]:
    """dataset_impl 'pairwise': each chosen (pos_*) dataset must hold as many sequences as its rejected (neg_*)
    one, and labels as many as their data (read from the .idx headers, before any worker starts)."""
    if args.dataset_impl != "pairwise":
        return []
    problems = []
    for split in ("train", "valid", "test"):
        for label in ("", "label_"):
            pos = getattr(args, f"pos_{split}_{label}data_paths") or []
            neg = getattr(args, f"neg_{split}_{label}data_paths") or []
            for p, n in zip(pos, neg):
                try:
                    sizes = [len(MMapIndexedDataset(path, skip_warmup=True)) for path in (p, n)]
                except (DataError, OSError, TypeError) as exc:
                    problems.append(f"pos_{split}_{label}data_paths / neg_{split}_{label}data_paths: {exc}")
                    continue
                if sizes[0] != sizes[1]:
                    problems.append(f"pos_{split}_{label}data_paths '{p}' has {sizes[0]} sequences but "
                                    f"neg_{split}_{label}data_paths '{n}' has {sizes[1]}: each chosen sequence needs "
                                    f"its rejected one (make both from one JSONL file with "
                                    f"preprocess_data_with_chat_template.py --jsonl-keys chosen rejected)")
    return problems


def tokenizer_problems(args: NeoXArgsSchema) -> List[str]:
    return tokenizer_file_problems(args.tokenizer_type, args.vocab_file, args.merge_file)


def load_problems(args: NeoXArgsSchema) -> List[str]:
    """`load` must be a directory; one that does not exist is a fresh start only where the run saves there."""
    load = args.load
    if not load:
        return []
    if os.path.exists(load) and not os.path.isdir(load):
        return [f"load='{load}' is a file; it must be the checkpoint directory (the one holding 'latest')"]
    if not os.path.exists(load):
        if script_name(args) in TRAINING_SCRIPTS and args.save and os.path.abspath(args.save) == os.path.abspath(load):
            return []  # the first run of a config that saves and resumes in one directory
        what = "there is no checkpoint to resume from" if script_name(args) in TRAINING_SCRIPTS else \
            "there is no checkpoint to load"
        return [f"load directory '{load}' does not exist: {what}; fix the path, or remove load"
                + (" to train from scratch" if script_name(args) in TRAINING_SCRIPTS else "")]
    if args.iteration is not None and not os.path.isdir(os.path.join(load, f"global_step{args.iteration}")):
        steps = sorted(d for d in os.listdir(load) if d.startswith("global_step"))
        return [f"iteration={args.iteration}: no checkpoint '{os.path.join(load, f'global_step{args.iteration}')}' "
                f"(load='{load}' holds {', '.join(steps) or 'none'})"]
    if args.iteration is None:
        try:
            resume_tag(load)  # `latest` naming another directory, or a missing one with nothing in its place
        except CheckpointError as exc:
            return [str(exc)]
    return []


def save_problems(args: NeoXArgsSchema) -> List[str]:
    """Training must be able to write in `save` (a read-only or unwritable one failed only at the first
    save, after the whole startup, as "Parent directory ... does not exist"). Probed by creating a file. And no
    other training run may be writing there (megatron.checkpoint.run_lock; the workers take the lock itself)."""
    save = args.save
    if not save or script_name(args) not in TRAINING_SCRIPTS:
        return []
    problem = directory_write_problem("save", save, "each checkpoint is written inside it")
    if problem:
        return [problem]
    in_use = lock_problem(save)
    return [in_use] if in_use else []


def directory_write_problem(key: str, path: str, why: str) -> Optional[str]:
    """Why directory ``path`` (config key ``key``) cannot be created or written, or None. Probed by creating a
    file in it, or in its nearest existing parent: root ignores permission bits, not a read-only mount or an
    immutable attribute."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{key}='{path}' is a file; it must be a directory ({why})"
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{key}='{path}' cannot be created: '{existing}' is a file"
    try:
        handle, probe = tempfile.mkstemp(prefix=".neox_write_probe", dir=existing)
        os.close(handle)
        os.remove(probe)
    except OSError as exc:
        return (f"{key}='{path}' is not writable: creating a file in '{existing}' failed ({exc.strerror or exc}); "
                f"choose a directory this user can write, on a writable filesystem")
    return None


def data_cache_problems(args: NeoXArgsSchema) -> List[str]:
    """data_cache_path, where train.py caches the index maps when it is set, must be writable."""
    if not args.data_cache_path or script_name(args) not in TRAINING_SCRIPTS:
        return []
    problem = directory_write_problem("data_cache_path", args.data_cache_path, "the index maps are cached in it")
    return [problem] if problem else []


def checkpoint_iteration(load: Optional[str]) -> Optional[int]:
    """The iteration of the checkpoint `load/latest` names, or None."""
    if not load:
        return None

    try:
        tag = resume_tag(load)[0]
    except CheckpointError:  # load_problems reports it
        return None
    match = re.fullmatch(r"global_step(\d+)", tag or "")
    return int(match.group(1)) if match else None


def finished_run_message(args: NeoXArgsSchema) -> Optional[str]:
    """For train.py: a message when the checkpoint it would resume from is already at train_iters (with
    train_epochs, the iterations those epochs take, counted from the training data's index as the worker will)."""
    if script_name(args) not in TRAINING_SCRIPTS or args.do_train is False or args.finetune:
        return None
    if args.iteration is not None:
        return None
    done = checkpoint_iteration(args.load)
    if done is None:
        return None
    train_iters, limit = args.train_iters, f"train_iters={args.train_iters}"
    if train_iters is None and args.train_samples is not None and args.train_batch_size:
        train_iters = training_iterations(args)
        limit = f"train_samples={args.train_samples} ({train_iters} iterations)"
    elif train_iters is None and args.train_epochs is not None:
        try:
            train_iters = iterations_for_epochs(args)
        except (OSError, ValueError):  # an unreadable index: the worker reports it with its own message
            return None
        limit = f"train_epochs={args.train_epochs} ({train_iters} iterations)"
    if train_iters is None or done < train_iters:
        return None
    further = next(name for name in ("train_iters", "train_samples", "train_epochs") if getattr(args, name) is not None)
    return (f"nothing to train: the checkpoint in load='{args.load}' is at iteration {done} and {limit}; "
            f"raise {further} to train further (with override_lr_scheduler: true to stretch the learning-rate "
            f"schedule), or point save / load at a new directory to start again")


def sample_input_problems(args: NeoXArgsSchema) -> List[str]:
    """generate.py's prompts file (text_gen_type input-file), as the worker words it (generate.py)."""
    path = args.sample_input_file
    if args.text_gen_type != "input-file" or not path:
        return []
    if os.path.isfile(path):
        problem = utf8_problem(path)
        return [f"sample_input_file: {problem}"] if problem else []
    return [f"sample_input_file not found: {path!r} (set sample_input_file or -i to a text file with one prompt per "
            f"line)"]


def eval_task_problems(args: NeoXArgsSchema) -> List[str]:
    """eval_tasks entries that name a local file or directory which is missing or holds no task (task names of
    lm-eval's registry are looked up by the workers, which load lm-eval)."""
    if script_name(args) != "eval.py" and not args.eval_tasks:
        return []
    try:
        resolve_tasks(args.eval_tasks or [])
    except EvalTaskError as err:
        return [str(err)]
    return []


def file_problems(args: NeoXArgsSchema) -> List[str]:
    script = script_name(args)
    problems: List[str] = []
    if script in TRAINING_SCRIPTS:
        problems += data_problems(args)
        transient = non_persistent_problem(args)  # another run's save directory, whose checkpoints it would
        problems += [transient] if transient else []  # resume from and delete
    if script in MODEL_SCRIPTS:
        problems += tokenizer_problems(args) + load_problems(args)
    if script == "generate.py":
        problems += sample_input_problems(args)
    if script in ("eval.py", *TRAINING_SCRIPTS):
        problems += eval_task_problems(args)
    problems += save_problems(args) + data_cache_problems(args)
    return problems


# ---- packages ----------------------------------------------------------------------------------------------------
def package_problems(args: NeoXArgsSchema) -> List[str]:
    """The optional packages the enabled features need and this Python does not have (found without importing
    them; each training worker checks its own environment again before it starts, for nodes set up otherwise)."""
    return missing_feature_packages(args, script_name(args))


# ---- hosts -----------------------------------------------------------------------------------------------------
def _ssh(host: str, command: str, ssh_port: Optional[int] = None) -> subprocess.CompletedProcess:
    argv = ["ssh", "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}"]
    if ssh_port:
        argv += ["-p", str(ssh_port)]
    if not HOST_ADDRESS.match(host):  # shell_problems names it; never handed to ssh
        return subprocess.CompletedProcess(argv, 2, "", f"{host!r} is not a host name or address")
    try:
        # `--`: a host name is never read as one of ssh's options (-oProxyCommand=... runs a command)
        return subprocess.run(argv + ["--", host, command], capture_output=True, text=True,
                              timeout=SSH_TIMEOUT_S + 5, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", "ssh is not installed on this machine")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer within {SSH_TIMEOUT_S + 5} s")


def _hostfile_name(args: NeoXArgsSchema) -> str:
    return args.hostfile or DEFAULT_HOSTFILE


def host_problems(args: NeoXArgsSchema) -> List[str]:
    """Every host of a launch over ssh must answer `ssh HOST true` without a password (DeepSpeed's runner
    checks the first only, with a raw traceback)."""
    if args.launcher not in SSH_LAUNCHERS or args.no_ssh_check or not multi_node_launch(args):
        return []
    hosts = [host for host in active_hosts(args) if HOST_ADDRESS.match(host)]  # shell_problems names the others
    with ThreadPoolExecutor(max_workers=min(16, len(hosts) or 1)) as pool:
        results = list(pool.map(lambda h: _ssh(h, "true"), hosts))
    problems = []
    for host, result in zip(hosts, results):
        if result.returncode != 0:
            why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
            problems.append(f"hostfile '{_hostfile_name(args)}': host '{host}' does not answer passwordless ssh "
                            f"({why}); launcher={args.launcher} starts the workers over ssh: set up keys (README, "
                            f"'Multi-node'), fix the host name, or leave it out with exclude")
    return problems


HOST_ADDRESS = re.compile(r"^(?!-)[A-Za-z0-9._:%\[\]-]+$")
"""A host name, IPv4 or IPv6 address: nothing a shell would read as more than one word, nothing a command (ssh,
pdsh, mpirun) would read as an option (no leading '-')."""
PDSH_WORD = re.compile(r"^[\w@%+=:,./-]*$")
"""What DeepSpeed's pdsh runner leaves unquoted or double-quotes safely (its own test for quoting)."""


def shell_problems(args: NeoXArgsSchema, master_addr: Optional[str], environ=None) -> List[str]:
    """Values that a launcher would hand to a shell unquoted. master_addr and the hosts are addresses for every
    launcher. With pdsh, DeepSpeed's runner builds the command each node's shell runs from the working directory,
    the script path and the forwarded variables without quoting them (variables with other characters only
    double-quoted, where `$(...)` and backquotes still run): those must be plain words there."""
    environ = os.environ if environ is None else environ
    problems = []
    if master_addr and not HOST_ADDRESS.match(master_addr):
        problems.append(f"master_addr={master_addr!r} is not a host name or address (only letters, digits and "
                        f"'.:-_%[]'); the launchers pass it to shells and to every rank")
    if multi_node_launch(args):
        hostfile = _hostfile_name(args)
        if hostfile.startswith("-"):  # DeepSpeed's runner hands it to mpirun as `-hostfile PATH`
            problems.append(f"hostfile '{hostfile}' begins with '-', which mpirun would read as an option; write "
                            f"./{hostfile}")
        for host in active_hosts(args):
            if not HOST_ADDRESS.match(host):
                problems.append(f"hostfile '{_hostfile_name(args)}': host {host!r} is not a host name or address")
    if args.launcher == "pdsh" and multi_node_launch(args):
        from deepspeed.launcher.runner import EXPORT_ENVS


        words = {"the working directory": os.path.abspath("."), "the user script": args.user_script or ""}
        words.update({f"the variable {name}": value for name, value in environ.items()
                      if any(name.startswith(p) for p in (*EXPORT_ENVS, *WORKER_ENV_PREFIXES))})
        for what, value in words.items():
            if not PDSH_WORD.match(value):
                problems.append(f"launcher=pdsh: DeepSpeed's runner writes {what} ({value[:80]!r}) into the shell "
                                f"command every node runs without quoting it, so its characters outside "
                                f"letters, digits and '@%+=:,./-' would be read by that shell; rename or move it, "
                                f"or unset the variable (openmpi and slurm pass values as arguments, unquoted "
                                f"values are no problem there)")
    return problems


def resolve_master_addr(args: NeoXArgsSchema) -> Tuple[Optional[str], List[str]]:
    """(master_addr to use, problems). Local launches use 127.0.0.1 (the runner's choice); several nodes use
    master_addr, else MASTER_ADDR from the environment (as GPT-NeoX), else the first address `hostname -I`
    prints on the first host, the way DeepSpeed's runner finds it. srun and mpirun do not pass the runner's
    choice on to the workers, so deepy.py settles it here and puts it in the config."""
    if args.master_addr:
        return args.master_addr, []
    if not multi_node_launch(args):
        return None, []
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"], []
    hosts = active_hosts(args)
    if not hosts or not HOST_ADDRESS.match(hosts[0]):  # shell_problems names a host that is no host name
        return None, []
    fix = (f"set master_addr to the address of '{hosts[0]}' (rank 0's host) that the other nodes reach, or export "
           f"MASTER_ADDR")
    if args.no_ssh_check or args.launcher not in SSH_LAUNCHERS:
        return None, [f"master_addr is not set and launcher={args.launcher} gives the workers no address of rank 0 "
                      f"(no ssh to look it up with no_ssh_check / srun); {fix}"]
    result = _ssh(hosts[0], "hostname -I")
    addresses = result.stdout.split() if result.returncode == 0 else []
    if not addresses:
        why = (result.stderr.strip().splitlines() or ["it printed no address"])[-1]
        return None, [f"master_addr is not set and `ssh {hosts[0]} hostname -I` did not give rank 0's address "
                      f"({why}); {fix}"]
    return addresses[0], []


# ---- master port ------------------------------------------------------------------------------------------------
def _is_local_address(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((addr, 0))
        return True
    except OSError:
        return False


def port_in_use(port: int) -> bool:
    """Whether rank 0 could not listen on `port` here (torch's TCPStore listens on every address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def master_port_note(args: NeoXArgsSchema, master_addr: Optional[str]) -> Tuple[Optional[int], Optional[str]]:
    """(replacement port, note) when rank 0 runs on this machine and master_port is taken; (None, None) else."""
    local = is_local_launch(args.hostfile) and not multi_node_launch(args)
    if not local and not (master_addr and _is_local_address(master_addr)):
        return None, None
    if not port_in_use(args.master_port):
        return None, None
    port = free_port()
    return port, (f"master_port {args.master_port} is in use on this machine (another run?); rank 0 listens on "
                  f"free port {port} instead (set master_port to choose one)")


# ---- CPU ----------------------------------------------------------------------------------------------------------
def all_ranks_here(args: NeoXArgsSchema) -> bool:
    """Whether every rank runs on this machine (no hostfile, or one that is this machine only)."""
    return is_local_launch(args.hostfile) and not multi_node_launch(args)


def _cuda_available() -> bool:
    import torch  # only for the configs that need the answer: the launcher starts without torch

    return torch.cuda.is_available()


def device_problems(args: NeoXArgsSchema, has_cuda: Optional[bool] = None) -> List[str]:
    """fp16 where every rank runs on this machine and it has no CUDA GPU (``has_cuda``: default, torch's answer)."""
    fp16 = args.precision == "fp16" or (isinstance(args.fp16, dict) and bool(args.fp16.get("enabled")))
    if not fp16 or not all_ranks_here(args):
        return []
    if has_cuda if has_cuda is not None else _cuda_available():
        return []
    return ["fp16 needs a CUDA GPU and this machine, where the ranks would run, has none; on CPU use "
            "bf16: {enabled: true} or fp32 (remove the fp16 dict)"]


def cpu_backend_note(args: NeoXArgsSchema, has_cuda: bool) -> Optional[str]:
    """The one line saying that CPU ranks use gloo where the config asks for nccl (megatron.initialize switches)."""
    if args.distributed_backend != "nccl" or has_cuda or not all_ranks_here(args):
        return None
    return ("distributed_backend=nccl needs CUDA and this machine has none: the ranks communicate with gloo "
            "(set distributed_backend: gloo to say so in the config)")


def cpu_oversubscription_warning(args: NeoXArgsSchema, has_cuda: bool) -> Optional[str]:
    if has_cuda or not is_local_launch(args.hostfile) or multi_node_launch(args):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = args.global_num_gpus or 1
    if ranks <= cores:
        return None
    return (f"num_gpus={ranks}: {ranks} CPU ranks on this machine's {cores} cores; they will compete for the "
            f"cores and run many times slower than {cores} ranks would (lower num_gpus to {cores} or fewer)")


def gpu_memory_bytes() -> Optional[int]:
    """The memory of the smallest GPU on this machine (nvidia-smi; torch is not imported here), None without one."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [int(line) for line in result.stdout.split() if line.strip().isdigit()] if result.returncode == 0 else []
    return min(sizes) * 2 ** 20 if sizes else None


def memory_problems(args: NeoXArgsSchema, gpu_bytes: Optional[int] = None,
                    ram_bytes: Optional[int] = None) -> List[str]:
    """A model that cannot fit one rank's memory (megatron.neox_arguments.memory), before any process starts: on
    this machine's GPUs, or for CPU ranks in their share of its RAM. Only for a launch on this machine (other
    nodes' memory is not known here). ``gpu_bytes`` / ``ram_bytes``: measured here when not given (tests)."""
    if not is_local_launch(args.hostfile) or multi_node_launch(args):
        return []
    training = script_name(args) in TRAINING_SCRIPTS
    gpu_bytes = gpu_memory_bytes() if gpu_bytes is None and ram_bytes is None else gpu_bytes
    if gpu_bytes is not None:
        problem = memory_problem(args, training, gpu_bytes, "the memory of the smallest GPU here", on_gpu=True)
    else:
        ranks = max(args.global_num_gpus or 1, 1)
        total = ram_bytes if ram_bytes is not None else psutil.virtual_memory().total
        problem = memory_problem(args, training, total // ranks, f"its share of this machine's "
                                 f"{total / 2 ** 30:,.1f} GiB of RAM over {ranks} CPU rank(s)", on_gpu=False)
    return [problem] if problem else []
