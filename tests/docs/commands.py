"""What becomes of each shell command of the documentation (tests/docs/extract.py finds them): run by tests/docs
itself (RUN), run by another test of the suite (Mapped: the test files, and the words each must contain: the
command's script and its key flags), or not run, with the reason (NotRun). tests/docs/test_commands.py fails on a
documented command missing here and on an entry whose command left the documentation."""
from dataclasses import dataclass
from typing import Dict, Tuple, Union


@dataclass(frozen=True)
class Run:
    """Run by tests/docs/test_commands.py (`how` says which test)."""
    how: str


@dataclass(frozen=True)
class Mapped:
    """Run by other tests: {test file: words it must contain}; `note` says what part of the command they run, and why
    the flags in `unchecked` (which no mapped test names) are not run."""
    tests: Dict[str, Tuple[str, ...]]
    note: str = ""
    unchecked: Tuple[str, ...] = ()


@dataclass(frozen=True)
class NotRun:
    """Not run by any test; `category` is one of CATEGORIES, `reason` says why."""
    category: str
    reason: str


@dataclass(frozen=True)
class RunAsWritten:
    """Run as the page writes it by `test`, which reads the page's ```bash blocks and runs them (so the words cannot
    drift from what runs)."""
    test: str
    page: str


CATEGORIES = ("install", "suite", "gpu", "multi-host", "benchmark", "network", "server")
Entry = Union[Run, Mapped, NotRun, RunAsWritten]

OWN_DATA = Run("test_own_data_recipe: a tiny JSONL through the commands as written, then deepy.py's checks of the "
               "config they make")
TRAIN_E2E = "tests/e2e/test_train.py"
RUN_ALL = Mapped({"tests/bench/test_run_all.py": ("run_all", "--list", "each_command_parses")},
                 "every command run_all.py runs is checked to parse with its script's options, and --list runs; "
                 "the runs themselves are the benchmarks (about 20 minutes; each script has its own tiny-size test)",
                 unchecked=("--all", "--only", "--out"))
FINE_TUNING_EXAMPLE = RunAsWritten("tests/tools/test_fine_tuning_doc.py", "docs/fine-tuning.md")
INSTALL = NotRun("install", "changes the Python environment; .ci/run installs with it on every CI run, and "
                            "tests/test_requirements_lock.py checks every install line of README takes the lock")

COMMANDS: Dict[str, Entry] = {
    # README: the two commands
    "pip install -e . -c requirements/constraints.txt": INSTALL,
    "python tools/datasets/analyze_difficulty.py my_config.yml --metrics vocab_rarity --save-path data/difficulty":
        Mapped({"tests/e2e/test_data_efficiency.py": ("analyze_difficulty.py", "--metrics", "vocab_rarity",
                                                      "--save-path")},
               "the tool over a training run's own config, then that run with the analysis"),
    "python tools/datasets/prepare_data.py": Mapped(
        {"tests/tools/test_prepare_data.py": ("prepare_data", "stdlib")},
        "the stdlib corpus end to end (corpus, tokenizer, .bin/.idx) and its reuse"),
    "python deepy.py train.py configs/quickstart.yml": Mapped(
        {"tests/configs/test_configs.py": ("quickstart.yml", "training_problems"),
         TRAIN_E2E: ("TrainingRun", "launch")},
        "the 300-step run itself takes minutes: its config is validated, and deepy.py train.py trains, saves and "
        "resumes on CPU ranks in the e2e tests"),
    "python deepy.py generate.py configs/quickstart.yml configs/text_generation.yml -o samples.jsonl": Mapped(
        {"tests/e2e/test_generate.py": ("generate.py", "text_generation.yml", "sample_output_file")}),
    ".ci/install-cluster-packages": NotRun("install", "installs Debian's sshd, pdsh, Open MPI and slurm as root; "
                                                      ".ci/run runs it"),
    "pip install -q -e . -r requirements/requirements-dev.txt -c requirements/constraints.txt": INSTALL,
    "python -m pytest -q -n 2 --dist loadfile": NotRun("suite", "the test suite itself; test_ci_runs_the_readme_"
                                                                "test_command checks .ci/run runs exactly it"),
    # README: your own data
    "python tools/tokenizers/train_tokenizer.py --input my_corpus.jsonl --output data/mine/tokenizer.json "
    "--vocab-size 8192": OWN_DATA,
    "python tools/datasets/preprocess_data.py --input my_corpus.jsonl --output-prefix data/mine/mine "
    "--tokenizer-type HFTokenizer --vocab-file data/mine/tokenizer.json --append-eod": OWN_DATA,
    "cp configs/quickstart.yml my_model.yml": OWN_DATA,
    "python deepy.py train.py my_model.yml": Mapped(
        {TRAIN_E2E: ("test_sigterm_to_deepy_alone_reaches_every_rank_which_saves_and_exits_interrupted",
                     "SIGTERM", "resume")},
        "deepy.py's checks of my_model.yml run in test_own_data_recipe; training, the stop by SIGTERM and the "
        "resume in the e2e test"),
    "python deepy.py generate.py my_model.yml configs/text_generation.yml -o samples.jsonl": Mapped(
        {"tests/e2e/test_generate.py": ("generate.py", "text_generation.yml", "sample_output_file")}),
    "python tools/ckpts/convert_neox_to_hf.py --input_dir checkpoints/mine --output_dir hf/mine": Mapped(
        {"tests/tools/test_convert_neox_to_hf.py": ("convert_neox_to_hf.py", "--input_dir", "--output_dir")}),
    "python deepy.py eval.py my_model.yml --eval_tasks my_tasks/": Mapped(
        {"tests/e2e/test_eval.py": ("eval.py", "eval_tasks", "tasks")}, "local task files, offline"),
    # docs/development.md
    "PYTHONPATH=$PWD DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m pytest -q -x -p no:cacheprovider tests/docs":
        NotRun("suite", "runs these tests"),
    "python -m pytest -q -m not slow -n 2": NotRun("suite", "the fast tier of the suite"),
    "requirements/refresh-lock.sh": NotRun("network", "resolves every requirement afresh from the package index "
                                                      "into a new venv (minutes); tests/test_requirements_lock.py "
                                                      "checks the lock it writes"),
    "python -m megatron.neox_arguments.docs": Mapped(
        {"tests/neox_arguments/test_schema.py": ("neox_arguments.md", "render()")},
        "the committed reference equals what the command writes"),
    "mkdocs serve": NotRun("server", "serves until stopped; mkdocs build --strict runs here"),
    "mkdocs build --strict -d /tmp/site": Run("test_the_site_builds_strict, into a temporary folder"),
    # docs/evaluation.md, docs/getting-started.md, configs/README.md
    "python deepy.py generate.py configs/quickstart.yml configs/text_generation.yml -i prompts.txt -o samples.jsonl":
        Mapped({"tests/e2e/test_generate.py": ("generate.py", "text_generation.yml", '"-i"', '"-o"')}),
    "python deepy.py eval.py configs/quickstart.yml --eval_tasks lambada_openai my_tasks/ --load "
    "checkpoints/quickstart --iteration 200": Mapped(
        {"tests/e2e/test_eval.py": ("eval.py", "eval_tasks", "iteration"),
         "tests/configs/test_configs.py": ("--load", "--eval_tasks")},
        "registry tasks need the Hugging Face hub: the tests run local tasks"),
    "python deepy.py train.py configs/125M.yml configs/local_setup.yml": Mapped(
        {"tests/configs/test_configs.py": ("125M.yml", "local_setup.yml")},
        "125M on CPU would take hours: the config combination is validated"),
    "python deepy.py generate.py configs/125M.yml configs/local_setup.yml configs/text_generation.yml -i prompts.txt "
    "-o samples.jsonl": Mapped(
        {"tests/configs/test_configs.py": ("125M.yml", "local_setup.yml"),
         "tests/e2e/test_generate.py": ("generate.py", "text_generation.yml", '"-i"', '"-o"')}),
    "python deepy.py generate.py configs/125M.yml configs/local_setup.yml configs/text_generation.yml": Mapped(
        {"tests/configs/test_configs.py": ("125M.yml", "local_setup.yml"),
         "tests/e2e/test_generate.py": ("generate.py", "text_generation.yml")}),
    "python deepy.py eval.py configs/125M.yml configs/local_setup.yml --eval_tasks lambada_openai my_tasks/": Mapped(
        {"tests/configs/test_configs.py": ("125M.yml", "local_setup.yml"),
         "tests/e2e/test_eval.py": ("eval.py", "eval_tasks")},
        "registry tasks need the Hugging Face hub: the tests run local tasks"),
    "python deepy.py --help": Run("test_help_commands"),
    "pip install -r requirements/requirements-transformers.txt -r requirements/requirements-eval.txt -c "
    "requirements/constraints.txt": INSTALL,
    # docs/gpu.md
    "python bench/gpu_check.py --prepare-wheels": NotRun("network", "downloads DeepSpeed's wheels from the package "
                                                                    "index"),
    "python bench/gpu_check.py": NotRun("gpu", "the GPU check needs a CUDA GPU; its --cpu-dry-run runs in CI"),
    "python bench/gpu_check.py --cpu-dry-run": Mapped(
        {"tests/bench/test_gpu_check.py": ("bench/gpu_check.py", "--cpu-dry-run")}),
    # docs/multi-node.md
    'ssh-keygen -t ed25519 -N "" -f ~/.ssh/id_ed25519': NotRun("multi-host", "creates your ssh key"),
    "ssh-copy-id node-0": NotRun("multi-host", "installs your key on a host of your cluster"),
    "ssh-copy-id node-1": NotRun("multi-host", "installs your key on a host of your cluster"),
    "ssh node-1 true": NotRun("multi-host", "checks passwordless ssh to a host of your cluster; deepy.py checks the "
                                            "same before launch (tests/e2e/test_prelaunch.py)"),
    "python deepy.py train.py configs/125M.yml configs/local_setup.yml -H hostfile --launcher pdsh": Mapped(
        {"tests/e2e/test_multinode.py": ("pdsh", "hostfile", "cluster.hostfile")},
        "two hosts of one machine in a network namespace (skips, saying why, where it cannot be built)"),
    "python deepy.py train.py configs/125M.yml configs/local_setup.yml -H hostfile --launcher openmpi": Mapped(
        {"tests/e2e/test_multinode.py": ("openmpi", "hostfile", "mpirun")},
        "two hosts of one machine in a network namespace"),
    "sbatch --nodes=2 --ntasks-per-node=8 --gres=gpu:8 tools/slurm/train.sbatch configs/125M.yml "
    "configs/slurm_local.yml": Mapped(
        {"tests/e2e/test_multinode.py": ("sbatch", "train.sbatch", "slurm_local.yml", "--nodes", "--ntasks-per-node")},
        "one and two nodes of a slurm cluster on one machine, which has no GPUs to ask for", unchecked=("--gres",)),
    # docs/post-training.md
    "python tools/datasets/preprocess_data_with_chat_template.py --input sft.jsonl --output-prefix data/sft/train "
    "--tokenizer-path HF_TOKENIZER_FOLDER --jsonl-keys messages": Mapped(
        {"tests/data/test_chat_template.py": ("preprocess_data_with_chat_template", "--tokenizer-path",
                                              "--jsonl-keys", "messages")}),
    "python tools/datasets/preprocess_data_with_chat_template.py --input pairs.jsonl --output-prefix "
    "data/pairwise/dpo_train --tokenizer-path HF_TOKENIZER_FOLDER --jsonl-keys chosen rejected --only-last": Mapped(
        {"tests/e2e/test_post_training.py": ("preprocess_data_with_chat_template", "--tokenizer-path",
                                             "--jsonl-keys", "--only-last", "chosen", "rejected")}),
    "python tools/datasets/make_chat_example.py": Mapped(
        {"tests/data/test_docstring_chat.py": ("make_chat_example",)}),
    "python deepy.py train.py configs/cpu_tiny.yml": Mapped(
        {"tests/configs/test_configs.py": ("cpu_tiny.yml", "test_the_post_training_example_chains"),
         TRAIN_E2E: ("TrainingRun",)},
        "the example's runs take minutes: the chain of its configs is checked, and training through deepy.py runs "
        "in the e2e tests"),
    "python deepy.py train.py configs/post_training/sft_tiny.yml": Mapped(
        {"tests/configs/test_configs.py": ("sft_tiny.yml",),
         "tests/e2e/test_post_training.py": ("TrainingRun", "train_impl")},
        "the config chain; post-training through deepy.py in the e2e test"),
    "python deepy.py train.py configs/post_training/dpo_tiny.yml": Mapped(
        {"tests/configs/test_configs.py": ("dpo_tiny.yml",),
         "tests/e2e/test_post_training.py": ("dpo", "resumes")}),
    "python deepy.py eval.py configs/post_training/dpo_tiny.yml --load checkpoints/cpu_tiny_dpo --eval_tasks "
    "data/chat_example/tasks/docstring_mc.yaml data/chat_example/tasks/docstring_mc_seen.yaml": Mapped(
        {"tests/configs/test_configs.py": ("dpo_tiny.yml", "--load", "--eval_tasks", "docstring_mc.yaml"),
         "tests/e2e/test_eval.py": ("eval.py", "eval_tasks")},
        "deepy.py parses this command line and its task file's path; eval.py on local tasks in the e2e test"),
    "python tools/rollout_server.py --save checkpoints/cpu_tiny_reinforce --reward "
    "megatron.post_training.example_rewards:letter_e_count --port 10000 &": Mapped(
        {"tests/e2e/test_reinforce_online.py": ("rollout_server.py", "--save", "--reward", "--port"),
         "tests/post_training/test_reinforce.py": ("megatron.post_training.example_rewards:letter_e_count",)},
        "the server on 127.0.0.1 beside a deepy.py REINFORCE run (with a reward module of the test's, imported from "
        "the current directory), restarted mid-run; the example's reward entry point is loaded and scored"),
    "python deepy.py train.py configs/post_training/reinforce_tiny.yml": Mapped(
        {"tests/configs/test_configs.py": ("reinforce_tiny.yml", "test_the_reinforce_example"),
         "tests/e2e/test_reinforce_online.py": ("TrainingRun", "reinforce", "online", "deepy.py")},
        "the example needs cpu_tiny's checkpoint (minutes): its config chain is checked, and the same loop with a "
        "tiny model runs through deepy.py in the e2e test"),
    # bench/README.md
    "python bench/packed_attention_memory.py": Mapped(
        {"tests/bench/test_packed_attention_memory.py": ("packed_attention_memory",)}, "at tiny sizes, in-process"),
    # tools/ckpts/README.md
    "python tools/ckpts/upgrade_checkpoint.py --input_dir checkpoints/old/global_step1000 --output_dir "
    "checkpoints/new": Mapped(
        {"tests/checkpoint_conversion/test_old_layouts.py": ("tools/ckpts/upgrade_checkpoint.py", "--input_dir",
                                                             "--output_dir")}),
    "python tools/ckpts/convert_neox_to_hf.py --input_dir checkpoints/global_step1000 --output_dir hf/my-model "
    "[--config_file configs/my-model.yml configs/local_setup.yml] [--architecture neox|llama|mistral|mixtral|qwen2|olmo|mamba] "
    "[--precision fp32|bf16|fp16]": Mapped(
        {"tests/tools/test_convert_neox_to_hf.py": ("convert_neox_to_hf.py", "--input_dir", "--config_file",
                                                    "--architecture"),
         "tests/checkpoint_conversion/test_hf_roundtrip.py": ("precision",)}),
    "python tools/ckpts/convert_hf_to_neox.py --hf_dir hf/my-model --output_dir checkpoints/my-model --config_out "
    "configs/my-model.yml [--model_parallel_size 2] [--pipe_parallel_size 1]": Mapped(
        {"tests/tools/test_convert_hf_to_neox.py": ("convert_hf_to_neox", "--hf_dir", "--config_out",
                                                    "--model_parallel_size", "--pipe_parallel_size")}),
    "python deepy.py generate.py configs/my-model.yml configs/text_generation.yml": Mapped(
        {"tests/tools/test_convert_hf_to_neox.py": ("generate.py", "--config_out")}),
    "python deepy.py train.py configs/my-model.yml configs/my-finetuning-data-and-optimizer.yml": Mapped(
        {"tests/tools/test_convert_hf_to_neox.py": ("train.py", "--config_out"),
         "tests/e2e/test_gpt_neox_checkpoints.py": ("convert_hf_to_neox", "finetune")}),
    # docs/fine-tuning.md
    "python deepy.py train.py configs/125M.yml configs/local_setup.yml --set train_iters=100 --set "
    "optimizer.params.lr=3e-4": Mapped(
        {"tests/launch/test_set_overrides.py": ("--set", "train_iters=100", "optimizer.params.lr=3e-4")},
        "the overrides on a small config in-process (125M would need its data); the worked example below launches "
        "with --set"),
    "python - <<PY": FINE_TUNING_EXAMPLE,
    "python tools/ckpts/convert_hf_to_neox.py --hf_dir tiny-llama --output_dir checkpoints/tiny-llama --config_out "
    "tiny-llama.yml --model_parallel_size 2": FINE_TUNING_EXAMPLE,
    "python tools/datasets/preprocess_data.py --input documents.jsonl --output-prefix data/counting --tokenizer-type "
    "HFTokenizer --vocab-file tiny-llama/tokenizer.json --append-eod --no-progress": FINE_TUNING_EXAMPLE,
    "cat > finetune.yml <<YML": FINE_TUNING_EXAMPLE,
    "python deepy.py train.py tiny-llama.yml finetune.yml --set train_iters=60 --set optimizer.params.lr=3e-3":
        FINE_TUNING_EXAMPLE,
    "python tools/ckpts/convert_neox_to_hf.py --input_dir checkpoints/tiny-llama-finetuned --output_dir "
    "tiny-llama-finetuned --architecture llama": FINE_TUNING_EXAMPLE,
    "printf w10 w11 w12\\nw50 w51\\nw7 w99 w3\\n > prompts.txt": FINE_TUNING_EXAMPLE,
    "python deepy.py generate.py tiny-llama.yml --num_gpus 2 --load checkpoints/tiny-llama-finetuned -i prompts.txt "
    "-o samples.jsonl --set temperature=0.0 --set maximum_tokens=8": FINE_TUNING_EXAMPLE,
    "python tools/datasets/preprocess_data_with_chat_template.py --input chat.jsonl --output-prefix data/chat "
    "--tokenizer-path tiny-llama --jsonl-keys messages --no-progress": FINE_TUNING_EXAMPLE,
    "cat > lora.yml <<YML": FINE_TUNING_EXAMPLE,
    "python deepy.py train.py tiny-llama.yml lora.yml --set seq_length=16": FINE_TUNING_EXAMPLE,
    "printf <|user|> w5 w6 w7 <|assistant|>\\n<|user|> w12 w13 w14 <|assistant|>\\n<|user|> w19 w20 w21 "
    "<|assistant|>\\n > chat-prompts.txt": FINE_TUNING_EXAMPLE,
    "python deepy.py generate.py tiny-llama.yml --num_gpus 2 --load checkpoints/tiny-llama-merged -i chat-prompts.txt "
    "-o chat-samples.jsonl --set temperature=0.0 --set maximum_tokens=6": FINE_TUNING_EXAMPLE,
    "python tools/ckpts/merge_lora.py --input_dir checkpoints/tiny-llama-lora --output_dir "
    "checkpoints/tiny-llama-merged": FINE_TUNING_EXAMPLE,
    "python tools/ckpts/convert_neox_to_hf.py --input_dir checkpoints/tiny-llama-merged --output_dir "
    "tiny-llama-merged --architecture llama": FINE_TUNING_EXAMPLE,
    "python tools/ckpts/export_lora_to_peft.py --input_dir checkpoints/tiny-llama-lora --output_dir "
    "tiny-llama-adapter --architecture llama": FINE_TUNING_EXAMPLE,
    # docs/guarantees.md
    "PYTHONPATH=$PWD DS_ACCELERATOR=cpu python -m pytest -q -m attack tests/": NotRun(
        "suite", "the attack suite, part of every run of the test suite (its account prints at the end)"),
    # docs/running.md
    "python deepy.py train.py configs/quickstart.yml --verbose": Mapped(
        {"tests/e2e/test_prelaunch.py": ("--verbose", "log_level"), "tests/e2e/test_multinode.py": ("--verbose",)},
        "the flag's effect on DeepSpeed's runner in-process; the multi-node launches read the runner's log with it"),
    # docs/gpt-neox-extras.md
    "nsys profile -s none -t nvtx,cuda -o out --force-overwrite true --capture-range=cudaProfilerApi "
    "--capture-range-end=stop python deepy.py train.py ...": NotRun(
        "gpu", "NVIDIA's nsys on a CUDA machine; the NVTX ranges and cudaProfilerStart/Stop calls it captures are "
               "checked in order with CUDA faked (tests/observability/test_profiler.py)"),
    "python bench/run_all.py": RUN_ALL,
    "python bench/run_all.py --all": RUN_ALL,
    "python bench/run_all.py --list": RUN_ALL,
    "python bench/run_all.py --only moe,recurrent --out tables.md": RUN_ALL,
}
