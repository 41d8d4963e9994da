"""Every Bridge setting ``nutp-bridge`` sees, in one table: honoured, not math, substituted or
refused.

The fields: every field of the provider class of every Megatron-Bridge text-LLM pretraining
recipe, of megatron-core's ``TransformerConfig`` and ``MLATransformerConfig`` (all ``model.*``),
and of every ``ConfigContainer`` section (``optimizer.*``, ``ddp.*``, ...; a top-level field that
is optional or not a section by its own name). ``tests/integrations/test_bridge_fields.py``
enumerates them from the installed Bridge and fails on a field missing here, or an entry that
no longer exists, so an upgrade that adds a setting fails loudly.

Each field is in exactly one class:
* ``HONOURED``: the NUTP run does what the setting says; the value names the test that proves it.
* ``NOT_MATH``: logging, paths, timers, checks, memory and launch settings, and fields read only
  by a refused feature (checkpoint loading, FSDP, another optimizer): the same training math.
* ``SUBSTITUTED``: another kernel, rounding or scheduling for the same model (TE layers become
  megatron's local layers, fusions are unfused, overlap is off); ``(value without notice,
  notice)``: away from that value, ``notices`` prints one line.
* ``REFUSED``: the NUTP model's value; any other value is a one-line ``ValueError`` naming the
  field before any process group (``refusals``). ``ABSENT``: a family's own field, which passes
  only absent or off; ``BRIDGE_DEFAULT``: Bridge's own default (the GPT provider's
  layer spec, the plain optimizer override provider). A field under ``ONLY_WITH`` is read only
  with its switch on (e.g. ``model.moe_*`` with ``model.num_moe_experts``), as megatron reads it:
  it is refused, or a substitution noticed, only then. The switch itself is refused, or (MoE:
  ``model.num_moe_experts``; MTP: ``model.mtp_num_layers``) honoured.

MoE (``model.num_moe_experts``, ``bridge_run.moe_of``; docs/moe.md): the experts, top-k, expert
FFN size, load-balancing type (``aux_loss``, ``seq_aux_loss`` or ``none``) and coefficient,
router dtype and DeepSeek-V3's routing (sigmoid scores, the expert bias and its update rate,
group-limited top-k, top-k scaling, a shared expert of any size, the MoE layer frequency, the
z-loss) and OLMoE's pre-softmax are honoured; the dispatcher (NUTP's all-to-all inside each
replica), grouped GEMM, the permute and router fusions, DeepEP, expert TP (1) and the shared
expert's overlap with the dispatcher's communication (CUDA streams) are substitutions; the flex
dispatcher's backend and kernel settings are not math; everything else
(capacity factor and dropping, the shared expert's gate, the GLU interleaving of
grouped-GEMM experts, expert parallelism outside the replica, ...) is refused away from
megatron's default. With MoE,
``model.pipeline_model_parallel_size`` is honoured too (per-stage degrees; the logged MoE
metrics reduced by ``bridge_moe_metrics``: ``tests/integrations/test_bridge_moe_pipeline.py``);
virtual stages and the distributed optimizer over stages are refused (``bridge_run.check_moe``).
Multi-token prediction (``model.mtp_num_layers``, with MoE only: ``bridge_run.moe_of``): the
layer count and ``model.mtp_loss_scaling_factor`` are honoured; the other ``model.mtp_*``
(detached heads, a repeated layer, its own gradient scale, ...) are refused away from the default.

"Off" values are equivalent (``None``, ``False``, ``0``, ``[]``), so a recipe that spells the
default differently passes. ``model.transformer_layer_spec`` is accepted at the GPT provider's
default and at Gemma 2's / Gemma 3's own (on their providers: their post norms and windows are
mapped by ``bridge_run.model_config_of``). Pure data and small functions: importing this module
imports neither Bridge nor megatron-core.
"""

from __future__ import annotations

import enum
import math
from typing import Any

ABSENT = "<absent>"
"""Accepted value of a family's own field: it passes only absent or off."""
BRIDGE_DEFAULT = "<bridge default>"
"""Accepted value: Bridge's own default object (resolved when checked)."""

PARITY = "tests/train/test_parity.py::test_parity_seven_ranks"
SETTINGS = "tests/train/test_parity.py::test_parity_model_settings"
BRIDGE_TRAIN = ("tests/integrations/test_bridge_train.py"
                "::test_bridge_train_nutp_2_1_matches_stock_megatron")
BRIDGE_UNIFORM = ("tests/integrations/test_bridge_uniform.py"
                  "::test_bridge_uniform_tp2_dp2_matches_bridge_stock_run")
INIT = "tests/model/test_init.py::test_megatron_stds"
DROPOUT = "tests/train/test_train.py::test_fp16_with_dropout_trains"
DATA_REFUSED = ("tests/integrations/test_bridge_data.py"
                "::test_data_settings_nutp_cannot_honour_are_rejected_by_name")
RESUME = ("tests/integrations/test_bridge_resume.py"
          "::test_nutp_bridge_resumes_in_another_layout_and_the_schedule_continues")
RESUME_NAMED = ("tests/integrations/test_bridge_resume.py"
                "::test_a_missing_checkpoint_is_named")
BF16_BY_NAME = ("tests/integrations/test_bridge_uniform.py"
                "::test_bridge_uniform_bf16_mixed_by_name_matches_bridge_stock_run")
EVAL = ("tests/integrations/test_bridge_eval.py"
        "::test_bridge_eval_nutp_2_1_matches_bridge_stock_run")
ZERO = ("tests/integrations/test_bridge_zero.py"
        "::test_bridge_distributed_optimizer_is_nutp_zero_and_matches_stock_megatron")
LR_SCHEDULE = ("tests/checkpoint/test_bridge_state.py"
               "::test_a_schedule_nutp_train_cannot_follow_is_named")

TOKENIZER_VOCAB = ("tests/integrations/test_bridge_shim.py"
                   "::test_tokenizer_vocabulary_is_bridges_padded_size")
PIPELINE = ("tests/integrations/test_bridge_pipeline.py"
            "::test_bridge_pipeline_matches_bridge_stock_run")
VIRTUAL = ("tests/integrations/test_bridge_pipeline.py"
           "::test_bridge_virtual_stages_match_bridge_stock_run")
BRIDGE_MOE = ("tests/integrations/test_bridge_moe.py"
              "::test_bridge_qwen3_moe_nutp_2_1_matches_bridge_stock_run")
BRIDGE_MTP = ("tests/integrations/test_bridge_mtp.py"
              "::test_bridge_qwen3_moe_mtp_nutp_2_1_matches_bridge_stock_run")
BRIDGE_DSV3 = ("tests/integrations/test_bridge_moe_routing.py"
               "::test_bridge_deepseek_routing_nutp_2_1_matches_bridge_stock_run")
SHARED_SIZE = ("tests/train/test_moe_shared_size.py"
               "::test_shared_expert_of_its_own_size_matches_stock")
BRIDGE_MLA = ("tests/integrations/test_bridge_mla.py"
              "::test_bridge_deepseek_v3_mla_nutp_2_1_matches_bridge_stock_run")
ROUNDING = "same math, other rounding"
KERNELS = "same math, other kernels"
SCHEDULING = "same math, other scheduling"
DROPOUT_RNG = "dropout masks drawn by another generator"

HONOURED: dict[str, str] = {  # the test that proves the effect
    "checkpoint.ckpt_step": RESUME,
    "checkpoint.exit_on_missing_checkpoint": RESUME_NAMED,
    "checkpoint.load": RESUME,
    "checkpoint.save": BRIDGE_TRAIN,
    "checkpoint.save_interval": BRIDGE_TRAIN,
    "dataset.add_extra_token_to_sequence": BRIDGE_UNIFORM,
    "dataset.allow_ambiguous_pad_tokens": BRIDGE_UNIFORM,
    "dataset.blend": BRIDGE_UNIFORM,
    "dataset.blend_per_split": BRIDGE_UNIFORM,
    "dataset.create_attention_mask": BRIDGE_UNIFORM,
    "dataset.data_path": BRIDGE_UNIFORM,
    "dataset.dataloader_type": DATA_REFUSED,
    "dataset.eod_mask_loss": BRIDGE_UNIFORM,
    "dataset.mid_level_dataset_surplus": BRIDGE_UNIFORM,
    "dataset.mock": BRIDGE_UNIFORM,
    "dataset.random_seed": BRIDGE_UNIFORM,
    "dataset.reset_attention_mask": BRIDGE_UNIFORM,
    "dataset.reset_position_ids": BRIDGE_UNIFORM,
    "dataset.seq_length": BRIDGE_UNIFORM,
    "dataset.sequence_length": BRIDGE_UNIFORM,
    "dataset.split": BRIDGE_UNIFORM,
    "dataset.split_matrix": BRIDGE_UNIFORM,
    "dataset.tokenizer": BRIDGE_UNIFORM,
    "ddp.grad_reduce_in_fp32": PARITY,
    "ddp.overlap_param_gather": ZERO,
    "ddp.use_distributed_optimizer": ZERO,
    "mixed_precision": BF16_BY_NAME,
    "mixed_precision.bf16": PARITY,
    "mixed_precision.fp16": PARITY,
    "mixed_precision.fp32": PARITY,
    "mixed_precision.grad_reduce_in_fp32": PARITY,
    "mixed_precision.hysteresis": PARITY,
    "mixed_precision.initial_loss_scale": PARITY,
    "mixed_precision.loss_scale": PARITY,
    "mixed_precision.loss_scale_window": PARITY,
    "mixed_precision.min_loss_scale": PARITY,
    "mixed_precision.params_dtype": PARITY,
    "model.activation_func": SETTINGS,
    "model.add_bias_linear": PARITY,
    "model.add_qkv_bias": SETTINGS,
    "model.attention_dropout": DROPOUT,
    "model.attn_logit_softcapping": SETTINGS,
    "model.beta_fast": BRIDGE_MLA,
    "model.beta_slow": BRIDGE_MLA,
    "model.bf16": PARITY,
    "model.cross_entropy_loss_fusion": PARITY,
    "model.embedding_init_method": INIT,
    "model.ffn_hidden_size": BRIDGE_TRAIN,
    "model.final_logit_softcapping": SETTINGS,
    "model.fp16": PARITY,
    "model.gated_linear_unit": SETTINGS,
    "model.hidden_dropout": DROPOUT,
    "model.hidden_size": BRIDGE_TRAIN,
    "model.init_method": INIT,
    "model.init_method_std": INIT,
    "model.interleaved_attn_pattern": SETTINGS,
    "model.kv_channels": SETTINGS,
    "model.kv_lora_rank": BRIDGE_MLA,
    "model.layernorm_epsilon": SETTINGS,
    "model.layernorm_zero_centered_gamma": SETTINGS,
    "model.moe_aux_loss_coeff": BRIDGE_MOE,
    "model.moe_ffn_hidden_size": BRIDGE_MOE,
    "model.moe_layer_freq": BRIDGE_DSV3,
    "model.moe_router_bias_update_rate": BRIDGE_DSV3,
    "model.moe_router_dtype": BRIDGE_MOE,
    "model.moe_router_enable_expert_bias": BRIDGE_DSV3,
    "model.moe_router_group_topk": BRIDGE_DSV3,
    "model.moe_router_load_balancing_type": BRIDGE_MOE,
    "model.moe_router_num_groups": BRIDGE_DSV3,
    "model.moe_router_pre_softmax": SHARED_SIZE,
    "model.moe_router_score_function": BRIDGE_DSV3,
    "model.moe_router_topk": BRIDGE_MOE,
    "model.moe_router_topk_scaling_factor": BRIDGE_DSV3,
    "model.moe_shared_expert_intermediate_size": BRIDGE_DSV3,
    "model.moe_z_loss_coeff": BRIDGE_DSV3,
    "model.mscale": BRIDGE_MLA,
    "model.mscale_all_dim": BRIDGE_MLA,
    "model.mtp_loss_scaling_factor": BRIDGE_MTP,
    "model.mtp_num_layers": BRIDGE_MTP,
    "model.multi_latent_attention": BRIDGE_MLA,
    "model.normalization": PARITY,
    "model.num_attention_heads": BRIDGE_TRAIN,
    "model.num_layers": BRIDGE_TRAIN,
    "model.num_moe_experts": BRIDGE_MOE,
    "model.num_query_groups": PARITY,
    "model.original_max_position_embeddings": BRIDGE_MLA,
    "model.output_layer_init_method": INIT,
    "model.params_dtype": PARITY,
    "model.pipeline_model_parallel_size": PIPELINE,
    "model.position_embedding_type": SETTINGS,
    "model.q_lora_rank": BRIDGE_MLA,
    "model.qk_head_dim": BRIDGE_MLA,
    "model.qk_layernorm": SETTINGS,
    "model.qk_pos_emb_head_dim": BRIDGE_MLA,
    "model.query_pre_attn_scalar": SETTINGS,
    "model.rope_scaling": SETTINGS,
    "model.rope_scaling_factor": SETTINGS,
    "model.rope_type": BRIDGE_MLA,
    "model.rotary_base": SETTINGS,
    "model.rotary_percent": SETTINGS,
    "model.rotary_scaling_factor": BRIDGE_MLA,
    "model.seq_len_interpolation_factor": SETTINGS,
    "model.seq_length": BRIDGE_TRAIN,
    "model.sequence_parallel": PIPELINE,
    "model.share_embeddings_and_output_weights": PARITY,
    "model.softmax_scale": SETTINGS,
    "model.tensor_model_parallel_size": BRIDGE_UNIFORM,
    "model.v_head_dim": BRIDGE_MLA,
    "model.virtual_pipeline_model_parallel_size": VIRTUAL,
    "model.vocab_size": BRIDGE_TRAIN,
    "model.window_attn_skip_freq": SETTINGS,
    "model.window_size": SETTINGS,
    "model.yarn_beta_fast": SETTINGS,
    "model.yarn_beta_slow": SETTINGS,
    "model.yarn_correction_range_round_to_int": SETTINGS,
    "model.yarn_mscale": SETTINGS,
    "model.yarn_mscale_all_dim": SETTINGS,
    "model.yarn_original_max_position_embeddings": SETTINGS,
    "model.yarn_rotary_scaling_factor": SETTINGS,
    "optimizer.adam_beta1": BRIDGE_UNIFORM,
    "optimizer.adam_beta2": BRIDGE_UNIFORM,
    "optimizer.adam_eps": BRIDGE_UNIFORM,
    "optimizer.bf16": PARITY,
    "optimizer.clip_grad": BRIDGE_TRAIN,
    "optimizer.decoupled_weight_decay": BRIDGE_UNIFORM,
    "optimizer.fp16": PARITY,
    "optimizer.hysteresis": PARITY,
    "optimizer.initial_loss_scale": PARITY,
    "optimizer.loss_scale": PARITY,
    "optimizer.loss_scale_window": PARITY,
    "optimizer.lr": BRIDGE_TRAIN,
    "optimizer.min_loss_scale": PARITY,
    "optimizer.min_lr": BRIDGE_UNIFORM,
    "optimizer.params_dtype": PARITY,
    "optimizer.use_distributed_optimizer": ZERO,
    "optimizer.weight_decay": BRIDGE_TRAIN,
    "rng.seed": BRIDGE_TRAIN,
    "scheduler.end_weight_decay": BRIDGE_TRAIN,
    "scheduler.lr_decay_iters": LR_SCHEDULE,
    "scheduler.lr_decay_samples": LR_SCHEDULE,
    "scheduler.lr_decay_steps": LR_SCHEDULE,
    "scheduler.lr_decay_style": LR_SCHEDULE,
    "scheduler.lr_warmup_fraction": LR_SCHEDULE,
    "scheduler.lr_warmup_init": LR_SCHEDULE,
    "scheduler.lr_warmup_iters": LR_SCHEDULE,
    "scheduler.lr_warmup_samples": LR_SCHEDULE,
    "scheduler.lr_warmup_steps": LR_SCHEDULE,
    "scheduler.lr_wsd_decay_iters": LR_SCHEDULE,
    "scheduler.lr_wsd_decay_samples": LR_SCHEDULE,
    "scheduler.lr_wsd_decay_style": LR_SCHEDULE,
    "scheduler.max_steps": LR_SCHEDULE,
    "scheduler.no_weight_decay_cond_type": BRIDGE_TRAIN,
    "scheduler.start_weight_decay": BRIDGE_TRAIN,
    "scheduler.wd_incr_steps": LR_SCHEDULE,
    "scheduler.weight_decay_incr_style": BRIDGE_TRAIN,
    "scheduler.wsd_decay_steps": LR_SCHEDULE,
    "tokenizer.merge_file": BRIDGE_UNIFORM,
    "tokenizer.null_tokenizer_eod_id": BRIDGE_UNIFORM,
    "tokenizer.null_tokenizer_pad_id": BRIDGE_UNIFORM,
    "tokenizer.tokenizer_model": BRIDGE_UNIFORM,
    "tokenizer.tokenizer_type": BRIDGE_TRAIN,
    "tokenizer.use_tokenizer_vocab_size": TOKENIZER_VOCAB,
    "tokenizer.vocab_file": BRIDGE_UNIFORM,
    "tokenizer.vocab_size": BRIDGE_TRAIN,
    "train.global_batch_size": BRIDGE_TRAIN,
    "train.micro_batch_size": BRIDGE_TRAIN,
    "train.train_iters": BRIDGE_TRAIN,
    "validation.eval_global_batch_size": EVAL,  # at the training one; others refused by name
    "validation.eval_interval": EVAL,
    "validation.eval_iters": EVAL,
    "validation.eval_micro_batch_size": EVAL,  # at the training one; others refused by name
    "validation.start_eval_at_iter": EVAL,
}

NOT_MATH: frozenset[str] = frozenset({
    "_checkpoint_load_required",
    "checkpoint.also_save_hf_checkpoint",
    "checkpoint.async_ckpt_cpu_priority",
    "checkpoint.async_ckpt_io_priority",
    "checkpoint.async_ckpt_use_cpu_shm",
    "checkpoint.async_save",
    "checkpoint.async_strategy",
    "checkpoint.async_write_results_mp_mode",
    "checkpoint.auto_detect_ckpt_format",
    "checkpoint.ckpt_assume_constant_structure",
    "checkpoint.ckpt_convert_format",
    "checkpoint.ckpt_convert_save",
    "checkpoint.ckpt_convert_update_legacy_dist_opt_format",
    "checkpoint.ckpt_format",
    "checkpoint.ckpt_fully_parallel_load_exchange_algo",
    "checkpoint.ckpt_fully_parallel_load_process_group",
    "checkpoint.ckpt_fully_parallel_save_process_group",
    "checkpoint.ckpt_load_validate_sharding_integrity",
    "checkpoint.custom_manager_class",
    "checkpoint.dist_ckpt_optim_fully_reshardable",
    "checkpoint.dist_ckpt_save_pre_mcore_014",
    "checkpoint.dist_ckpt_strictness",
    "checkpoint.dist_ckpt_workers",
    "checkpoint.distrib_optim_fully_reshardable_mem_efficient",
    "checkpoint.fully_parallel_load",
    "checkpoint.fully_parallel_save",
    "checkpoint.hf_distributed_save",
    "checkpoint.hf_save_every_n_ranks",
    "checkpoint.hf_source_path",
    "checkpoint.hf_trust_remote_code",
    "checkpoint.load_main_params_from_ckpt",
    "checkpoint.load_rng",
    "checkpoint.most_recent_k",
    "checkpoint.non_persistent_ckpt_type",
    "checkpoint.non_persistent_global_ckpt_dir",
    "checkpoint.non_persistent_local_ckpt_algo",
    "checkpoint.non_persistent_local_ckpt_dir",
    "checkpoint.replication",
    "checkpoint.replication_factor",
    "checkpoint.replication_jump",
    "checkpoint.save_activations_interval",
    "checkpoint.save_dgrads_interval",
    "checkpoint.save_optim",
    "checkpoint.save_params_interval",
    "checkpoint.save_retain_interval",
    "checkpoint.save_rng",
    "checkpoint.save_tokenizer_assets",
    "checkpoint.save_tokens_per_expert_interval",
    "checkpoint.save_wgrads_interval",
    "checkpoint.storage_writers_per_rank",
    "checkpoint.stream_ckpt_dequant",
    "checkpoint.strict_fsdp_dtensor_load",
    "checkpoint.use_checkpoint_args",
    "checkpoint.use_mp_args_from_checkpoint_args",
    "checkpoint.use_persistent_ckpt_worker",
    "checkpoint.use_tokenizer_model_from_checkpoint_args",
    "checkpoint.verify_integrity",
    "comm_overlap",
    "comm_overlap.align_param_gather",
    "comm_overlap.batch_p2p_comm",
    "comm_overlap.bucket_size",
    "comm_overlap.data_parallel_size",
    "comm_overlap.overlap_grad_reduce",
    "comm_overlap.overlap_moe_expert_parallel_comm",
    "comm_overlap.overlap_p2p_comm",
    "comm_overlap.overlap_param_gather",
    "comm_overlap.overlap_param_gather_with_optimizer_step",
    "comm_overlap.tp_comm_bootstrap_backend",
    "comm_overlap.wgrad_deferral_limit",
    "dataset.data_parallel_size",
    "dataset.data_sharding",
    "dataset.dataloader_load",
    "dataset.dataloader_save",
    "dataset.defer_npy_index_mmap",
    "dataset.drop_last",
    "dataset.drop_last_partial_validation_sequence",
    "dataset.fast_cache_load",
    "dataset.full_validation",
    "dataset.mmap_bin_files",
    "dataset.multiple_validation_sets",
    "dataset.num_dataset_builder_threads",
    "dataset.num_workers",
    "dataset.object_storage_cache_path",
    "dataset.path_to_cache",
    "dataset.per_dataset_sequences_path",
    "dataset.persistent_workers",
    "dataset.pin_memory",
    "dataset.sequence_parallel_size",
    "dataset.sequences_per_dataset",
    "dataset.token_dtype_code",
    "dataset.trust_remote_code",
    "ddp.align_param_gather",
    "ddp.bucket_size",
    "ddp.check_for_large_grads",
    "ddp.check_for_nan_in_grad",
    "ddp.delay_wgrad_compute",
    "ddp.disable_symmetric_registration",
    "ddp.fsdp_all_gather_in_start_param_sync",
    "ddp.fsdp_db_use_persist_buf_on_alloc_fail",
    "ddp.fsdp_double_buffer",
    "ddp.fsdp_manual_registration",
    "ddp.gradient_reduce_div_fusion",
    "ddp.keep_fp8_transpose_cache",
    "ddp.megatron_fsdp_cuda_graph_mode",
    "ddp.megatron_fsdp_enable_fine_grained_param_gather",
    "ddp.megatron_fsdp_grad_comm_dtype",
    "ddp.megatron_fsdp_main_grads_dtype",
    "ddp.megatron_fsdp_main_params_dtype",
    "ddp.megatron_fsdp_max_pool_double_buffer",
    "ddp.megatron_fsdp_use_decoupled_grad",
    "ddp.nccl_ub",
    "ddp.num_buckets",
    "ddp.overlap_grad_reduce",
    "ddp.pad_buckets_for_high_nccl_busbw",
    "ddp.param_name_patterns_for_fp32_local_accumulation",
    "ddp.reduce_scatter_with_fp32_accumulation",
    "ddp.suggested_communication_unit_size",
    "dist.align_grad_reduce",
    "dist.distributed_backend",
    "dist.distributed_timeout_minutes",
    "dist.distributed_timeout_seconds_after_init",
    "dist.enable_megatron_core_experimental",
    "dist.eval_context_parallel_size",
    "dist.external_gpu_device_mapping",
    "dist.flight_recorder_dump_on_timeout",
    "dist.flight_recorder_dump_path",
    "dist.flight_recorder_extra_dump_on_exec",
    "dist.flight_recorder_include_only_active",
    "dist.flight_recorder_include_stack_trace",
    "dist.flight_recorder_trace_buffer_size",
    "dist.high_priority_stream_groups",
    "dist.lazy_mpu_init",
    "dist.local_rank",
    "dist.nccl_communicator_config_path",
    "dist.sharp_enabled_group",
    "dist.use_decentralized_pg",
    "dist.use_gloo_process_groups",
    "dist.use_sharp",
    "dist.use_tp_pp_dp_mapping",
    "env_vars",
    "ft",
    "ft.calc_ft_timeouts",
    "ft.simulated_fault_base_delay",
    "ft.simulated_fault_rank",
    "ft.simulated_fault_type",
    "inprocess_restart",
    "inprocess_restart.active_world_size",
    "inprocess_restart.barrier_timeout",
    "inprocess_restart.completion_timeout",
    "inprocess_restart.empty_cuda_cache",
    "inprocess_restart.granularity",
    "inprocess_restart.hard_timeout",
    "inprocess_restart.heartbeat_interval",
    "inprocess_restart.heartbeat_timeout",
    "inprocess_restart.last_call_wait",
    "inprocess_restart.max_iterations",
    "inprocess_restart.max_rank_faults",
    "inprocess_restart.monitor_process_interval",
    "inprocess_restart.monitor_process_logdir",
    "inprocess_restart.monitor_thread_interval",
    "inprocess_restart.progress_watchdog_interval",
    "inprocess_restart.soft_timeout",
    "inprocess_restart.termination_grace_time",
    "logger.barrier_with_L1_time",
    "logger.comet_api_key",
    "logger.comet_experiment_name",
    "logger.comet_project",
    "logger.comet_tags",
    "logger.comet_workspace",
    "logger.filter_warnings",
    "logger.log_device_memory_used",
    "logger.log_energy",
    "logger.log_interval",
    "logger.log_l2_norm_grad_to_tensorboard",
    "logger.log_loss_scale_to_tensorboard",
    "logger.log_max_attention_logit",
    "logger.log_memory_interval",
    "logger.log_memory_to_tensorboard",
    "logger.log_num_zeros_in_grad",
    "logger.log_params_norm",
    "logger.log_progress",
    "logger.log_runtime_to_tensorboard",
    "logger.log_throughput",
    "logger.log_throughput_to_tensorboard",
    "logger.log_timers_to_tensorboard",
    "logger.log_validation_ppl_to_tensorboard",
    "logger.log_world_size_to_tensorboard",
    "logger.logging_level",
    "logger.memory_keys",
    "logger.mlflow_description",
    "logger.mlflow_experiment",
    "logger.mlflow_log_artifacts",
    "logger.mlflow_run_name",
    "logger.mlflow_tags",
    "logger.mlflow_tracking_uri",
    "logger.modules_to_filter",
    "logger.moe_routing_trace_capture_hidden_states",
    "logger.moe_routing_trace_capture_logits",
    "logger.moe_routing_trace_dump_weights",
    "logger.moe_routing_trace_max_training_iters",
    "logger.moe_routing_trace_path",
    "logger.runtime_time_unit",
    "logger.save_config_filepath",
    "logger.set_level_for_all_loggers",
    "logger.skip_train_metrics_log",
    "logger.tensorboard_dir",
    "logger.tensorboard_log_interval",
    "logger.tensorboard_queue_size",
    "logger.throughput_window_size",
    "logger.timing_log_level",
    "logger.timing_log_option",
    "logger.wandb_entity",
    "logger.wandb_exp_name",
    "logger.wandb_project",
    "logger.wandb_save_dir",
    "mixed_precision.pipeline_dtype",
    "model._cpu_offloading_context",
    "model._pg_collection",
    "model.account_for_embedding_in_pipeline_split",
    "model.account_for_loss_in_pipeline_split",
    "model.activation_offload_fraction",
    "model.async_tensor_model_parallel_allreduce",
    "model.barrier_with_L1_time",
    "model.batch_p2p_comm",
    "model.batch_p2p_sync",
    "model.bos_token_id",
    "model.clone_scatter_output_in_embedding",
    "model.config_logger_dir",
    "model.cp_comm_type",
    "model.cpu_offloading",
    "model.cpu_offloading_activations",
    "model.cpu_offloading_double_buffering",
    "model.cpu_offloading_num_layers",
    "model.cpu_offloading_retain_pinned_cpu_buffers",
    "model.cpu_offloading_weights",
    "model.cuda_graph_modules",
    "model.cuda_graph_retain_backward_graph",
    "model.cuda_graph_scope",
    "model.cuda_graph_use_single_mempool",
    "model.cuda_graph_warmup_steps",
    "model.deallocate_pipeline_outputs",
    "model.delay_offload_until_cuda_graph",
    "model.delta_offload_bytes_across_pp_ranks",
    "model.disable_parameter_transpose_cache",
    "model.distribute_saved_activations",
    "model.eos_token_id",
    "model.ep_overlap_early_attn_memory_release",
    "model.finalize_model_grads_func",
    "model.fine_grained_activation_offloading",
    "model.fine_grained_offloading_max_inflight_offloads",
    "model.flash_decode",
    "model.grad_scale_func",
    "model.grad_sync_func",
    "model.hetereogenous_dist_checkpoint",
    "model.hf_config_dict",
    "model.hf_model_id",
    "model.hf_model_revision",
    "model.hf_text_config",
    "model.high_priority_a2a_comm_stream",
    "model.inference_cuda_graph_scope",
    "model.inference_disable_triton_nvls_kernels",
    "model.inference_fuse_tp_communication",
    "model.inference_grouped_gemm_backend",
    "model.inference_moe_disable_fused_quant_kernels",
    "model.inference_moe_token_dispatcher_type",
    "model.inference_rng_tracker",
    "model.inference_sampling_seed",
    "model.init_model_with_meta_device",
    "model.kitchen_attention_backend",
    "model.log_max_attention_logit",
    "model.make_vocab_size_divisible_by",
    "model.microbatch_group_size_per_vp_stage",
    "model.min_offloaded_tensor_size",
    "model.mlp_chunks_for_prefill",
    "model.mlp_chunks_for_training",
    "model.moe_deepep_num_sms",
    "model.moe_flex_dispatcher_backend",
    "model.moe_flex_dispatcher_num_sms",
    "model.moe_hybridep_num_blocks_permute",
    "model.moe_hybridep_num_blocks_unpermute",
    "model.moe_hybridep_num_sms",
    "model.moe_hybridep_num_sms_preprocessing",
    "model.moe_hybridep_pad_uneven_dispatch_inputs",
    "model.moe_layer_recompute",
    "model.moe_ncclep_static_shape",
    "model.moe_ncclep_zero_copy",
    "model.moe_per_layer_logging",
    "model.moe_permute_fusion_into_hybridep",
    "model.nccl_all_reduce_for_prefill",
    "model.no_sync_func",
    "model.num_microbatches_with_partial_activation_checkpoints",
    "model.offload_modules",
    "model.overlap_dispatch_backward_with_experts_wgrad",
    "model.overlap_moe_expert_parallel_comm",
    "model.overlap_p2p_comm",
    "model.overlap_p2p_comm_warmup_flush",
    "model.parallel_output",
    "model.param_sync_func",
    "model.perform_initialization",
    "model.pipeline_dtype",
    "model.pipeline_model_parallel_comm_backend",
    "model.recompute_granularity",
    "model.recompute_method",
    "model.recompute_modules",
    "model.recompute_num_layers",
    "model.test_mode",
    "model.timers",
    "model.tp_comm_atomic_ag",
    "model.tp_comm_atomic_rs",
    "model.tp_comm_bootstrap_backend",
    "model.tp_comm_bulk_dgrad",
    "model.tp_comm_bulk_wgrad",
    "model.tp_comm_overlap_ag",
    "model.tp_comm_overlap_disable_fc1",
    "model.tp_comm_overlap_disable_qkv",
    "model.tp_comm_overlap_rs",
    "model.tp_comm_overlap_rs_dgrad",
    "model.tp_comm_split_ag",
    "model.tp_comm_split_rs",
    "model.tp_only_amax_red",
    "model.use_arbitrary_attention_mask",
    "model.use_cpu_initialization",
    "model.use_inference_optimized_layers",
    "model.use_mamba_mem_eff_path",
    "model.use_ring_exchange_p2p",
    "model.variable_seq_lengths",
    "model.wgrad_deferral_limit",
    "nvrx_straggler",
    "nvrx_straggler.calc_individual_gpu_perf",
    "nvrx_straggler.calc_relative_gpu_perf",
    "nvrx_straggler.enable_logging",
    "nvrx_straggler.gpu_individual_perf_threshold",
    "nvrx_straggler.gpu_relative_perf_threshold",
    "nvrx_straggler.logger_name",
    "nvrx_straggler.num_gpu_perf_scores_to_print",
    "nvrx_straggler.profiling_interval",
    "nvrx_straggler.report_time_interval",
    "nvrx_straggler.stop_if_detected",
    "optimizer.adaptive_muon_beta2",
    "optimizer.adaptive_muon_eps",
    "optimizer.adaptive_muon_moment2_method",
    "optimizer.barrier_with_L1_time",
    "optimizer.config_logger_dir",
    "optimizer.lion_beta1",
    "optimizer.lion_beta2",
    "optimizer.log_num_zeros_in_grad",
    "optimizer.muon_coefficient_type",
    "optimizer.muon_extra_scale_factor",
    "optimizer.muon_fp32_matmul_prec",
    "optimizer.muon_momentum",
    "optimizer.muon_nesterov",
    "optimizer.muon_num_ns_steps",
    "optimizer.muon_scalar_optimizer",
    "optimizer.muon_scale_mode",
    "optimizer.muon_split_qkv",
    "optimizer.muon_tp_mode",
    "optimizer.optimizer_cuda_graph",
    "optimizer.overlap_cpu_optimizer_d2h_h2d",
    "optimizer.overlap_param_gather",
    "optimizer.pin_cpu_grads",
    "optimizer.pin_cpu_params",
    "optimizer.sgd_momentum",
    "optimizer.soap_precondition_frequency",
    "optimizer.soap_shampoo_beta",
    "optimizer.soap_use_kl_shampoo",
    "optimizer.store_param_remainders",
    "optimizer.timers",
    "optimizer.use_torch_optimizer_for_cpu_offload",
    "peft.params_to_save",
    "profiling.memory_snapshot_path",
    "profiling.nvtx_ranges",
    "profiling.profile_ranks",
    "profiling.profile_step_end",
    "profiling.profile_step_start",
    "profiling.pytorch_profiler_collect_callstack",
    "profiling.pytorch_profiler_collect_chakra",
    "profiling.pytorch_profiler_collect_shapes",
    "profiling.record_memory_history",
    "profiling.record_shapes",
    "profiling.use_nsys_profiler",
    "profiling.use_pytorch_profiler",
    "rerun_state_machine.check_for_nan_in_loss",
    "rerun_state_machine.check_for_spiky_loss",
    "rerun_state_machine.error_injection_type",
    "rerun_state_machine.spiky_loss_factor",
    "rng.inference_rng_tracker",
    "scheduler.override_opt_param_scheduler",
    "scheduler.use_checkpoint_opt_param_scheduler",
    "straggler",
    "straggler.disable_straggler_on_startup",
    "straggler.enable_straggler_on_startup",
    "straggler.straggler_ctrlr_port",
    "straggler.straggler_minmax_count",
    "tensor_inspect",
    "tensor_inspect._feature_dirs_from_default",
    "tensor_inspect.allow_custom_feature_dirs",
    "tensor_inspect.feature_dirs",
    "tensor_inspect.features",
    "tensor_inspect.init_training_step",
    "tensor_inspect.log_dir",
    "tokenizer.chat_template",
    "tokenizer.chat_template_path",
    "tokenizer.force_system_message",
    "tokenizer.hf_tokenizer_kwargs",
    "tokenizer.image_tag_type",
    "tokenizer.make_vocab_size_divisible_by",
    "tokenizer.metadata_path",
    "tokenizer.padded_vocab_size",
    "tokenizer.rank",
    "tokenizer.sp_tokenizer_kwargs",
    "tokenizer.special_tokens",
    "tokenizer.tensor_model_parallel_size",
    "tokenizer.tiktoken_num_special_tokens",
    "tokenizer.tiktoken_pattern",
    "tokenizer.tokenizer_hf_no_include_special_tokens",
    "tokenizer.tokenizer_hf_no_use_fast",
    "tokenizer.tokenizer_prompt_format",
    "tokenizer.tokenizer_sentencepiece_ignore_extra_whitespaces",
    "tokenizer.tokenizer_sentencepiece_legacy",
    "tokenizer.trust_remote_code",
    "tokenizer.vocab_extra_ids",
    "train._train_iters_from_num_epochs",
    "train.check_optimizer_step_success",
    "train.empty_unused_memory_level",
    "train.exit_duration_in_mins",
    "train.exit_interval",
    "train.exit_signal",
    "train.exit_signal_handler",
    "train.exit_signal_handler_for_dataloader",
    "train.exit_signal_handler_for_training",
    "train.gpu_sniff_test_interval",
    "train.manual_gc",
    "train.manual_gc_eval",
    "train.manual_gc_interval",
    "train.train_sync_interval",
    "validation.full_validation",
    "validation.multiple_validation_sets",
    "validation.test_mode",
    "validation.validation_set_names",
})

SUBSTITUTED: dict[str, tuple[Any, str]] = {
    "comm_overlap.defer_embedding_wgrad_compute": (None, f"not deferred ({SCHEDULING})"),
    "comm_overlap.delay_wgrad_compute": (None, f"weight gradients not delayed ({SCHEDULING})"),
    "comm_overlap.tp_comm_overlap": (False, f"no TP communication overlap ({SCHEDULING})"),
    "comm_overlap.tp_comm_overlap_cfg": (None, f"no TP communication overlap ({SCHEDULING})"),
    "ddp.average_in_collective": (False, f"NUTP's weighted reduction divides ({ROUNDING})"),
    "dist.disable_jit_fuser": (False, f"torch's jit fuser as it is ({KERNELS})"),
    "model.apply_rope_fusion": (False, f"RoPE unfused ({ROUNDING})"),
    "model.attention_backend": ("auto", f"the NUTP model's core attention ({KERNELS})"),
    "model.attention_softmax_in_fp32": (True, f"the attention softmax in fp32 ({ROUNDING})"),
    "model.batch_invariant_mode": (False, f"no batch-invariant kernels ({KERNELS})"),
    "model.bias_activation_fusion": (False, f"fused on CUDA only, as NUTP builds it ({ROUNDING})"),
    "model.bias_dropout_fusion": (False, f"fused on CUDA only, as NUTP builds it ({ROUNDING})"),
    "model.cross_entropy_fusion_impl": ("native", f"megatron's fused cross entropy ({ROUNDING})"),
    "model.cuda_graph_impl": ("none", f"no CUDA graphs ({KERNELS})"),
    "model.defer_embedding_wgrad_compute": (False, f"not deferred ({SCHEDULING})"),
    "model.delay_wgrad_compute": (False, f"weight gradients not delayed ({SCHEDULING})"),
    "model.dense_grouped_gemm": (False, f"no grouped GEMM ({KERNELS})"),
    "model.deterministic_mode": (False, f"no deterministic-kernel mode ({KERNELS})"),
    "model.disable_bf16_reduced_precision_matmul": (False, f"torch's bf16 matmuls ({ROUNDING})"),
    "model.enable_cuda_graph": (False, f"no CUDA graphs ({KERNELS})"),
    "model.expert_tensor_parallel_size": (1, f"each expert on one rank: expert TP 1 ({ROUNDING})"),
    "model.external_cuda_graph": (False, f"no CUDA graphs ({KERNELS})"),
    "model.flash_attention_version": (None, f"the NUTP model's core attention ({KERNELS})"),
    "model.fp16_lm_cross_entropy": (False, f"the cross entropy in fp32 ({ROUNDING})"),
    "model.fused_residual_rmsnorm": (False, f"residual add and RMSNorm unfused ({ROUNDING})"),
    "model.fused_single_qkv_rope": (False, f"QKV RoPE unfused ({ROUNDING})"),
    "model.gradient_accumulation_fusion": (False, f"weight gradients unfused ({ROUNDING})"),
    "model.masked_softmax_fusion": (False, f"the attention softmax unfused ({ROUNDING})"),
    "model.memory_efficient_layer_norm": (False, f"torch's norm ({ROUNDING})"),
    "model.moe_enable_deepep": (False, f"NUTP's all-to-all dispatcher, not DeepEP ({KERNELS})"),
    "model.moe_grouped_gemm": (
        False, f"megatron's SequentialMLP experts, no grouped GEMM ({KERNELS})"),
    "model.moe_permute_fusion": (False, f"the token permutation unfused ({KERNELS})"),
    "model.moe_router_fusion": (False, f"the router's top-k and scores unfused ({KERNELS})"),
    "model.moe_shared_expert_overlap": (
        False, f"the shared expert not overlapped with the dispatcher's communication "
        f"({SCHEDULING})"),
    "model.moe_token_dispatcher_type": (
        "alltoall", f"NUTP's all-to-all dispatcher inside each replica ({KERNELS})"),
    "model.persist_layer_norm": (False, f"torch's norm ({ROUNDING})"),
    "model.symmetric_ar_type": (None, f"torch.distributed all-reduce ({ROUNDING})"),
    "model.tp_comm_overlap": (False, f"no TP communication overlap ({SCHEDULING})"),
    "model.tp_comm_overlap_cfg": (None, f"no TP communication overlap ({SCHEDULING})"),
    "model.transformer_impl": ("local", f"megatron's local layers, not TE's ({KERNELS})"),
    "model.use_fused_weighted_squared_relu": (False, f"squared ReLU unfused ({ROUNDING})"),
    "model.use_grouped_gemm_for_dense_mlp": (False, f"no grouped GEMM ({KERNELS})"),
    "model.use_grouped_gemm_for_shared_expert": (False, f"no grouped GEMM ({KERNELS})"),
    "model.use_te_activation_func": (False, f"torch's activation, not TE's ({KERNELS})"),
    "model.use_te_rng_tracker": (False, f"megatron's RNG tracker ({DROPOUT_RNG})"),
    "model.use_transformer_engine_full_layer_spec": (False, f"megatron's local layers ({KERNELS})"),
    "model.use_transformer_engine_op_fuser": (False, f"no TE op fuser ({KERNELS})"),
    "optimizer.overlap_param_gather_with_optimizer_step": (
        False, f"the parameters are gathered at the end of the optimizer step ({SCHEDULING})"),
    "optimizer.use_precision_aware_optimizer": (
        False, f"NUTP's distributed optimizer: torch's Adam on fp32 masters and moments, the "
        f"dtypes the recipe gives, for TE's fused Adam ({KERNELS})"),
    "rng.te_rng_tracker": (False, f"megatron's RNG tracker ({DROPOUT_RNG})"),
}

REFUSED: dict[str, Any] = {  # the NUTP model's value; any other is refused
    "checkpoint.finetune": False,
    "checkpoint.load_optim": True,
    "checkpoint.non_persistent_save_interval": None,
    "checkpoint.pretrained_checkpoint": None,
    "dataset.context_parallel_size": None,
    "dataset.hybrid_context_parallel": False,
    "dataset.inter_document_masking": False,
    "ddp.data_parallel_sharding_strategy": 'no_shard',
    "ddp.fp4_param_gather": False,
    "ddp.fp8_param_gather": False,
    "ddp.num_distributed_optimizer_instances": 1,
    "ddp.outer_dp_sharding_strategy": 'no_shard',
    "ddp.reuse_grad_buf_for_mxfp8_param_ag": False,
    "ddp.use_custom_fsdp": False,
    "ddp.use_megatron_fsdp": False,
    "dist.use_megatron_fsdp": False,
    "dist.use_torch_fsdp2": False,
    "ft.enable_ft_package": False,
    "ft.simulate_fault": False,
    "inprocess_restart.enabled": False,
    "mixed_precision.autocast_dtype": None,
    "mixed_precision.autocast_enabled": False,
    "mixed_precision.first_last_layers_bf16": False,
    "mixed_precision.fp4": None,
    "mixed_precision.fp4_param": None,
    "mixed_precision.fp4_param_gather": False,
    "mixed_precision.fp4_recipe": 'nvfp4',
    "mixed_precision.fp8": None,
    "mixed_precision.fp8_amax_compute_algo": 'most_recent',
    "mixed_precision.fp8_amax_history_len": 1,
    "mixed_precision.fp8_dot_product_attention": False,
    "mixed_precision.fp8_margin": 0,
    "mixed_precision.fp8_multi_head_attention": False,
    "mixed_precision.fp8_param": None,
    "mixed_precision.fp8_param_gather": False,
    "mixed_precision.fp8_recipe": 'tensorwise',
    "mixed_precision.fp8_wgrad": True,
    "mixed_precision.num_layers_at_end_in_bf16": 0,
    "mixed_precision.num_layers_at_start_in_bf16": 0,
    "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag": False,
    "model.A_init_dist": ABSENT,
    "model.A_init_range": ABSENT,
    "model.D_has_hdim": ABSENT,
    "model.activation_func_clamp_value": None,
    "model.activation_func_fp8_input_store": False,
    "model.add_decoder": ABSENT,
    "model.add_encoder": ABSENT,
    "model.apply_query_key_layer_scaling": False,
    "model.apply_residual_connection_post_layernorm": False,
    "model.attention_in_multiplier": ABSENT,
    "model.attention_k_eq_v": ABSENT,
    "model.attention_other_setting": ABSENT,
    "model.attention_out_multiplier": ABSENT,
    "model.attention_output_gate": False,
    "model.attention_value_scale": ABSENT,
    "model.autocast_dtype": None,
    "model.cache_mla_latents": False,
    "model.calculate_per_token_loss": False,
    "model.chunk_size": ABSENT,
    "model.context_parallel_size": 1,
    "model.conv_bias": ABSENT,
    "model.conv_init": ABSENT,
    "model.d_conv": ABSENT,
    "model.dsa_indexer_head_dim": None,
    "model.dsa_indexer_k_norm_epsilon": None,
    "model.dsa_indexer_k_norm_fp32": False,
    "model.dsa_indexer_loss_coeff": None,
    "model.dsa_indexer_n_heads": None,
    "model.dsa_indexer_rope_interleaved": False,
    "model.dsa_indexer_rotate_activation": True,
    "model.dsa_indexer_scoring_relu": True,
    "model.dsa_indexer_skip_topk_offset": 0,
    "model.dsa_indexer_topk": None,
    "model.dsa_indexer_topk_freq": 1,
    "model.dsa_indexer_use_sparse_loss": False,
    "model.dsa_kernel_backend": 'none',
    "model.dt_init": ABSENT,
    "model.dt_init_floor": ABSENT,
    "model.dt_max": ABSENT,
    "model.dt_min": ABSENT,
    "model.dt_scale": ABSENT,
    "model.embedding_init_method_std": None,
    "model.embedding_multiplier": ABSENT,
    "model.enable_autocast": False,
    "model.expand": ABSENT,
    "model.experimental_attention_variant": None,
    "model.experimental_attention_variant_loss_scale_func": None,
    "model.expert_gtp_weight_remat_size": 1,
    "model.expert_model_parallel_size": 1,
    "model.expert_tensor_parallel_num_weight_shards": None,
    "model.falconh1_ratio": ABSENT,
    "model.falconh1_stack_spec": ABSENT,
    "model.first_last_layers_bf16": False,
    "model.fp32_residual_connection": False,
    "model.fp4": None,
    "model.fp4_param": False,
    "model.fp4_quantizer_factory": None,
    "model.fp4_recipe": 'nvfp4',
    "model.fp8": None,
    "model.fp8_amax_compute_algo": 'most_recent',
    "model.fp8_amax_history_len": 1,
    "model.fp8_dot_product_attention": False,
    "model.fp8_interval": 1,
    "model.fp8_margin": 0,
    "model.fp8_multi_head_attention": False,
    "model.fp8_output_proj": False,
    "model.fp8_param": False,
    "model.fp8_param_gather": ABSENT,
    "model.fp8_quantizer_factory": None,
    "model.fp8_recipe": 'delayed',
    "model.fp8_wgrad": True,
    "model.freeze_language_model": ABSENT,
    "model.freeze_mtp_model": ABSENT,
    "model.freeze_vision_model": ABSENT,
    "model.freeze_vision_projection": ABSENT,
    "model.full_attn_num_query_groups": ABSENT,
    "model.global_head_dim": ABSENT,
    "model.global_rotary_percent": ABSENT,
    "model.glu_linear_offset": 0.0,
    "model.gtp_weight_remat_size": 1,
    "model.head_wise_attn_gate": ABSENT,
    "model.heterogeneous_block_specs": False,
    "model.hierarchical_context_parallel_sizes": None,
    "model.hybrid_attention_pattern": ABSENT,
    "model.hybrid_attention_ratio": ABSENT,
    "model.hybrid_context_parallel": False,
    "model.hybrid_layer_pattern": ABSENT,
    "model.hybrid_mlp_ratio": ABSENT,
    "model.hybrid_override_pattern": ABSENT,
    "model.hybrid_stack_spec": ABSENT,
    "model.image_token_id": ABSENT,
    "model.index_head_dim": ABSENT,
    "model.index_n_heads": ABSENT,
    "model.is_hybrid_model": False,
    "model.is_vision_language": ABSENT,
    "model.keep_mtp_spec_in_bf16": ABSENT,
    "model.key_multiplier": ABSENT,
    "model.language_max_sequence_length": ABSENT,
    "model.layer_types": ABSENT,
    "model.lightning_indexer_layers": ABSENT,
    "model.linear_attention_freq": None,
    "model.linear_conv_kernel_dim": 4,
    "model.linear_key_head_dim": 128,
    "model.linear_num_key_heads": 16,
    "model.linear_num_value_heads": 32,
    "model.linear_value_head_dim": 128,
    "model.lm_head_multiplier": ABSENT,
    "model.mamba_chunk_size": ABSENT,
    "model.mamba_head_dim": 64,
    "model.mamba_num_groups": 8,
    "model.mamba_num_heads": None,
    "model.mamba_state_dim": 128,
    "model.mamba_training_ssm_states_dtype": None,
    "model.max_seqlen_per_dp_cp_rank": None,
    "model.mla_down_proj_fusion": False,
    "model.mlp_multipliers": ABSENT,
    "model.moe_apply_probs_on_input": False,
    "model.moe_enable_routing_replay": False,
    "model.moe_expert_capacity_factor": None,
    "model.moe_expert_rank_capacity_factor": None,
    "model.moe_grad_scale_func": None,
    "model.moe_input_jitter_eps": None,
    "model.moe_latent_size": None,
    "model.moe_mlp_glu_interleave_size": None,
    "model.moe_pad_expert_input_to_capacity": False,
    "model.moe_pad_experts_for_cuda_graph_inference": False,
    "model.moe_paged_stash": False,
    "model.moe_paged_stash_buffer_size_factor_cpu": 0.0,
    "model.moe_paged_stash_buffer_size_factor_cuda": 1.1,
    "model.moe_paged_stash_page_size": 64,
    "model.moe_router_force_biased": None,
    "model.moe_router_force_load_balancing": False,
    "model.moe_router_padding_for_fp8": False,
    "model.moe_router_padding_for_quantization": False,
    "model.moe_router_quantile_balancing_ema": 0.0,
    "model.moe_router_topk_limited_devices": None,
    "model.moe_shared_expert_gate": False,
    "model.moe_shared_expert_glu_interleave_size": None,
    "model.moe_single_grouped_bias": False,
    "model.moe_single_grouped_weight": False,
    "model.moe_token_drop_policy": 'probs',
    "model.moe_token_dropping": False,
    "model.mrope_section": None,
    "model.mtp_detach_heads": False,
    "model.mtp_enabled": False,
    "model.mtp_grad_scale_func": None,
    "model.mtp_hybrid_override_pattern": None,
    "model.mtp_standalone": False,
    "model.mtp_use_repeated_layer": False,
    "model.multimodal_projector_bias": ABSENT,
    "model.mup_attn_scale_power": 1.0,
    "model.mup_base_head_dim": None,
    "model.mup_base_hidden_size": None,
    "model.mup_embedding_mult": 1.0,
    "model.mup_output_mult": 1.0,
    "model.mup_width_mult": 1.0,
    "model.no_rope_freq": None,
    "model.norm_before_gate": ABSENT,
    "model.num_global_key_value_heads": ABSENT,
    "model.num_layers_at_end_in_bf16": 1,
    "model.num_layers_at_start_in_bf16": 1,
    "model.num_layers_in_first_pipeline_stage": None,
    "model.num_layers_in_last_pipeline_stage": None,
    "model.pipeline_model_parallel_layout": None,
    "model.projector_bias": ABSENT,
    "model.projector_hidden_size": ABSENT,
    "model.qk_clip": False,
    "model.qk_clip_alpha": 0.5,
    "model.qk_clip_threshold": 100,
    "model.qk_l2_norm": False,
    "model.quant_recipe": None,
    "model.restore_modelopt_state": False,
    "model.rmsnorm": ABSENT,
    "model.rotary_base_per_layer": ABSENT,
    "model.rotary_interleaved": False,
    "model.scatter_embedding_sequence_parallel": True,
    "model.should_pad_vocab": False,
    "model.sliding_attention_setting": ABSENT,
    "model.softmax_type": 'vanilla',
    "model.spatial_merge_size": ABSENT,
    "model.ssm_in_multiplier": ABSENT,
    "model.ssm_multipliers": ABSENT,
    "model.ssm_out_multiplier": ABSENT,
    "model.swa_num_query_groups": ABSENT,
    "model.temporal_patch_size": ABSENT,
    "model.tensor_parallel_num_weight_shards": None,
    "model.transformer_layer_spec": BRIDGE_DEFAULT,
    "model.understand_projector_stride": ABSENT,
    "model.use_attention": ABSENT,
    "model.use_kitchen": False,
    "model.use_kitchen_attention": False,
    "model.use_mamba": ABSENT,
    "model.use_mlp": ABSENT,
    "model.use_mup": False,
    "model.video_token_id": ABSENT,
    "model.vision_config": ABSENT,
    "model.vision_end_token_id": ABSENT,
    "model.vision_start_token_id": ABSENT,
    "model.vision_token_id": ABSENT,
    "nvrx_straggler.enabled": False,
    "optimizer.apply_wd_to_qk_layernorm": False,
    "optimizer.decoupled_lr": None,
    "optimizer.decoupled_min_lr": None,
    "optimizer.exp_avg_dtype": "torch.float32",
    "optimizer.exp_avg_sq_dtype": "torch.float32",
    "optimizer.fp8_recipe": None,
    "optimizer.grad_norm_skip_threshold": math.inf,
    "optimizer.main_grads_dtype": "torch.float32",
    "optimizer.main_params_dtype": "torch.float32",
    "optimizer.optimizer": 'adam',
    "optimizer.optimizer_cpu_offload": False,
    "optimizer.optimizer_offload_fraction": 0.0,
    "optimizer.reuse_grad_buf_for_mxfp8_param_ag": False,
    "optimizer.use_layer_wise_distributed_optimizer": False,
    "peft": None,
    "rerun_state_machine.error_injection_rate": 0,
    "rerun_state_machine.rerun_mode": 'disabled',
    "rng.data_parallel_random_init": False,
    "straggler.log_straggler": False,
    "tensor_inspect.enabled": False,
    "tokenizer.pad_vocab_size": False,
    "train.check_weight_hash_across_dp_replicas_interval": None,
    "train.decrease_batch_size_if_needed": False,
    "train.eval_interval": None,
    "train.eval_iters": None,
    "train.iterations_to_skip": [],
    "train.num_epochs": None,
    "train.rampup_batch_size": None,
    "train.skip_sync_grad_norm_across_mp": False,
    "train.skip_train": None,
    "train.step_batch_size_schedule": None,
    "train.train_samples": None,
    "validation.skip_train": False,
}

ONLY_WITH: dict[str, str] = {  # refused field (or prefix) -> the switch it is read with
    # Megatron FSDP's sharding; Bridge's recipes set it beside use_megatron_fsdp=False, where
    # megatron's DDP and distributed optimizer never read it
    "ddp.data_parallel_sharding_strategy": "ddp.use_megatron_fsdp",
    "ddp.outer_dp_sharding_strategy": "ddp.use_megatron_fsdp",
    "mixed_precision.autocast_dtype": "mixed_precision.autocast_enabled",
    "mixed_precision.first_last_layers_bf16": "mixed_precision.fp8",
    "mixed_precision.fp4_": "mixed_precision.fp4",
    "mixed_precision.fp8_": "mixed_precision.fp8",
    "mixed_precision.num_layers_at_": "mixed_precision.fp8",
    "model.activation_func_fp8_input_store": "model.fp8",
    "model.autocast_dtype": "model.enable_autocast",
    "model.cache_mla_latents": "model.multi_latent_attention",
    "model.dsa_": "model.experimental_attention_variant",
    "model.expert_": "model.num_moe_experts",
    "model.first_last_layers_bf16": "model.fp8",
    "model.fp4_": "model.fp4",
    "model.fp8_": "model.fp8",
    "model.linear_": "model.experimental_attention_variant",
    "model.mla_down_proj_fusion": "model.multi_latent_attention",
    "model.moe_": "model.num_moe_experts",
    "model.mtp_": "model.mtp_num_layers",
    "model.mup_": "model.use_mup",
    "model.num_layers_at_": "model.fp8",
    "model.qk_clip_": "model.qk_clip",
    "optimizer.fp8_recipe": "model.fp8",  # megatron reads it for fp8 parameters only
}

_RECOVERY = "NUTP's recovery.* does its job (its recovery supervisor)"
_STRAGGLERS = ("NUTP's straggler handling is its own (nutp.straggler_probe_interval, "
               "nutp.exclude_stragglers; nutp-train)")
_GLU_INTERLEAVE = ("megatron reads it only in the grouped-GEMM {} fc1 layout (gate and up "
                   "rows in interleaved blocks); NUTP's SequentialMLP reads fc1 as [gate; up], "
                   "so the same weights would mean another model")
WHY_REFUSED: dict[str, str] = {  # the reason a refusal adds, where it is more than the value
    "ft.enable_ft_package": f"Bridge's fault tolerance (nvidia-resiliency-ext); {_RECOVERY}",
    "ft.simulate_fault": "Bridge's fault injection; NUTP's is recovery.fault",
    "inprocess_restart.enabled": f"Bridge's in-process restart; {_RECOVERY}",
    "nvrx_straggler.enabled": f"Bridge's NVRx straggler detection; {_STRAGGLERS}",
    "straggler.log_straggler": f"megatron's straggler detector; {_STRAGGLERS}",
}
"""Bridge's own resilience switches: NUTP's recovery and straggler handling replace them."""

WHY_REFUSED_MOE: dict[str, str] = {
    "model.moe_mlp_glu_interleave_size": _GLU_INTERLEAVE.format("experts' (TEGroupedMLP)"),
    "model.moe_shared_expert_glu_interleave_size": _GLU_INTERLEAVE.format(
        "shared expert's (use_grouped_gemm_for_shared_expert)"),
}
"""The GLU interleaving of grouped-GEMM weights, which NUTP's experts do not read."""

CLASSES = ("honoured", "not_math", "substituted", "refused")


def classification(name: str) -> str | None:
    """The class of ``name`` (``model.hidden_size``, ``ddp.bucket_size``, ``peft``), or None."""
    tables: tuple[Any, ...] = (HONOURED, NOT_MATH, SUBSTITUTED, REFUSED)
    for cls, table in zip(CLASSES, tables, strict=True):
        if name in table:
            return cls
    return None


def _plain(value: Any) -> Any:
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value)  # torch.float32 -> "torch.float32", without importing torch
    return value.name if isinstance(value, enum.Enum) else value


def _layer_spec_default(value: Any, provider: Any) -> bool:
    """The GPT provider's default layer spec, or a Gemma 2 / Gemma 3 provider's own (whose
    post norms, windows and attention ``model_config_of`` maps), or megatron's decoder block
    spec as Bridge's DeepSeek-V3 / Kimi-K2 / GLM-4.5 providers set it
    (``partial(get_gpt_decoder_block_spec, use_transformer_engine=...)``: each layer dense or
    MoE by ``model.moe_layer_freq``, MLA by ``model.multi_latent_attention``, the norms by
    ``model.normalization`` (TE's), which the NUTP model builds from the same fields)."""
    import dataclasses
    import functools

    from megatron.bridge.models.gemma.gemma2_provider import Gemma2ModelProvider, gemma2_layer_spec
    from megatron.bridge.models.gemma.gemma3_provider import Gemma3ModelProvider, gemma3_layer_spec
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = {f.name: f.default for f in dataclasses.fields(GPTModelProvider)}
    if value is spec["transformer_layer_spec"]:
        return True
    if isinstance(value, functools.partial) and value.func is get_gpt_decoder_block_spec and \
            not value.args and set(value.keywords) <= {"use_transformer_engine"}:
        return True
    return (isinstance(provider, Gemma2ModelProvider) and value is gemma2_layer_spec) or \
        (isinstance(provider, Gemma3ModelProvider) and value is gemma3_layer_spec)


def _bridge_default(name: str, value: Any, provider: Any = None) -> bool:
    if name == "model.transformer_layer_spec":
        return _layer_spec_default(value, provider)
    from megatron.bridge.training.config import OptimizerConfigOverrideProvider

    return type(value) is OptimizerConfigOverrideProvider


def at_accepted(name: str, value: Any, accepted: Any, provider: Any = None) -> bool:
    """Whether ``value`` is the accepted one; off values (None, False, 0, empty) are equal.
    ``provider``: the model provider the value belongs to (what ``BRIDGE_DEFAULT`` means may
    depend on its class)."""
    if value is ABSENT:  # a provider without a field has the feature off
        return True
    if accepted == ABSENT:
        accepted = None  # a family's own field, present but off
    if accepted == BRIDGE_DEFAULT:
        return _bridge_default(name, value, provider)
    value = _plain(value)
    if not accepted and not (isinstance(accepted, float) and math.isnan(accepted)):
        try:
            return not value
        except (TypeError, ValueError):  # an array's truth value
            return False
    return bool(value == accepted)


def _section(cfg: Any, name: str) -> Any:
    """The object that holds ``name``'s field: the container, the provider, or a section
    (``mixed_precision`` by its recipe name resolved as Bridge resolves it); None: absent."""
    head = name.split(".", 1)[0]
    if "." not in name:
        return cfg
    obj = getattr(cfg, head, None)
    if head == "mixed_precision" and isinstance(obj, str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        obj = get_mixed_precision_config(obj)
    return obj


def _value(cfg: Any, name: str) -> Any:
    """The field's value; an optional section (``ft``, ``straggler``, ...) that a ``+ft.x=...``
    override or a YAML block turned on is a plain dict (Bridge's ``process_config_with_overrides``
    leaves it so), read by key."""
    obj = _section(cfg, name)
    field = name.rsplit(".", 1)[-1]
    if isinstance(obj, dict):
        return obj.get(field, ABSENT)
    return ABSENT if obj is None else getattr(obj, field, ABSENT)


def unknown_keys(cfg: Any) -> list[str]:
    """``<section>.<key>`` for every key of a section given as a plain dict (a ``None`` section
    that overrides created) that is no field of the section in this table."""
    sections = {n.split(".", 1)[0] for t in (HONOURED, NOT_MATH, SUBSTITUTED, REFUSED)
                for n in t if "." in n}
    out = []
    for head in sorted(sections):
        obj = getattr(cfg, head, None)
        if isinstance(obj, dict):
            out += [f"{head}.{k}" for k in obj if classification(f"{head}.{k}") is None]
    return out


def _switch_on(cfg: Any, name: str) -> bool:
    """A field under ``ONLY_WITH`` counts only while its switch is on (itself refused)."""
    for prefix, switch in ONLY_WITH.items():
        if name.startswith(prefix) and name != switch:
            # (a switch NUTP honours, e.g. model.num_moe_experts: on unless off)
            return not at_accepted(switch, _value(cfg, switch), REFUSED.get(switch))
    return True


def _short(value: Any) -> str:
    text = " ".join(str(getattr(value, "__name__", value)).split())
    return text if len(text) <= 60 else text[:57] + "..."


def refusals(cfg: Any, *, prefix: str = "") -> list[str]:
    """``<field>=<value>: ...`` for every refused field of ``cfg`` (a ``ConfigContainer``) away
    from the NUTP model's value, fields starting with ``prefix`` only (``"model."``)."""
    out = []
    for name, accepted in REFUSED.items():
        if not name.startswith(prefix):
            continue
        value = _value(cfg, name)
        if at_accepted(name, value, accepted, getattr(cfg, "model", None)) or \
                not _switch_on(cfg, name):
            continue
        needs = ("a provider without it" if accepted == ABSENT else
                 "Bridge's default" if accepted == BRIDGE_DEFAULT else _short(accepted))
        reason = WHY_REFUSED.get(name) or WHY_REFUSED_MOE.get(name)
        why = f": {reason}" if reason else ""
        out.append(f"{name}={_short(value)}: not supported by NUTP (needs {needs}){why}")
    return out


class _Provider:
    """A provider seen as a container's ``model`` section."""

    def __init__(self, provider: Any) -> None:
        self.model = provider


def check_model(provider: Any) -> None:
    """One-line ``ValueError`` naming every refused ``model.*`` field of a Bridge provider."""
    bad = refusals(_Provider(provider), prefix="model.")
    if bad:
        raise ValueError("; ".join(bad))


def check_container(cfg: Any) -> None:
    """One-line ``ValueError`` naming every refused field of a ``ConfigContainer`` outside
    ``model`` (``check_model`` covers it), before any process group exists."""
    bad = [r for r in refusals(cfg) if not r.startswith("model.")]
    bad += [f"{k}: unknown key of Bridge's {k.split('.')[0]} section" for k in unknown_keys(cfg)]
    if bad:
        raise ValueError("; ".join(bad))


def notices(cfg: Any) -> list[str]:
    """One line per active substitution of a ``ConfigContainer``: ``<field>=<value>: <notice>``."""
    out = []
    for name, (plain, text) in SUBSTITUTED.items():
        value = _value(cfg, name)  # None: unset, the library's default
        if value is not None and not at_accepted(name, value, plain) and \
                _switch_on(cfg, name):  # (a MoE kernel of a dense model: never read)
            out.append(f"{name}={_short(_plain(value))}: {text}")
    iters = getattr(getattr(cfg, "validation", None), "eval_iters", 0) or 0
    if iters > 0:  # nutp-bridge calls Bridge's train(), not pretrain(), which evaluates after it
        out.append(f"validation.eval_iters={iters}: evaluated during training only; the final "
                   "validation and test evaluations Bridge's pretrain() runs after training are "
                   "not run by nutp-bridge")
    return out
