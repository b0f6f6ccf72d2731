"""NeoXArgsMoE: Mixture-of-experts settings.

Fields, types and defaults follow the GPT-NeoX argument reference; the docs say what each does here
(megatron/model/moe)."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsMoE:
    """Mixture-of-experts settings. Built: the dropless layer (moe_type megablocks, GPT-NeoX's dMoE) in plain
    PyTorch, with pipeline, data and tensor parallelism (the experts split over the tensor-parallel ranks, as
    GPT-NeoX's dMoE); DeepSpeed's token-dropping layer (moe_type deepspeed) with data and tensor parallelism (its
    experts replicated over the tensor-parallel ranks, or split with enable_expert_tensor_parallelism) and ZeRO 0-2;
    expert parallelism for both (moe_expert_parallel_size); sequence_parallel for both, with and without expert
    parallelism (the layers gather the sequence); DeepSpeed's layer and expert parallelism in a pipeline with data
    and tensor parallelism (PP x DP x TP), with the per-parameter logs; conversion to Hugging Face's Mixtral.
    Not built yet, and refused with a message: tutel. Every MoE setting
    written while moe_num_experts is 1 is refused (nothing would read it)."""

    expert_interval: int = 2
    """
    Have one MoE layer every expert_interval layers: layers 0, expert_interval, 2 x expert_interval, ... (0-based)
    have a mixture of experts in place of the MLP. GPT-NeoX's older name of moe_expert_interval: the one written
    wins; both written with different values is an error; neither written gives 2.
    """

    moe_top_k: int = 1
    """
    Activate top K experts in MoE: each token goes to this many different experts (1 <= moe_top_k <=
    moe_num_experts).
    """

    use_tutel: bool = False
    """
    Use Tutel optimizations in MoE. Not supported: true is refused, since tutel cannot be installed as a
    dependency (it is not on PyPI; it installs from its GitHub repository and builds CUDA kernels). Tutel
    accelerates DeepSpeed's layer (moe_type deepspeed), which runs without it.
    """

    moe_num_experts: int = 1
    """
    Number of MoE experts. 1: no mixture of experts; > 1: the layers expert_interval picks have this many expert
    MLPs and a router.
    """

    moe_loss_coeff: float = 0.1
    """
    Coefficient for MoE loss: the load-balancing loss of each MoE layer (E x sum_e f_e x P_e, f_e the fraction of
    routed slots and P_e the mean router probability of expert e; 1 when balanced) times this is added to the LM
    loss for the gradients, and logged separately as moe_aux_loss (the sum over MoE layers). 0 switches it off.
    """

    moe_train_capacity_factor: float = 1.0
    """
    The capacity of the expert at train time (moe_type deepspeed with moe_token_dropping; setting it without
    is refused): each expert takes at most max(ceil(moe_top_k x tokens / moe_num_experts x this),
    moe_min_capacity) routes of a micro-batch.
    """

    moe_eval_capacity_factor: float = 1.0
    """
    The capacity of the expert at eval time (as moe_train_capacity_factor, in evaluation and generation).
    """

    moe_min_capacity: int = 4
    """
    The minimum capacity per expert regardless of the capacity_factor (moe_type deepspeed with
    moe_token_dropping).
    """

    moe_token_dropping: bool = False
    """
    Whether to drop tokens when exceeding capacity (moe_type deepspeed; the dropless megablocks layer refuses
    it). Dropped routes lose their weight (a token whose routes are all dropped passes through the residual
    connection only); the logs report the dropped fraction per layer. False: the capacity grows to the busiest
    expert.
    """

    create_moe_param_group: bool = True
    """
    Whether to create a separate parameter group for MoE parameters: the experts' weights form their own
    optimizer group (named moe_experts, decayed with weight_decay); false leaves them with the other weights.
    """

    moe_use_residual: bool = True
    """
    Whether to use residual in MoE (moe_type deepspeed: DeepSpeed's residual MoE, a dense MLP beside the experts
    mixed by a learned 2-way softmax; on by default, as in GPT-NeoX). With moe_type megablocks the layer has no
    residual MLP: writing true is refused.
    """

    moe_expert_parallel_size: int = 1
    """
    Number of parallel experts in MoE (expert parallelism over data-parallel ranks): the data-parallel ranks form
    groups of this many, each rank holding moe_num_experts / moe_expert_parallel_size of the experts and sending
    tokens to the others' experts by all-to-all; expert gradients are reduced over the ranks holding the same
    experts. Must divide the data-parallel size and moe_num_experts. Both layer types (GPT-NeoX: DeepSpeed's only),
    in a pipeline with data and tensor parallelism (each stage's and tensor-parallel rank's experts in files of
    their own), and with model_parallel_size > 1: DeepSpeed's layer keeps its experts whole and replicated on the
    tensor-parallel ranks, the dropless layer splits each tensor-parallel rank's block of moe_num_experts /
    model_parallel_size experts over the expert-parallel ranks (moe_num_experts divisible by both sizes' product);
    experts are saved one per file (DeepSpeed's layer_N_expert_M files). A checkpoint resumes at the same value; at another one with no_load_optim: true
    (DeepSpeed's layer: any value; the dropless layer: any value above 1). generate.py and eval.py hold every
    expert on every rank. The per-parameter logs (log_grad_norm & co.) gather every rank's experts.
    """

    moe_type: str = 'megablocks'
    """
    Either `deepspeed` or `megablocks`. megablocks: the dropless layer (GPT-NeoX's dMoE: every token reaches its
    top-k experts, no capacity), plain PyTorch on CPU and GPU, GPT-NeoX's parameter names (mlp.router.layer,
    mlp.experts.mlp.w1 / w3 / w2). deepspeed: DeepSpeed's MoE layer (deepspeed.moe.layer.MoE; experts are copies
    of the dense MLP, each initialised on its own; its top-k gate and gate loss, capacity, random token selection
    for top-1, no sampling of the second expert), its experts saved in DeepSpeed's expert files.
    """

    moe_expert_interval: int = 1
    """
    GPT-NeoX's newer name for the spacing of MoE layers: one MoE layer every moe_expert_interval layers (the same
    setting as expert_interval).
    """

    moe_router_type: Literal['sinkhorn', 'topk'] = 'sinkhorn'
    """
    Token routing: "sinkhorn" (GPT-NeoX trains with it: experts chosen on the Sinkhorn-balanced scores, weighted
    by sigmoid (top-1) or softmax (top-k) of the router's logits; plain top-k of those in evaluation) or "topk"
    (softmax probabilities, the top k, renormalised to sum to 1 for k >= 2, as Mixtral's router).
    """

    moe_glu: bool = False
    """
    Use gated linear units in MoE: the experts use the GLU form of activation (gelu -> geglu, relu -> reglu,
    silu / swish -> swiglu), with a third weight w3; gated activations are GLUs already.
    """

    moe_lbl_in_fp32: bool = False
    """
    Whether to compute the load balancing loss in fp32 (else in the model's dtype; the router's softmax is fp32
    either way). DeepSpeed's gate (moe_type deepspeed) computes its loss in fp32 always.
    """

    moe_jitter_eps: Optional[float] = None
    """
    Coefficient for MoE routing jitter: while training, the router's input is multiplied by noise uniform in
    [1 - eps, 1 + eps] (from the global RNG, which checkpoints save). Jitter is not used if set to None. With
    moe_type deepspeed only 0.01 (DeepSpeed's 'Jitter' gate policy).
    """

    enable_expert_tensor_parallelism: bool = False
    """
    Enable expert tensor parallelism (moe_type deepspeed, model_parallel_size > 1): each expert's MLP is split
    column / row over the tensor-parallel ranks, as the dense MLP (every rank runs its share of every expert on
    all of its tokens; the outputs are all-reduced). False: DeepSpeed's layer keeps whole experts, replicated, on
    every tensor-parallel rank. Each tensor-parallel rank saves its shards in its own expert files
    (layer_N_expert_M_mp_rank_T; in a pipeline mp_rank stage x model_parallel_size + T); they resume, load for
    generate.py / eval.py and merge for conversion. With
    moe_type megablocks refused (it splits whole experts over the tensor-parallel ranks already).
    """
